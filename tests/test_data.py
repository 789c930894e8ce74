"""The data loader on JSONL/CSV/Parquet, GSM8K answers, and every bad input naming what is wrong."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from docuchat_rl.data import DataError, load_examples, reasoning_target, render_prompt
from rewards.correctness import gold_of

from .conftest import TASK

ROWS = [{"q": "What is 2 + 2?", "a": "2 + 2 = <<2+2=4>>4\n#### 4", "level": 1},
        {"q": "Capital of France?", "a": "Paris", "level": 3}]


def write(tmp_path, fmt):
    import datasets

    ds = datasets.Dataset.from_list(ROWS)
    path = tmp_path / f"d.{fmt}"
    {"jsonl": lambda: ds.to_json(str(path)), "csv": lambda: ds.to_csv(str(path), index=False),
     "parquet": lambda: ds.to_parquet(str(path))}[fmt]()
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_loads_each_format_with_column_mapping(tmp_path, fmt):
    ex = load_examples(str(write(tmp_path, fmt)), "train", "q", "a")
    assert [(e.prompt_id, e.question, e.answer) for e in ex] == [(0, "What is 2 + 2?", "4"),
                                                                   (1, "Capital of France?", "Paris")]
    # the other columns go to the rewards, the answer column too (raw, under its own name, as TRL passes it)
    assert [e.columns for e in ex] == [{"a": r["a"], "level": r["level"]} for r in ROWS]


def test_limit(tmp_path):
    assert len(load_examples(str(write(tmp_path, "jsonl")), "train", "q", "a", limit=1)) == 1


def test_bad_inputs_name_the_culprit(tmp_path):
    good = str(write(tmp_path, "jsonl"))
    with pytest.raises(DataError, match="column 'question' \\(data.prompt_column\\) not found.*'q'"):
        load_examples(good, "train", "question", "a")
    with pytest.raises(DataError, match="column 'gold' \\(data.answer_column\\)"):
        load_examples(good, "train", "q", "gold")
    with pytest.raises(DataError, match="data file not found: .*nope.jsonl"):
        load_examples(str(tmp_path / "nope.jsonl"), "train", "q", "a")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match="empty"):
        load_examples(str(empty), "train", "q", "a")
    blank = tmp_path / "blank.jsonl"
    blank.write_text(json.dumps({"q": "  ", "a": "1"}) + "\n")
    with pytest.raises(DataError, match="row 0 has an empty 'q'"):
        load_examples(str(blank), "train", "q", "a")
    odd = tmp_path / "data.txt"
    odd.write_text("x")
    with pytest.raises(DataError, match="unsupported data file type '.txt'"):
        load_examples(str(odd), "train", "q", "a")
    with pytest.raises(DataError, match="folder"):
        load_examples(str(tmp_path), "train", "q", "a")
    numbers = tmp_path / "numbers.jsonl"  # (e.g. an id column named as the prompt column)
    numbers.write_text("".join(json.dumps({"q": 1035 + i, "a": "1"}) + "\n" for i in range(3)))
    with pytest.raises(DataError, match="numbers.jsonl: row 0 column 'q' \\(data.prompt_column\\) holds int '1035'"):
        load_examples(str(numbers), "train", "q", "a")


@pytest.mark.parametrize("suffix,line", [(".jsonl", 2), (".csv", 3)])
def test_a_row_that_is_not_utf8_names_the_file_and_line(tmp_path, suffix, line):
    p = tmp_path / f"latin1{suffix}"
    head = b'{"question": "1 + 1?", "answer": "#### 2"}\n' if suffix == ".jsonl" else b"question,answer\n1 + 1?,2\n"
    bad = b'{"question": "caf\xe9 costs 3", "answer": "#### 3"}\n' if suffix == ".jsonl" else b"caf\xe9 costs 3,3\n"
    p.write_bytes(head + bad)
    with pytest.raises(DataError, match=rf"latin1{suffix}: line {line} is not UTF-8 text \(byte b'\\xe9'") as e:
        load_examples(str(p), "train", "question", "answer")
    assert "\n" not in str(e.value)


def test_gsm8k_helpers():
    assert gold_of("Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72") == "72"
    assert gold_of("#### 1,234") == "1234"
    assert reasoning_target("Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72") == (
        "<think>\nNatalia sold 48/2 = 24 clips.\n</think>\n<answer>72</answer>")


def test_render_without_chat_template_falls_back_to_plain_text():
    class Plain:
        chat_template = None

    assert render_prompt(Plain(), "Q?", "Be brief.") == "Be brief.\n\nQuestion: Q?\nAnswer: "
    shot = [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "#### 2"}]
    # a blank line after each answered example: where a base model that goes on writes "\n\n" (a stop token)
    assert render_prompt(Plain(), "Q?", None, few_shot=shot) == "Question: 1 + 1?\nAnswer: #### 2\n\nQuestion: Q?\nAnswer: "


def test_a_plain_prompt_starts_with_bos_where_the_tokenizer_adds_one():
    """A template-less tokenizer that puts BOS before every text (Gemma's, Llama's) gets it in the plain prompt,
    which is encoded without special tokens; one that adds none (GPT-2's) gets none."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    from .conftest import MODEL

    tok = AutoTokenizer.from_pretrained(str(MODEL))
    tok.chat_template = None
    assert not render_prompt(tok, "Q?", None).startswith("<|endoftext|>")
    tok.bos_token = "<|endoftext|>"
    bos = tok.convert_tokens_to_ids("<|endoftext|>")
    tok.backend_tokenizer.post_processor = TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)])
    assert tok("1", add_special_tokens=True)["input_ids"][0] == bos
    prompt = render_prompt(tok, "Q?", None)
    assert prompt == "<|endoftext|>Question: Q?\nAnswer: "
    assert tok(prompt, add_special_tokens=False)["input_ids"].count(bos) == 1


def test_conversational_prompts_load_as_messages_and_render_through_the_template(tmp_path):
    """TRL's conversational form: the prompt column holds {role, content} messages; no answer column."""
    from transformers import AutoTokenizer

    from .conftest import MODEL

    rows = [{"prompt": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "1 + 1?"},
                        {"role": "assistant", "content": "2"}, {"role": "user", "content": "And 2 + 2?"}],
             "level": 1},
            {"prompt": [{"role": "user", "content": "3 + 3?"}], "level": 2}]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ex = load_examples(str(path), "train", "prompt", None)
    assert [e.question for e in ex] == ["And 2 + 2?", "3 + 3?"]  # the last user turn (traces, our rewards)
    assert ex[0].messages == tuple(rows[0]["prompt"]) and ex[0].answer == "" and ex[0].columns == {"level": 1}
    tok = AutoTokenizer.from_pretrained(MODEL)
    own_system = render_prompt(tok, ex[0].question, "Default system.", ex[0].messages)
    assert own_system == tok.apply_chat_template(rows[0]["prompt"], tokenize=False, add_generation_prompt=True)
    added = render_prompt(tok, ex[1].question, "Default system.", ex[1].messages)
    assert added == render_prompt(tok, "3 + 3?", "Default system.")  # one user turn: as a text prompt

    path.write_text(json.dumps({"prompt": [{"role": "user", "content": "hi"}, {"role": "tool", "content": 3}]}))
    with pytest.raises(DataError, match="row 0 column 'prompt': message 1 is not a"):
        load_examples(str(path), "train", "prompt", None)
    path.write_text(json.dumps({"prompt": []}) + "\n")
    with pytest.raises(DataError, match="row 0 column 'prompt': an empty list of messages"):
        load_examples(str(path), "train", "prompt", None)


def test_few_shot_turns_go_between_the_system_prompt_and_the_question():
    from transformers import AutoTokenizer

    from docuchat_rl.config import load_config
    from docuchat_rl.data import render_prompt

    from .conftest import MODEL

    tok = AutoTokenizer.from_pretrained(MODEL)
    cfg = load_config(None, ["data.few_shot=[{role: user, content: 'Q1'}, {role: assistant, content: 'A1'}]"])
    text = render_prompt(tok, "Q2", cfg.data.system_prompt, None, cfg.data.few_shot_turns)
    assert text.index(cfg.data.system_prompt) < text.index("user\nQ1") < text.index("assistant\nA1") \
        < text.index("user\nQ2") and text.endswith("<|im_start|>assistant\n")
    messages = ({"role": "system", "content": "own"}, {"role": "user", "content": "Q3"})
    assert render_prompt(tok, "", "ignored", messages, cfg.data.few_shot_turns).index("own") \
        < render_prompt(tok, "", "ignored", messages, cfg.data.few_shot_turns).index("Q1")
    assert render_prompt(tok, "Q2", None) == render_prompt(tok, "Q2", None, None, [])
    from docuchat_rl.config import ConfigError

    with pytest.raises(ConfigError, match="data.few_shot.0.role"):
        load_config(None, ["data.few_shot=[{role: tool, content: x}]"])


def _curriculum_rows():
    """Rows of the embedded task (2-4 calculations) and of the one-operation task (1)."""
    from docuchat_rl.data import load_examples

    two_to_four = load_examples(str(TASK / "train.jsonl"), "train", "question", "answer", limit=60)
    one = load_examples(str(TASK.parent / "task_1op" / "train.jsonl"), "train", "question", "answer", limit=20)
    return one + two_to_four


def test_curriculum_levels_count_the_answers_calculations_or_read_a_column():
    from docuchat_rl.config import CurriculumConfig
    from docuchat_rl.data import DataError, Example, levels_of

    rows = _curriculum_rows()
    levels = levels_of(rows, CurriculumConfig(), "answer")
    assert set(levels[:20]) == {1} and set(levels[20:]) == {2, 3, 4}
    assert levels[20] == rows[20].columns["answer"].count("<<")
    by_column = [Example(i, "Q", "1", {"hops": n}) for i, n in enumerate([3, 1, 2])]
    assert levels_of(by_column, CurriculumConfig(level="hops"), None) == [3, 1, 2]
    with pytest.raises(DataError, match=r"row 0: data.curriculum.level calculations counts .* column 'answer'"):
        levels_of([Example(0, "Q", "5", {"answer": "#### 5"})], CurriculumConfig(), "answer")
    with pytest.raises(DataError, match=r"row 1: column 'hops' \(data.curriculum.level\) holds '2', not a whole"):
        levels_of([Example(0, "Q", "1", {"hops": 1}), Example(1, "Q", "1", {"hops": "2"})],
                  CurriculumConfig(level="hops"), None)
    with pytest.raises(DataError, match=r"data.curriculum.start 1: no training row .* \(levels 2-4\)"):
        levels_of(rows[20:], CurriculumConfig(), "answer")


def test_curriculum_sampler_draws_up_to_its_level_and_resumes_its_order():
    from docuchat_rl.config import CurriculumConfig
    from docuchat_rl.data import Curriculum, CurriculumSampler, levels_of, make_sampler

    levels = levels_of(_curriculum_rows(), CurriculumConfig(), "answer")

    def at(level):
        return Curriculum.start(CurriculumConfig(), levels, {"level": level})

    s = make_sampler(len(levels), 0, {}, at(1))
    assert isinstance(s, CurriculumSampler) and s.n == 20
    first = s.take(30)  # past an epoch of the 20 level-1 rows
    assert {levels[i] for i in first} == {1} and sorted(first[:20]) == list(range(20))
    state = s.state()
    assert state == {"epoch": 1, "position": 10, "level": 1}
    again = make_sampler(len(levels), 0, state, at(1))
    assert again.take(15) == s.take(15)  # resumed mid-epoch: the same order
    s.promote(3)
    assert s.state() == {"epoch": 0, "position": 0, "level": 3}
    drawn = s.take(200)
    assert {levels[i] for i in drawn} == {1, 2, 3}
    # a checkpoint's data position was taken before its step's log raised the level: the new level's order starts
    resumed = make_sampler(len(levels), 0, state, at(3))
    assert resumed.take(200) == drawn


def test_curriculum_promotes_on_the_windows_accuracy_to_the_next_level_the_data_has():
    from docuchat_rl.config import CurriculumConfig
    from docuchat_rl.data import Curriculum

    c = Curriculum.start(CurriculumConfig(start=1, promote_at=0.5, window=3), [1, 1, 2, 4], {})
    assert c.level == 1
    assert [c.observe(a) for a in (0.9, None, 0.2, 0.6)] == [False, False, False, True]  # (0.9+0.2+0.6)/3 >= 0.5
    assert c.level == 2 and c.recent == []  # counted afresh at each level
    assert not c.observe(1.0) and not c.observe(1.0) and c.observe(1.0) and c.level == 4  # (no rows at level 3)
    assert not any(c.observe(1.0) for _ in range(5)) and c.level == 4  # the top: nothing above
    resumed = Curriculum.start(CurriculumConfig(start=1, promote_at=0.5, window=3), [1, 1, 2, 4],
                               {"level": 2, "recent": [0.4, 0.6]})
    assert not resumed.observe(0.4) and resumed.observe(0.8) and resumed.level == 4


def test_curriculum_config_is_refused_with_a_lag_or_without_an_accuracy():
    from docuchat_rl.config import load_config

    from .conftest import ROOT

    cfg = load_config(ROOT / "config/default.yaml", ["data.curriculum.start=2", "data.curriculum.window=5"])
    assert cfg.data.curriculum.start == 2 and cfg.data.curriculum.promote_at == 0.6
    with pytest.raises(ValueError, match="data.curriculum cannot be used with rollout.async_lag"):
        load_config(ROOT / "config/default.yaml", ["data.curriculum.start=2", "rollout.async_lag=1"])
    with pytest.raises(ValueError, match="data.curriculum promotes on the training accuracy, the mean of reward "
                                         "'correctness'"):
        load_config(ROOT / "config/default.yaml", ["data.curriculum.start=2", "rewards=[{name: format}]"])


def test_rewards_see_the_answer_column_as_written_beside_the_final_answer():
    """A GSM8K-style `answer` column reaches the rewards as `answer_text`, worked solution and annotations
    included (ours, the final answer, takes the name `answer`): gold_steps gives partial credit on the
    embedded task's own rows, and the final answer is unchanged."""
    from docuchat_rl.data import reward_inputs
    from rewards import build_reward

    rows = load_examples(str(TASK / "test.jsonl"), "test", "question", "answer", limit=3)
    cols = reward_inputs(rows, [10] * 3, [False] * 3)
    raw = [json.loads(line)["answer"] for line in (TASK / "test.jsonl").read_text().splitlines()[:3]]
    assert cols["answer_text"] == raw and cols["answer"] == [gold_of(a) for a in raw]
    first_step = raw[0].split("\n")[0].split(" = <<")[0] + " = " + raw[0].split(">>")[1].split("\n")[0]
    scores = build_reward("gold_steps")(["Q"] * 3, [first_step, first_step, "nothing"], **cols)
    assert scores[0] == 1 / raw[0].count("<<") and scores[2] == 0.0  # one of its steps reached; none


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(answers=st.lists(st.sampled_from([None, "", "  ", "#### 4", "7", "Paris"]), min_size=1, max_size=8))
def test_an_answer_column_without_a_value_in_any_row_is_refused(tmp_path, answers):
    """A column without values (all null or blank): every answer-reading reward would score None on every
    row and the run would train on format alone, without a word. Refused naming the column; a column with
    at least one answer loads."""
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"question": f"Q{i}?", "answer": a}) + "\n" for i, a in enumerate(answers)))
    if not any(a and a.strip() for a in answers):
        with pytest.raises(DataError, match=r"column 'answer' \(data.answer_column\) holds no answer in any of its"):
            load_examples(str(path), "train", "question", "answer")
    else:
        rows = load_examples(str(path), "train", "question", "answer")
        assert [r.answer for r in rows] == [("4" if a == "#### 4" else (a or "").strip()) for a in answers]


# ------------------------------------------------------------------------------------- difficulty filtering

def _sampler(n=40, **conf):
    from docuchat_rl.config import DifficultyConfig
    from docuchat_rl.data import DifficultySampler

    return DifficultySampler(n, 0, DifficultyConfig(**conf))


def test_a_prompt_always_right_or_always_wrong_leaves_the_band_and_rests_until_its_revisit():
    """Mastered (rate >= high) and out of reach (rate <= low) prompts are not drawn again before revisit_after
    steps since their last draw; then they are, and measured anew. A prompt sometimes right stays in the band
    and comes back after replay_after steps."""
    from docuchat_rl.data import BAND, MASTERED, OUT_OF_REACH

    s = _sampler(n=40, replay=0.5, replay_after=2, revisit_after=6)
    first = s.take(4, step=1)
    s.observe(1, first, [1.0, 0.0, 0.5, 0.25])  # mastered, out of reach, band, band
    assert [s.prompts[i]["standing"] for i in first] == [MASTERED, OUT_OF_REACH, BAND, BAND]
    rate = {first[0]: 1.0, first[1]: 0.0, first[2]: 0.5, first[3]: 0.5}  # (every other prompt: never right)
    drawn = {}
    for step in range(2, 12):
        drawn[step] = s.take(4, step=step)
        s.observe(step, drawn[step], [rate.get(i, 0.0) for i in drawn[step]])
    assert all(first[0] not in drawn[t] and first[1] not in drawn[t] for t in range(2, 7))  # resting
    assert any(first[0] in drawn[t] for t in range(7, 12)) and any(first[1] in drawn[t] for t in range(7, 12))
    assert first[2] in drawn[3] and first[3] in drawn[3] and first[2] not in drawn[2]  # replayed after 2 steps
    assert s.metrics()["difficulty/known"] == len(s.prompts)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rates=st.lists(st.lists(st.sampled_from([0.0, 0.125, 0.5, 0.875, 1.0, None]), min_size=3, max_size=3),
                      min_size=2, max_size=12),
       replay=st.sampled_from([0.0, 0.34, 1.0]), cut=st.integers(1, 11))
def test_a_sampler_rebuilt_from_its_state_draws_what_the_uninterrupted_one_draws(rates, replay, cut):
    """Any sequence of group pass rates: the sampler made from `state()` after step `cut` (what a checkpoint
    holds) draws the same prompts and records the same rates as the one that went on."""
    from docuchat_rl.config import DifficultyConfig
    from docuchat_rl.data import make_sampler

    conf = DifficultyConfig(replay=replay, replay_after=1, revisit_after=3)
    a = make_sampler(7, 5, {}, None, conf)
    b = None
    for step, step_rates in enumerate(rates, 1):
        got = a.take(3, step)
        a.observe(step, got, step_rates)
        if b is not None:
            assert b.take(3, step) == got
            b.observe(step, got, step_rates)
            assert b.state() == a.state()
        if step == cut:
            b = make_sampler(7, 5, json.loads(json.dumps(a.state())), None, conf)  # (through JSON, as saved)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2 ** 16), retire=st.sampled_from([0.3, 0.8, 1.0]), revisit=st.sampled_from([0.125, 0.25, 0.5]),
       band_share=st.sampled_from([0.0, 0.2, 0.5]))
def test_a_retired_prompt_is_drawn_again_within_a_bound_once_its_rest_is_over(seed, retire, revisit, band_share):
    """Generated pass-rate histories (a share of the draws retiring, some staying in the band): every retired
    prompt falls due `revisit_after` steps after its last draw and is then drawn again, in the order they fell due,
    within ceil(due before it / revisit slots) steps, even while the band fills the replay share (the issue's case:
    1,773 due and none drawn). The backlog is the step's `difficulty/due`."""
    import math
    import random

    rng = random.Random(seed)
    k, after = 8, 10
    s = _sampler(n=400, replay=0.25, replay_after=3, revisit_after=after, revisit=revisit)
    slots = round(revisit * k)
    fell_due: dict[int, int] = {}  # prompt -> the step its rest ended
    ahead: dict[int, int] = {}  # prompt -> due prompts before it, not drawn yet, when it fell due
    revisited = 0
    for step in range(1, 120):
        for i, t in fell_due.items():
            if t == step:
                ahead[i] = sum(1 for j, u in fell_due.items() if u <= step and (u, j) < (t, i))
        due_now = s.due(step)
        drawn = s.take(k, step)
        for i in drawn:
            if i in fell_due and fell_due[i] <= step:
                assert step - fell_due[i] < math.ceil((ahead[i] + 1) / slots), (i, step, fell_due[i], ahead[i])
                revisited += 1
            fell_due.pop(i, None)
        assert [i for i in due_now[:slots] if i not in drawn] == []  # (the longest-due first)
        rates = [(1.0 if rng.random() < 0.5 else 0.0) if rng.random() < retire else
                 (0.5 if rng.random() < band_share else 0.0) for _ in drawn]
        s.observe(step, drawn, rates)
        for i, rate in zip(drawn, rates):
            if rate in (0.0, 1.0):
                fell_due[i] = step + after
        assert s.metrics()["difficulty/due"] == len(s.due(step))
    assert revisited > 0


def test_a_band_no_group_meets_goes_on_and_says_so_at_the_step(tmp_path, capsys):
    """Dynamic sampling with a band no group of 4 can be inside (0.3-0.4: rates are 0, .25, .5, .75, 1): each step
    trains on its last round's groups (advantage 0) and says so in one line, where the run used to end; groups of
    one cannot be measured at all and are refused at load."""
    from docuchat_rl.config import ConfigError, load_config
    from docuchat_rl.outputs import read_jsonl

    from .conftest import train_here

    out = tmp_path / "run"
    train_here(None, [f"run.output_dir={out}", "run.steps=2", "rollout.prompts_per_step=2", "rollout.num_generations=4",
                      "rollout.max_new_tokens=8", "rollout.dynamic_sampling=true", "rollout.max_resample_rounds=1",
                      "data.difficulty={low: 0.3, high: 0.4}", "eval.before_and_after=false", "logging.progress=false",
                      "run.threads=1"])
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2] and all(m["dynamic_sampling/unfilled"] == 1.0 for m in metrics)
    said = [x for x in capsys.readouterr().err.splitlines() if "dynamic sampling found no group" in x]
    assert len(said) == 2 and "inside data.difficulty's band" in said[0]
    with pytest.raises(ConfigError, match="data.difficulty measures a prompt's pass rate over its group"):
        load_config(None, ["rollout.num_generations=1", "data.difficulty={}", "algorithm.name=a2c"])


def test_without_difficulty_the_data_order_is_the_plain_one():
    from docuchat_rl.data import PromptSampler, make_sampler

    plain, made = PromptSampler(30, 3), make_sampler(30, 3, {})
    assert type(made) is PromptSampler and [made.take(4, s) for s in range(1, 20)] == [plain.take(4) for _ in range(19)]
    # a checkpoint written with data.difficulty resumes without it from the same position
    with_state = make_sampler(30, 3, {"epoch": 1, "position": 7, "difficulty": {"3": {"rate": 1.0}}})
    assert with_state.state() == {"epoch": 1, "position": 7}


@pytest.mark.slow
def test_difficulty_state_and_draws_survive_kill_9_and_resume(tmp_path):
    """A run with data.difficulty and dynamic sampling, killed (-9) after a checkpoint and resumed: every step's
    prompts, their traced pass rates and the final pass-rate table equal the uninterrupted run's; groups out of
    the band are dropped; a run without it writes no prompt_pass_rate."""
    import subprocess
    import sys

    from docuchat_rl.outputs import read_jsonl

    from .conftest import ROOT, killed_and_resumed

    def sets(out):
        return [a for s in ("eval.before_and_after=false", "logging.progress=false", "run.threads=1",
                            f"run.output_dir={out}", "run.steps=8", "checkpoint.every=1", "rollout.dynamic_sampling=true",
                            "data.difficulty={replay: 0.5, replay_after: 2, revisit_after: 3}") for a in ("--set", s)]

    _, out, _ = killed_and_resumed(sets, tmp_path, after_checkpoint=4)
    cmd = [sys.executable, "-m", "docuchat_rl", "train"]

    def drawn(run):
        return [(r["step"], r["slot"], r["prompt_id"], r["prompt_pass_rate"], r["used"], r["total"])
                for r in read_jsonl(run / "traces.jsonl")]

    a, b = drawn(tmp_path / "whole"), drawn(out)
    assert a == b
    assert any(rate is not None for _, _, _, rate, _, _ in a)  # (replays: prompts drawn with a known pass rate)
    final = [json.loads((run / "checkpoint-8" / "trainer_state.json").read_text())["sampler"]
             for run in (tmp_path / "whole", out)]
    assert final[0] == final[1] and final[0]["difficulty"]
    metrics = read_jsonl(out / "metrics.jsonl")
    assert all("difficulty/band_share" in m for m in metrics)
    plain = tmp_path / "plain"
    assert subprocess.run(cmd + sets(plain)[:-4] + ["--set", "run.steps=1"], cwd=ROOT, capture_output=True,
                          timeout=600).returncode == 0
    assert all("prompt_pass_rate" not in r for r in read_jsonl(plain / "traces.jsonl"))


@pytest.mark.parametrize("value", [["4"], {"n": 4}, True], ids=["list", "dict", "bool"])
def test_an_answer_of_the_wrong_type_is_one_line_naming_its_row_and_column(tmp_path, value):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"question": "Q1", "answer": "#### 1"}) + "\n" + json.dumps({"question": "Q2", "answer": value}) + "\n")
    with pytest.raises(DataError, match=r"row 1 column 'answer' \(data.answer_column\) holds"):
        load_examples(str(f), "train", "question", "answer")


@pytest.mark.parametrize("text,said", [("\n\n  \n", "data file is empty"), ('{"question": "Q"}\n{"quest', "line 2 is not JSON"),
                                       ("[1, 2]\n", "line 1 holds a JSON list, not an object")])
def test_a_jsonl_file_that_is_empty_torn_or_not_rows_is_one_line_naming_the_key_and_line(tmp_path, text, said):
    from docuchat_rl.config import load_config
    from docuchat_rl.data import load_split

    f = tmp_path / "d.jsonl"
    f.write_text(text)
    with pytest.raises(DataError, match=f"data.test: .*{said}"):
        load_split(load_config(None, [f"data.test={f}"]).data, "test")


@pytest.mark.parametrize("column", ["prompt_id", "truncated", "completion_tokens", "completions"])
def test_a_column_named_as_a_reward_argument_is_refused_not_replaced(tmp_path, column):
    """A data set's own `prompt_id` (or truncated, ...) column would reach the rewards replaced by ours: one line
    naming the column instead."""
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"question": "Q1", "answer": "#### 1", column: 7}) + "\n")
    with pytest.raises(DataError, match=f"column '{column}' has the name of an argument docuchat-rl gives every reward"):
        load_examples(str(f), "train", "question", "answer")


def test_a_local_data_file_leaves_no_copy_in_the_datasets_cache(tmp_path, monkeypatch):
    """datasets caches every file it reads (an Arrow copy per file and content) under the user's home; a local file
    read here leaves none there."""
    import datasets

    from docuchat_rl.data import load_table

    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps({"question": f"Q{i}", "answer": f"#### {i}"}) + "\n" for i in range(5)))
    assert len(load_table(str(f), "train")) == 5
    assert list(cache.rglob("*")) == []
