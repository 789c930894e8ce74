"""memory.TensorBytes: the bytes of the tensors alive, per phase, on a real model's load, forward and backward."""

import torch

from docuchat_rl.memory import TensorBytes

from .conftest import MODEL


def _param_bytes(model) -> int:
    return sum(p.untyped_storage().nbytes() for p in {p.untyped_storage().data_ptr(): p
                                                       for p in model.parameters()}.values())


def test_weights_loaded_from_a_file_are_counted_and_freed():
    """A model loaded inside the count holds at least its parameters' bytes (whether or not an operation made
    them), and deleting it gives them back."""
    from docuchat_rl.modeling import load_model_and_tokenizer

    with TensorBytes() as held:
        before = held.now
        model, _ = load_model_and_tokenizer(str(MODEL), dtype="float32", device="cpu")
        held.phase("loaded")
        weights = _param_bytes(model)
        assert held.now - before >= weights
        del model
        import gc

        gc.collect()
    assert held.now - before < weights / 10


def test_a_forward_and_backward_peak_counts_the_logits_and_the_activations(tiny):
    """The forward's phase peak holds at least the [B, T, V] float32 logits; the backward's more than the forward's
    end (gradients beside the activations); once outputs and gradients are dropped, what was alive before."""
    model, _ = tiny
    ids = torch.randint(5, 500, (4, 32))  # [B, T]
    with TensorBytes() as held:
        before = held.now
        held.phase("forward")
        logits = model(input_ids=ids).logits  # [4, 32, V]
        after_forward = held.now
        assert held.peaks["forward"] - before >= logits.numel() * 4
        held.phase("backward")
        logits.float().logsumexp(-1).sum().backward()
        assert held.peaks["backward"] - before > logits.numel() * 4
        del logits
        model.zero_grad(set_to_none=True)
    assert held.now == before
    assert after_forward > before
