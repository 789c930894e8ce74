"""Composite arithmetic and fault isolation for each failure kind; strict mode raises at once."""

import time

import pytest

from rewards import CompositeReward, RewardFailure

GOOD = "<think>\n2 + 2 = 4\n</think>\n<answer>4</answer>"
BAD = "<answer>5</answer> trailing"


def run(specs, completions=(GOOD, BAD), **kw):
    comp = CompositeReward(specs, **kw)
    n = len(completions)
    return comp(["Q"] * n, list(completions), answer=["4"] * n)


def test_weighted_total_and_trace_fields():
    res = run([{"name": "correctness", "weight": 1.0}, {"name": "format", "weight": 0.25}])
    good, bad = res.records
    assert good.total == pytest.approx(1.25) and bad.total == pytest.approx(0.0)
    c = good.components["format"]
    assert (c.raw, c.weight, c.weighted, c.error) == (1.0, 0.25, 0.25, None)
    assert set(c.as_dict()) == {"raw", "weight", "weighted", "info", "error"}
    assert res.errors == {"correctness": 0, "format": 0}


def test_negative_weights_and_params_per_component():
    res = run([{"name": "repetition", "weight": 2.0, "params": {"n": 1, "max_penalty": -1.0}}],
              completions=["a a a b"])
    assert res.records[0].total == pytest.approx(2.0 * -0.5)  # 4 unigrams, 2 repeats


def test_not_applicable_is_excluded_without_renormalising():
    comp = CompositeReward([{"name": "correctness", "weight": 1.0}, {"name": "format", "weight": 0.5}])
    rec = comp(["Q"], [GOOD], answer=[""]).records[0]  # no gold: correctness is None
    assert rec.components["correctness"].raw is None and rec.components["correctness"].error is None
    assert rec.total == pytest.approx(0.5)  # format's 0.5, not scaled up to 1.5


@pytest.mark.parametrize("fn,message", [
    ("raises", "RuntimeError: boom"),
    ("wrong_length", "returned 3 values for 2 completions"),
    ("async_wrong_length", "returned 1 values for 2 completions"),  # (awaited apart: the same check)
    ("not_a_number", "expected a number"),
    ("exits", "called sys.exit(3)"),
])
def test_batch_failures_are_recorded_not_raised(fn, message):
    res = run([{"name": "correctness", "weight": 1.0}, {"name": f"tests.user_rewards:{fn}", "weight": 1.0}])
    name = f"tests.user_rewards:{fn}"
    assert res.errors[name] == 2
    for rec in res.records:
        assert rec.components[name].raw is None and message in rec.components[name].error
    assert [r.total for r in res.records] == [1.0, 0.0]  # correctness still counts


def test_every_value_trl_accepts_counts_and_what_it_refuses_is_named():
    """bool (`[len(c) > 3 for c in completions]`), numpy scalars and one-element tensors are numbers, as in
    TRL; an array of several values fails its completion, naming the value."""
    res = run([{"name": "tests.user_rewards:long_enough"}], completions=["a", "abcd"])
    assert [r.components["tests.user_rewards:long_enough"].raw for r in res.records] == [0.0, 1.0]
    name = "tests.user_rewards:numpy_and_torch"
    res = run([{"name": name, "weight": 2.0}], completions=list("abcde"))
    comps = [r.components[name] for r in res.records]
    assert [c.raw for c in comps] == [0.5, 2.0, 0.25, 1.5, None]
    assert all(type(c.raw) is float for c in comps[:4]) and comps[1].weighted == 4.0
    assert res.errors[name] == 1 and "returned ndarray" in comps[4].error and "expected a number" in comps[4].error


def test_nan_is_no_value_as_in_trl_and_infinity_fails_only_its_completion():
    """TRL sums reward columns with nansum: a NaN is "no value" (as None), not a failure; inf fails its
    completion alone."""
    res = run([{"name": "tests.user_rewards:not_finite"}], completions=["a", "b", "c"])
    name = "tests.user_rewards:not_finite"
    assert res.errors[name] == 1
    assert [r.components[name].raw for r in res.records] == [None, None, 1.0]
    assert res.records[0].components[name].error is None  # NaN: no value, no error, but said
    assert res.records[0].components[name].info == {"nan": True} and "nan" not in res.records[2].components[name].info
    assert "non-finite" in res.records[1].components[name].error
    assert res.records[0].total_missing and not res.records[2].total_missing


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_a_whole_numpy_array_or_tensor_is_a_list_of_values_as_trl_iterates_it(kind):
    name = f"tests.user_rewards:whole_{kind}"
    res = run([{"name": name}], completions=["a", "bb", "ccc"])
    assert res.errors[name] == 0
    assert [r.components[name].raw for r in res.records] == [1.0, 2.0, None]  # (its NaN: no value)


def test_timeout_is_recorded_and_the_next_call_works():
    comp = CompositeReward([{"name": "tests.user_rewards:slow"}, {"name": "format", "weight": 1.0}],
                           timeout_s=0.3)
    res = comp(["Q"], [GOOD])
    assert "time limit" in res.records[0].components["tests.user_rewards:slow"].error
    assert res.records[0].total == 1.0
    again = comp(["Q"], [GOOD])  # a fresh worker serves the next batch
    assert again.records[0].components["format"].raw == 1.0


def test_signal_based_reward_code_runs_and_the_time_limit_still_holds():
    """Sync rewards run in the main thread, as TRL calls them: math_verify with its default timeouts works,
    and a reward past rewards.timeout_s is still cut off there (and the next call runs)."""
    comp = CompositeReward([{"name": "tests.user_rewards:openr1_accuracy"}])
    res = comp(["Q", "Q"], ["so \\boxed{4}", "\\boxed{5}"], solution=["$4$", "$4$"])
    assert [r.components["tests.user_rewards:openr1_accuracy"].raw for r in res.records] == [1.0, 0.0]
    assert res.errors["tests.user_rewards:openr1_accuracy"] == 0
    comp = CompositeReward([{"name": "tests.user_rewards:slow"}, {"name": "format"}], timeout_s=0.3)
    t0 = time.perf_counter()
    res = comp(["Q"], [GOOD])
    assert time.perf_counter() - t0 < 1.5  # the 2 s sleep was interrupted, not waited for
    assert "exceeded the 0.3 s time limit" in res.records[0].components["tests.user_rewards:slow"].error
    assert res.records[0].components["format"].raw == 1.0


def test_an_async_reward_keeps_one_event_loop_across_calls():
    """An async judge with module-level loop-bound state works on every call, not only the first."""
    comp = CompositeReward([{"name": "tests.user_rewards:async_judge"}])
    for _ in range(3):
        res = comp(["Q", "Q"], ["ab", "abcd"])
        assert res.errors["tests.user_rewards:async_judge"] == 0, res.records[0].components
        assert [r.total for r in res.records] == [2.0, 4.0]


def test_a_reward_abandoned_past_its_time_limit_does_not_keep_the_process_from_exiting():
    """The abandoned call still sleeps (Python cannot stop a thread), but the process ends when its work does:
    no wait at interpreter exit for the worker (a finished run would hang and keep its folder locked)."""
    import subprocess
    import sys
    import time

    from .conftest import ROOT

    code = ("import threading\n"
            "from rewards import CompositeReward\n"
            "c = CompositeReward([{'name': 'tests.user_rewards:stuck'}], timeout_s=0.2)\n"
            "out = [c(['Q'], ['a'])]  # in the main thread: interrupted at the limit\n"
            "t = threading.Thread(target=lambda: out.append(c(['Q'], ['a'])))  # elsewhere: a worker, abandoned\n"
            "t.start(); t.join()\n"
            "for r in out: print(r.records[0].components['tests.user_rewards:stuck'].error)\n")
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert done.returncode == 0 and done.stdout.count("exceeded the 0.2 s time limit") == 2, done.stderr[-1000:]
    assert time.perf_counter() - t0 < 20  # the stuck calls sleep 60 s


def test_several_async_components_are_awaited_together_with_the_sync_ones_in_order():
    """Two async components that each wait for the other finish (started together, as TRL gathers them); a
    sync component between them still runs in the main thread, and the records keep the configured order."""
    from . import user_rewards

    user_rewards.HANDSHAKE.clear()
    names = ["tests.user_rewards:meets_b", "tests.user_rewards:long_enough", "tests.user_rewards:meets_a"]
    comp = CompositeReward([{"name": n} for n in names], timeout_s=5)
    res = comp(["Q", "Q"], ["short", "a long enough completion"])
    assert res.errors == dict.fromkeys(names, 0), res.records[0].components
    assert list(res.records[1].components) == names
    assert [r.components[names[0]].raw for r in res.records] == [1.0, 1.0]


def test_sys_exit_in_an_async_reward_is_that_call_s_failure_and_the_loop_serves_the_next_calls():
    comp = CompositeReward([{"name": "tests.user_rewards:async_exits"}, {"name": "tests.user_rewards:async_judge"}],
                           timeout_s=5)
    for _ in range(2):
        res = comp(["Q"], ["abc"])
        assert res.records[0].components["tests.user_rewards:async_exits"].error == "RewardError: called sys.exit(3)"
        assert res.records[0].components["tests.user_rewards:async_judge"].raw == 3.0


def test_an_async_reward_past_its_time_limit_is_cancelled_not_left_running():
    from tests import user_rewards

    comp = CompositeReward([{"name": "tests.user_rewards:async_stuck"}], timeout_s=0.3)
    res = comp(["Q", "Q"], ["a", "b"])
    assert "time limit" in res.records[0].components["tests.user_rewards:async_stuck"].error
    for _ in range(50):  # (the cancellation runs on the event loop's thread)
        if user_rewards.CANCELLED:
            break
        time.sleep(0.02)
    assert user_rewards.CANCELLED == [2]


@pytest.mark.parametrize("fn", ["raises", "wrong_length", "not_finite", "not_a_number"])
def test_strict_raises_with_the_reward_name(fn):
    with pytest.raises(RewardFailure, match=f"tests.user_rewards:{fn}"):
        run([{"name": f"tests.user_rewards:{fn}"}], completions=["a", "b"], strict=True)


def test_only_selected_rewards_are_built_and_duplicates_fail():
    comp = CompositeReward([{"name": "format"}])
    assert comp.names == ["format"]
    with pytest.raises(ValueError, match="listed twice"):
        CompositeReward([{"name": "format"}, {"name": "format"}])
