"""The MoE feed-forward block: route, run experts, add shared experts, reduce.

Legend: T tokens, H hidden.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.distributed.parallel_state import ParallelState
from pdserve.layers.mlp import GatedMLP
from pdserve.layers.moe.experts import Experts
from pdserve.layers.moe.router import RoutingConfig, TopKRouter


class SparseMoE(nn.Module):
    """Checkpoint layout (HF): ``gate.weight`` [, ``gate.e_score_correction_bias``],
    ``experts.{e}.{gate,up,down}_proj.weight``, optional ``shared_experts.*``.

    Reduction: without EP the routed experts are TP-split like the shared ones, so one
    all-reduce over TP sums both. With EP the routed partial is summed over the EP group
    (the all-to-all dispatch replaces this later) and the shared partial over TP.
    """

    def __init__(self, hidden: int, moe_intermediate: int, routing: RoutingConfig, parallel: ParallelState,
                 dtype: torch.dtype, shared_intermediate: int = 0, hidden_act: str = "silu"):
        super().__init__()
        self.parallel = parallel
        self.gate = TopKRouter(hidden, routing, dtype)
        self.experts = Experts(routing.num_experts, hidden, moe_intermediate, parallel, dtype)
        self.shared_experts = (GatedMLP(hidden, shared_intermediate, parallel, dtype, hidden_act,
                                        reduce_results=False) if shared_intermediate else None)
        self.use_loop_reference = False  # tests flip this to run the slow twin end to end

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        weights, ids = self.gate(x)  # [T, K], [T, K]
        run = self.experts.forward_loop if self.use_loop_reference else self.experts
        routed = run(x, weights, ids)  # [T, H] partial
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        if self.parallel.ep_size == 1:
            out = routed if shared is None else routed + shared
            return self.parallel.tp_all_reduce(out)
        routed = self._ep_all_reduce(routed)
        return routed if shared is None else routed + self.parallel.tp_all_reduce(shared)

    def _ep_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(x, group=self.parallel.ep_group)
        return x
