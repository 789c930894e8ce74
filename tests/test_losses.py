"""Loss math against slow per-element reference loops and hand-computed values."""

import math

import pytest
import torch

from docuchat_rl.learning.losses import (
    Normalisers,
    aggregate,
    clipped_surrogate,
    k3_kl,
    log_ratio,
    token_entropy,
    token_logprobs,
)


def test_token_logprobs_match_log_softmax_gather():
    torch.manual_seed(0)
    logits, ids = torch.randn(3, 5, 11), torch.randint(0, 11, (3, 5))
    ref = torch.zeros(3, 5)
    for r in range(3):
        for t in range(5):
            ref[r, t] = torch.log_softmax(logits[r, t], -1)[ids[r, t]]
    assert torch.allclose(token_logprobs(logits, ids), ref, atol=1e-6)


def test_entropy_of_uniform_and_peaked():
    uniform = torch.zeros(1, 1, 8)
    assert token_entropy(uniform).item() == pytest.approx(math.log(8), abs=1e-6)
    peaked = torch.tensor([[[100.0, 0, 0, 0]]])
    assert token_entropy(peaked).item() == pytest.approx(0.0, abs=1e-6)


def test_k3_is_zero_when_equal_and_positive_otherwise():
    lp = torch.log(torch.tensor([[0.2, 0.5, 0.9]]))
    assert torch.all(k3_kl(lp, lp) == 0)
    ref = torch.log(torch.tensor([[0.4, 0.25, 0.6]]))
    kl = k3_kl(lp, ref)
    # hand: r = p_ref/p; k3 = r - log r - 1
    for j, (p, q) in enumerate([(0.2, 0.4), (0.5, 0.25), (0.9, 0.6)]):
        r = q / p
        assert kl[0, j].item() == pytest.approx(r - math.log(r) - 1, rel=1e-5)
        assert kl[0, j].item() > 0


def test_clipped_surrogate_hand_cases():
    # rho: 0.5 (below 1-0.2), 1.0, 1.5 (above 1+0.28); advantages of both signs
    log_rho = torch.log(torch.tensor([[0.5, 1.0, 1.5], [0.5, 1.0, 1.5]]))
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    loss, low, high = clipped_surrogate(log_rho, adv, 0.2, 0.28)
    # A>0: min(rho, clip(rho)) -> 0.5, 1.0, 1.28 ; A<0: -max(rho, clip) -> -0.8, -1.0, -1.5
    assert torch.allclose(-loss, torch.tensor([[0.5, 1.0, 1.28], [-0.8, -1.0, -1.5]]), atol=1e-6)
    assert low.tolist() == [[False, False, False], [True, False, False]]
    assert high.tolist() == [[False, False, True], [False, False, False]]


def test_clipped_gradient_vanishes_where_clipped():
    log_rho = torch.log(torch.tensor([[1.5, 1.1]])).requires_grad_()
    loss, _, _ = clipped_surrogate(log_rho, torch.ones(1, 2), 0.2, 0.2)
    loss.sum().backward()
    assert log_rho.grad[0, 0] == 0  # clipped: no push further up
    assert log_rho.grad[0, 1] != 0


def _reference_aggregate(per_token, mask, mode, norm):
    rows = []
    for r in range(per_token.shape[0]):
        vals = [per_token[r, t].item() for t in range(per_token.shape[1]) if mask[r, t] > 0]
        rows.append(vals)
    if mode == "grpo":
        return sum(sum(v) / max(len(v), 1) for v in rows) / norm.rows
    if mode == "dapo":
        return sum(sum(v) for v in rows) / norm.tokens
    if mode == "dr_grpo":
        return sum(sum(v) for v in rows) / (norm.rows * norm.max_new_tokens)
    raise AssertionError


@pytest.mark.parametrize("mode", ["grpo", "dapo", "dr_grpo"])
def test_aggregation_matches_reference_and_micro_batches_sum_to_the_minibatch(mode):
    torch.manual_seed(1)
    per_token = torch.randn(6, 7)
    mask = (torch.rand(6, 7) > 0.3).float()
    mask[:, 0] = 1
    norm = Normalisers(rows=6, tokens=float(mask.sum()), max_new_tokens=10)
    whole = aggregate(per_token, mask, mode, norm)
    assert whole.item() == pytest.approx(_reference_aggregate(per_token, mask, mode, norm), rel=1e-5)
    parts = sum(aggregate(per_token[i:i + 2], mask[i:i + 2], mode, norm) for i in range(0, 6, 2))
    assert parts.item() == pytest.approx(whole.item(), rel=1e-5)


def test_padding_contributes_nothing():
    per_token = torch.tensor([[1.0, 2.0, 99.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    norm = Normalisers(rows=1, tokens=2.0, max_new_tokens=3)
    assert aggregate(per_token, mask, "grpo", norm).item() == pytest.approx(1.5)
    assert aggregate(per_token, mask, "dapo", norm).item() == pytest.approx(1.5)
    assert aggregate(per_token, mask, "dr_grpo", norm).item() == pytest.approx(1.0)


def test_sequence_ratio_is_masked_token_mean():
    new = torch.tensor([[0.0, -1.0, 5.0]])
    old = torch.tensor([[-1.0, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    assert log_ratio(new, old, mask, "sequence").tolist() == [[0.5]]  # (1 + 0) / 2, padding ignored
    assert log_ratio(new, old, mask, "token").tolist() == [[1.0, 0.0, 5.0]]


# ---------------------------------------------------------------- value loss
from docuchat_rl.learning.losses import explained_variance, value_loss  # noqa: E402


def test_clipped_value_loss_hand_cases():
    old = torch.tensor([[1.0, 1.0, 1.0]])
    ret = torch.tensor([[2.0, 2.0, 0.0]])
    new = torch.tensor([[1.1, 3.0, 3.0]])
    # t0: inside the clip: 0.5*(1.1-2)^2 = 0.405
    # t1: V moved +2 (clipped to 1.2): max((3-2)^2, (1.2-2)^2) = 1 -> 0.5
    # t2: V moved +2 away from R=0: max(9, 1.44) = 9 -> 4.5 (the pessimistic max keeps the unclipped)
    got = value_loss(new, old, ret, clip=0.2)
    assert torch.allclose(got, torch.tensor([[0.405, 0.5, 4.5]]))
    assert torch.allclose(value_loss(new, old, ret, clip=None), torch.tensor([[0.405, 0.5, 4.5]]))
    # a case where clipping raises the loss: V jumps past R, the clipped estimate stays far from it
    got = value_loss(torch.tensor([[2.1]]), torch.tensor([[0.0]]), torch.tensor([[2.0]]), clip=0.5)
    assert got.item() == pytest.approx(0.5 * (0.5 - 2.0) ** 2)


def test_clipped_value_gradient_stops_past_the_clip():
    new = torch.tensor([[2.1]], requires_grad=True)
    value_loss(new, torch.tensor([[0.0]]), torch.tensor([[2.0]]), clip=0.5).sum().backward()
    assert new.grad.item() == 0.0  # the clipped branch wins and is constant in V


def test_explained_variance():
    target, mask = torch.tensor([[1.0, 2.0, 3.0, 4.0]]), torch.ones(1, 4)
    assert explained_variance(target, target, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full((1, 4), 2.5), target, mask) == pytest.approx(0.0)


def _truncated_reference(z: torch.Tensor, top_k: int, top_p: float, t: int):
    """One position, by hand: sort the probabilities, keep the top k, then the smallest prefix (largest
    first) whose mass reaches top_p, renormalise; (log-prob of t, entropy) with autograd through z."""
    p = torch.softmax(z.detach(), -1)
    order = sorted(range(len(z)), key=lambda v: -float(p[v]))
    kept = order[:top_k] if top_k > 0 else order
    mass = sum(float(p[v]) for v in kept)
    chosen, acc = [], 0.0
    for v in kept:  # transformers' rule: drop a token when the mass below it (ascending) is <= 1 - top_p
        if (mass - acc) / mass <= 1 - top_p + 1e-12 and chosen:
            break
        chosen.append(v)
        acc += float(p[v])
    chosen = sorted(set(chosen) | {t})
    logp = torch.log_softmax(z[chosen], -1)
    return logp[chosen.index(t)], -(logp.exp() * logp).sum()


def test_truncated_log_probs_by_hand():
    """logits [2, 1, 0, -1]: top-k 2 keeps tokens 0 and 1; top-p 0.9 drops only token 3 (mass 0.032)."""
    from docuchat_rl.learning.losses import chunked_token_stats

    hidden = torch.tensor([[[2.0, 1.0, 0.0, -1.0]] * 2])  # [1, 2, 4]: the head is the identity
    ids = torch.tensor([[1, 2]])
    for top_k, top_p, want in ((2, 1.0, [1 - math.log(math.e ** 2 + math.e), None]),
                               (0, 0.9, [1 - math.log(math.e ** 2 + math.e + 1), -math.log(math.e ** 2 + math.e + 1)])):
        logps, entropy = chunked_token_stats(lambda h: h, hidden, ids, 1.0, 1, True, False, top_k, top_p)
        assert logps[0, 0].item() == pytest.approx(want[0], abs=1e-6)
        if want[1] is not None:
            assert logps[0, 1].item() == pytest.approx(want[1], abs=1e-6)
    # top-k 2 and a drawn token outside it (the trainer's logits a rounding error away): kept, renormalised with it
    logps, _ = chunked_token_stats(lambda h: h, hidden, ids, 1.0, 1, False, False, 2, 1.0)
    assert logps[0, 1].item() == pytest.approx(0 - math.log(math.e ** 2 + math.e + 1), abs=1e-6)


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (0, 0.8), (4, 0.9)])
@pytest.mark.parametrize("chunk", [0, 3])
def test_truncated_log_probs_entropy_and_gradients_equal_a_slow_reference_loop(top_k, top_p, chunk):
    """The trainer's scoring under top-k / top-p, both paths (whole logits and the chunked written-out
    backward), against a per-position loop that truncates by hand: values, and gradients of
    logp + 0.3 * entropy to the hidden states and the head (none to the dropped logits)."""
    from docuchat_rl.learning.forward import _token_stats

    torch.manual_seed(0)
    head = torch.nn.Linear(6, 13, bias=False)
    hidden = torch.randn(2, 4, 6, requires_grad=True)
    ids = torch.randint(0, 13, (2, 4))
    logps, entropy = _token_stats(head, hidden, ids, 0.8, chunk, True, True, top_k, top_p)
    (logps.sum() + 0.3 * entropy.sum()).backward()
    got = (hidden.grad.clone(), head.weight.grad.clone())
    hidden.grad, head.weight.grad = None, None
    ref_lp, ref_h, total = torch.zeros(2, 4), torch.zeros(2, 4), 0
    for r in range(2):
        for t in range(4):
            lp, h = _truncated_reference(head(hidden[r, t]) / 0.8, top_k, top_p, int(ids[r, t]))
            ref_lp[r, t], ref_h[r, t] = lp.detach(), h.detach()
            total = total + lp + 0.3 * h
    total.backward()
    assert torch.allclose(logps.detach(), ref_lp, atol=1e-5) and torch.allclose(entropy.detach(), ref_h, atol=1e-5)
    assert torch.allclose(got[0], hidden.grad, atol=1e-5) and torch.allclose(got[1], head.weight.grad, atol=1e-5)
    assert (ref_lp > torch.log_softmax(head(hidden.detach()) / 0.8, -1).gather(-1, ids[..., None])[..., 0]).any()
