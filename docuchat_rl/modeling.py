"""Model and tokenizer loading: any causal LM by local path, hub id or GGUF file (gguf.py), with LoRA from peft.

dtype "auto" picks bfloat16 on a GPU that supports it (else float16; a training run float32) and float32 on a
CPU. bf16-autocast (TRL's bf16 training) runs bfloat16 weights and float32 LoRA adapters under
torch.autocast (`enable_autocast`). bf16-mixed keeps
the weights in bfloat16 and runs matmuls and attention in it under torch.autocast, while the residual
stream, the norms, softmaxes and the output head (the logits) stay float32 (`enable_mixed`,
`compute_context`); on a CPU with bfloat16 instructions (AVX512-BF16, AMX) it is faster but not the default
(`resolve_dtype` says why). Remote code runs
only when the config asks (`model.trust_remote_code`). A tokenizer without a pad token gets its EOS as pad.
The base model's dropout is turned off for RL (`disable_dropout`): rollouts are sampled in eval mode, so
an update with dropout on would train a different function than the one that sampled. LoRA's own
dropout stays what `lora.dropout` says. Here too: the LoRA adapters (the policy's, and the separate
critic's), switching between them, and sampling with merged LoRA weights; and what the sampler and the
trainer both need of a model: its positions (`position_ids`), its KV-cache keyword (`with_cache`,
`cache_of`) and the sampling distribution's processors (`warpers`).

Deliberately left out: quantised (4/8-bit) loading and full fine-tuning; LoRA is the one training mode.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .errors import ModelError
from .gguf import KNOWN, is_gguf, load_gguf

if TYPE_CHECKING:
    from .config import LoraConfig

REFERENCE_ADAPTER = "reference"  # the KL reference when a run starts from an adapter (run.start_adapters)
CRITIC_ADAPTER = "critic"  # the separate critic's LoRA adapter (algorithm.critic_backbone: separate)


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a peft wrapper (the model itself when it has none)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


@functools.cache
def _cache_name(forward) -> str:
    import inspect

    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def with_cache(model: torch.nn.Module, cache) -> dict:
    """The keyword that hands a KV cache to `model`'s forward: `cache` since transformers 5.2x (which
    deprecates `past_key_values`, to be removed in 5.40), `past_key_values` before (vLLM's CPU build pins
    an older transformers)."""
    return {_cache_name(type(base_model(model)).forward): cache}


def cache_of(output):
    """The KV cache a forward returned (`cache` or, in older transformers, `past_key_values`)."""
    return output["cache"] if "cache" in output else output.past_key_values


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens only (left padding does not shift them). [R, L] -> [R, L]"""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def warpers(temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> list:
    """transformers' own temperature, top-k and top-p processors, in `generate`'s order; exactly the
    ones the config names (a model's generation_config never adds any)."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    out = []
    if temperature != 1.0:
        out.append(TemperatureLogitsWarper(temperature))
    if top_k > 0:
        out.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        out.append(TopPLogitsWarper(top_p))
    return out


def pick_device(device: str = "auto") -> torch.device:
    """The torch device `model.device` names (auto: the GPU when there is one)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


MIXED = "bf16-mixed"  # Lightning's name for bfloat16 compute over float32 accumulations
AUTOCAST = "bf16-autocast"  # bfloat16 weights, float32 LoRA adapters, every forward under autocast (TRL's bf16)


def resolve_dtype(dtype: str, device: torch.device) -> str:
    """The dtype name `auto` stands for on `device` (see the module docstring); other names as they are.

    Why float32 on a CPU, even one with AVX512-BF16 where bfloat16 matmuls ran 4-4.5x faster (2 EPYC
    cores, 2026-11-24): on SmolLM2-135M's recipe bf16-mixed made a step 1.3x faster (5.1 s against 6.7)
    and learned about as well (held-out accuracy 65% against 70% after 150 steps, within the evaluation's
    noise; training reward a little lower in every 25-step window), but the sampler's and the trainer's
    log-probs differed by 0.021 nats (median of the steps' means; 13% of tokens off by more than 0.01, up
    to 3.8 nats on one token) against 1e-6 in float32, and its peak memory was higher (4.8 GB against 3.9).
    float32 keeps the trainer scoring what the sampler drew (docs/smollm2.md)."""
    if dtype != "auto":
        return dtype
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return "float32"


def native_bf16_cpu() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX), where a bfloat16 matmul beats float32;
    on one without (AVX2 only), torch emulates it."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # (torch.cpu's own, private but stable)
    return any(getattr(torch.cpu, p, lambda: False)() for p in probes)


_SAID_BF16: set[str] = set()


def warn_slow_bf16(name: str) -> None:
    """Say once a process that a bfloat16 dtype on this CPU is emulated: measured on 2 AVX2-only EPYC cores
    (2026-11-28), SmolLM2-135M's forward 6x and its backward 20x slower than float32."""
    if name in _SAID_BF16:
        return
    _SAID_BF16.add(name)
    warnings.warn(f"model.dtype {name} on a CPU without native bfloat16 (no AVX512-BF16 or AMX): torch emulates it, "
                  "and a step runs several times slower than in float32 (measured: SmolLM2-135M's forward 6x, its "
                  "backward 20x); set model.dtype=float32 here", stacklevel=3)


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype | str:
    """The torch dtype the weights load in (bf16-mixed: bfloat16); base: the checkpoint's own dtype."""
    if dtype == "base":
        return "auto"  # transformers' "auto" reads the checkpoint's own dtype
    name = resolve_dtype(dtype, device)
    return torch.bfloat16 if name in (MIXED, AUTOCAST) else getattr(torch, name)


class _Float32Logits(torch.autograd.Function):
    """x [..., H] @ weight32.T in float32; the gradient of x through the bfloat16 weight, in bfloat16 as
    every other matmul's backward under autocast (the logits' precision matters for the log-probs, a
    gradient's 0.4% rounding does not; a float32 backward would be a third of a bf16-mixed update of
    SmolLM2-135M's micro-batch)."""

    @staticmethod
    def forward(ctx, x, weight32, bias32, weight16):
        ctx.save_for_backward(weight16)
        return torch.nn.functional.linear(x, weight32, bias32)  # [..., V] float32

    @staticmethod
    def backward(ctx, grad):
        (weight16,) = ctx.saved_tensors
        return (grad.to(weight16.dtype) @ weight16).float(), None, None, None  # [..., H]


class Float32Head(torch.nn.Module):
    """The output layer in float32 over a bfloat16 model (bf16-mixed): logits of magnitude 10-30 rounded to
    bfloat16 are off by up to 0.06, so the sampler's and the trainer's log-probs would disagree by that
    much. Keeps the layer's own weight Parameter (a tied embedding stays tied and is saved as before) and a
    float32 copy of it, made once (the head is frozen: LoRA's all-linear leaves the output layer out; a
    head whose weight trains is multiplied from that weight instead, cast each call)."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight32", linear.weight.detach().float(), persistent=False)  # [V, H]
        self.register_buffer("bias32", None if linear.bias is None else linear.bias.detach().float(),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            if self.weight.requires_grad:
                bias = None if self.bias is None else self.bias.float()
                return torch.nn.functional.linear(x.float(), self.weight.float(), bias)  # [..., V]
            return _Float32Logits.apply(x.float(), self.weight32, self.bias32, self.weight)  # [..., V]


def enable_mixed(model: torch.nn.Module) -> torch.nn.Module:
    """Make a bfloat16 model bf16-mixed: the embeddings' output in float32 (so the residual stream, which
    every layer adds to, stays float32), the output head in float32 (Float32Head), and the model marked
    for `compute_context`. Measured on SmolLM2-135M (2 CPU cores): the sampler/trainer log-prob mismatch
    falls from 0.027 to 0.012 nats (mean) against plain bfloat16, at 0.87x its sampling speed."""
    model.get_input_embeddings().register_forward_hook(lambda module, args, out: out.float())
    head = model.get_output_embeddings()
    if isinstance(head, torch.nn.Linear):
        model.set_output_embeddings(Float32Head(head))
    model.docuchat_mixed = True
    return model


def enable_autocast(model: torch.nn.Module) -> torch.nn.Module:
    """Mark a bfloat16 model bf16-autocast: every forward under bfloat16 autocast, as TRL trains (bf16=True).
    peft keeps the LoRA adapters (and so their optimizer state) in float32 over bfloat16 weights; without
    autocast each adapted layer casts its bfloat16 input to float32 and autograd keeps that copy for the
    backward, with autocast the adapter's matmul takes the bfloat16 input and the float32 copy is transient
    (the saved-for-backward bytes of a training forward: tests/test_modeling.py). Unlike bf16-mixed, the
    residual stream and the logits stay bfloat16, as in plain bfloat16."""
    model.docuchat_autocast = True
    return model


def compute_context(model: torch.nn.Module):
    """The context every forward of `model` runs in: bfloat16 autocast for a bf16-mixed model (matmuls and
    attention in bfloat16, everything else float32) and a bf16-autocast one (`enable_autocast`), else nothing."""
    base = base_model(model)
    if getattr(base, "docuchat_mixed", False) or getattr(base, "docuchat_autocast", False):
        return torch.autocast(next(model.parameters()).device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def in_compute_context(fn):
    """Decorate `fn(model, ...)` to run in `compute_context(model)` (generation, the policy forward)."""
    @functools.wraps(fn)
    def wrapper(model, *args, **kwargs):
        with compute_context(model):
            return fn(model, *args, **kwargs)

    return wrapper


def load_model_and_tokenizer(name_or_path: str, dtype: str = "auto", device: str = "auto",
                             trust_remote_code: bool = False, revision: str | None = None,
                             stop_tokens: list[str] | tuple[str, ...] = (), chat_template: str | None = None,
                             template_kwargs: dict | None = None, quantization=None):
    """(model on the device in the chosen dtype, tokenizer with a pad token and the chat template the recipe
    gives: `set_chat_template`), the `stop_tokens` among the model's EOS ids (add_stop_tokens); a load failure is
    one line naming the key. `quantization`: a `Quantization` (model.quantization's), the linear layers loaded
    quantized by bitsandbytes on the device."""
    dev = pick_device(device)
    with _quiet_local_load(Path(name_or_path).expanduser().exists()):
        if is_gguf(name_or_path) and quantization is not None:  # dequantized, then quantized from a float32 copy
            model, tok = _gguf_quantized(Path(name_or_path).expanduser(), dtype, dev, quantization)
        elif is_gguf(name_or_path):  # a llama.cpp file: dequantized into a plain model (gguf.py)
            model, tok = load_gguf(Path(name_or_path).expanduser(), pick_dtype(dtype, dev))
        else:
            model, tok = _from_pretrained(name_or_path, pick_dtype(dtype, dev), revision, trust_remote_code,
                                          quantization, dev)
    return prepare_model(model, tok, dtype, str(dev), stop_tokens, chat_template, template_kwargs)


@dataclass(frozen=True)
class Quantization:
    """model.quantization's settings, as bitsandbytes takes them (`config`)."""

    kind: str  # nf4, fp4, int8
    compute_dtype: str  # nf4/fp4: the 4-bit layers' compute dtype (float32, bfloat16)
    double_quant: bool  # nf4/fp4: the quantization constants quantized too

    @classmethod
    def of(cls, m, device: torch.device) -> Quantization | None:
        """The recipe's model section `m` (config.ModelConfig) on `device`; None for model.quantization none."""
        if m.quantization == "none":
            return None
        compute = m.bnb_4bit_compute_dtype
        if compute == "auto":  # (the model's own compute dtype: bfloat16 where it runs in bfloat16)
            compute = "float32" if resolve_dtype(m.dtype, device) == "float32" else "bfloat16"
        return cls(m.quantization, compute, m.bnb_4bit_use_double_quant)

    def config(self):
        """transformers' BitsAndBytesConfig (bitsandbytes must be installed: one line otherwise)."""
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            raise ModelError(f"model.quantization {self.kind} needs bitsandbytes: pip install 'docuchat-rl[quant]'"
                             ) from None
        from transformers import BitsAndBytesConfig

        if self.kind == "int8":
            return BitsAndBytesConfig(load_in_8bit=True)
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=self.kind,
                                  bnb_4bit_compute_dtype=getattr(torch, self.compute_dtype),
                                  bnb_4bit_use_double_quant=self.double_quant)


def _no_cpu_packing(model) -> None:
    """Keep bitsandbytes' 4-bit layers on their dequantize-and-matmul path on every CPU. On an AVX512-BF16 CPU a
    layer repacks its weight at its first forward in eval mode (the rollout's) and from then on computes through
    an inference kernel: in bfloat16 whatever bnb_4bit_compute_dtype says, without an autograd kernel, and with an
    in-place bias add that fails under autograd for a layer with a bias (Qwen2's q/k/v). The sampler and the
    trainer then computed the same layer in two ways; here both compute it the one way, in the compute dtype."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def is_quantized(model) -> bool:
    """Whether `model` (or the base under a peft model) was loaded quantized by bitsandbytes."""
    return bool(getattr(base_model(model), "is_quantized", False) or getattr(model, "is_quantized", False))


def _gguf_quantized(path: Path, dtype: str, dev: torch.device, quantization: Quantization):
    """A GGUF file quantized by bitsandbytes: transformers' GGUF loader dequantizes it (load_gguf), and bitsandbytes
    quantizes only while from_pretrained reads a folder, so the dequantized weights go through a temporary float32
    folder (the model's size on disk while it loads), removed after."""
    import tempfile

    plain, tok = load_gguf(path, torch.float32)
    with tempfile.TemporaryDirectory(prefix="docuchat-gguf-") as tmp:
        plain.save_pretrained(tmp)
        del plain
        model, _ = _from_pretrained(tmp, pick_dtype(dtype, dev), None, False, quantization, dev, tok)
    model.config.name_or_path = str(path)
    return model, tok


def load_configured(m, dtype: str | None = None, device: str | None = None, quantized: bool = True):
    """`load_model_and_tokenizer` with every setting of the recipe's model section `m` (config.ModelConfig), in
    `dtype` and on `device` when given (else m.dtype, m.device): the one call the engine loads a model with.
    `quantized=False`: the base as it is stored, whatever model.quantization says (export merges into it)."""
    dev = pick_device(device or m.device)
    quantization = Quantization.of(m, dev) if quantized else None
    return load_model_and_tokenizer(m.name_or_path, dtype or m.dtype, str(dev), m.trust_remote_code, m.revision,
                                    m.stop_tokens, m.chat_template, m.chat_template_kwargs, quantization)


def prepare_model(model, tok, dtype: str = "auto", device: str = "auto", stop_tokens: list[str] | tuple[str, ...] = (),
                  chat_template: str | None = None, template_kwargs: dict | None = None):
    """A loaded model and tokenizer made ready as `load_model_and_tokenizer` makes them (a pad token, the
    chat template, the stop tokens, the dtype and its mixed-precision wrapping, the device): also what the Python
    API does to a model a user loaded."""
    dev = pick_device(device)
    resolved = resolve_dtype(dtype, dev) if dtype != "base" else None
    if dev.type == "cpu" and resolved in (MIXED, AUTOCAST, "bfloat16") and not native_bf16_cpu():
        warn_slow_bf16(resolved)
    want = pick_dtype(dtype, dev) if resolved is not None else None
    for param in model.parameters():  # (a model loaded elsewhere, in another dtype: its weights only; buffers such
        if param.is_floating_point() and want is not None and param.dtype != want:  # as the rotary inv_freq stay
            param.data = param.data.to(want)  # float32, as from_pretrained leaves them)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    set_chat_template(tok, chat_template, template_kwargs or {})
    add_stop_tokens(model, tok, stop_tokens)
    if resolved == MIXED:
        enable_mixed(model)
    elif resolved == AUTOCAST:
        enable_autocast(model)
    return (model if is_quantized(model) else model.to(dev)), tok  # (a quantized model is placed as it loads)


def _jinja(value) -> str:
    """A JSON-like value as a Jinja literal (JSON's null is Jinja's none).

    >>> _jinja({"a": [True, None, 1.5, "x"]})
    '{"a": [true, none, 1.5, "x"]}'
    """
    import json

    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {_jinja(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_jinja(v) for v in value) + "]"
    return json.dumps(value)


def set_chat_template(tok, path: str | None, kwargs: dict) -> None:
    """The recipe's chat template on the tokenizer: `model.chat_template` (a .jinja file) in place of its own, and
    `model.chat_template_kwargs` set at the template's top (`{%- set enable_thinking = false -%}`), so every
    rendering (rollout, evaluation, SFT, chat) and every saved tokenizer (checkpoints, export) has them: one
    place, where a keyword at each apply_chat_template call would be one more thing each caller could forget."""
    if path is not None:
        p = Path(path).expanduser()
        if not p.is_file():
            raise ModelError(f"model.chat_template {path}: no such file (a Jinja chat template, .jinja)")
        tok.chat_template = p.read_text(encoding="utf-8")
    if kwargs:
        if not getattr(tok, "chat_template", None):
            raise ModelError(f"model.chat_template_kwargs {sorted(kwargs)}: the tokenizer has no chat template to give "
                             "them to")
        head = "".join(f"{{%- set {k} = {_jinja(v)} -%}}" for k, v in kwargs.items())
        tok.chat_template = head + tok.chat_template


def eos_ids(model, tokenizer) -> list[int]:
    """Every token id that ends a completion (generation config's EOS list, model.stop_tokens among them,
    plus the tokenizer's)."""
    ids = model.generation_config.eos_token_id
    ids = [] if ids is None else ([ids] if isinstance(ids, int) else list(ids))
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def end_of_turn(model, tokenizer) -> int:
    """The stop token a supervised target ends with: of the model's stops (`eos_ids`), the one its chat template
    writes first after an assistant message's text (Llama 3's <|eot_id|>, Gemma's <end_of_turn>, ChatML's
    <|im_end|>), found by rendering a one-turn conversation, as the tool loop finds its result framing. A list
    that puts end-of-text first (Llama-3.x-Instruct [128001, 128008, 128009], Gemma-3-IT [1, 106]) would
    otherwise teach a token the template never writes after an answer. Without a template (a base model's plain
    form), or where the template writes none of the stops, the first stop.

    >>> from transformers import AutoModelForCausalLM, AutoTokenizer
    >>> tok = AutoTokenizer.from_pretrained("data/model")
    >>> model = AutoModelForCausalLM.from_pretrained("data/model")
    >>> model.generation_config.eos_token_id = [0, 3]  # (<|endoftext|> first, as Llama 3's list has it)
    >>> tok.decode([end_of_turn(model, tok)])
    '<|im_end|>'
    """
    stops = eos_ids(model, tokenizer)
    if not getattr(tokenizer, "chat_template", None) or not stops:
        return stops[0]
    marker = "\u2063end-of-answer\u2063"  # (text no template writes: where the assistant's content ends)
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "?"},
                                              {"role": "assistant", "content": marker}], tokenize=False)
    except Exception:  # noqa: BLE001 (a template that cannot render a plain answer: nothing to find)
        return stops[0]
    tail = text[text.rfind(marker) + len(marker):] if marker in text else ""
    found = [(tail.find(word), i) for i in stops if (word := tokenizer.decode([i])) and word in tail]
    return min(found)[1] if found else stops[0]


def add_stop_tokens(model, tokenizer, texts: list[str] | tuple[str, ...]) -> list[int]:
    """Add the token of each text in `texts` (model.stop_tokens) to the model's generation_config EOS ids,
    where every engine, evaluation and an export read them (generation.eos_ids); the ids added. A text that
    is not exactly one token is refused, naming the key: a stop is matched token by token while decoding.

    >>> from transformers import AutoModelForCausalLM, AutoTokenizer
    >>> tok = AutoTokenizer.from_pretrained("data/model")
    >>> model = AutoModelForCausalLM.from_pretrained("data/model")
    >>> [tok.decode(i) for i in add_stop_tokens(model, tok, ["."])]
    ['.']
    """
    ids, added = eos_ids(model, tokenizer), []
    for text in texts:
        pieces = tokenizer.encode(text, add_special_tokens=False)
        if len(pieces) != 1:
            shown = [tokenizer.decode([p]) for p in pieces]
            raise ModelError(f"model.stop_tokens: {text!r} is {len(pieces)} tokens of this tokenizer ({shown}), not "
                             "one; give the text of a single token")
        if pieces[0] not in ids:
            ids.append(pieces[0])
            added.append(pieces[0])
    if added:
        model.generation_config.eos_token_id = ids
    return added


@contextlib.contextmanager
def _quiet_local_load(local: bool):
    """transformers' "Loading weights" bar off while a local model loads (a bar per command, frames in every
    log); a hub download keeps its bars."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    if local and was:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if local and was:
            hf_logging.enable_progress_bar()


def _from_pretrained(name_or_path: str, dtype, revision: str | None, trust_remote_code: bool,
                     quantization: Quantization | None = None, device: torch.device | None = None, tok=None):
    """(model, tokenizer) by local path or hub id, quantized on `device` when asked; a failure is one line saying
    what was tried."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quantized = {}
    if quantization is not None:  # (bitsandbytes quantizes as the weights are placed: on the run's device)
        quantized = {"quantization_config": quantization.config(), "device_map": {"": str(device or "cpu")}}
    try:
        tok = tok or AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code, revision=revision)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*kernels-community.*")  # (bitsandbytes' optional CPU kernels)
            model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype, trust_remote_code=trust_remote_code,
                                                         revision=revision, **quantized)
        if quantization is not None:
            _no_cpu_packing(model)
    except (OSError, ValueError) as e:  # transformers reports a missing folder as a ~70-line hub error
        tried = ("a local folder that does not exist" if _looks_local(name_or_path)
                 else "a local folder (none there), then the hub (offline or no such repository)")
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        known = next((m for m in KNOWN.values() if Path(name_or_path) == Path(m.folder)), None)
        hint = (f"; make it with: docuchat-rl get-model {known.name}" if known and not Path(name_or_path).exists()
                else "")
        raise ModelError(f"model.name_or_path {name_or_path!r} could not be loaded: tried {tried}: "
                         f"{first[:200]}{hint}") from None
    return model, tok


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
                          target_modules=cfg.target_modules, exclude_modules=cfg.exclude_modules,
                          layers_to_transform=cfg.layers_to_transform, layers_pattern=cfg.layers_pattern,
                          use_rslora=cfg.use_rslora, rank_pattern=dict(cfg.rank_pattern),
                          alpha_pattern=dict(cfg.alpha_pattern), init_lora_weights=cfg.init_lora_weights,
                          task_type="CAUSAL_LM")


def build_lora(model, cfg: LoraConfig):
    """The peft model with the policy's adapter ("default")."""
    from peft import get_peft_model

    head = model.get_output_embeddings()
    if isinstance(head, Float32Head) and cfg.target_modules not in ("all-linear", None) and any(
            name == t or name.endswith(f".{t}") for name, m in model.named_modules() if m is head
            for t in cfg.target_modules):
        raise ModelError("lora.target_modules names the output head, which model.dtype bf16-mixed computes in "
                         "float32 outside peft: use model.dtype float32 or bfloat16 to adapt it")
    try:
        with warnings.catch_warnings():
            # Adapting one side of a tied head and embedding gives that side alone the delta, here as in
            # sampling (merged_adapter) and export: peft warns that it could tie the two adapters
            # (ensure_weight_tying), which would train another function than the one we sample from.
            warnings.filterwarnings("ignore", message=".*tie_word_embeddings=True.*tied layer is part of the adapter")
            return get_peft_model(model, lora_config(cfg))
    except ValueError as e:  # peft's NoMatchingPeftModuleError (a ValueError), raised after its own traceback
        if "not found in the base model" not in str(e):
            raise
        linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                         if isinstance(m, torch.nn.Linear) and m is not model.get_output_embeddings()})
        raise ModelError(f"lora.target_modules {cfg.target_modules} matches no module of the model; its linear "
                         f"layers are: {', '.join(linear)} (or 'all-linear')") from None


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


def unmergeable(model) -> str | None:
    """Why `merged_adapter` cannot fold this peft model's LoRA into its weights layer by layer (then it samples
    unmerged), or None. Said as a phrase naming the layer: a LoRA on an embedding or another non-Linear
    layer, DoRA, an adapter already merged by peft."""
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    for name, m in model.named_modules():
        if not isinstance(m, LoraLayer):
            continue
        if type(m) is not LoraLinear:
            return f"its LoRA layer {name} ({type(m).__name__}) is not a linear one"
        if any(m.use_dora.values()):
            return f"its LoRA layer {name} uses DoRA"
        if m.merged:
            return f"its LoRA layer {name} is already merged by peft"
    return None


def tied_head_adapted(model) -> str | None:
    """The name of a LoRA-adapted output head whose weight is the input embedding's (tied), or None: a merged
    copy of such a model loses the head's delta wherever the tie is restored from the embedding (vLLM)."""
    from peft.tuners.lora import LoraLayer

    embed = model.get_input_embeddings()
    for name, m in model.named_modules():
        if isinstance(m, LoraLayer) and getattr(m.get_base_layer(), "weight", None) is getattr(embed, "weight", 0):
            return name
    return None


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
    adapters that peft does not merge linearly (DoRA), non-Linear LoRA layers and a model whose adapter is
    disabled (`disable_adapter()`: the base model is asked for) run unmerged.
    """
    from peft.tuners.lora import LoraLayer

    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    disabled = any(m.disable_adapters for m in layers)  # (inside peft's disable_adapter(): the base model, which
    # a merge of the active adapters would silently undo)
    if not hasattr(model, "disable_adapter") or not layers or disabled or unmergeable(model) is not None:
        yield model
        return
    swapped, bypassed = [], []
    try:
        with torch.no_grad():
            for m in layers:
                base = m.get_base_layer()
                weight = base.weight
                merged = _merged_weight(m, weight)
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


def _merged_weight(layer, weight: torch.Tensor) -> torch.Tensor:
    """A LoRA layer's base weight with its active adapters' deltas added. One float32 adapter on a float32
    weight: W + s B A as one addmm, the very weight the fused LoRA forward multiplies by
    (learning/fused_lora.py), so the sampler and the update compute with the same numbers; else peft's delta
    (B A s, transposed for fan-in-fan-out layers) added in float32."""
    names = [a for a in layer.active_adapters if a in layer.lora_A]
    if not names:  # (no active adapter on this layer: its weight as it is)
        return weight.detach()
    if len(names) == 1 and not layer.fan_in_fan_out:
        a, b = layer.lora_A[names[0]].weight, layer.lora_B[names[0]].weight  # [r, in], [out, r]
        if weight.dtype == a.dtype == b.dtype == torch.float32:
            return torch.addmm(weight, b, a, alpha=layer.scaling[names[0]])  # [out, in]
    delta = sum(layer.get_delta_weight(n) for n in names)
    return (weight.float() + delta.float()).to(weight.dtype)


def adapter_digest(model) -> str | None:
    """sha256 (first 16 hex digits) of the policy adapter's tensors (`state_digest`): the identity of a policy
    version (the trace's `adapter_sha256`; `docuchat-rl replay` checks the policy it rebuilt against it)."""
    from peft import get_peft_model_state_dict

    return state_digest(get_peft_model_state_dict(model, adapter_name="default"))


def state_digest(state: dict[str, torch.Tensor]) -> str | None:
    """sha256 (first 16 hex digits) of an adapter state, by name in sorted order and the tensors' bytes as
    stored; None for sharded weights (a process holds a shard only)."""
    import hashlib

    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach()
        if type(t) is not torch.Tensor:  # (an FSDP2 DTensor shard)
            return None
        h.update(name.encode())
        h.update(t.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]
