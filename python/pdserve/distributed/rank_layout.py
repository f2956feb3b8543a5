"""Where each scheduler rank sits: pure arithmetic over ParallelConfig, no torch.

SGLang's semantics (``ParallelConfig``):

- without DP attention, ``dp_size`` replicas of ``tp_size`` ranks; replica d is ranks
  ``[d * tp, (d + 1) * tp)``, and every layer of a replica splits over those ranks;
- with DP attention, ``tp_size`` ranks in all; attention rank group d is ranks
  ``[d * a, (d + 1) * a)`` with ``a = tp_size / dp_size``, and the dense / MoE layers
  split over all ``tp_size`` ranks.

Either way an *attention group* (``attn_tp``) runs one batch in lock step and owns its
requests; its first rank is that group's *DP leader* (samples, talks to the frontend).
Rank 0 is the *leader* of the whole engine (reads the frontend's messages).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.config import ParallelConfig


@dataclass(frozen=True)
class RankLayout:
    config: ParallelConfig
    rank: int  # global rank in [0, world_size)

    def __post_init__(self):
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank: {self.rank} outside [0, {self.world_size})")

    # ------------------------------------------------------------ sizes
    @property
    def world_size(self) -> int:
        return self.config.world_size

    @property
    def dp_size(self) -> int:
        return self.config.dp_size

    @property
    def attn_tp_size(self) -> int:
        return self.config.attn_tp_size

    @property
    def tp_size(self) -> int:
        """Ranks a dense / MoE layer splits over."""
        return self.config.tp_size

    @property
    def ep_size(self) -> int:
        return self.config.ep_size

    @property
    def dp_attention(self) -> bool:
        """True when layers outside attention span several attention groups."""
        return self.config.enable_dp_attention and self.dp_size > 1

    # ------------------------------------------------------------ this rank
    @property
    def dp_rank(self) -> int:
        """The attention group (request owner) this rank belongs to."""
        return self.rank // self.attn_tp_size

    @property
    def attn_tp_rank(self) -> int:
        return self.rank % self.attn_tp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def ep_rank(self) -> int:
        return self.tp_rank if self.ep_size > 1 else 0

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def is_dp_leader(self) -> bool:
        return self.attn_tp_rank == 0

    def dp_leader_rank(self, dp_rank: int | None = None) -> int:
        """Global rank of the first rank of attention group ``dp_rank`` (default: this rank's)."""
        return (self.dp_rank if dp_rank is None else dp_rank) * self.attn_tp_size

    def leader_of(self, rank: int) -> int:
        """Global rank of the attention group leader of any ``rank``."""
        return rank - rank % self.attn_tp_size

    # ------------------------------------------------------------ groups
    def attn_tp_groups(self) -> list[list[int]]:
        a = self.attn_tp_size
        return [list(range(d * a, (d + 1) * a)) for d in range(self.world_size // a)]

    def tp_groups(self) -> list[list[int]]:
        t = self.tp_size
        return [list(range(r * t, (r + 1) * t)) for r in range(self.world_size // t)]

    def attn_dp_groups(self) -> list[list[int]]:
        """With DP attention: ranks holding the same attention-TP slice in every attention group
        (the ranks whose tokens a dense / MoE layer gathers). Empty otherwise."""
        if not self.dp_attention:
            return []
        a = self.attn_tp_size
        return [list(range(i, self.world_size, a)) for i in range(a)]

    def ranks_on_node(self, node_rank: int | None = None) -> list[int]:
        """Global ranks node ``node_rank`` (default: config.node_rank) runs: a contiguous block."""
        node = self.config.node_rank if node_rank is None else node_rank
        per = self.world_size // self.config.nnodes
        return list(range(node * per, (node + 1) * per))


def layouts_on_node(config: ParallelConfig) -> list[RankLayout]:
    """One layout per rank this node runs."""
    first = RankLayout(config, 0)
    return [RankLayout(config, r) for r in first.ranks_on_node()]
