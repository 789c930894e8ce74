"""Learned reward models as reward components: a Hugging Face sequence-classification model scores
(prompt, completion) pairs, batched, on the training device, with the trace entry and fault isolation
of every other reward (the composite reward times it, records its errors, never lets it stop training).

It lives in the engine, not in `rewards/`, because it needs torch (imported on first call only); it
registers itself when the `docuchat_rl` package is imported, so `{name: reward_model, params: {model:
PATH}}` works in any recipe and `rewards` never names the engine.

Deliberately left out: pairwise (Bradley-Terry) comparison within a group and remote reward servers.
"""

from __future__ import annotations

from typing import Any

from rewards import Reward, RewardError, Score, register, text_of


@register("reward_model")
class RewardModel(Reward):
    """The logit of `label` from an `AutoModelForSequenceClassification` on the (prompt, completion)
    conversation, rendered with the reward model's own chat template when it has one (else prompt and
    completion joined by a newline). Unbounded: weight it to taste.

    params: model (folder or hub id, required), label (0), batch_size (16), max_length (1024: longer
    inputs are truncated from the left, keeping the completion's end), device (auto: the GPU when there
    is one), dtype (auto).

    >>> import tempfile, torch, transformers
    >>> tok = transformers.AutoTokenizer.from_pretrained("data/model")
    >>> cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
    ...                                num_attention_heads=2, num_labels=1, pad_token_id=tok.pad_token_id)
    >>> folder = tempfile.mkdtemp()
    >>> _ = torch.manual_seed(0); transformers.LlamaForSequenceClassification(cfg).save_pretrained(folder)
    >>> tok.save_pretrained(folder) and None
    >>> rm = RewardModel(model=folder)
    >>> s = rm.explain(["What is 2 + 2?"], ["<answer>4</answer>"])[0]
    >>> isinstance(s.value, float), s.info["model"] == folder
    (True, True)
    """

    low, high = float("-inf"), float("inf")

    def __init__(self, model: str | None = None, label: int = 0, batch_size: int = 16, max_length: int = 1024,
                 device: str = "auto", dtype: str = "auto"):
        if not model:
            raise RewardError("reward_model needs params.model: a sequence-classification model folder or hub id")
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from ..modeling import pick_device, pick_dtype

        self.model_name, self.label, self.batch_size, self.max_length = model, label, batch_size, max_length
        self.device = pick_device(device)
        try:
            self.tok = AutoTokenizer.from_pretrained(model)
            self.net = AutoModelForSequenceClassification.from_pretrained(
                model, dtype=pick_dtype(dtype, self.device)).to(self.device).eval()
        except (OSError, ValueError) as e:
            raise RewardError(f"reward_model: cannot load {model!r}: {str(e).strip().splitlines()[0]}") from None
        if self.tok.pad_token is None:
            self.tok.pad_token = self.tok.eos_token
        self.tok.truncation_side = "left"  # an over-long conversation keeps its completion's end
        if self.net.config.pad_token_id is None:
            self.net.config.pad_token_id = self.tok.pad_token_id
        if not 0 <= label < self.net.config.num_labels:
            raise RewardError(f"reward_model: label {label} is outside the model's {self.net.config.num_labels} labels")
        self._torch = torch

    def _text(self, prompt: str, completion: str) -> str:
        if getattr(self.tok, "chat_template", None):
            return self.tok.apply_chat_template([{"role": "user", "content": prompt},
                                                 {"role": "assistant", "content": completion}], tokenize=False)
        return f"{prompt}\n{completion}"

    def explain(self, prompts: list, completions: list, **columns: Any) -> list[Score]:
        if len(prompts) != len(completions):
            raise RewardError(f"{self.name}: {len(prompts)} prompts for {len(completions)} completions")
        texts = [self._text(text_of(p), text_of(c)) for p, c in zip(prompts, completions)]
        scores: list[Score] = []
        info = {"model": self.model_name, "label": self.label}
        for start in range(0, len(texts), self.batch_size):
            enc = self.tok(texts[start:start + self.batch_size], return_tensors="pt", padding=True, truncation=True,
                           max_length=self.max_length, add_special_tokens=False)
            with self._torch.no_grad():
                logits = self.net(**enc.to(self.device)).logits[:, self.label]  # [b]
            scores += [Score(float(v), dict(info)) for v in logits.float().tolist()]
        return scores
