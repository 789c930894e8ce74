"""Model and tokenizer loading: any causal LM by local path or hub id, with LoRA adapters from peft.

dtype "auto" picks float32 on a CPU and bfloat16 on a GPU that supports it (else float16). Remote code runs
only when the config asks (`model.trust_remote_code`). A tokenizer without a pad token gets its EOS as pad.

Deliberately left out: quantised (4/8-bit) loading and full fine-tuning; LoRA is the one training mode.
"""

from __future__ import annotations

import contextlib

import torch


def pick_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return getattr(torch, dtype)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def load_model_and_tokenizer(name_or_path: str, dtype: str = "auto", device: str = "auto",
                             trust_remote_code: bool = False, revision: str | None = None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = pick_device(device)
    tok = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code, revision=revision)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=pick_dtype(dtype, dev),
                                                 trust_remote_code=trust_remote_code, revision=revision)
    return model.to(dev), tok


@contextlib.contextmanager
def merged_adapter(model):
    """Run the block with each LoRA delta folded into its base weight, then restore the originals exactly.

    Generation then costs what the base model costs (an unmerged LoRA layer adds two matmuls and a
    module call per projection per token). peft's own merge_adapter/unmerge_adapter subtract the delta
    again, which leaves rounding drift in the base weights after every rollout (worst in bf16); here the
    merged weight is a new tensor and the original tensor object is put back, bit for bit. Costs one
    extra copy of the adapted weights while the block runs. Models that are not peft models, adapters
    that peft does not merge linearly (DoRA) and non-Linear LoRA layers run unmerged.
    """
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    mergeable = (hasattr(model, "disable_adapter") and layers
                 and all(type(m) is LoraLinear and not m.merged and not any(m.use_dora.values()) for m in layers))
    if not mergeable:
        yield model
        return
    swapped = []
    try:
        with torch.no_grad():
            for m in layers:
                weight = m.get_base_layer().weight
                delta = sum(m.get_delta_weight(a) for a in m.active_adapters if a in m.lora_A)
                swapped.append((weight, weight.data))
                weight.data = (weight.data.float() + delta.float()).to(weight.dtype)
        with model.disable_adapter():
            yield model
    finally:
        for weight, original in swapped:
            weight.data = original
