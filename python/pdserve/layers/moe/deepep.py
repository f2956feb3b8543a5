"""DeepEP behind the Dispatcher contract (layers/moe/dispatch.py): the same answer as the
all-to-all, over DeepEP's NVLink/RDMA kernels. 2+ GPUs; imported only when selected.

Legend: T tokens this rank dispatches, K experts per token, H hidden, E experts, El = E / ep
local experts, M tokens received, Cap low-latency slots per local expert.

DeepEP moves tokens, not (token, expert) pairs: a token travels once to each rank owning one of
its experts, with its top-k ids (local, -1 for other ranks' experts) and weights. The receiver
runs its experts on the pairs, weights and sums them per token; ``combine`` sums the ranks'
parts back at the token's home. Modes (``--deepep-mode``): ``normal`` (throughput kernels,
prefill), ``low_latency`` (fixed-capacity buffers, no host sync, decode and CUDA graphs),
``auto``: low latency for batches up to ``LOW_LATENCY_MAX_TOKENS``.
"""

from __future__ import annotations

import torch

from pdserve.distributed.parallel_state import ParallelState
from pdserve.layers.moe.dispatch import Dispatcher, ExpertFn

LOW_LATENCY_MAX_TOKENS = 128  # per rank and step; DeepEP sizes its low-latency buffers for it
NVL_BUFFER_BYTES = 1 << 30


class DeepEPDispatcher(Dispatcher):
    def __init__(self, parallel: ParallelState, num_experts: int):
        import deep_ep

        self.deep_ep = deep_ep
        self.parallel = parallel
        self.num_experts = num_experts
        self.per_rank = num_experts // parallel.ep_size
        self.mode = parallel.deepep_mode
        self._buffers: dict[bool, object] = {}  # low_latency -> deep_ep.Buffer, built on first use

    def _buffer(self, low_latency: bool, hidden: int):
        if low_latency not in self._buffers:
            group, B = self.parallel.ep_group, self.deep_ep.Buffer
            if low_latency:
                rdma = B.get_low_latency_rdma_size_hint(LOW_LATENCY_MAX_TOKENS, hidden, self.parallel.ep_size,
                                                        self.num_experts)
                self._buffers[True] = B(group, 0, rdma, low_latency_mode=True,
                                        num_qps_per_rank=max(1, self.per_rank))
            else:
                self._buffers[False] = B(group, NVL_BUFFER_BYTES, 0)
        return self._buffers[low_latency]

    def _low_latency(self, T: int) -> bool:
        if self.mode == "auto":
            return T <= LOW_LATENCY_MAX_TOKENS
        return self.mode == "low_latency"

    def run(self, x, weights, ids, experts):
        ids = ids.to(torch.int64)
        if self._low_latency(x.shape[0]):
            return self._run_low_latency(x, weights, ids, experts)
        return self._run_normal(x, weights, ids, experts)

    def _run_normal(self, x, weights, ids, experts: ExpertFn) -> torch.Tensor:
        buf = self._buffer(False, x.shape[-1])
        per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(ids, self.num_experts)
        recv_x, recv_ids, recv_w, _, handle, _ = buf.dispatch(
            x, topk_idx=ids, topk_weights=weights.float(), num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
        y = _weighted_local(recv_x, recv_ids, recv_w, experts)  # [M, H]
        out, _, _ = buf.combine(y, handle)
        return out.to(x.dtype)  # [T, H]

    def _run_low_latency(self, x, weights, ids, experts: ExpertFn) -> torch.Tensor:
        buf = self._buffer(True, x.shape[-1])
        recv, _, handle, _, _ = buf.low_latency_dispatch(x, ids, LOW_LATENCY_MAX_TOKENS, self.num_experts,
                                                         use_fp8=False)  # recv [El, Cap, H]
        El, Cap, H = recv.shape
        # Every slot runs (unused ones hold garbage that combine never reads): no host sync.
        local = torch.arange(El, device=recv.device).repeat_interleave(Cap)  # [El Cap]
        y = experts(recv.reshape(El * Cap, H), local).view(El, Cap, H)
        out, _, _ = buf.low_latency_combine(y, ids, weights.float(), handle)
        return out.to(x.dtype)  # [T, H]


def _weighted_local(rows: torch.Tensor, local_ids: torch.Tensor, weights: torch.Tensor,
                    experts: ExpertFn) -> torch.Tensor:
    """rows [M, H], local_ids [M, K] (-1: not here), weights [M, K] -> sum_k w * expert_k(row) [M, H]."""
    tok, slot = torch.nonzero(local_ids >= 0, as_tuple=True)  # pairs for this rank's experts
    y = experts(rows[tok], local_ids[tok, slot])  # [n, H]
    out = torch.zeros(rows.shape, dtype=torch.float32, device=rows.device)
    out.index_add_(0, tok, y.float() * weights[tok, slot].unsqueeze(-1))
    return out.to(rows.dtype)
