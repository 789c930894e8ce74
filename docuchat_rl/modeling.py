"""Model and tokenizer loading: any causal LM by local path or hub id, with LoRA adapters from peft.

dtype "auto" picks float32 on a CPU and bfloat16 on a GPU that supports it (else float16). Remote code runs
only when the config asks (`model.trust_remote_code`). A tokenizer without a pad token gets its EOS as pad.

Deliberately left out: quantised (4/8-bit) loading and full fine-tuning; LoRA is the one training mode.
"""

from __future__ import annotations

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
