"""Dynamic sampling's decision: a group trains only when the rewards of its completions that have a
value differ (a completion without any reward value is out of the baseline and adds no signal)."""

from docuchat_rl.sampling.rollout import rewards_varied
from rewards import CompositeReward


def _group(name):
    comp = CompositeReward([{"name": name, "weight": 1.0}])
    return comp(["Q"] * 4, ["a", "b", "c", "d"]).records


def test_missing_rewards_do_not_make_a_group_varied():
    records = _group("tests.user_rewards:none_on_even")  # None, 1, None, 1: the totals read 0, 1, 0, 1
    assert [r.total_missing for r in records] == [True, False, True, False]
    assert not rewards_varied(records)


def test_differing_valid_rewards_make_a_group_varied():
    records = _group("tests.user_rewards:length_over")  # every completion of length 1: all 0
    assert not rewards_varied(records)
    records[0].total, records[1].total = 1.0, 0.0
    assert rewards_varied(records)
    assert not rewards_varied(records[:1])  # one valid reward compares with nothing


def test_truncated_completions_stay_in_their_group_but_out_of_the_loss():
    """mask_truncated_completions: the cut completion's tokens are in the batch (its group's baseline
    still counts its reward) but not in the completion mask nor in the loss's token count."""
    from docuchat_rl.data import Example
    from docuchat_rl.sampling.rollout import Completion, Rollout

    comp = CompositeReward([{"name": "tests.user_rewards:length_over", "weight": 2.0}])
    records = comp(["Q"] * 2, ["a", "bb"]).records
    ex = Example(0, "Q", "1")
    rows = [Completion(ex, 0, i, 0, [5, 6], ids, [-0.5] * len(ids), "t", cut, rec, True, 0)
            for i, (ids, cut, rec) in enumerate(zip([[1, 2, 3], [4, 2]], [True, False], records))]
    rollout = Rollout(rows, prompts_sampled=1, groups_used=1)
    for masked in (False, True):
        batch = rollout.batch(pad_id=0, mask_truncated=masked)
        assert batch.completion_mask.sum(-1).tolist() == ([0.0, 2.0] if masked else [3.0, 2.0])
        assert batch.info.completion_lens == (3, 2)  # the tokens are there (the forward sees them)
        assert batch.info.loss_lens == ((0, 2) if masked else (3, 2))
        assert batch.component_rewards.tolist() == [[r.components[name].raw for name in r.components]
                                                    for r in records]


def test_a_process_without_used_groups_builds_an_empty_batch_that_gdpo_handles():
    """Dynamic sampling may leave a process no group: its batch has no rows, and the decoupled
    advantages (which take batch statistics over every process) still run on it."""
    import torch

    from docuchat_rl.data import Example
    from docuchat_rl.learning.advantages import decoupled_advantages
    from docuchat_rl.sampling.rollout import Completion, Rollout

    rec = CompositeReward([{"name": "tests.user_rewards:length_over", "weight": 1.0}])(["Q"], ["a"]).records[0]
    rollout = Rollout([Completion(Example(0, "Q", "1"), 0, 0, 0, [5], [1], [-0.1], "a", False, rec, False, None)], 1, 0)
    batch = rollout.batch(pad_id=0)
    assert batch.rows == 0 and batch.component_rewards.shape == (0, 0)
    adv = decoupled_advantages(batch.component_rewards, torch.tensor([1.0, 0.5]), batch.group)
    assert adv.shape == (0,)
