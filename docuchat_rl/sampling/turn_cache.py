"""Keys and values kept between the turns of a multi-turn rollout, so a later turn prefills only its new tokens.

A conversation's next turn continues token ids this process has just sampled: its prompt, its earlier turns,
the tool results appended since. Prefilled whole at every turn, the calculator recipe's step spent most of its
rollout running the model over tokens it had already run (docs/tools.md). Here, while a `TurnCache` is open
(multiturn.MultiTurn.sample opens one for its rows), the fast decode loop hands back each row's keys/values
when the row stops decoding: its prompt's and those of every completion token it fed (all but the last
sampled one), keyed by those token ids. The next call that continues a row (`generate` with token-id prompts)
takes the longest kept prefix of each prompt and runs the model over the rest only: the last sampled token
and the tool result's tokens. The rows of one call go through one forward however their kept lengths
differ: kept keys are left-padded to the longest, new tokens left-padded after them, the attention mask has
zeros over both paddings, and positions count real tokens only, so each row attends exactly its own
conversation at its own positions (test: the same tokens and log-probs within 1e-5 of a whole prefill).

This is vLLM's automatic prefix caching done per conversation for our own engine: hand-written because
transformers' caches are per batch (a `DynamicCache` cannot take rows out of one batch and into another with
other lengths), and vLLM's lives in its own engine. Entries live for one `MultiTurn.sample` call (the same
weights throughout) and are dropped as they are taken; a call that continues rows drops every other entry
(those rows ended at their last turn), so what is held is at most the step's rows' keys and values once each.

Deliberately left out (those prefill the whole conversation, as before): `transformers.generate` (rollout
engine hf), the static CUDA-graph decode (cuda_graphs), sharded generation (lockstep), and models whose cache
is not plain full attention (sliding windows, linear attention); sharing one prompt's keys between the G rows
of a group after the first turn (each row keeps its own copy).
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass

import torch

_OPEN: ContextVar[TurnCache | None] = ContextVar("docuchat_turn_cache", default=None)


@dataclass
class Kept:
    """One row's keys and values: per layer (keys, values), each [KV, length, D], for its first `length` ids."""

    length: int
    layers: list[tuple[torch.Tensor, torch.Tensor]]


class TurnCache:
    """The kept rows of one multi-turn sampling call, and what the calls under it prefilled."""

    def __init__(self, keep: bool = True):
        self.keep = keep  # False: nothing is kept (every turn prefilled whole); the counts are still taken
        self.entries: dict[tuple[int, ...], list[Kept]] = {}  # token ids -> their keys/values (one per row)
        self.prefilled = 0  # prompt tokens the model was run over
        self.reused = 0  # prompt tokens whose keys/values were taken from here instead

    def put(self, ids: list[int], layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Keep a row's keys/values for its token ids `ids` (each layer's [KV, len(ids), D])."""
        if self.keep and ids:
            self.entries.setdefault(tuple(ids), []).append(Kept(len(ids), layers))

    def take(self, ids: list[int]) -> Kept | None:
        """The longest kept prefix of `ids` shorter than `ids` (at least one token is left to prefill: the
        next logits come from it), removed from here; None when no kept row starts `ids`."""
        for n in sorted({len(k) for k in self.entries if len(k) < len(ids)}, reverse=True):
            rows = self.entries.get(tuple(ids[:n]))
            if rows:
                kept = rows.pop()
                if not rows:
                    del self.entries[tuple(ids[:n])]
                return kept
        return None


def open_cache() -> TurnCache | None:
    """The cache of the multi-turn call this thread is in (None outside one)."""
    return _OPEN.get()


@contextlib.contextmanager
def turn_cache(keep: bool = True):
    """Keep keys/values between the turns sampled inside the block (`keep` False: count prefill tokens only);
    yields the TurnCache, whose counts the block's caller reads after."""
    cache = TurnCache(keep)
    token = _OPEN.set(cache)
    try:
        yield cache
    finally:
        _OPEN.reset(token)
        cache.entries.clear()
