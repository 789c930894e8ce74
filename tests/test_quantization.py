"""A quantized base (model.quantization: QLoRA), on the CPU through bitsandbytes' own kernels: tiny random Llama and
Qwen2 models and the embedded default in NF4 and int8 sample what they score (the sampler/trainer gap no larger than
plain bfloat16's), train LoRA with the gradients of the dequantized model, resume exactly after kill -9, their
adapters load on the plain base and export to a plain transformers model; what does not combine is refused at load
naming both keys; TRL's BitsAndBytesConfig maps to it."""

from __future__ import annotations

import json

import pytest
import torch

from docuchat_rl.config import ConfigError, LoraConfig, load_config

from .conftest import MODEL, ROOT, killed_and_resumed

pytest.importorskip("bitsandbytes")

QUESTION = "Ava has 3 apples. Ava buys 4 more apples. How many apples does Ava have now?"


def _folder(name: str, folder):
    """A tiny random Llama or Qwen2 as a model folder with data/model's tokenizer, every linear layer's input a
    multiple of 64 features (bitsandbytes' CPU 4-bit kernel reads blocks of 64: real models' widths all are)."""
    import transformers as tf
    from transformers import AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(MODEL)
    torch.manual_seed(0)
    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model = (tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, tie_word_embeddings=True)) if name == "qwen2" else
             tf.LlamaForCausalLM(tf.LlamaConfig(**common)))
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The embedded default and two tiny random architectures as model folders (bitsandbytes quantizes at load)."""
    root = tmp_path_factory.mktemp("quant-models")
    return {"default": MODEL, **{name: _folder(name, root / name) for name in ("llama", "qwen2")}}


def _gap(folder, dtype: str, quantization: str) -> tuple[float, object]:
    """The mean |log pi_trainer - log pi_sampler| of 4 sampled completions of a LoRA (B non-zero) policy, and it."""
    from docuchat_rl.config import ModelConfig
    from docuchat_rl.data import render_prompt
    from docuchat_rl.learning.batch import build_batch
    from docuchat_rl.learning.forward import policy_forward
    from docuchat_rl.modeling import build_lora, load_configured
    from docuchat_rl.sampling.generation import generate

    model, tok = load_configured(ModelConfig(name_or_path=str(folder), dtype=dtype, device="cpu",
                                             quantization=quantization))
    pm = build_lora(model, LoraConfig(r=4, alpha=8))
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    gen = generate(pm, tok, [render_prompt(tok, QUESTION, None)], max_new_tokens=16, do_sample=True,
                   num_return_sequences=4, row_seeds=[11, 12, 13, 14])
    batch = build_batch(gen.prompt_ids, gen.completion_ids, [0.0] * 4, [0] * 4, tok.pad_token_id,
                        sampler_logps=gen.logps)
    out = policy_forward(pm, batch, share_prompt=True)
    gap = float(((out.logps.detach() - batch.sampler_logps).abs() * batch.completion_mask).sum()
                / batch.completion_mask.sum())
    (out.logps * batch.completion_mask).sum().backward()
    return gap, pm


@pytest.mark.parametrize("arch", ["default", "llama", "qwen2"])
@pytest.mark.parametrize("quantization", ["nf4", "int8"])
def test_a_quantized_base_samples_what_it_scores_and_trains_only_the_float32_adapter(folders, arch, quantization):
    from docuchat_rl.modeling import is_quantized

    gap, pm = _gap(folders[arch], "float32", quantization)
    if quantization == "nf4":  # (4-bit layers compute in the compute dtype, float32: float32's level)
        assert is_quantized(pm) and gap < 1e-5, gap
    else:  # (LLM.int8 computes in float16, bitsandbytes casting the inputs: the order of bfloat16's rounding)
        bf16, _ = _gap(folders[arch], "bfloat16", "none")
        assert is_quantized(pm) and gap <= 2 * bf16, (gap, bf16)
    lora = [p for n, p in pm.named_parameters() if "lora_" in n]
    assert lora and all(p.dtype == torch.float32 and p.grad is not None and p.grad.abs().sum() > 0 for p in lora)
    assert all(p.grad is None for n, p in pm.named_parameters() if "lora_" not in n)


def test_a_loras_gradients_over_nf4_are_those_over_its_dequantized_copy():
    """The backward through bitsandbytes' 4-bit layers (its CPU vector kernel has no autograd kernel of its own:
    torch warns) gives the LoRA the gradients the same adapter gets over the dequantized weights, to the kernel's
    bfloat16 rounding."""
    import bitsandbytes as bnb
    from peft import LoraConfig as PeftLora
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from docuchat_rl.modeling import Quantization

    q = AutoModelForCausalLM.from_pretrained(MODEL, quantization_config=Quantization("nf4", "float32", False).config(),
                                             device_map={"": "cpu"}, dtype=torch.float32)
    f = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    quantized = dict(q.named_modules())
    with torch.no_grad():
        for name, m in f.named_modules():
            if isinstance(quantized.get(name), bnb.nn.Linear4bit):
                w = quantized[name].weight
                m.weight.copy_(bnb.functional.dequantize_4bit(w.data, w.quant_state).float())
    conf = PeftLora(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights="gaussian")
    pq, pf = get_peft_model(q, conf), get_peft_model(f, conf)
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in pq.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
        pf.load_state_dict({k: v for k, v in pq.state_dict().items() if "lora_" in k}, strict=False)
    for ids in ([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]], [[7]]):  # (a batch, and one row: the vector kernel)
        x = torch.tensor(ids)
        grads = []
        for pm in (pq, pf):
            pm.zero_grad()
            pm(x).logits.float().logsumexp(-1).sum().backward()
            grads.append(torch.cat([p.grad.flatten() for p in pm.parameters() if p.requires_grad]))
        assert float((grads[0] - grads[1]).norm() / grads[1].norm()) < 0.01


@pytest.mark.parametrize("sets,said", [
    (["rollout.grouped_decode=true"], "rollout.grouped_decode does not combine with model.quantization nf4"),
    (["rollout.cuda_graphs=true"], "rollout.cuda_graphs does not combine with model.quantization nf4"),
    (["rollout.merge_adapter=true"], "rollout.merge_adapter does not combine with model.quantization nf4: a merged"),
    (["lora.fused=true"], "lora.fused does not combine with model.quantization nf4"),
    (["model.dtype=bf16-mixed"], "model.quantization nf4 with model.dtype bf16-mixed"),
])
def test_what_does_not_combine_with_a_quantized_base_is_refused_at_load_naming_both_keys(sets, said):
    with pytest.raises(ConfigError, match=said) as e:
        load_config(None, ["model.quantization=nf4", *sets])
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="model.bnb_4bit_use_double_quant applies to model.quantization nf4 or fp4"):
        load_config(None, ["model.quantization=int8", "model.bnb_4bit_use_double_quant=true"])
    decided = load_config(None, ["model.quantization=nf4"]).for_device("cpu")  # (every auto that reads weights: off)
    assert (decided.rollout.grouped_decode, decided.rollout.merge_adapter, decided.lora.fused,
            decided.rollout.cuda_graphs) == (False, False, False, False)
    assert load_config(None, ["model.quantization=nf4"]).for_device("cuda").rollout.engine == "hf"


def test_trls_bitsandbytes_config_is_our_quantization():
    from transformers import BitsAndBytesConfig
    from trl import GRPOConfig

    from docuchat_rl.trl_args import translate

    four = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
                              bnb_4bit_use_double_quant=True)
    o = translate(GRPOConfig(output_dir="/tmp/q", use_cpu=True, max_steps=2,
                             model_init_kwargs={"quantization_config": four})).overrides
    assert (o["model.quantization"], o["model.bnb_4bit_compute_dtype"], o["model.bnb_4bit_use_double_quant"]) == \
        ("nf4", "bfloat16", True)
    o = translate(GRPOConfig(output_dir="/tmp/q", use_cpu=True, max_steps=2,
                             model_init_kwargs={"quantization_config": {"load_in_8bit": True}})).overrides
    assert o["model.quantization"] == "int8"
    with pytest.raises(ConfigError, match="quantization_config.llm_int8_threshold=4.0 is not built here"):
        translate(GRPOConfig(output_dir="/tmp/q", use_cpu=True, max_steps=2, model_init_kwargs={
            "quantization_config": BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=4.0)}))


@pytest.mark.slow
def test_a_quantized_run_resumes_exactly_after_kill_9_and_its_adapter_is_a_plain_bases(tmp_path):
    """An NF4 run killed with -9 after a checkpoint and resumed writes the uninterrupted run's traces; its adapter
    loads with PeftModel.from_pretrained on the plain (unquantized) base, and `export` merges it into the base as
    stored, a folder plain transformers loads (and says so)."""
    import subprocess
    import sys

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    def sets(out):
        return [a for s in ("model.quantization=nf4", "run.steps=4", "checkpoint.every=1", "rollout.prompts_per_step=2",
                            "rollout.num_generations=4", "rollout.max_new_tokens=16", "eval.before_and_after=false",
                            "logging.progress=false", "run.threads=1", f"run.output_dir={out}") for a in ("--set", s)]

    whole, out, said = killed_and_resumed(sets, tmp_path, after_checkpoint=2)
    assert "autograd kernel" not in said and "kernels-community" not in said  # (quiet_bitsandbytes)

    def lines(run):
        return [{k: v for k, v in json.loads(x).items() if k != "run_id"} for x in (run / "traces.jsonl").read_text().splitlines()]

    assert lines(out) == lines(whole)
    plain = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    adapted = PeftModel.from_pretrained(plain, str(tmp_path / "whole" / "checkpoint-4"))
    assert any("lora_A" in n for n, _ in adapted.named_parameters())
    export = subprocess.run([sys.executable, "-m", "docuchat_rl", "export", "--adapter", str(tmp_path / "whole"),
                             "--out", str(tmp_path / "exported")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert export.returncode == 0, export.stderr[-1500:]
    assert "merged into the base as stored" in export.stderr and "dequantized" in export.stderr
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "exported", dtype=torch.float32)
    assert not hasattr(merged.config, "quantization_config")
    x = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():  # (the base as stored, float16 here: the merged weights are rounded to it)
        torch.testing.assert_close(merged(x).logits, adapted(x).logits, atol=2e-2, rtol=2e-2)
