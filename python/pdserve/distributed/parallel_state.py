"""Parallel groups passed explicitly to every layer (never module globals).

A rank process must read its ModelConfig before ``init_process_group``: the first config
lookup imports torch.distributed.nn.functional (through transformers), whose default
arguments capture the world group if one exists, and then ``destroy_process_group`` cannot
free it (gloo's threads outlive main() and can abort the process at exit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ParallelState:
    """Where this process sits in the TP / EP grid, and the groups to talk over.

    ``tp_group`` / ``ep_group`` are torch.distributed process groups, or None when
    the size is 1 (single process: every collective is the identity).
    """

    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    tp_group: Any = None
    ep_group: Any = None

    def __post_init__(self):
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank: {self.tp_rank} outside [0, {self.tp_size})")
        if not 0 <= self.ep_rank < self.ep_size:
            raise ValueError(f"ep_rank: {self.ep_rank} outside [0, {self.ep_size})")

    def tp_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return x
        import torch.distributed as dist

        dist.all_reduce(x, group=self.tp_group)
        return x

    def tp_all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.tp_size == 1:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=dim)

    def shard(self, n: int, rank: int | None = None, size: int | None = None) -> tuple[int, int]:
        """[start, end) of this rank's share of ``n`` items split evenly over TP."""
        rank = self.tp_rank if rank is None else rank
        size = self.tp_size if size is None else size
        if n % size:
            raise ValueError(f"{n} is not divisible by tp_size={size}")
        per = n // size
        return rank * per, (rank + 1) * per


SINGLE = ParallelState()
