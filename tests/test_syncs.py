"""Host syncs: reading a tensor back into Python (`item`, `int`, `float`, `bool`, `tolist`) waits for the
device. The decode loop reads at most once every few tokens whatever the number of layers, and the update
a fixed number of times per optimizer step whatever the number of micro-batches. Counted by wrapping the
conversions of torch.Tensor (`diagnostics.count_host_reads`; on a CPU they cost nothing, but each is a
full stop on a GPU).

Library conversions in the update are not ours to remove and are left out of its count: transformers'
mask code asks `padding_mask.all()` once per forward (to skip building a mask), and torch's Adam reads
its step counter, a CPU tensor, with `item()` (no device sync)."""

import torch

from docuchat_rl.diagnostics import count_host_reads
from docuchat_rl.sampling.generation import DONE_CHECK_EVERY, generate

from .conftest import MODEL


def _llama(tok, layers):
    import transformers as tf

    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                              num_hidden_layers=layers, num_attention_heads=4,
                                              max_position_embeddings=512)).eval()


def _decode_conversions(model, tok, tokens):
    prompts = ["What is 2 + 2?", "Ben has 5 coins. Ben loses 2 coins. How many coins does Ben have now?"]
    with count_host_reads() as reads:
        generate(model, tok, prompts, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=True,
                 num_return_sequences=2, row_seeds=list(range(4)))
    return reads.all


def test_decode_conversions_per_token_do_not_grow_with_layers_or_tokens(tiny):
    _, tok = tiny
    counts = {}
    for layers in (2, 24):
        model = _llama(tok, layers)
        short, long = _decode_conversions(model, tok, 16), _decode_conversions(model, tok, 48)
        counts[layers] = (long - short) / 32  # per decoded token, set-up and read-out cancelled
    assert counts[2] == counts[24], counts  # nothing per layer
    assert counts[24] <= 1 / DONE_CHECK_EVERY, counts  # the all-done check, every few tokens


def test_update_conversions_do_not_grow_with_micro_batches(tmp_path):
    from docuchat_rl.config import load_config
    from docuchat_rl.trainer import Timer, Trainer

    counts = {}
    for micro in (16, 2):  # 1 or 8 micro-batches per optimizer step
        cfg = load_config(MODEL.parent.parent / "config/default.yaml", [
            f"run.output_dir={tmp_path / str(micro)}", "rollout.prompts_per_step=2", "rollout.num_generations=8",
            "rollout.max_new_tokens=16", "logging.progress=false", "eval.before_and_after=false",
            f"optim.micro_batch_size={micro}", "algorithm.num_iterations=2"])
        t = Trainer(cfg)
        batch = t.prepare(t.collect(Timer()))
        t.advantages(batch, Timer())
        with count_host_reads() as reads:
            t.update(batch, Timer())
        t.close()
        counts[micro] = reads.ours
    assert counts[2] == counts[16], counts
    assert counts[2] <= 2 * 2 + 2, counts  # per optimizer step the loss and the grad norm; the metrics once
