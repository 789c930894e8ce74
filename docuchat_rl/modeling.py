"""Model and tokenizer loading: any causal LM by local path or hub id, with LoRA adapters from peft.

dtype "auto" picks float32 on a CPU and bfloat16 on a GPU that supports it (else float16). Remote code runs
only when the config asks (`model.trust_remote_code`). A tokenizer without a pad token gets its EOS as pad.
The base model's dropout is turned off for RL (`disable_dropout`): rollouts are sampled in eval mode, so
an update with dropout on would train a different function than the one that sampled. LoRA's own
dropout stays what `lora.dropout` says. Here too: the LoRA adapters (the policy's, and the separate
critic's), switching between them, and sampling with merged LoRA weights.

Deliberately left out: quantised (4/8-bit) loading and full fine-tuning; LoRA is the one training mode.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .errors import ModelError

if TYPE_CHECKING:
    from .config import LoraConfig

CRITIC_ADAPTER = "critic"  # the separate critic's LoRA adapter (algorithm.critic_backbone: separate)


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a peft wrapper (the model itself when it has none)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def pick_device(device: str = "auto") -> torch.device:
    """The torch device `model.device` names (auto: the GPU when there is one)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype | str:
    """auto: float32 on a CPU, bfloat16 (else float16) on a GPU; base: the dtype the checkpoint was saved in."""
    if dtype == "base":
        return "auto"  # transformers' "auto" reads the checkpoint's own dtype
    if dtype != "auto":
        return getattr(torch, dtype)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def load_model_and_tokenizer(name_or_path: str, dtype: str = "auto", device: str = "auto",
                             trust_remote_code: bool = False, revision: str | None = None):
    """(model on the device in the chosen dtype, tokenizer with a pad token); a load failure is one line
    naming the key."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = pick_device(device)
    try:
        tok = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code, revision=revision)
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=pick_dtype(dtype, dev),
                                                     trust_remote_code=trust_remote_code, revision=revision)
    except (OSError, ValueError) as e:  # transformers reports a missing folder as a ~70-line hub error
        tried = ("a local folder that does not exist" if _looks_local(name_or_path)
                 else "a local folder (none there), then the hub (offline or no such repository)")
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(f"model.name_or_path {name_or_path!r} could not be loaded: tried {tried}: "
                         f"{first[:200]}") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model.to(dev), tok


def _looks_local(name: str) -> bool:
    """A path rather than a hub id (`owner/name`): starts with ., /, ~ or has more than one slash."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or Path(name).exists()


def disable_dropout(model: torch.nn.Module) -> int:
    """Set every dropout of the base model to 0: nn.Dropout modules and the float attention-dropout
    attributes that attention functions read in train mode. Returns how many were non-zero."""
    changed = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout) and module.p > 0:
            module.p, changed = 0.0, changed + 1
        for attr in ("attention_dropout", "dropout"):
            value = getattr(module, attr, None)
            if isinstance(value, float) and value > 0:
                setattr(module, attr, 0.0)
                changed += 1
    return changed


def lora_config(cfg: LoraConfig):
    """peft's LoraConfig for our `lora` section."""
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                          target_modules=cfg.target_modules, task_type="CAUSAL_LM")


def build_lora(model, cfg: LoraConfig):
    """The peft model with the policy's adapter ("default")."""
    from peft import get_peft_model

    return get_peft_model(model, lora_config(cfg))


def add_critic_adapter(model, cfg: LoraConfig) -> None:
    """A second LoRA adapter for a separate critic, its parameters trainable too (peft trains the active
    adapter only; `active_adapter` switches to it for the critic's forward)."""
    model.add_adapter(CRITIC_ADAPTER, lora_config(cfg))
    for name, p in model.named_parameters():
        if f".{CRITIC_ADAPTER}." in name:
            p.requires_grad_(True)


@contextlib.contextmanager
def active_adapter(model, name: str, trainable: list[torch.nn.Parameter]):
    """Run the block with adapter `name` active, then the policy's ("default") again. peft's set_adapter
    also freezes the inactive adapters; every trainable parameter is made trainable again each time."""
    model.set_adapter(name)
    for p in trainable:
        p.requires_grad_(True)
    try:
        yield
    finally:
        model.set_adapter("default")
        for p in trainable:
            p.requires_grad_(True)


@contextlib.contextmanager
def merged_adapter(model):
    """Run the block with each LoRA delta folded into its base weight, then restore the originals exactly.

    Generation then costs what the base model costs (an unmerged LoRA layer adds two matmuls and a
    module call per projection per token). peft's own merge_adapter/unmerge_adapter subtract the delta
    again, which leaves rounding drift in the base weights after every rollout (worst in bf16); here the
    merged weight is a new Parameter set on the LoRA layer's base module only, and the original
    Parameter object is put back afterwards, bit for bit. A weight that another module shares (a tied
    lm_head and input embedding) is therefore never changed for the other module. Costs one extra copy
    of the adapted weights while the block runs. The LoRA layers themselves are replaced by their (merged)
    base layers for the block, so the forward runs no peft code at all. Models that are not peft models,
    adapters that peft does not merge linearly (DoRA) and non-Linear LoRA layers run unmerged.
    """
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    mergeable = (hasattr(model, "disable_adapter") and layers
                 and all(type(m) is LoraLinear and not m.merged and not any(m.use_dora.values()) for m in layers))
    if not mergeable:
        yield model
        return
    swapped, bypassed = [], []
    try:
        with torch.no_grad():
            for m in layers:
                base = m.get_base_layer()
                weight = base.weight
                delta = sum(m.get_delta_weight(a) for a in m.active_adapters if a in m.lora_A)
                merged = (weight.float() + delta.float()).to(weight.dtype)
                swapped.append((base, weight))
                base.weight = torch.nn.Parameter(merged, requires_grad=False)  # this module only
        # the LoRA wrappers step out of the module tree (their base layers, merged, take their place): a
        # decode step then makes no call into peft's Python per projection
        for name, m in model.named_modules():
            if isinstance(m, LoraLayer):
                parent, _, attr = name.rpartition(".")
                bypassed.append((model.get_submodule(parent), attr, m))
        for parent, attr, m in bypassed:
            setattr(parent, attr, m.get_base_layer())
        yield model
    finally:
        for parent, attr, m in bypassed:
            setattr(parent, attr, m)
        for base, original in swapped:
            base.weight = original
