"""The supervised loss: the summed negative log-likelihood of a batch of SFT examples' loss tokens.

Each example runs as one sequence, its prompt and target together, right-padded to its length bucket's
longest; positions count from its first token, as RL's do, so the prompt is scored where RL samples it; the
output layer runs on the loss tokens' positions only (tool results and prompt tokens carry no loss and never
reach it). Deliberately left out: packing several examples into one row (a varlen attention kernel; on a CPU
there is none, and buckets take most of its gain) and label smoothing.
"""

from __future__ import annotations

import torch

from ..learning.forward import bucket_rows, decoder_stack, output_head
from ..learning.losses import chunked_token_stats, token_logprobs
from ..modeling import in_compute_context, position_ids
from .targets import Target


@in_compute_context
def nll_sum(model, targets: list[Target], pad_id: int, logit_chunk: int, length_buckets: int) -> tuple[torch.Tensor, int]:
    """(the summed negative log-likelihood of the targets' loss tokens, how many there are), at temperature 1.

    Each example runs as one sequence, its prompt and target together, right-padded only to the longest whole
    example of its bucket (`bucket_rows` over whole lengths), and the output layer runs on the loss tokens'
    positions only, `logit_chunk` at a time. RL's layout (a left-padded prompt, then a right-padded
    completion, `learning.forward.policy_forward`) pads both parts to their own longest, buckets by completion
    length alone and scores every completion column: on a batch of SmolLM2's SFT recipe its forward + backward
    took 1.13-1.37x this one's (three alternating runs) for the same loss (to 1e-7 a token) and gradient (to
    7e-7 relative; docs/performance.md). Positions count from each example's first token, as RL's do, so the
    prompt is scored where RL samples it."""
    device = next(model.parameters()).device
    decoder, head = decoder_stack(model), output_head(model)
    total = torch.zeros((), device=device)
    for rows in bucket_rows([len(t.prompt_ids) + len(t.target_ids) for t in targets], length_buckets):
        seqs = [targets[r].prompt_ids + targets[r].target_ids for r in rows]
        width = max(map(len, seqs))
        ids = torch.tensor([s + [pad_id] * (width - len(s)) for s in seqs], device=device)  # [n, L]
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs], device=device)  # [n, L]
        hidden = decoder(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask),
                         use_cache=False).last_hidden_state  # [n, L, H]
        # target token j of row i sits at len(prompt) + j and is predicted by the position before it
        at = [(i, len(targets[r].prompt_ids) + j) for i, r in enumerate(rows)
              for j, m in enumerate(targets[r].loss_mask) if m]
        if not at:
            continue
        row_t, col_t = (torch.tensor(x, device=device) for x in zip(*at))  # [N] each
        h, labels = hidden[row_t, col_t - 1][None], ids[row_t, col_t][None]  # [1, N, H], [1, N]
        if logit_chunk > 0:
            logps, _ = chunked_token_stats(head, h, labels, 1.0, logit_chunk, False, False)  # [1, N]
        else:
            logps = token_logprobs(head(h).float(), labels)  # [1, N]
        total = total - logps.sum()
    return total, sum(sum(t.loss_mask) for t in targets)  # (counted on the host: no device read)
