"""Reward tables (one comment per case), properties over arbitrary text, registry and dotted paths."""

import math

import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rewards import RewardError, build_reward, registered, resolve_reward


def one(name, completion, prompt="Q", params=None, **row):
    r = build_reward(name, params)
    return r.explain([prompt], [completion], **{k: [v] for k, v in row.items()})[0]


CORRECTNESS = [
    # (completion, gold, expected, why)
    ("<think>4 + 3 = 7</think><answer>7</answer>", "4 + 3 = <<4+3=7>>7\n#### 7", 1.0, "GSM8K gold with ####"),
    ("<answer>141</answer>", "14", 0.0, "no substring match: 14 is not 141"),
    ("<answer>1,000</answer>", "1000", 1.0, "thousands separator in the prediction"),
    ("<answer>1000</answer>", "#### 1,000", 1.0, "thousands separator in the gold"),
    ("<answer>\\frac{1}{2}</answer>", "0.5", 1.0, "LaTeX fraction equals a decimal"),
    ("<answer>1/2</answer>", "\\frac{1}{2}", 1.0, "plain fraction equals a LaTeX gold"),
    ("<answer>-3</answer>", "-3", 1.0, "negative number"),
    ("<answer>3</answer>", "-3", 0.0, "sign matters"),
    ("<answer>18 apples</answer>", "18", 1.0, "units after the number"),
    ("<answer>$18</answer>", "18", 1.0, "currency sign"),
    ("The result is \\boxed{42}.", "42", 1.0, "boxed answer when no tag"),
    ("so #### 12", "12", 1.0, "GSM8K-style hashes in the completion"),
    ("I think it is 5, no wait, 6", "6", 1.0, "last number as the last resort"),
    ("<answer>5</answer> but really 6", "6", 0.0, "the answer tag wins over later numbers"),
    ("<answer>1\n<answer>51</answer>", "51", 1.0, "nested tags: the innermost answer"),
    ("<think>unclosed <answer>9", "9", 1.0, "unclosed answer tag: falls back to the last number"),
    ("", "7", 0.0, "empty completion"),
    ("   \n\t ", "7", 0.0, "whitespace only"),
    ("<answer>Paris</answer>", "paris", 1.0, "non-math gold: normalised string match"),
    ("<answer>París.</answer>", "Paris", 1.0, "accents and punctuation ignored"),
    ("<answer>Lyon</answer>", "Paris", 0.0, "non-math mismatch"),
    ("```python\nprint(7)\n```\n<answer>7</answer>", "7", 1.0, "code block before the answer"),
    # LaTeX written in the tag without $ delimiters is judged by its value
    ("<answer>2^{3}</answer>", "8", 1.0, "bare LaTeX power"),
    ("<answer>2 \\cdot 4</answer>", "8", 1.0, "bare LaTeX product with cdot"),
    ("<answer>2\\times 4</answer>", "8", 1.0, "bare LaTeX product with times"),
    ("<answer>\\frac{16}{2}</answer>", "#### 8", 1.0, "bare LaTeX fraction equal to an integer gold"),
    ("<answer>\\sqrt{64}</answer>", "8", 1.0, "bare LaTeX square root"),
    ("<answer>4^{2}</answer>", "8", 0.0, "bare LaTeX power of another value"),
    ("<answer>3 \\cdot 3</answer>", "8", 0.0, "bare LaTeX product of another value"),
    ("\\boxed{2^{3}}", "8", 1.0, "LaTeX inside boxed"),
    ("<answer>$2^{3}$</answer>", "8", 1.0, "delimited LaTeX still works"),
    ("<answer>七</answer>", "7", 0.0, "a CJK numeral is not parsed as 7"),
]


@pytest.mark.parametrize("completion,gold,expected,why", CORRECTNESS, ids=[c[3] for c in CORRECTNESS])
def test_correctness(completion, gold, expected, why):
    assert one("correctness", completion, answer=gold).value == expected


@pytest.mark.parametrize("gold", ["", "   ", None, "####   "])
def test_correctness_without_gold_is_not_applicable(gold):
    s = one("correctness", "<answer>3</answer>", answer=gold)
    assert s.value is None and s.info["reason"] == "no gold answer"


def test_correctness_info_explains():
    s = one("correctness", "<answer>8</answer>", answer="#### 8")
    assert s.info == {"gold": "8", "extracted": "8", "extractor": "answer_tag", "method": "math_verify"}


def test_correctness_extractor_order_is_configurable():
    s = one("correctness", "<answer>5</answer> \\boxed{6}", params={"extractors": ["boxed"]}, answer="6")
    assert s.value == 1.0 and s.info["extractor"] == "boxed"
    with pytest.raises(RewardError, match="unknown extractors"):
        build_reward("correctness", {"extractors": ["nope"]})


def test_correctness_missing_column_names_it():
    with pytest.raises(RewardError, match="'answer'"):
        build_reward("correctness")(["Q"], ["<answer>1</answer>"])


FORMAT = [
    # (completion, strict, lenient, why)
    ("<think>\n1 + 1 = 2\n</think>\n<answer>2</answer>", 1.0, 1.0, "canonical"),
    ("  <think>x</think><answer>2</answer>\n", 1.0, 1.0, "surrounding whitespace"),
    ("<think>x</think><answer>2</answer> extra", 0.0, 1.0, "text after the answer"),
    ("Sure: <think>x</think><answer>2</answer>", 0.0, 1.0, "text before the think block"),
    ("<think>x<answer>2</answer>", 0.0, 0.0, "unclosed think"),
    ("<answer>2</answer><think>x</think>", 0.0, 0.0, "wrong order"),
    ("<think><think>x</think></think><answer>2</answer>", 0.0, 1.0, "nested think tags"),
    ("<think>x</think><answer>1</answer><answer>2</answer>", 0.0, 1.0, "two answers"),
    ("", 0.0, 0.0, "empty"),
    ("<think>Je réfléchis</think><answer>2</answer>", 1.0, 1.0, "non-English content"),
]


@pytest.mark.parametrize("completion,strict,lenient,why", FORMAT, ids=[c[3] for c in FORMAT])
def test_format(completion, strict, lenient, why):
    assert one("format", completion).value == strict
    assert one("format", completion, params={"mode": "lenient"}).value == lenient


HASHES = [
    # (completion, score with partial 0.5, why)
    ("3 + 4 = 7\n7 * 2 = 14\n#### 14", 1.0, "working, then the last line #### N"),
    ("#### 14", 1.0, "the answer line alone"),
    ("7 * 2 = 14\n#### 14.\n", 1.0, "a full stop and a newline after the number"),
    ("#### 1,400", 1.0, "thousands separator"),
    ("#### 14\nThe answer is 14.", 0.5, "the marker once, then more text: partial"),
    ("so #### 14", 0.5, "the marker inside the last line: partial"),
    ("#### 14\n#### 15", 0.0, "a list of #### lines earns nothing"),
    ("#### N.", 0.0, "the instruction's literal #### N copied: no number"),
    ("#### fourteen", 0.0, "no number after the marker"),
    ("The answer is 14.", 0.0, "no marker"),
    ("", 0.0, "empty"),
]


@pytest.mark.parametrize("completion,expected,why", HASHES, ids=[c[2] for c in HASHES])
def test_format_hashes_mode_with_partial_credit(completion, expected, why):
    assert one("format", completion, params={"mode": "hashes", "partial": 0.5}).value == expected
    assert one("format", completion, params={"mode": "hashes"}).value == (1.0 if expected == 1.0 else 0.0)


def test_format_partial_credit_for_tags_and_its_range():
    assert one("format", "<think>x</think><answer>2</answer> extra", params={"partial": 0.25}).value == 0.25
    assert one("format", "<think>x</think>", params={"partial": 0.25}).value == 0.0  # no answer tag at all
    with pytest.raises(RewardError, match="partial must be in"):
        build_reward("format", {"partial": 1.0})
    with pytest.raises(RewardError, match="'strict', 'lenient' or 'hashes'"):
        build_reward("format", {"mode": "boxed"})


ARITHMETIC = [
    # (completion, score, equations checked, why)
    ("5 + 3 = 8\n8 * 2 = 16\n#### 16", 1.0, 2, "every calculation right"),
    ("25 * 4 = 90\n90 - 10 = 80", 0.5, 2, "one wrong product, one right difference"),
    ("12 - 16 = 1", 0.0, 1, "a wrong subtraction"),
    ("28 / 4 = 7, so 7 x 3 = 21 and 21 ÷ 3 = 7.", 1.0, 3, "x, ÷ and equations inside a sentence"),
    ("1,000 + 24 = 1,024", 1.0, 1, "thousands separators"),
    ("2.5 * 4 = 10", 1.0, 1, "decimals"),
    ("3 + 4 = 7.5", 0.0, 1, "a decimal result is read whole"),
    ("10 / 0 = 1", 0.0, 1, "division by zero is wrong, not an error"),
    ("The answer is 8.", None, 0, "no equation: nothing to check"),
]


@pytest.mark.parametrize("completion,expected,count,why", ARITHMETIC, ids=[c[3] for c in ARITHMETIC])
def test_arithmetic(completion, expected, count, why):
    s = one("arithmetic", completion)
    assert s.value == expected and s.info["equations"] == count
    if expected is not None and expected < 1:
        assert s.info["wrong"]  # the trace names the wrong calculations


GOLD = "22 / 2 = <<22/2=11>>11\n11 + 6 = <<11+6=17>>17\n17 + 1 = <<17+1=18>>18\n#### 18"
GOLD_STEPS = [
    # (completion, score, steps reached, why)
    ("22 / 2 = 11\n11 + 6 = 17\n17 + 1 = 18\n#### 18", 1.0, 3, "every gold step reached"),
    ("22 / 2 = 11\n11 + 6 = 18\n#### 18", 1 / 3, 1, "the second step's sum is wrong: only the first counts"),
    ("11 + 6 = 17\n22 / 2 = 11", 2 / 3, 2, "order is not checked"),
    ("#### 18", 0.0, 0, "a right final answer without working reaches no step"),
    ("17 = 17\n11 17 18", 0.0, 0, "numbers that are not an equation's result do not count"),
    ("22 / 2 = 11\n5 + 6 = 11\n10 + 7 = 17", 2 / 3, 2, "two equations reaching 11 count for one gold step"),
    ("22 / 2 = 11.0\n11 + 6 = 17", 2 / 3, 2, "a decimal result equal to the gold"),
]


@pytest.mark.parametrize("completion,expected,reached,why", GOLD_STEPS, ids=[c[3] for c in GOLD_STEPS])
def test_gold_steps(completion, expected, reached, why):
    s = one("gold_steps", completion, answer_text=GOLD)
    assert math.isclose(s.value, expected) and s.info["reached"] == reached and s.info["gold_steps"] == 3


def test_gold_steps_without_annotations_or_column():
    assert one("gold_steps", "4 + 3 = 7", answer_text="#### 7").value is None  # nothing to give partial credit for
    with pytest.raises(RewardError, match="gold_steps needs the column 'answer_text'"):
        one("gold_steps", "4 + 3 = 7", solution="#### 7")
    assert one("gold_steps", "4 + 3 = 7", params={"answer_key": "solution"}, solution="<<4+3=7>>7").value == 1.0


def test_format_says_why():
    assert one("format", "<think>x</think><answer>2</answer> extra").info["reason"] == "text after the answer"


TAGS = [
    ("<think>x</think><answer>2</answer>", 1.0, "all four once"),
    ("<think>x</think>", 0.5, "two of four"),
    ("<think><think>x</think><answer>2</answer>", 0.75, "a doubled tag earns nothing"),
    ("plain", 0.0, "no tags"),
]


@pytest.mark.parametrize("completion,expected,why", TAGS, ids=[c[2] for c in TAGS])
def test_tag_count(completion, expected, why):
    assert one("tag_count", completion).value == expected


STEPS = [
    # (completion, score, markers counted, why)
    ("<think>\n4 + 3 = 7\n7 * 2 = 14\n</think>", 2 / 3, 2, "two equations, one per line"),
    ("Step 1: add.\nStep 2: multiply.\nStep 3: done.\nStep 4: check.", 1.0, 4, "saturates at 3"),
    ("First, add. Next, multiply.", 1 / 3, 1, "two transitions on one line count once"),
    ("First, add.\nNext, multiply.\nFinally, report.", 1.0, 3, "transitions on separate lines"),
    ("1. add\n2. multiply", 2 / 3, 2, "numbered list"),
    ("just an answer", 0.0, 0, "no markers"),
    ("", 0.0, 0, "empty"),
]


@pytest.mark.parametrize("completion,expected,count,why", STEPS, ids=[c[3] for c in STEPS])
def test_reasoning_steps(completion, expected, count, why):
    s = one("reasoning_steps", completion)
    assert s.value == pytest.approx(expected) and s.info["count"] == count


REPETITION = [
    ("the cat sat on the mat", 0.0, "no repeated trigram"),
    ("a b c a b c a b c", -4 / 7, "7 trigrams, 3 distinct: 4 repeats"),
    ("go", 0.0, "shorter than n"),
    ("", 0.0, "empty"),
]


@pytest.mark.parametrize("completion,expected,why", REPETITION, ids=[c[2] for c in REPETITION])
def test_repetition(completion, expected, why):
    assert one("repetition", completion).value == pytest.approx(expected)


def test_repetition_params():
    assert one("repetition", "go go go go go", params={"n": 2, "max_penalty": -0.5}).value == pytest.approx(-0.375)
    with pytest.raises(RewardError, match="max_penalty"):
        build_reward("repetition", {"max_penalty": 1.0})


LANGUAGE = [
    ("<think>First we add the apples. Then we count all of them again.</think>", "en", 1.0, "English"),
    ("<think>D'abord nous additionnons les pommes. Ensuite nous les comptons.</think>", "en", 0.0, "French"),
    ("<think>D'abord nous additionnons les pommes. Ensuite nous les comptons.</think>", "fr", 1.0,
     "French as the target"),
    ("<think>We add them: $3 + 4 = 7$ and then `x = 7` again.\n```\nprint(3+4)\n```</think>", "en", 1.0,
     "math and code spans do not count against English"),
    ("<think>首先我们把苹果加起来。然后我们再数一遍。</think>", "en", 0.0, "Chinese when English is asked"),
    ("<think>首先我们把苹果加起来。然后我们再数一遍。</think>", "zh", 1.0, "Chinese as the target"),
]


@pytest.mark.parametrize("completion,target,expected,why", LANGUAGE, ids=[c[3] for c in LANGUAGE])
def test_language(completion, target, expected, why):
    assert one("language", completion, params={"target": target}).value == pytest.approx(expected)


def test_language_mixed_and_auto_and_not_applicable():
    mixed = one("language", "<think>First we add all of the apples together. "
                "Ensuite nous comptons toutes les pommes restantes.</think>")
    assert 0.3 < mixed.value < 0.7 and set(mixed.info["detected"]) == {"en", "fr"}
    auto = one("language", "<think>Zuerst addieren wir alle Äpfel zusammen.</think>",
               prompt="Wie viele Äpfel hat Anna jetzt insgesamt?", params={"target": "auto"})
    assert auto.value == 1.0 and auto.info["target"] == "de"
    eq = one("language", "<think>\n3 + 4 = 7\n7 * 2 = 14\n</think><answer>14</answer>")
    assert eq.value is None  # nothing but equations: nothing to judge


LENGTH = [
    # (params, correct?, tokens, expected, why)
    ({"shape": "cosine", "max_len": 100}, True, 0, 1.0, "short and correct: max"),
    ({"shape": "cosine", "max_len": 100}, True, 100, 0.5, "long and correct: min_correct"),
    ({"shape": "cosine", "max_len": 100}, True, 50, 0.75, "halfway: midpoint of the cosine"),
    ({"shape": "cosine", "max_len": 100}, False, 0, -1.0, "short and wrong: punished most"),
    ({"shape": "cosine", "max_len": 100}, False, 100, -0.5, "long and wrong: punished least"),
    ({"shape": "cosine", "max_len": 100}, True, 500, 0.5, "beyond max_len: clamped"),
    ({"shape": "overlong", "max_len": 100, "cache": 20}, True, 80, 0.0, "inside the budget"),
    ({"shape": "overlong", "max_len": 100, "cache": 20}, True, 95, -0.75, "inside the soft buffer"),
    ({"shape": "overlong", "max_len": 100, "cache": 20}, True, 101, -1.0, "over the limit"),
]


@pytest.mark.parametrize("params,correct,tokens,expected,why", LENGTH, ids=[c[4] for c in LENGTH])
def test_length(params, correct, tokens, expected, why):
    completion = "<answer>4</answer>" if correct else "<answer>5</answer>"
    assert one("length", completion, params=params, answer="4",
               completion_tokens=tokens).value == pytest.approx(expected)


def test_length_uses_trl_completion_ids_or_chars_and_names_missing_column():
    assert one("length", "x", params={"shape": "overlong", "max_len": 10, "cache": 5},
               completion_ids=list(range(8))).value == pytest.approx(-0.6)
    assert one("length", "x" * 8, params={"shape": "overlong", "max_len": 10, "cache": 5, "unit": "chars"}
               ).value == pytest.approx(-0.6)
    with pytest.raises(RewardError, match="completion_tokens"):
        one("length", "x", params={"shape": "overlong"})


# ---------------------------------------------------------------- properties over arbitrary text
ROW = {"answer": "12", "completion_tokens": 30}
texts = st.text(min_size=0, max_size=300) | st.builds(
    lambda a, b, c: f"<think>{a}</think><answer>{b}</answer>{c}", st.text(max_size=80), st.text(max_size=20),
    st.text(max_size=20))


@pytest.mark.parametrize("name,params", [("correctness", {}), ("format", {}), ("format", {"mode": "lenient"}),
                                         ("tag_count", {}), ("reasoning_steps", {}), ("repetition", {}),
                                         ("language", {}), ("length", {"max_len": 64, "cache": 16}),
                                         ("length", {"shape": "overlong", "max_len": 64, "cache": 16})])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=texts)
def test_never_raises_finite_and_in_range(name, params, text):
    r = build_reward(name, params)
    s = r.explain([text], [text], **{k: [v] for k, v in ROW.items()})[0]
    assert s.value is None or (math.isfinite(s.value) and r.low <= s.value <= r.high)
    import json
    json.dumps(s.info)  # info is JSON-serialisable


# ---------------------------------------------------------------- registry
def test_registry_names_and_unknown_name_lists_valid():
    assert {"correctness", "format", "tag_count", "reasoning_steps", "repetition", "language",
            "length"} <= set(registered())
    with pytest.raises(RewardError, match="registered rewards are .*correctness"):
        resolve_reward("corectness")


def test_registering_a_name_twice_fails():
    from rewards import Reward, register

    with pytest.raises(RewardError, match="already registered"):
        register("format")(type("Dup", (Reward,), {}))


def test_one_reward_file_imported_twice_registers_once():
    """pytest's importlib mode imports a reward file a second time to collect its doctests alone
    (`pytest rewards/format.py`); the same definition again is no clash, and the first class stays."""
    import importlib.util

    from rewards import format as first
    from rewards.base import _REGISTRY

    spec = importlib.util.spec_from_file_location("rewards.format_again", first.__file__)
    again = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = again  # (as an import does, before the module runs)
    try:
        spec.loader.exec_module(again)
    finally:
        del sys.modules[spec.name]
    assert again.Format is not first.Format and _REGISTRY["format"] is first.Format


def test_dotted_path_reward_with_params():
    r = build_reward("tests.user_rewards:length_over", {"limit": 3})
    assert r(["Q", "Q"], ["ab", "abcdef"]) == [0.0, 1.0]
    assert r.__name__ == "tests.user_rewards:length_over"
    with pytest.raises(RewardError, match="cannot import"):
        build_reward("tests.user_rewards:missing")


def test_unknown_param_names_the_reward():
    with pytest.raises(RewardError, match="'format'.*bad params"):
        build_reward("format", {"strictness": 1})


def test_a_users_reward_module_is_found_by_file_path_and_from_the_working_folder(tmp_path, monkeypatch):
    """`{name: my_rewards.py:reward_len}` and `{name: my_rewards:reward_len}` run from the user's folder
    (a console script's sys.path does not hold the working folder)."""
    import sys

    from rewards import build_reward

    (tmp_path / "my_rewards_q.py").write_text(
        "def reward_len(completions, **kwargs):\n    return [-abs(20 - len(c)) for c in completions]\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    for name in ("my_rewards_q.py:reward_len", f"{tmp_path}/my_rewards_q.py:reward_len", "my_rewards_q:reward_len"):
        assert build_reward(name)(["Q", "Q"], ["short", "x" * 20]) == [-15, 0], name
    with pytest.raises(RewardError, match="cannot import reward 'nope.py:f': no file nope.py"):
        build_reward("nope.py:f")


def test_a_reward_module_that_does_not_import_is_one_line_naming_the_file_and_line(tmp_path):
    """A syntax error or an exception at import time in a user's reward file: a RewardError naming the reward
    (and, for a syntax error, the file and line), which `train` and `config` print as one line."""
    (tmp_path / "broken_syntax.py").write_text("def r(completions, **kw):\n    return [1.0 for c in completions\n")
    (tmp_path / "broken_import.py").write_text("LIMIT = undefined_name + 1\n")
    with pytest.raises(RewardError, match=r"broken_syntax.py:r': syntax error in .*broken_syntax.py line 2: "
                                          r"'\[' was never closed") as e:
        build_reward(f"{tmp_path}/broken_syntax.py:r")
    assert "\n" not in str(e.value)
    with pytest.raises(RewardError, match="importing it raised NameError: name 'undefined_name' is not defined"):
        build_reward(f"{tmp_path}/broken_import.py:r")

