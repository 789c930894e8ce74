"""The committed default model and tokenizer: offline loading, chat template, generation, the card."""

import json

import pytest
import torch

from docuchat_rl.config import DEFAULT_SYSTEM_PROMPT, load_config
from docuchat_rl.data import render_prompt
from docuchat_rl.modeling import pick_dtype
from docuchat_rl.sampling.generation import generate

from .conftest import MODEL, with_lora


def test_loads_offline_with_plain_auto_classes():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(MODEL, local_files_only=True)
    assert model.config.model_type == "llama"
    assert 1e6 < sum(p.numel() for p in model.parameters()) < 1e7  # "a few million"
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|pad|>"


def test_chat_template_renders_system_user_and_generation_prompt(tiny):
    _, tok = tiny
    text = render_prompt(tok, "What is 2 + 2?", DEFAULT_SYSTEM_PROMPT)
    assert text == (f"<|im_start|>system\n{DEFAULT_SYSTEM_PROMPT}<|im_end|>\n"
                    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n")


def test_reasoning_tags_are_single_ordinary_tokens(tiny):
    _, tok = tiny
    for tag in ("<think>", "</think>", "<answer>", "</answer>"):
        ids = tok(tag, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1
        assert tok.decode(ids, skip_special_tokens=True) == tag  # TRL decodes like this
    assert tok.decode(tok("<|im_end|>")["input_ids"], skip_special_tokens=True) == ""
    assert tok.convert_ids_to_tokens(tok("2025", add_special_tokens=False)["input_ids"]) == list("2025")


def test_generates_the_reasoning_format_greedily(tiny):
    model, tok = tiny
    prompt = render_prompt(tok, "Ava has 3 apples. Ava buys 4 more apples. How many apples does Ava "
                                "have now?", DEFAULT_SYSTEM_PROMPT)
    gen = generate(model, tok, [prompt], max_new_tokens=64, do_sample=False)
    text = tok.decode(gen.completion_ids[0], skip_special_tokens=True)
    assert text.startswith("<think>") and "</think>" in text and text.rstrip().endswith("</answer>")
    assert not gen.truncated[0] and gen.completion_ids[0][-1] == tok.eos_token_id


def test_dtype_choice():
    assert pick_dtype("auto", torch.device("cpu")) == torch.float32
    assert pick_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    assert pick_dtype("bf16-mixed", torch.device("cpu")) == torch.bfloat16  # (weights; compute_context does the rest)


def _logits_in(dtype: str, ids: torch.Tensor) -> tuple[torch.nn.Module, torch.Tensor, torch.dtype]:
    """(the model loaded in `dtype`, its logits of ids, the dtype of the residual stream entering layer 0)."""
    from docuchat_rl.modeling import compute_context, load_model_and_tokenizer

    model, _ = load_model_and_tokenizer(str(MODEL), dtype, "cpu")
    seen = []

    def stream(module, args, kwargs):
        seen.append((args[0] if args else kwargs["hidden_states"]).dtype)

    model.model.layers[0].register_forward_pre_hook(stream, with_kwargs=True)
    with torch.no_grad(), compute_context(model):
        return model, model(input_ids=ids).logits, seen[0]


def test_bf16_mixed_keeps_the_residual_stream_and_the_logits_in_float32():
    """bf16-mixed: bfloat16 weights, float32 embeddings' output (the residual stream) and float32 logits from a
    float32 copy of the tied head: closer to the float32 model than plain bfloat16, the tie kept."""
    ids = torch.tensor([[5, 17, 40, 99, 3, 8, 21, 60, 7, 250, 31, 12] * 4])
    _, ref, _ = _logits_in("float32", ids)
    _, plain, plain_stream = _logits_in("bfloat16", ids)
    mixed_model, mixed, mixed_stream = _logits_in("bf16-mixed", ids)
    assert mixed.dtype == torch.float32 and plain.dtype == torch.bfloat16
    assert mixed_stream == torch.float32 and plain_stream == torch.bfloat16
    assert mixed_model.model.embed_tokens.weight.dtype == torch.bfloat16  # weights stay bfloat16
    assert mixed_model.lm_head.weight is mixed_model.model.embed_tokens.weight  # still tied, saved as before
    assert "lm_head.weight" in mixed_model.state_dict() and "lm_head.weight32" not in mixed_model.state_dict()
    err_plain = (plain.float().log_softmax(-1) - ref.log_softmax(-1)).abs().mean()
    err_mixed = (mixed.log_softmax(-1) - ref.log_softmax(-1)).abs().mean()
    # measured: 0.017 against 0.027 nats (a bfloat16 head alone: 0.024)
    assert err_mixed < 0.75 * err_plain, (err_mixed, err_plain)


def test_the_float32_head_gives_float32_logits_and_a_bfloat16_input_gradient():
    """bf16-mixed's output head: logits equal a float32 multiply by the (bfloat16) weight; the hidden states'
    gradient runs through the bfloat16 weight (0.4% rounding, like every backward matmul under autocast);
    a head whose weight trains gets its gradient; LoRA on the head is refused in one line."""
    from docuchat_rl.config import LoraConfig
    from docuchat_rl.errors import ModelError
    from docuchat_rl.modeling import Float32Head, build_lora

    torch.manual_seed(0)
    linear = torch.nn.Linear(16, 50, bias=False).to(torch.bfloat16).requires_grad_(False)  # frozen, as in LoRA
    head = Float32Head(linear)
    x = torch.randn(3, 16, requires_grad=True)
    g = torch.randn(3, 50)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = head(x)
    assert logits.dtype == torch.float32
    assert torch.equal(logits, x.detach() @ linear.weight.float().T)
    logits.backward(g)
    exact = g @ linear.weight.float()
    assert (x.grad - exact).norm() < 1e-2 * exact.norm() and not torch.equal(x.grad, exact)
    linear.weight.requires_grad_(True)
    head(x).backward(g)
    assert linear.weight.grad is not None and linear.weight.grad.abs().sum() > 0
    model, _ = _logits_in("bf16-mixed", torch.tensor([[5, 17]]))[:2]
    with pytest.raises(ModelError, match="names the output head, which model.dtype bf16-mixed computes"):
        build_lora(model, LoraConfig(target_modules=["q_proj", "lm_head"]))


def test_bf16_mixed_trains_float32_lora_weights_and_samples_what_it_scores():
    """LoRA on a bf16-mixed model: float32 adapters that get gradients (the base none), and a sampler whose
    log-probs are nearer the trainer's than plain bfloat16's."""
    from docuchat_rl.config import LoraConfig
    from docuchat_rl.learning.batch import build_batch
    from docuchat_rl.learning.forward import policy_forward
    from docuchat_rl.modeling import build_lora, load_model_and_tokenizer

    gaps = {}
    for dtype in ("bfloat16", "bf16-mixed"):
        model, tok = load_model_and_tokenizer(str(MODEL), dtype, "cpu")
        pm = build_lora(model, LoraConfig(r=4, alpha=8))
        prompts = [render_prompt(tok, q, DEFAULT_SYSTEM_PROMPT) for q in ("Ava has 3 apples. Ava buys 4 more apples. "
                                                                            "How many apples does Ava have now?",)]
        gen = generate(pm, tok, prompts, max_new_tokens=24, do_sample=True, num_return_sequences=4,
                       row_seeds=[11, 12, 13, 14])
        batch = build_batch(gen.prompt_ids, gen.completion_ids, [0.0] * 4, [0] * 4, tok.pad_token_id,
                            sampler_logps=gen.logps)
        out = policy_forward(pm, batch, share_prompt=True)
        gaps[dtype] = float(((out.logps.detach() - batch.sampler_logps).abs() * batch.completion_mask).sum()
                            / batch.completion_mask.sum())
        (out.logps * batch.completion_mask).sum().backward()
        lora = [p for n, p in pm.named_parameters() if "lora_B" in n]
        assert lora and all(p.dtype == torch.float32 and p.grad is not None and p.grad.abs().sum() > 0 for p in lora)
        assert all(p.grad is None for n, p in pm.named_parameters() if "lora_" not in n)
    assert gaps["bf16-mixed"] < gaps["bfloat16"], gaps


@pytest.mark.slow
def test_card_accuracy_is_in_band_and_re_measures_within_3_points(tiny):
    from docuchat_rl.evaluation import evaluate

    card = json.loads((MODEL / "card.json").read_text())
    claimed = card["heldout"]["greedy_accuracy"]
    assert 0.20 <= claimed <= 0.60 and card["heldout"]["format_rate"] >= 0.8
    cfg = load_config(None, ["eval.max_new_tokens=96", "eval.batch_size=256"])
    result = evaluate(tiny[0], tiny[1], cfg)  # math-verify correctness on all 500 held-out rows
    assert result["rows"] == card["heldout"]["rows"] == 500
    assert abs(result["accuracy"] - claimed) <= 0.03, (result["accuracy"], claimed)


@pytest.mark.slow
def test_card_answer_only_habit_re_measures(tiny):
    """The card's claim that RL has a habit to train away: most 3-4-step problems answered without working."""
    from docuchat_rl.synthetic import make_task

    model, tok = tiny
    by = json.loads((MODEL / "card.json").read_text())["heldout"]["by_steps"]
    assert by["2"]["answer_only_rate"] < 0.5 <= min(by["3"]["answer_only_rate"], by["4"]["answer_only_rate"])
    test = make_task(1234)["test"]
    prompts = [render_prompt(tok, p.question, DEFAULT_SYSTEM_PROMPT) for p in test]
    gen = generate(model, tok, prompts, max_new_tokens=96, do_sample=False, batch_size=256)
    texts = tok.batch_decode(gen.completion_ids, skip_special_tokens=True)
    for k in ("2", "3", "4"):
        rows = [t for p, t in zip(test, texts) if p.answer.count("<<") == int(k)]
        bare = sum(t.replace("\n", "").startswith("<think></think>") for t in rows) / len(rows)
        assert len(rows) == by[k]["rows"] and abs(bare - by[k]["answer_only_rate"]) <= 0.05, (k, bare, by[k])


def _lora(model):
    return with_lora(model, "all-linear", r=8, alpha=16)


def _three_ways(pm) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A peft model's logits of one short row: with its adapter as peft runs it, with the adapter off, and
    inside `merged_adapter`."""
    from docuchat_rl.modeling import merged_adapter

    ids = torch.tensor([[5, 17, 40, 99, 3]])
    with torch.no_grad():
        unmerged = pm(input_ids=ids).logits
        with pm.disable_adapter():
            base = pm(input_ids=ids).logits
        with merged_adapter(pm):
            return unmerged, base, pm(input_ids=ids).logits


def test_merged_adapter_gives_the_adapter_outputs_and_restores_weights_bit_for_bit():
    from transformers import AutoModelForCausalLM

    pm = _lora(AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32))
    before = {n: p.detach().clone() for n, p in pm.named_parameters()}
    unmerged, base, merged = _three_ways(pm)
    assert not torch.allclose(unmerged, base, atol=1e-3)  # the adapter matters
    assert torch.allclose(merged, unmerged, atol=1e-4)  # and the merged weights carry it
    after = dict(pm.named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in before)  # no drift, not even rounding
    assert pm.base_model.model.model.layers[0].self_attn.q_proj.disable_adapters is False


def test_the_sampled_merged_weight_is_the_one_the_fused_update_multiplies_by():
    """At a scaling that is no power of two (alpha 3, r 4: 0.75), the rollout's merged weight is, bit for bit,
    the weight the fused LoRA forward builds for the update (learning/fused_lora.py), so the sampler and the
    update multiply by the same numbers; the same projection's output agrees bit for bit too."""
    from transformers import AutoModelForCausalLM

    from docuchat_rl.learning.fused_lora import fuse_lora
    from docuchat_rl.modeling import merged_adapter

    pm = with_lora(AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32), "all-linear", r=4, alpha=3)
    torch.manual_seed(0)
    for n, p in pm.named_parameters():
        if "lora_" in n:
            p.data.normal_(0, 0.05)
    assert fuse_lora(pm) > 0
    layer = pm.base_model.model.model.layers[1].mlp.down_proj
    x = torch.randn(6, layer.in_features)
    with torch.no_grad():
        trained = layer(x)  # the fused forward: F.linear(x, addmm(W, B, A, alpha=s))
        with merged_adapter(pm):
            merged = layer.get_base_layer().weight
            sampled = torch.nn.functional.linear(x, merged)
    assert layer.scaling["default"] == 0.75
    assert torch.equal(merged, torch.addmm(layer.base_layer.weight, layer.lora_B["default"].weight,
                                           layer.lora_A["default"].weight, alpha=0.75))
    assert torch.equal(sampled, trained)


def test_merged_adapter_leaves_a_layer_the_active_adapter_does_not_cover_as_it_is():
    """Two adapters on different layers, the second active: the first one's layers hold no active adapter, and
    the merge leaves their weights as they are (it added an empty sum before, and failed); the logits are the
    unmerged model's."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    pm = with_lora(AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32), ["q_proj"], r=4, alpha=8)
    pm.add_adapter("other", LoraConfig(r=4, lora_alpha=8, target_modules=["v_proj"], init_lora_weights=False))
    pm.set_adapter("other")
    unmerged, base, merged = _three_ways(pm)
    assert not torch.allclose(unmerged, base, atol=1e-3)  # the active adapter matters
    torch.testing.assert_close(merged, unmerged, atol=1e-4, rtol=1e-4)


def test_merged_adapter_restores_after_an_error_and_ignores_plain_models(tiny):
    from transformers import AutoModelForCausalLM

    from docuchat_rl.modeling import merged_adapter

    pm = _lora(AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32))
    before = {n: p.detach().clone() for n, p in pm.named_parameters()}
    with pytest.raises(RuntimeError), merged_adapter(pm):
        raise RuntimeError("generation failed")
    assert all(torch.equal(before[n], p) for n, p in pm.named_parameters())
    model, _ = tiny
    with merged_adapter(model) as m:  # not a peft model: a no-op
        assert m is model


def test_merged_adapter_never_changes_a_tied_embedding():
    """LoRA on a tied lm_head (the default model and Qwen2.5-0.5B tie it to the input embedding): the merged
    rollout must give the adapter's logits, with the embedding untouched by the lm_head's delta."""
    from transformers import AutoModelForCausalLM

    from docuchat_rl.modeling import merged_adapter

    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    pm = with_lora(model, ["q_proj", "lm_head"], r=8, alpha=16)
    ids = torch.tensor([[5, 17, 40, 99, 3]])
    with torch.no_grad():
        unmerged = pm(input_ids=ids).logits
        with merged_adapter(pm):
            merged = pm(input_ids=ids).logits
    assert (merged.log_softmax(-1) - unmerged.log_softmax(-1)).abs().max() < 1e-4


def _dropout_models(tok):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=4, n_positions=256,
                                      resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1))
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         attention_dropout=0.3, max_position_embeddings=256))
    return {"gpt2": gpt2, "llama": llama}


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_disable_dropout_makes_train_mode_score_what_eval_mode_sampled(tiny, arch):
    """GPT-2 ships dropout 0.1 (modules), Llama-family configs an attention_dropout float: in train mode
    either makes the update score another function than the rollout sampled, unless turned off."""
    from docuchat_rl.modeling import disable_dropout

    _, tok = tiny
    model = _dropout_models(tok)[arch]
    ids = torch.tensor([[5, 17, 40, 99, 3, 8, 21, 60]])

    def logps(train: bool):
        model.train(train)
        with torch.no_grad():
            return model(input_ids=ids).logits.log_softmax(-1)

    assert (logps(True) - logps(False)).abs().max() > 1e-3  # dropout is really on in train mode
    assert disable_dropout(model) > 0
    assert torch.allclose(logps(True), logps(False), atol=1e-6)


def test_a_bad_model_path_is_one_line_naming_the_key(tmp_path):
    from docuchat_rl.errors import ModelError
    from docuchat_rl.modeling import load_model_and_tokenizer

    for name in (str(tmp_path / "no-such-model"), "./data/modle"):
        with pytest.raises(ModelError, match=r"model.name_or_path .* could not be loaded: tried a local folder") as e:
            load_model_and_tokenizer(name, device="cpu")
        assert "\n" not in str(e.value) and name in str(e.value)


def test_a_stop_token_that_is_not_one_token_is_one_line_naming_the_key():
    from docuchat_rl.errors import ModelError
    from docuchat_rl.modeling import eos_ids, load_model_and_tokenizer

    model, tok = load_model_and_tokenizer(str(MODEL), "float32", "cpu", stop_tokens=["\n"])
    newline = tok.encode("\n", add_special_tokens=False)
    assert len(newline) == 1 and eos_ids(model, tok) == [tok.eos_token_id, *newline]
    text = "Question:"
    assert len(tok.encode(text, add_special_tokens=False)) > 1
    with pytest.raises(ModelError, match=r"model.stop_tokens: 'Question:' is \d+ tokens of this tokenizer") as e:
        load_model_and_tokenizer(str(MODEL), "float32", "cpu", stop_tokens=["\n", text])
    assert "\n" not in str(e.value)


def test_lora_target_modules_that_match_nothing_are_one_line_listing_the_linear_layers():
    from transformers import AutoModelForCausalLM

    from docuchat_rl.config import LoraConfig
    from docuchat_rl.errors import ModelError
    from docuchat_rl.modeling import build_lora

    model = AutoModelForCausalLM.from_pretrained(MODEL)
    with pytest.raises(ModelError, match=r"lora.target_modules \['qkv'\] matches no module of the model; its "
                                         r"linear layers are: down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, "
                                         r"v_proj") as e:
        build_lora(model, LoraConfig(target_modules=["qkv"]))
    assert "\n" not in str(e.value)



def _saved_bytes_and_grads(autocast: bool, ids: torch.Tensor):
    """A LoRA'd tiny Qwen2 in bfloat16 (float32 adapters, as peft keeps them): the bytes autograd keeps for
    the backward of a log-prob loss (each storage once), the adapters' gradients, their dtypes."""
    import transformers as tf

    from docuchat_rl.config import LoraConfig
    from docuchat_rl.modeling import build_lora, compute_context, enable_autocast

    torch.manual_seed(0)
    model = tf.Qwen2ForCausalLM(tf.Qwen2Config(vocab_size=int(ids.max()) + 1, hidden_size=128, intermediate_size=352,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                               tie_word_embeddings=True)).to(torch.bfloat16)
    model = build_lora(enable_autocast(model) if autocast else model, LoraConfig(r=16, alpha=32))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)  # (as after training: B = 0 would give A no gradient)
    saved = {}

    def pack(t):
        saved[(t.untyped_storage().data_ptr(), t.dtype, tuple(t.shape))] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), compute_context(model):
        logits = model(input_ids=ids).logits  # [B, L, V]
        loss = logits.float().log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None]).mean()
    loss.backward()
    trained = [p for p in model.parameters() if p.requires_grad]
    return sum(saved.values()), torch.cat([p.grad.flatten() for p in trained]), {p.dtype for p in trained}


def test_bf16_autocast_keeps_fewer_bytes_for_the_backward_and_the_same_gradients(tiny):
    """model.dtype bf16-autocast (TRL's bf16 training): float32 adapters over bfloat16 weights, the forward
    under autocast. Without autocast peft casts each adapted layer's input to float32 and autograd keeps that
    copy; with it the saved bytes drop (measured 1.27x on this model) and the adapters' gradients stay within
    bfloat16 rounding of plain bfloat16's (measured 0.9% apart)."""
    _, tok = tiny
    ids = torch.randint(0, len(tok), (4, 96), generator=torch.Generator().manual_seed(0))  # [B, L]
    plain_bytes, plain_grads, plain_dtypes = _saved_bytes_and_grads(False, ids)
    auto_bytes, auto_grads, auto_dtypes = _saved_bytes_and_grads(True, ids)
    assert plain_dtypes == auto_dtypes == {torch.float32}  # the adapters (and so Adam's state) in float32
    assert plain_bytes > 1.2 * auto_bytes, (plain_bytes, auto_bytes)
    assert (plain_grads - auto_grads).norm() < 0.03 * plain_grads.norm()
    assert not torch.equal(plain_grads, auto_grads)  # (the adapters' matmuls really ran in bfloat16)


def test_bf16_autocast_loads_and_samples_under_autocast():
    from docuchat_rl.modeling import compute_context, load_model_and_tokenizer

    model, tok = load_model_and_tokenizer(str(MODEL), dtype="bf16-autocast", device="cpu")
    assert next(model.parameters()).dtype == torch.bfloat16
    with compute_context(model):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    out = generate(model, tok, ["<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"],
                   max_new_tokens=8, do_sample=False)
    assert len(out.completion_ids[0]) > 0 and all(-1e9 < x <= 0 for x in out.logps[0])
