"""Using a trained checkpoint: `generate` (base, adapter, side by side, scored), `chat` through a real
pseudo-terminal, `export` to a merged standalone model (equal outputs), and a learned reward model as a
reward component in a real run."""

import json
import os
import pty
import select
import subprocess
import sys
import time

import pytest
import torch

from docuchat_rl.cli import main
from docuchat_rl.outputs import read_jsonl

from .conftest import MODEL, ROOT

SHORT = ["run.steps=2", "rollout.prompts_per_step=2", "rollout.num_generations=4", "rollout.max_new_tokens=24",
         "logging.progress=false", "eval.limit=8", "eval.max_new_tokens=48", "run.threads=2"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A real 2-step run of the default recipe with its before/after evaluation: (run folder, checkpoint)."""
    out = tmp_path_factory.mktemp("run")
    args = ["train", "--config", str(ROOT / "config/default.yaml"), "--set", f"run.output_dir={out}"]
    assert main(args + [a for s in SHORT for a in ("--set", s)]) == 0
    return out, out / "checkpoint-2"


def _json_lines(text):
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_generate_from_prompts_file_and_held_out_with_scores(run, tmp_path, capsys):
    _, ckpt = run
    assert main(["generate", "--adapter", str(ckpt), "--prompt", "Ava has 3 apples. Ava buys 4 more apples. "
                 "How many apples does Ava have now?", "--json"]) == 0
    (rec,) = _json_lines(capsys.readouterr().out)
    assert rec["model"] == "adapter" and rec["completion"] and "rewards" not in rec  # config from the checkpoint
    txt = tmp_path / "p.txt"
    txt.write_text("What is 2 + 2?\n\nBen has 5 coins. Ben loses 2 coins. How many coins does Ben have now?\n")
    assert main(["generate", "--adapter", str(ckpt), "--file", str(txt), "--n", "3", "--json"]) == 0
    recs = _json_lines(capsys.readouterr().out)
    assert [(r["prompt_id"], r["sample"]) for r in recs] == [(p, s) for p in range(2) for s in range(3)]
    assert main(["generate", "--adapter", str(ckpt), "--held-out", "3", "--score", "--compare", "--json"]) == 0
    recs = _json_lines(capsys.readouterr().out)
    assert [r["model"] for r in recs] == ["base", "adapter"] * 3  # side by side, prompt by prompt
    for r in recs:
        assert r["gold"] and set(r["rewards"]) == {"correctness", "format"}
        assert r["rewards"]["correctness"]["raw"] in (0.0, 1.0) and r["total"] == pytest.approx(
            sum(c["weighted"] or 0 for c in r["rewards"].values()))
    assert main(["generate", "--adapter", str(ckpt), "--held-out", "1", "--score"]) == 0
    shown = capsys.readouterr().out
    assert "model adapter" in shown and "correctness" in shown and "weighted" in shown  # the audit's record view


def test_generate_refuses_compare_without_adapter_and_missing_files(capsys, tmp_path):
    assert main(["generate", "--prompt", "x", "--compare"]) == 2
    assert "--compare needs --adapter" in capsys.readouterr().err
    assert main(["generate", "--file", str(tmp_path / "none.txt")]) == 2
    assert "prompt file not found" in capsys.readouterr().err
    assert main(["generate", "--adapter", str(tmp_path), "--prompt", "x"]) == 2
    assert "no adapter_config.json" in capsys.readouterr().err


@pytest.mark.slow
def test_adapter_accepts_the_run_folder_or_its_latest_pointer_as_the_newest_checkpoint(run, capsys):
    out, ckpt = run
    capsys.readouterr()  # (the fixture's run)
    got = []
    for adapter in (ckpt, out, out / "latest"):
        assert main(["generate", "--adapter", str(adapter), "--prompt", "What is 2 + 2?", "--json"]) == 0
        (rec,) = _json_lines(capsys.readouterr().out)
        got.append(rec["completion"])
    assert got[0] == got[1] == got[2]  # greedy, the same adapter
    assert main(["eval", "--adapter", str(out / "latest"), "--set", "eval.limit=2"]) == 0
    assert json.loads(capsys.readouterr().out)["adapter"] == str(ckpt)


@pytest.mark.parametrize("argv,says", [
    (["generate", "--prompt", "x", "--n", "0"], "argument --n: 0 must be at least 1"),
    (["generate", "--held-out", "-1"], "argument --held-out: -1 must be at least 1"),
    (["generate", "--prompt", "x", "--top-p", "1.5"], "argument --top-p: 1.5 must be above 0 and at most 1"),
    (["generate", "--prompt", "x", "--temperature", "0"], "argument --temperature: 0 must be above 0"),
    (["chat", "--max-new-tokens", "two"], "argument --max-new-tokens: 'two' is not an integer"),
    (["train", "--stop-after", "0"], "argument --stop-after: 0 must be at least 1"),
    (["audit", "runs", "--bins", "0"], "argument --bins: 0 must be at least 1"),
    (["audit", "runs", "--limit", "-3"], "argument --limit: -3 must be at least 0")])
def test_numeric_flags_out_of_range_are_one_usage_line_before_anything_loads(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_chat_with_standard_input_closed_is_one_line():
    done = subprocess.run(["bash", "-c", "docuchat-rl chat <&-"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip() == ("docuchat-rl: error: chat reads your messages from standard input, which is "
                                   "closed: run it in a terminal or pipe the messages in (generate --prompt "
                                   "answers without one)")


def _read_until(fd, marker, seconds=120):
    out, deadline = b"", time.time() + seconds
    while marker.encode() not in out and time.time() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            try:
                out += os.read(fd, 4096)
            except OSError:
                break
    return out.decode(errors="replace")


@pytest.mark.slow
def test_chat_in_a_real_pseudo_terminal(run):
    _, ckpt = run
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "docuchat_rl", "chat", "--adapter", str(ckpt),
                             "--max-new-tokens", "24"], stdin=slave, stdout=slave, stderr=subprocess.DEVNULL,
                            cwd=ROOT, close_fds=True)
    os.close(slave)
    try:
        assert "/exit quits" in _read_until(master, "you> ")
        os.write(master, b"Ava has 3 apples. Ava buys 4 more apples. How many apples does Ava have now?\n")
        first = _read_until(master, "you> ")
        assert "model> " in first
        os.write(master, b"And then?\n")
        assert "model> " in _read_until(master, "you> ")  # a second turn, with the first in the context
        os.write(master, b"/reset\n")
        assert "(conversation reset)" in _read_until(master, "you> ")
        os.write(master, b"/exit\n")
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)


@pytest.mark.slow
def test_export_gives_a_plain_model_equal_to_base_plus_adapter(run, tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from docuchat_rl.config import DEFAULT_SYSTEM_PROMPT
    from docuchat_rl.data import load_examples, render_prompt
    from docuchat_rl.learning.batch import build_batch
    from docuchat_rl.learning.forward import policy_forward
    from docuchat_rl.sampling.generation import generate

    out_dir, ckpt = run
    out = tmp_path / "merged"
    assert main(["export", "--adapter", str(ckpt), "--out", str(out), "--dtype", "float32"]) == 0
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32),
                                          str(ckpt)).eval()
    rows = load_examples(str(ROOT / "data/task/test.jsonl"), "test", "question", "answer", limit=12)
    prompts = [render_prompt(tok, r.question, DEFAULT_SYSTEM_PROMPT) for r in rows]
    a = generate(exported, tok, prompts, max_new_tokens=48, do_sample=False)
    b = generate(reference, tok, prompts, max_new_tokens=48, do_sample=False)
    assert a.completion_ids == b.completion_ids  # greedy ids identical
    batch = build_batch(b.prompt_ids, b.completion_ids, [0.0] * 12, list(range(12)), tok.pad_token_id)
    with torch.no_grad():
        la, lb = policy_forward(exported, batch).logps, policy_forward(reference, batch).logps
    m = batch.completion_mask.bool()
    assert (la[m] - lb[m]).abs().max() < 1e-5
    gc = GenerationConfig.from_pretrained(out)
    assert gc.repetition_penalty in (None, 1.0) and gc.top_k == 0 and gc.temperature == 1.0
    card = (out / "README.md").read_text()
    assert "base_model: data/model" in card and "step 2" in card and "| after |" in card
    assert main(["export", "--adapter", str(ckpt), "--out", str(out)]) == 2  # never over an existing export
    assert "not empty" in capsys.readouterr().err


def _tiny_reward_model(folder):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    tok = AutoTokenizer.from_pretrained(MODEL)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_labels=1, pad_token_id=tok.pad_token_id)
    LlamaForSequenceClassification(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_a_reward_model_scores_beside_correctness_in_a_real_run(tmp_path):
    from docuchat_rl.config import load_config
    from docuchat_rl.sampling.reward_models import RewardModel
    from docuchat_rl.trainer import Trainer

    rm = _tiny_reward_model(tmp_path / "rm")
    rewards = f"rewards=[{{name: correctness}}, {{name: reward_model, weight: 0.5, params: {{model: '{rm}', batch_size: 3}}}}]"
    cfg = load_config(ROOT / "config/default.yaml", [f"run.output_dir={tmp_path / 'run'}", *SHORT[:5],
                                                      "eval.before_and_after=false", rewards])
    t = Trainer(cfg)
    t.train()
    t.close()
    traces = read_jsonl(tmp_path / "run" / "traces.jsonl")
    assert len(traces) == 16
    direct = RewardModel(model=str(rm)).explain([r["prompt"] for r in traces], [r["completion"] for r in traces])
    for r, d in zip(traces, direct):
        comp = r["rewards"]["reward_model"]
        assert comp["error"] is None and comp["info"]["model"] == str(rm) and comp["weight"] == 0.5
        assert comp["raw"] == pytest.approx(d.value, abs=1e-4)  # batched in 3s in the run, 16 at once here
        assert r["total"] == pytest.approx((r["rewards"]["correctness"]["raw"] or 0) + 0.5 * comp["raw"])


def test_reward_model_errors_name_the_problem(tmp_path):
    from rewards import RewardError, build_reward

    with pytest.raises(RewardError, match="needs params.model"):
        build_reward("reward_model")
    with pytest.raises(RewardError, match="cannot load"):
        build_reward("reward_model", {"model": str(tmp_path / "missing")})
    assert "reward_model" in __import__("rewards").registered()


def _save_tiny(folder, arch):
    """A tiny random-weight model of another architecture (or another size) beside the default tokenizer."""
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(str(MODEL))
    if arch == "gpt2":  # none of the adapter's Llama module names (q_proj, ...)
        model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=4))
    else:  # the same module names, other shapes
        model = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=len(tok), hidden_size=48, intermediate_size=64,
                                                   num_hidden_layers=2, num_attention_heads=4))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("arch", ["gpt2", "llama-wider"])
def test_an_adapter_on_a_base_it_was_not_trained_on_is_refused_in_one_line(run, tmp_path, capsys, arch):
    _, ckpt = run
    other = _save_tiny(tmp_path / arch, arch)
    capsys.readouterr()  # (the fixture's run)
    for cmd in (["generate", "--prompt", "What is 2 + 2?"], ["eval", "--set", "eval.limit=2"]):
        assert main([*cmd, "--adapter", str(ckpt), "--set", f"model.name_or_path={other}"]) == 2
        err = capsys.readouterr().err
        (line,) = [x for x in err.splitlines() if x.startswith("docuchat-rl: error:")]
        assert "'data/model'" in line and str(other) in line and "Traceback" not in err


def test_resuming_a_checkpoint_under_another_model_is_refused_in_one_line(run, tmp_path, capsys):
    out, _ = run
    other = _save_tiny(tmp_path / "llama-wider", "llama-wider")
    capsys.readouterr()  # (the fixture's run)
    args = ["train", "--config", str(ROOT / "config/default.yaml"), "--set", f"run.output_dir={out}",
            "--set", f"model.name_or_path={other}", "--resume", "latest"]
    assert main(args + [a for s in SHORT for a in ("--set", s)]) == 2
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if x.startswith("docuchat-rl: error:")]
    assert "model.name_or_path='data/model'" in line and str(other) in line and "Traceback" not in err


# ------------------------------------------------------------------ damaged files, odd input, closed streams
@pytest.mark.slow
def test_a_damaged_adapter_is_refused_in_one_line_by_generate_and_export(run, tmp_path, capsys):
    """A checkpoint whose adapter had a bit flipped (its manifest's hash differs) used to be used as it was; a
    plain adapter folder (no manifest) whose weights are cut short used to end in safetensors' traceback."""
    import shutil

    _, ckpt = run
    flipped = tmp_path / "checkpoint-2"
    shutil.copytree(ckpt, flipped)
    weights = flipped / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0x01
    weights.write_bytes(bytes(data))
    cut = tmp_path / "plain"
    cut.mkdir()
    shutil.copy(ckpt / "adapter_config.json", cut)
    (cut / "adapter_model.safetensors").write_bytes((ckpt / "adapter_model.safetensors").read_bytes()[:300])
    capsys.readouterr()
    for folder, says in ((flipped, "adapter_model.safetensors is damaged (its hash differs from the manifest's)"),
                         (cut, "adapter_model.safetensors cannot be read (damaged or cut short?)")):
        for argv in (["generate", "--prompt", "What is 2 + 2?"], ["export", "--out", str(tmp_path / "x")]):
            assert main([*argv, "--adapter", str(folder), "--set", "model.name_or_path=data/model"]) == 2, argv
            err = capsys.readouterr().err.strip()
            assert err.startswith("docuchat-rl: error: --adapter") and says in err and "\n" not in err, err
    assert not (tmp_path / "x").exists()


def test_text_that_is_not_utf8_is_one_line_for_generate_and_a_retry_in_chat(tmp_path):
    latin1 = tmp_path / "prompts.txt"
    latin1.write_bytes("Zo\xeb has 3 apples.\n".encode("latin-1"))
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    done = subprocess.run([sys.executable, "-m", "docuchat_rl", "generate", "--file", str(latin1)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip() == (f"docuchat-rl: error: {latin1}: line 1 is not UTF-8 text (byte b'\\xeb' at column "
                                   "3); save the file as UTF-8")
    done = subprocess.run([sys.executable.encode(), b"-m", b"docuchat_rl", b"generate", b"--prompt", b"Zo\xeb?"],
                          cwd=ROOT, capture_output=True, timeout=120, env=env)
    assert done.returncode == 2 and b"Traceback" not in done.stderr
    assert done.stderr.decode().strip().startswith("docuchat-rl: error: --prompt number 1 is not UTF-8 text")
    done = subprocess.run([sys.executable, "-m", "docuchat_rl", "chat", "--max-new-tokens", "4"], cwd=ROOT,
                          input=b"Zo\xeb?\nWhat is 2 + 2?\n/exit\n", capture_output=True, timeout=120, env=env)
    out = done.stdout.decode()
    assert done.returncode == 0 and b"Traceback" not in done.stderr, done.stderr[-2000:]
    assert "(that line is not UTF-8 text: nothing was sent; type it again)" in out and out.count("model> ") == 1


@pytest.mark.parametrize("command", [["chat"], ["generate", "--prompt", "hi"], ["eval"], ["config"]])
def test_a_command_whose_standard_output_is_closed_says_so_in_one_line(command):
    done = subprocess.run(["bash", "-c", " ".join(["docuchat-rl", *command]) + " >&-"], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip() == (f"docuchat-rl: error: {command[0]} writes its results to standard output, which "
                                   "is closed: run it with standard output open (redirect it to a file to keep it)")


def test_a_reader_that_goes_away_ends_a_command_quietly(tmp_path):
    """`| head`: the command stops at the broken pipe with no traceback (exit 141, as Unix tools)."""
    traces = tmp_path / "traces.jsonl"
    traces.write_text("".join(json.dumps({"step": 1, "prompt_id": i, "sample": 0, "completion": "x" * 300,
                                          "rewards": {}, "total": 0.0}) + "\n" for i in range(2000)))
    done = subprocess.run(["bash", "-c", f"set -o pipefail; docuchat-rl audit {traces} --where 'step > 0' "
                                         "--limit 2000 --json | head -c 10"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 141 and done.stderr == "" and done.stdout.startswith("[{")


@pytest.mark.slow
def test_a_checkpoint_written_before_the_grouped_decode_fix_still_loads(run, tmp_path, capsys):
    """hf-engine checkpoints of that time hold grouped_decode: true (decided for a loop hf never runs), which
    today's config refuses: generate, eval and export read them as false."""
    import shutil

    _, ckpt = run
    old = tmp_path / "checkpoint-2"
    shutil.copytree(ckpt, old)
    saved = json.loads((old / "run_config.json").read_text())
    saved["config"]["rollout"].update(engine="hf", grouped_decode=True)
    (old / "run_config.json").write_text(json.dumps(saved))
    from docuchat_rl.checkpoint import _seal

    (old / "manifest.json").unlink()
    _seal(old)  # (a checkpoint of that time, sealed as it was written: the manifest of the files as they are)
    assert main(["generate", "--adapter", str(old), "--prompt", "What is 2 + 2?", "--max-new-tokens", "4",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["completion_tokens"] <= 4


@pytest.mark.slow
def test_export_of_an_adapted_tied_embedding_equals_base_plus_adapter(tmp_path):
    """A tied head and embedding with the embedding adapted: training gave the embedding alone its delta (the
    head reads the base weight), so the export unties them before merging (merging into the shared weight
    changed the head too)."""
    import transformers as tf
    from peft import PeftModel

    from docuchat_rl.config import Config, LoraConfig
    from docuchat_rl.modeling import build_lora
    from docuchat_rl.tools.inference import export_merged

    tok = tf.AutoTokenizer.from_pretrained(str(MODEL))
    base_dir = tmp_path / "tied"
    torch.manual_seed(0)
    tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, tie_word_embeddings=True)).save_pretrained(base_dir)
    tok.save_pretrained(base_dir)
    base = tf.AutoModelForCausalLM.from_pretrained(base_dir)
    peft_model = build_lora(base, LoraConfig(r=4, target_modules=["embed_tokens", "q_proj"]))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.1)
    adapter = tmp_path / "adapter"
    peft_model.save_pretrained(adapter)
    ids = torch.tensor([tok("Ava has 3 apples and buys 4 more.")["input_ids"]])
    with torch.no_grad():
        want = PeftModel.from_pretrained(tf.AutoModelForCausalLM.from_pretrained(base_dir), adapter)(ids).logits
    cfg = Config.model_validate({"model": {"name_or_path": str(base_dir)}})
    out = export_merged(cfg, adapter, tmp_path / "merged", "float32")
    merged = tf.AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        got = merged(ids).logits
    assert (got - want).abs().max() < 1e-4
    assert not merged.config.tie_word_embeddings


def test_generate_samples_through_the_recipes_static_decode_when_cuda_graphs_is_set(tmp_path):
    """`generate` and `chat` decode as the run does: rollout.cuda_graphs (auto: on on GPUs) reaches them, so on
    a GPU they replay the graphs; on a CPU, set, the static step runs eagerly, the same greedy completions."""
    from docuchat_rl.config import load_config
    from docuchat_rl.data import load_split
    from docuchat_rl.sampling import static_decode
    from docuchat_rl.tools.inference import load_policy, sample_records

    plain = load_config(ROOT / "config/default.yaml")
    model, tok = load_policy(plain.model, None)
    examples = load_split(plain.data, "test", 4)
    before = sample_records(model, tok, plain, examples, max_new_tokens=16)
    assert model not in static_decode._DECODERS
    graphs = load_config(ROOT / "config/default.yaml", ["rollout.cuda_graphs=true"])
    after = sample_records(model, tok, graphs, examples, max_new_tokens=16)
    assert model in static_decode._DECODERS  # (the static step ran)
    assert [r["completion"] for r in after] == [r["completion"] for r in before]

