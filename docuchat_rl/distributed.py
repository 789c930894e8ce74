"""The few collectives data-parallel training needs, on torch.distributed (set up by accelerate under
`accelerate launch` or `torchrun`), and the identity on one process.

The trainer does not wrap the model in DistributedDataParallel: a step's ranks may hold different
numbers of rows in a minibatch (a group never spans ranks), and the trainable parameters (LoRA adapters,
a value head, a critic adapter) are small, so after each minibatch's backward the gradients are summed
across ranks in one flat all-reduce. The loss of each rank is already normalised by the minibatch's
global row or token count, so the sum is exactly the one-process gradient (up to summation order).

Deliberately left out: sharded parameters (FSDP/ZeRO); every rank holds the whole model.
"""

from __future__ import annotations

import torch


def no_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum over the processes of a one-process run: the tensor itself (the default `reduce` of the
    functions that take one)."""
    return x


class Dist:
    def __init__(self, world: int = 1, rank: int = 0, device: torch.device | None = None):
        self.world, self.rank, self.device = world, rank, device or torch.device("cpu")

    @classmethod
    def from_accelerator(cls, accelerator) -> Dist:
        return cls(accelerator.num_processes, accelerator.process_index, accelerator.device)

    @property
    def active(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def _reduce(self, x: torch.Tensor, op) -> torch.Tensor:
        if not self.active:
            return x
        import torch.distributed as dist

        out = x.detach().to(self.device, copy=True)
        dist.all_reduce(out, op=op)
        return out.to(x.device)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over ranks (a new tensor; x itself unchanged)."""
        import torch.distributed as dist

        return self._reduce(x, dist.ReduceOp.SUM) if self.active else x

    def max(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        return self._reduce(x, dist.ReduceOp.MAX) if self.active else x

    def gather(self, items: list) -> list:
        """Every rank's list, concatenated in rank order (on every rank)."""
        if not self.active:
            return items
        import torch.distributed as dist

        out: list = [None] * self.world
        dist.all_gather_object(out, items)
        return [x for part in out for x in part]

    def barrier(self) -> None:
        if self.active:
            import torch.distributed as dist

            dist.barrier()

    def sum_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Replace each parameter's gradient by its sum over ranks (missing gradients count as zeros)."""
        if not self.active:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = self.sum(torch.cat([g.reshape(-1).float() for g in grads]))  # [total trainable]
        start = 0
        for p, g in zip(params, grads):
            n = g.numel()
            p.grad = flat[start:start + n].view_as(p).to(p.dtype)
            start += n
