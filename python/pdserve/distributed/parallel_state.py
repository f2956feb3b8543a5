"""Parallel groups passed explicitly to every layer (never module globals).

A rank process must read its ModelConfig before ``init_process_group``: the first config
lookup imports torch.distributed.nn.functional (through transformers), whose default
arguments capture the world group if one exists, and then ``destroy_process_group`` cannot
free it (gloo's threads outlive main() and can abort the process at exit).

Legend: T tokens on this rank, Ta tokens of every attention group together, H hidden.
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

    The TP fields describe the split of the dense and MoE layers. Attention, the KV
    pool, the embedding and the LM head split as ``attention`` says: the same state
    unless DP attention gives them their own (``attn``), in which case each attention
    group owns different tokens and the dense / MoE layers gather them over
    ``attn_dp_group`` (``dp_gather``) and hand each group its rows back.
    """

    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    tp_group: Any = None
    ep_group: Any = None
    attn: ParallelState | None = None  # DP attention: the attention group's own TP split
    attn_dp_rank: int = 0
    attn_dp_size: int = 1
    attn_dp_group: Any = None  # same attention-TP slice in every attention group
    moe_a2a_backend: str = "none"  # how EP moves tokens to experts (layers/moe/dispatch.py)
    deepep_mode: str = "auto"  # DeepEP's kernels: normal, low_latency, or auto (by batch size)

    def __post_init__(self):
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank: {self.tp_rank} outside [0, {self.tp_size})")
        if not 0 <= self.ep_rank < self.ep_size:
            raise ValueError(f"ep_rank: {self.ep_rank} outside [0, {self.ep_size})")
        if not 0 <= self.attn_dp_rank < self.attn_dp_size:
            raise ValueError(f"attn_dp_rank: {self.attn_dp_rank} outside [0, {self.attn_dp_size})")
        if (self.attn_dp_size > 1) != (self.attn is not None):
            raise ValueError("attn: DP attention (attn_dp_size > 1) needs the attention split, and only it")

    @property
    def attention(self) -> ParallelState:
        """The split of attention, KV pool, embedding and LM head."""
        return self if self.attn is None else self.attn

    @property
    def is_single(self) -> bool:
        """No split at all: every layer holds whole weights."""
        return self.tp_size == 1 and self.ep_size == 1 and self.attn is None

    @property
    def dp_attention(self) -> bool:
        return self.attn_dp_size > 1

    @property
    def ep_is_tp(self) -> bool:
        """True when EP spans exactly the TP ranks, so one all-reduce sums both."""
        return self.ep_size == self.tp_size and self.ep_group is self.tp_group

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

    def ep_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.ep_size == 1:
            return x
        import torch.distributed as dist

        dist.all_reduce(x, group=self.ep_group)
        return x

    def dp_gather(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x [T, H] (this attention group's tokens, ``counts[attn_dp_rank]`` rows) -> [Ta, H]:
        every group's tokens in group order. All groups take part, even with no tokens."""
        if self.attn_dp_size == 1:
            return x
        import torch.distributed as dist

        most = max(counts)
        padded = x.new_zeros(most, *x.shape[1:])  # gloo gathers equal sizes only
        padded[:x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in range(self.attn_dp_size)]
        dist.all_gather(parts, padded, group=self.attn_dp_group)
        return torch.cat([p[:n] for p, n in zip(parts, counts)])  # [Ta, H]

    def dp_slice(self, y: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """[Ta, H] -> this attention group's rows [T, H] (inverse of ``dp_gather``)."""
        if self.attn_dp_size == 1:
            return y
        start = sum(counts[:self.attn_dp_rank])
        return y[start:start + counts[self.attn_dp_rank]]

    def shard(self, n: int, rank: int | None = None, size: int | None = None) -> tuple[int, int]:
        """[start, end) of this rank's share of ``n`` items split evenly over TP."""
        rank = self.tp_rank if rank is None else rank
        size = self.tp_size if size is None else size
        if n % size:
            raise ValueError(f"{n} is not divisible by tp_size={size}")
        per = n // size
        return rank * per, (rank + 1) * per


SINGLE = ParallelState()
