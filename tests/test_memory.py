"""memory.TensorBytes: the bytes of the tensors alive, per phase, on a real model's load, forward and backward."""

import pytest
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


def test_the_rollout_is_sized_by_hand_computed_bytes():
    """A Qwen2.5-0.5B shape in bfloat16 (24 layers, 2 key/value heads of 64, 151,936 tokens): 24 x 2 x 2 x 64 x 2 =
    12,288 bytes a position; a row at 4,096 positions 48 MiB of keys and values and 1.16 MiB of logits; 8 GiB
    free holds 4 GiB of rows, 83 of them, 80 in whole groups of 8; a 7B shape's (28 layers, 4 heads of 128) 57,344
    bytes a position: 256 rows at 4,096 positions ask for 56 GiB (the issue's figure)."""
    import transformers as tf

    from docuchat_rl.memory import bytes_per_position, bytes_per_row, rows_that_fit

    def shape(**kw):
        with torch.device("meta"):
            return tf.Qwen2ForCausalLM(tf.Qwen2Config(**kw)).to(torch.bfloat16)

    small = shape(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                  intermediate_size=4864, vocab_size=151936)
    assert bytes_per_position(small) == 24 * 2 * 2 * 64 * 2 == 12288
    per_row = bytes_per_row(small, 4096)
    assert per_row == 12288 * 4096 + 8 * 151936
    assert rows_that_fit(8 * 2**30, per_row, cap=256, group=8) == (4 * 2**30 // per_row) // 8 * 8 == 80
    large = shape(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                  intermediate_size=18944, vocab_size=152064)
    assert bytes_per_position(large) == 28 * 2 * 4 * 128 * 2 == 57344
    assert round(256 * bytes_per_position(large) * 4096 / 2**30) == 56


def test_a_rollout_no_group_of_fits_is_refused_in_one_line_before_it_is_allocated(tmp_path):
    from docuchat_rl.config import load_config
    from docuchat_rl.errors import TrainingError
    from docuchat_rl.trainer import Trainer

    cfg = load_config(None, [f"run.output_dir={tmp_path / 'r'}", "rollout.prompts_per_step=1",
                             "rollout.num_generations=65536", "rollout.max_new_tokens=300", "eval.before_and_after=false"])
    with pytest.raises(TrainingError, match=r"^rollout.generation_batch_size auto: a group of 65536 rows at \d+ "
                                            r"positions needs [\d.]+ GiB .*lower rollout.num_generations") as e:
        Trainer(cfg)
    assert "\n" not in str(e.value) and not (tmp_path / "r").exists()
