"""The MoE feed-forward block: route, run experts, add shared experts, reduce.

Legend: T tokens, Ts tokens this EP rank dispatches, H hidden.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.distributed.parallel_state import ParallelState
from pdserve.layers.mlp import GatedMLP
from pdserve.layers.moe.dispatch import create_dispatcher, share
from pdserve.layers.moe.experts import Experts
from pdserve.layers.moe.router import RoutingConfig, TopKRouter


class SparseMoE(nn.Module):
    """Checkpoint layout (HF): ``gate.weight`` [, ``gate.e_score_correction_bias``],
    ``experts.{e}.{gate,up,down}_proj.weight``, optional ``shared_experts.*``.

    Input: x [T, H], the same on every TP (and EP) rank. Reduction: without EP the routed
    experts are TP-split like the shared ones, so one all-reduce over TP sums both. With
    EP each rank routes a share of the T tokens and dispatches it to the experts' owners
    (``ep_dispatch = "all_to_all"``); the shares are joined by an all-reduce over EP,
    which also sums the shared experts' TP partials when EP spans the TP ranks. The slow
    twin (``"all_reduce"``) runs every token through the local experts and sums over EP.
    """

    def __init__(self, hidden: int, moe_intermediate: int, routing: RoutingConfig, parallel: ParallelState,
                 dtype: torch.dtype, shared_intermediate: int = 0, hidden_act: str = "silu"):
        super().__init__()
        self.parallel = parallel
        self.gate = TopKRouter(hidden, routing, dtype)
        self.experts = Experts(routing.num_experts, hidden, moe_intermediate, parallel, dtype)
        self.shared_experts = (GatedMLP(hidden, shared_intermediate, parallel, dtype, hidden_act,
                                        reduce_results=False) if shared_intermediate else None)
        self.dispatcher = create_dispatcher(parallel, routing.num_experts) if parallel.ep_size > 1 else None
        self.use_loop_reference = False  # tests flip this to run the slow twin end to end
        self.ep_dispatch = "all_to_all"  # "all_reduce": the slow twin of the EP dispatch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        shared = self.shared_experts(x) if self.shared_experts is not None else None  # [T, H] TP partial
        if self.parallel.ep_size == 1:
            routed = self._run_experts(x, *self.gate(x))
            return self.parallel.tp_all_reduce(routed if shared is None else routed + shared)
        routed = self._ep_dispatched(x) if self.ep_dispatch == "all_to_all" else self._run_experts(x, *self.gate(x))
        if shared is not None and self.parallel.ep_is_tp:
            return self.parallel.ep_all_reduce(routed + shared)
        routed = self.parallel.ep_all_reduce(routed)
        return routed if shared is None else routed + self.parallel.tp_all_reduce(shared)

    def _run_experts(self, x, weights, ids) -> torch.Tensor:
        run = self.experts.forward_loop if self.use_loop_reference else self.experts
        return run(x, weights, ids)  # [T, H] this rank's experts' part

    def _ep_dispatched(self, x: torch.Tensor) -> torch.Tensor:
        """This rank routes and dispatches its share of the tokens; the other rows stay zero."""
        if self.dispatcher is None:
            raise RuntimeError("MoE: token dispatch needs expert parallelism (ep_size > 1)")
        lo, hi = share(x.shape[0], self.parallel.ep_rank, self.parallel.ep_size)
        weights, ids = self.gate(x[lo:hi])  # [Ts, K]
        out = torch.zeros_like(x)  # [T, H]
        out[lo:hi] = self.dispatcher.run(x[lo:hi], weights, ids, self._local_experts)
        return out

    def _local_experts(self, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """Received pairs: rows [M, H], each through its (local) expert, unweighted -> [M, H]."""
        ones = torch.ones(rows.shape[0], 1, dtype=torch.float32, device=rows.device)
        return self._run_experts(rows, ones, (local_ids + self.experts.expert_start).unsqueeze(1))
