"""Expert-parallel dispatch: each (token, expert) pair travels to the rank owning the expert,
runs there, and its output travels back to be weighted and summed per token.

Legend: T tokens this rank dispatches, K experts per token, H hidden, N = T*K pairs sent,
M pairs received, E routed experts, El = E/ep experts per rank, ep EP ranks.

Backends (``--moe-a2a-backend``): ``none`` moves the pairs with torch.distributed
``all_to_all_single`` (gloo on CPU, NCCL on GPU); ``deepep`` runs DeepEP's kernels
(layers/moe/deepep.py), 2+ CUDA GPUs only, imported only when selected.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from pdserve.distributed.parallel_state import ParallelState

# (rows [M, H], local expert ids [M]) -> each row's output of its expert [M, H], unweighted
ExpertFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Dispatcher(ABC):
    """Contract: every EP rank calls ``run`` together (with T possibly 0); ``run`` returns
    sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) for this rank's T tokens, in float32
    accumulation, cast to x's dtype. Nothing is reduced over ranks afterwards."""

    @abstractmethod
    def run(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: ExpertFn) -> torch.Tensor:
        """x [T, H], weights [T, K] float32, ids [T, K] global expert ids -> [T, H]."""


class AllToAllDispatcher(Dispatcher):
    """Pairs sorted by owner rank, exchanged with ``all_to_all_single`` (counts, rows,
    expert ids, then outputs back): four collectives per MoE layer."""

    def __init__(self, parallel: ParallelState, num_experts: int):
        self.parallel = parallel
        self.per_rank = num_experts // parallel.ep_size

    def run(self, x, weights, ids, experts):
        T, K = ids.shape
        H = x.shape[-1]
        flat = ids.flatten()  # [N]
        owner = torch.div(flat, self.per_rank, rounding_mode="floor")  # [N]
        order = torch.argsort(owner, stable=True)  # [N] pairs grouped by owner rank
        send = torch.bincount(owner, minlength=self.parallel.ep_size)  # [ep]
        recv = self._exchange(send, torch.empty_like(send), [1] * len(send), [1] * len(send))  # [ep]
        sent, got = send.tolist(), recv.tolist()
        rows = self._exchange(x[torch.div(order, K, rounding_mode="floor")], x.new_empty(sum(got), H), got, sent)
        local = self._exchange(flat[order] % self.per_rank, flat.new_empty(sum(got)), got, sent)  # [M]
        y = experts(rows, local)  # [M, H]
        back = self._exchange(y, y.new_empty(T * K, H), sent, got)  # [N, H], pair order[i] at row i
        out = torch.empty(T * K, H, dtype=torch.float32, device=x.device)
        out[order] = back.float() * weights.flatten()[order].unsqueeze(-1)
        return out.view(T, K, H).sum(dim=1).to(x.dtype)  # [T, H]

    def _exchange(self, src: torch.Tensor, dst: torch.Tensor, out_splits: list[int],
                  in_splits: list[int]) -> torch.Tensor:
        import torch.distributed as dist

        dist.all_to_all_single(dst, src.contiguous(), out_splits, in_splits, group=self.parallel.ep_group)
        return dst


def create_dispatcher(parallel: ParallelState, num_experts: int) -> Dispatcher:
    """The dispatcher ``parallel.moe_a2a_backend`` names."""
    require_backend(parallel.moe_a2a_backend)
    if parallel.moe_a2a_backend == "deepep":
        from pdserve.layers.moe.deepep import DeepEPDispatcher

        return DeepEPDispatcher(parallel, num_experts)
    return AllToAllDispatcher(parallel, num_experts)


def require_backend(backend: str) -> None:
    """Raise ValueError naming the field when ``backend`` cannot run here (entrypoints call it
    before starting any rank, so the operator hears it at once)."""
    if backend == "none":
        return
    if backend != "deepep":
        raise ValueError(f"moe_a2a_backend: {backend!r} is not one of ('none', 'deepep')")
    if not torch.cuda.is_available():
        raise ValueError("moe_a2a_backend: 'deepep' runs on CUDA GPUs only and this host has none "
                         "(use --moe-a2a-backend none)")
    gpus = torch.cuda.device_count()
    if gpus < 2:
        raise ValueError(f"moe_a2a_backend: 'deepep' moves tokens between GPUs and needs 2 or more, this host has "
                         f"{gpus} (use --moe-a2a-backend none)")
    try:
        import deep_ep  # noqa: F401
    except ImportError as e:
        raise ValueError(f"moe_a2a_backend: 'deepep' needs the deep_ep package ({e})") from None


def share(num_tokens: int, rank: int, size: int) -> tuple[int, int]:
    """[start, end) of the tokens rank ``rank`` of ``size`` dispatches when every rank holds the
    same T tokens: contiguous, sizes differing by at most one."""
    per, extra = divmod(num_tokens, size)
    start = rank * per + min(rank, extra)
    return start, start + per + (rank < extra)
