"""The fused LoRA projection gives peft's outputs and gradients, and steps aside wherever it does not apply."""

import copy

import torch

from docuchat_rl.learning.batch import build_batch
from docuchat_rl.learning.forward import policy_forward
from docuchat_rl.learning.fused_lora import fuse_lora

from .conftest import with_lora


def _qwen2(tok):
    """A tiny Qwen2 (its q/k/v projections have a bias) with LoRA on every linear layer of its blocks."""
    import transformers as tf

    torch.manual_seed(0)
    model = tf.Qwen2ForCausalLM(tf.Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    return with_lora(model, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


def _batch(tok):
    p = [tok("Ava has 3 apples and buys 4 more.", add_special_tokens=False)["input_ids"]] * 3
    c = [tok(x, add_special_tokens=False)["input_ids"] for x in ("<answer>7</answer>", "<think>\n3 + 4", "7")]
    return build_batch(p, c, [0.0] * 3, [0, 0, 0], tok.pad_token_id)


def _run(pm, batch, share_prompt=True):
    """(log-probs, the gradient of every trainable parameter) of one forward and backward."""
    pm.zero_grad()
    out = policy_forward(pm, batch, temperature=0.8, share_prompt=share_prompt)
    loss = (out.logps * batch.completion_mask).sum()
    loss.backward()
    return out.logps.detach(), {n: p.grad.clone() for n, p in pm.named_parameters() if p.grad is not None}


def _peft_only(pm):
    """The model's fused forwards taken away (each LoRA layer back on peft's class forward)."""
    for m in pm.modules():
        m.__dict__.pop("forward", None)


def test_fused_projection_gives_peft_log_probs_and_gradients(tiny):
    _, tok = tiny
    pm, batch = _qwen2(tok), _batch(tok)
    ref_logps, ref_grads = _run(pm, batch)
    assert fuse_lora(pm) == 2 * 7  # 2 layers x 7 projections
    calls = []
    from docuchat_rl.learning import fused_lora

    original = fused_lora._MergedLoRALinear.apply
    fused_lora._MergedLoRALinear.apply = lambda *a: calls.append(1) or original(*a)
    try:
        logps, grads = _run(pm, batch)
    finally:
        fused_lora._MergedLoRALinear.apply = original
    assert len(calls) >= 14  # every projection went through the fused path
    pm.train()  # transformers' activation checkpointing (non-reentrant) recomputes the fused forward
    pm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    pm.enable_input_require_grads()
    checkpointed = _run(pm, batch, share_prompt=False)  # (checkpointed layers drop the cache a shared prompt hands on)
    for got, want in ((logps, ref_logps), (checkpointed[0], ref_logps)):
        assert torch.allclose(got, want, atol=1e-5)
    for g in (grads, checkpointed[1]):
        assert g.keys() == ref_grads.keys() and len(g) == 2 * 7 * 2
        for n in g:  # float32 sums in another order
            assert (g[n] - ref_grads[n]).norm() <= 1e-5 * ref_grads[n].norm(), n


def test_fused_projection_steps_aside_for_a_disabled_a_switched_or_a_bf16_adapter(tiny):
    _, tok = tiny
    pm, batch = _qwen2(tok), _batch(tok)
    pm.add_adapter("other", copy.deepcopy(pm.peft_config["default"]))
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if ".other." in n and "lora_B" in n:
                p.normal_(0, 0.05)
    pm.eval()
    ids = batch.input_ids

    def logits():
        with torch.no_grad():
            return pm(input_ids=ids).logits

    expected = {}
    with pm.disable_adapter():
        expected["disabled"] = logits()
    expected["default"] = logits()
    pm.set_adapter("other")
    expected["other"] = logits()
    pm.set_adapter("default")
    fuse_lora(pm)
    with pm.disable_adapter():  # the reference model: no adapter at all
        assert torch.equal(logits(), expected["disabled"])
    assert torch.allclose(logits(), expected["default"], atol=1e-5)
    pm.set_adapter("other")  # another adapter (a separate critic's) is the one applied
    assert torch.allclose(logits(), expected["other"], atol=1e-5)
    pm.set_adapter("default")
    copied = copy.deepcopy(pm)  # the fused forward is bound to the copy's own layers
    with torch.no_grad():
        for n, p in copied.named_parameters():
            if "lora_B" in n:
                p.zero_()
    with torch.no_grad():
        assert torch.allclose(copied(input_ids=ids).logits, expected["disabled"], atol=1e-5)
    assert torch.allclose(logits(), expected["default"], atol=1e-5)

    bias = pm.get_base_model().model.layers[0].self_attn.q_proj.base_layer.bias
    bias.requires_grad_(True)  # a trainable base bias gets its gradient (peft's path, not a silent None)
    pm(input_ids=ids).logits.float().pow(2).mean().backward()
    assert bias.grad is not None and bias.grad.abs().sum() > 0
    bias.requires_grad_(False)

    half = pm.to(torch.bfloat16)  # bf16 weights, bf16 adapters: fused; then float32 adapters: peft's path
    with torch.no_grad():
        fused_bf16 = half(input_ids=ids).logits
        for n, p in half.named_parameters():
            if "lora_" in n:
                p.data = p.data.float()
        mixed = half(input_ids=ids).logits
        _peft_only(half)
        assert torch.equal(half(input_ids=ids).logits, mixed)  # the mixed-dtype case ran peft's own forward
    assert fused_bf16.dtype == torch.bfloat16 and torch.isfinite(fused_bf16).all()
