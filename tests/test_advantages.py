import statistics

import pytest
import torch

from docuchat_rl.learning.advantages import group_advantages


def _groups(n, g):
    return torch.arange(n) // g  # contiguous groups of g


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
    adv, zero = group_advantages(torch.tensor(rewards), _groups(12, 4), scale, 1e-4)
    ref, ref_zero = _reference(rewards, 4, scale, 1e-4)
    assert adv.tolist() == pytest.approx(ref, abs=1e-5)
    assert zero.tolist() == ref_zero == [False, True, False]


def test_zero_variance_group_gets_exactly_zero_advantage():
    # 0.2 is not exact in float32: the centred values are ~1e-8, which / eps would be ~1e-4, not 0
    for scale in ("group", "batch", "none"):
        adv, zero = group_advantages(torch.tensor([0.2, 0.2, 0.2, 1.2, 0.2, 0.2]), _groups(6, 3), scale)
        assert adv[:3].tolist() == [0.0, 0.0, 0.0] and zero.tolist() == [True, False]


def test_hand_computed_pair():
    # rewards 1 and 0: mean .5, Bessel std sqrt(.5) = .7071 -> +-0.7071
    adv, _ = group_advantages(torch.tensor([1.0, 0.0]), _groups(2, 2), "group", eps=0.0)
    assert adv.tolist() == pytest.approx([0.70710678, -0.70710678], abs=1e-6)


def test_groups_are_read_from_the_group_index_not_from_row_order():
    """Interleaved rows give each row the advantage it has with its group laid out contiguously."""
    rewards = [1.0, 0.0, 0.0, 1.0, 0.2, 0.2, 0.2, 0.2, 1.2, 0.0, 0.2, 0.0]
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    for scale in ("group", "batch", "none"):
        contiguous, _ = group_advantages(torch.tensor(rewards), _groups(12, 4), scale)
        shuffled, _ = group_advantages(torch.tensor(rewards)[perm], _groups(12, 4)[perm], scale)
        assert torch.allclose(shuffled, contiguous[perm], atol=1e-6)


def test_rows_without_a_reward_stay_out_of_the_baseline():
    """A row whose every component returned None (total 0) must not pull its group's mean down."""
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.5])
    valid = torch.tensor([True, True, True, False, True, True])  # row 3: no reward value
    adv, zero = group_advantages(rewards, _groups(6, 3), "group", eps=0.0, valid=valid)
    # group 0 as before; group 1 is rows 4 and 5 only: mean .75, Bessel std .3536
    g0, _ = _reference([1.0, 0.0, 1.0], 3, "group", 0.0)
    assert adv[:3].tolist() == pytest.approx(g0, abs=1e-6)
    assert adv[3].item() == 0.0
    assert adv[4:].tolist() == pytest.approx([0.70710678, -0.70710678], abs=1e-6)
    # a group left with fewer than two rewards has no baseline: advantage 0
    adv, zero = group_advantages(torch.tensor([1.0, 0.0]), _groups(2, 2), "group", valid=torch.tensor([True, False]))
    assert adv.tolist() == [0.0, 0.0] and zero.tolist() == [True]


# ---------------------------------------------------------------- GAE and n-step returns vs slow loops
from docuchat_rl.learning.advantages import gae, nstep_returns, whiten  # noqa: E402


def _ref_gae(r, v, d, nv, gamma, lam):
    n, t_len = len(r), len(r[0])
    adv = [[0.0] * t_len for _ in range(n)]
    for i in range(n):
        for t in range(t_len):  # forward definition: sum of discounted deltas until a done
            total, coef = 0.0, 1.0
            for k in range(t, t_len):
                nxt = nv[i] if k + 1 == t_len else v[i][k + 1]
                delta = r[i][k] + gamma * nxt * (1 - d[i][k]) - v[i][k]
                total += coef * delta
                if d[i][k]:
                    break
                coef *= gamma * lam
            adv[i][t] = total
    return adv


def _ref_nstep(r, v, d, nv, gamma, n):
    rows, t_len = len(r), len(r[0])
    out = [[0.0] * t_len for _ in range(rows)]
    for i in range(rows):
        for t in range(t_len):
            total, k, done = 0.0, 0, False
            while k < (n or t_len) and t + k < t_len:
                total += gamma ** k * r[i][t + k]
                if d[i][t + k]:
                    done = True
                    break
                k += 1
            if not done:
                boot = nv[i] if t + k == t_len else v[i][t + k]
                total += gamma ** k * boot
            out[i][t] = total
    return out


def _episodes():
    g = torch.Generator().manual_seed(3)
    r = torch.randn(3, 9, generator=g)
    v = torch.randn(3, 9, generator=g)
    d = torch.zeros(3, 9)
    d[0, 2] = d[0, 6] = 1  # two episode ends inside the segment
    d[1, 8] = 1  # ends exactly at the segment end: no bootstrap
    nv = torch.tensor([0.7, -5.0, 1.3])  # row 2 never ends: bootstrap from next_value
    return r, v, d, nv


@pytest.mark.parametrize("gamma,lam", [(0.99, 0.95), (1.0, 1.0), (0.9, 0.0)])
def test_gae_matches_reference_loop_with_dones(gamma, lam):
    r, v, d, nv = _episodes()
    adv, ret = gae(r, v, d, nv, gamma, lam)
    ref = _ref_gae(r.tolist(), v.tolist(), d.tolist(), nv.tolist(), gamma, lam)
    assert torch.allclose(adv, torch.tensor(ref), atol=1e-5)
    assert torch.allclose(ret, adv + v)


def test_gae_lambda_one_is_monte_carlo_minus_value():
    r, v, d, nv = _episodes()
    adv, _ = gae(r, v, d, nv, 0.97, 1.0)
    mc = nstep_returns(r, v, d, nv, 0.97)
    assert torch.allclose(adv, mc - v, atol=1e-5)


@pytest.mark.parametrize("n", [None, 1, 3, 5, 9, 20])
def test_nstep_returns_match_reference_loop_with_dones(n):
    r, v, d, nv = _episodes()
    out = nstep_returns(r, v, d, nv, 0.9, n)
    ref = _ref_nstep(r.tolist(), v.tolist(), d.tolist(), nv.tolist(), 0.9, n)
    assert torch.allclose(out, torch.tensor(ref), atol=1e-5)


def test_nstep_hand_case():
    # r = [1, 2, 3], no dones, V = [10, 20, 30], next_value 40, gamma 0.5
    r, v, d = torch.tensor([[1.0, 2, 3]]), torch.tensor([[10.0, 20, 30]]), torch.zeros(1, 3)
    assert nstep_returns(r, v, d, torch.tensor([40.0]), 0.5, 1).tolist() == [[11.0, 17.0, 23.0]]
    # full: R2 = 3 + .5*40 = 23, R1 = 2 + .5*23 = 13.5, R0 = 1 + .5*13.5 = 7.75
    assert nstep_returns(r, v, d, torch.tensor([40.0]), 0.5).tolist() == [[7.75, 13.5, 23.0]]


def test_whiten_masked():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, -100.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    w = whiten(x, mask)
    assert w[:, 2].tolist() == [0.0, 0.0]
    assert (w * mask).sum().item() == pytest.approx(0.0, abs=1e-6)
    assert ((w[:, :2] ** 2).sum() / 3).item() == pytest.approx(1.0, rel=1e-5)
