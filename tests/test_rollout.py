"""Dynamic sampling's decision: a group trains only when the rewards of its completions that have a
value differ (a completion without any reward value is out of the baseline and adds no signal)."""

from docuchat_rl.rollout import rewards_varied
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
