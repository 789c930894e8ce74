"""LoRA projections as one matmul: y = x (W + s B A)^T, with the gradients of A and B peft would give.

peft computes a LoRA projection as three matmuls and two elementwise passes over the output,
base(x) + B(A(x)) * s, and autograd keeps each piece. With a small rank the two thin matmuls and the
elementwise passes write and read [tokens, features] tensors for little arithmetic: about a tenth of an
update of the embedded default on a CPU. Here the delta is folded into the weight for the one matmul
(W + s B A costs out x r x in, nothing beside the tokens' work) and rebuilt in the backward rather than
kept, so no copy of the weights outlives the call:

    grad x = g (W + s B A)        grad B = s g^T (x A^T)        grad A = s (g B)^T x

Hand-written because peft has no fused path (Unsloth's fused LoRA kernels are GPU-only Triton).

Applies to a LoRA `Linear` on a `torch.nn.Linear` with one active adapter, no dropout, no DoRA or other
variant, no LoRA bias, a frozen base layer (its weight and bias get no gradient here) and a base weight
of the adapter's dtype. Anything else runs peft's own forward: adapters disabled for the reference pass,
merged weights, several active adapters, and bf16 weights with float32 adapters (there the merged bf16
weight would round a small delta away).

Deliberately left out: fusing the elementwise work of attention and MLP, and a Triton kernel.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F


class _MergedLoRALinear(torch.autograd.Function):
    """x [..., in], frozen weight [out, in] and bias [out] | None, A [r, in], B [out, r] -> [..., out]."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scaling: float):
        ctx.save_for_backward(x, weight, lora_a, lora_b)
        ctx.scaling = scaling
        return F.linear(x, torch.addmm(weight, lora_b, lora_a, alpha=scaling), bias)  # [..., out]

    @staticmethod
    def backward(ctx, grad):
        x, weight, lora_a, lora_b = ctx.saved_tensors
        s = ctx.scaling
        flat_x, flat_g = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])  # [N, in], [N, out]
        grad_x = grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            merged = torch.addmm(weight, lora_b, lora_a, alpha=s)  # [out, in], rebuilt (not kept from the forward)
            grad_x = (flat_g @ merged).view(*grad.shape[:-1], x.shape[-1])  # [..., in]
        if ctx.needs_input_grad[3]:
            grad_a = (flat_g @ lora_b).t().mm(flat_x).mul_(s)  # [r, N] @ [N, in] -> [r, in]
        if ctx.needs_input_grad[4]:
            grad_b = flat_g.t().mm(flat_x @ lora_a.t()).mul_(s)  # [out, N] @ [N, r] -> [out, r]
        return grad_x, None, None, grad_a, grad_b, None


def _fused_forward(layer, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The forward `fuse_lora` binds to a peft LoRA Linear: fused when it applies, else peft's own."""
    from peft.tuners.lora import Linear as LoraLinear

    names = layer.active_adapters
    if args or kwargs or layer.disable_adapters or layer.merged or len(names) != 1 or names[0] not in layer.lora_A:
        return LoraLinear.forward(layer, x, *args, **kwargs)
    name = names[0]
    a, b, base = layer.lora_A[name], layer.lora_B[name], layer.base_layer
    if (name in layer.lora_variant or not isinstance(layer.lora_dropout[name], torch.nn.Identity)
            or b.bias is not None or not x.dtype == base.weight.dtype == a.weight.dtype == b.weight.dtype
            or base.weight.requires_grad or (base.bias is not None and base.bias.requires_grad)):
        return LoraLinear.forward(layer, x, *args, **kwargs)
    return _MergedLoRALinear.apply(x, base.weight, base.bias, a.weight, b.weight, layer.scaling[name])


def fuse_lora(model: torch.nn.Module) -> int:
    """Bind the fused forward to every peft LoRA Linear over a plain `torch.nn.Linear` (GPT-2's Conv1D and
    quantised bases keep peft's) -> how many. The choice is made at each call, so switching adapters,
    disabling them or merging them keeps working; a bound method, so `copy.deepcopy` of the model rebinds it."""
    from peft.tuners.lora import Linear as LoraLinear

    count = 0
    for module in model.modules():
        if type(module) is LoraLinear and type(module.base_layer) is torch.nn.Linear and not module.fan_in_fan_out:
            module.forward = types.MethodType(_fused_forward, module)
            count += 1
    return count
