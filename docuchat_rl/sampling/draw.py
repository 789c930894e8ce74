"""The draw: one token per row from its own uniform, through the inverse CDF of the sampler's distribution,
without a scan or a normalised float64 copy of the whole vocabulary (`block_draw`). Shared by every engine
of ours (the dynamic loop, the static step inside CUDA graphs, transformers.generate's processor), so that
each draws the same token from the same uniform.

Deliberately left out: Gumbel-max and `torch.multinomial` (a random number per vocabulary entry, and no
uniform a replay can hand back).
"""

from __future__ import annotations

import torch

DRAW_BLOCK = 1024  # vocabulary entries per block of the draw's two-level CDF (a few hundred blocks for 150k)


def block_draw(logits: torch.Tensor, u: torch.Tensor, block: int = DRAW_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(the token each uniform draws [R, 1], its log-prob [R, 1] float32) from logits [R, V] (any constant
    per row added; removed tokens at -inf) and u [R, 1] in [0, 1) float64: the first token whose cumulative
    probability exceeds u, as the inverse CDF over the whole vocabulary in float64 draws it.

    Why not that CDF itself: a float64 softmax and a float64 cumulative sum over [R, V] cost more than all
    of a layer's matmuls on a GPU (round 3's profile: 20% of a decoded token, the scan 60% of that), and
    float32 cannot hold it (near 1 its step is 6e-8: a 150k vocabulary's tail tokens would get empty or
    one-ulp intervals; float32 exponentials move the boundaries by ~1e-6: tried, they drew another token
    once in 36,864 draws at V = 49,152). Each row needs one block of the CDF: the float64 exponentials' sums per block (one
    reduction over the vocabulary, no scan, no normalised copy), the block its target falls in, then that
    block's own cumulative sum in float64 from the sums before it. The numbers are the whole CDF's, summed
    in another order (a difference in the last of float64's bits), so the draws are its draws
    (tests/test_generation.py checks them against it). Fixed shapes and no host reads: it runs inside a
    CUDA graph.

    >>> logits, u = torch.tensor([[0.0, float("-inf"), 0.0]]), torch.tensor([[0.2], [0.7]], dtype=torch.float64)
    >>> [block_draw(logits, u[i:i + 1], block=2)[0].item() for i in range(2)]
    [0, 2]
    """
    r, v = logits.shape
    nb = -(-v // block)
    top = logits.amax(-1, keepdim=True).double()  # [R, 1]
    if nb == 1:  # one block (a small vocabulary): the draw below without its block-level steps
        return _one_block(logits, top, u)
    x = logits if nb * block == v else torch.nn.functional.pad(logits, (0, nb * block - v), value=float("-inf"))
    sums = (x.view(r, nb, block).double() - top[:, :, None]).exp().sum(-1)  # [R, nb] float64 block sums
    cum = sums.cumsum(-1)  # [R, nb]
    target = u * cum[:, -1:]  # [R, 1]
    b = torch.searchsorted(cum, target, right=True).clamp_(max=nb - 1)  # [R, 1] the block the target is in
    before = torch.where(b > 0, cum.gather(-1, (b - 1).clamp(min=0)), 0.0)  # [R, 1] the blocks before it
    inside = (x.gather(-1, b * block + torch.arange(block, device=x.device)).double() - top).exp()  # [R, block]
    j = torch.searchsorted(inside.cumsum(-1) + before, target, right=True)  # [R, 1]
    # (the block's sum above and its cumulative sum here may differ in the last bit: a target past the block's
    # end by that rounding takes its last token with a probability, never a zero-probability one)
    last = torch.where(inside > 0, torch.arange(block, device=x.device), -1).amax(-1, keepdim=True)  # [R, 1]
    token = b * block + torch.minimum(j, last)  # [R, 1]
    logp = ((logits.gather(-1, token).double() - top) - cum[:, -1:].log()).float()  # [R, 1]
    return token, logp


def _one_block(logits: torch.Tensor, top: torch.Tensor, u: torch.Tensor):
    """`block_draw` over a vocabulary of one block (logits [R, V], V <= the block): the exponentials once,
    where the two-level draw takes them twice (the block sums, then the block the target is in), over the
    vocabulary itself (no padding), and no search for the block. tests/test_generation.py checks its draws
    against the whole float64 CDF's."""
    inside = (logits.double() - top).exp()  # [R, V] float64
    total = inside.sum(-1, keepdim=True)  # [R, 1]
    j = torch.searchsorted(inside.cumsum(-1), u * total, right=True)  # [R, 1]
    # (a target past the sum's end by rounding takes the last possible token, as the two-level draw does)
    last = torch.where(inside > 0, torch.arange(logits.shape[-1], device=logits.device), -1).amax(-1, keepdim=True)
    token = torch.minimum(j, last)  # [R, 1]
    logp = ((logits.gather(-1, token).double() - top) - total.log()).float()  # [R, 1]
    return token, logp
