import statistics

import pytest
import torch

from docuchat_rl.advantages import group_advantages


def _reference(rewards, g, scale, eps):
    out, zero = [], []
    all_std = statistics.stdev(rewards)
    for i in range(0, len(rewards), g):
        grp = rewards[i:i + g]
        mean, std = statistics.mean(grp), statistics.stdev(grp)
        zero.append(std < 1e-8)
        div = {"group": std + eps, "batch": all_std + eps, "none": 1.0}[scale]
        out += [(r - mean) / div for r in grp]
    return out, zero


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_match_reference(scale):
    rewards = [1.0, 0.0, 0.0, 1.0, 0.2, 0.2, 0.2, 0.2, 1.2, 0.0, 0.2, 0.0]
    adv, zero = group_advantages(torch.tensor(rewards), 4, scale, 1e-4)
    ref, ref_zero = _reference(rewards, 4, scale, 1e-4)
    assert adv.tolist() == pytest.approx(ref, abs=1e-5)
    assert zero.tolist() == ref_zero == [False, True, False]


def test_zero_variance_group_gets_zero_advantage():
    adv, zero = group_advantages(torch.tensor([0.5, 0.5, 0.5]), 3, "group")
    assert adv.tolist() == [0.0, 0.0, 0.0] and zero.tolist() == [True]


def test_hand_computed_pair():
    # rewards 1 and 0: mean .5, Bessel std sqrt(.5) = .7071 -> +-0.7071
    adv, _ = group_advantages(torch.tensor([1.0, 0.0]), 2, "group", eps=0.0)
    assert adv.tolist() == pytest.approx([0.70710678, -0.70710678], abs=1e-6)


def test_rows_must_split_into_groups():
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages(torch.zeros(6), 4, "group")
