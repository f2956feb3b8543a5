"""Routed experts: SwiGLU FFNs stored stacked, run batched (sort by expert, grouped matmul).

Legend: T tokens, H hidden, K experts per token, E routed experts (global), El local experts,
I moe_intermediate_size (per rank under TP), N = T*K token-expert pairs, Nl pairs routed here.

Ownership (EP-ready): with ep_size > 1, rank r owns experts [r*E/ep, (r+1)*E/ep) whole;
with ep_size == 1 every rank owns all experts and TP splits I. Either way ``forward``
returns this rank's partial sum over [T, H]; the MoE block reduces it over the group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.distributed.parallel_state import ParallelState
from pdserve.layers.activation import silu_and_mul
from pdserve.layers.quant.fp8 import SCALE_SUFFIX, hold_fp8
from pdserve.layers.weights import WeightEntry, check_shape, copy_into

_PROJ = ("gate_proj", "up_proj", "down_proj")


class Experts(nn.Module):
    """``w13`` [El, 2I, H] = [gate | up] rows, ``w2`` [El, H, I].

    Checkpoint: per-expert ``{prefix}.{e}.{gate,up,down}_proj.weight`` (HF checkpoints, and what
    transformers 5 writes on save), or the fused ``{prefix}.gate_up_proj`` [E, 2I, H] /
    ``{prefix}.down_proj`` [E, H, I] that transformers 5 holds in memory.
    """

    GROUPED_MAX_ELEMENTS = 1 << 19  # Nl * I up to which "auto" picks the grouped matmul (measured on CPU)

    def __init__(self, num_experts: int, hidden: int, intermediate: int, parallel: ParallelState,
                 dtype: torch.dtype):
        super().__init__()
        if num_experts % parallel.ep_size:
            raise ValueError(f"n_routed_experts: {num_experts} is not divisible by ep_size={parallel.ep_size}")
        self.num_experts, self.hidden, self.intermediate_full = num_experts, hidden, intermediate
        per_rank = num_experts // parallel.ep_size
        self.expert_start, self.num_local = parallel.ep_rank * per_rank, per_rank
        # Under EP an expert lives whole on one rank; only without EP does TP split I.
        i_lo, i_hi = parallel.shard(intermediate) if parallel.ep_size == 1 else (0, intermediate)
        self.i_start, self.intermediate = i_lo, i_hi - i_lo
        self.w13 = nn.Parameter(torch.empty(per_rank, 2 * self.intermediate, hidden, dtype=dtype),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(per_rank, hidden, self.intermediate, dtype=dtype), requires_grad=False)
        self.impl = "auto"  # "grouped" | "sliced" | "auto"; see forward
        # keep_fp8: w13/w2 float8_e4m3fn with w13_scale_inv [El, 2I/bo, ceil(H/bi)], w2_scale_inv
        # [El, ceil(H/bo), I/bi]; forward then runs the fused FP8 MoE kernel.
        self.fp8_block: tuple[int, int] | None = None
        self.w13_scale_inv: nn.Parameter | None = None  # parameters once hold_fp8 made them
        self.w2_scale_inv: nn.Parameter | None = None

    # ------------------------------------------------------------------ compute

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Batched: x [T, H], weights [T, K] float32, ids [T, K] -> [T, H] (this rank's share).

        Token-expert pairs are sorted by expert so each expert's rows are one contiguous run.
        Small batches (decode) then run as two grouped matmuls over all experts at once.
        Large ones (prefill) go expert by expert over those runs, so an expert's [n, 2I]
        intermediate stays in cache instead of [Nl, 2I] arrays streaming through memory.
        """
        T, K = ids.shape
        if self.fp8_block is not None:
            return self._fused_fp8(x, weights, ids)
        if x.is_cuda and self.num_local == self.num_experts:
            return self._fused_triton(x, weights, ids)
        local = ids.flatten() - self.expert_start  # [N]
        if self.num_local != self.num_experts:
            # Pairs for other ranks' experts get id El, which sorts after every local expert.
            local = torch.where((local >= 0) & (local < self.num_local), local, self.num_local)
        order = torch.argsort(local, stable=True)  # [N] pairs grouped by expert
        counts = torch.bincount(local, minlength=self.num_local + 1)[:self.num_local]  # [El]
        n_local = T * K if self.num_local == self.num_experts else int(counts.sum())
        pairs = order[:n_local]  # [Nl]
        w = weights.flatten()[pairs].unsqueeze(-1)  # [Nl, 1] float32
        if self._use_grouped(x, n_local):
            return self._grouped(x, pairs, w, counts, T, K)
        return self._sliced(x, pairs, w, counts, K)

    def _fused_triton(self, x, weights, ids) -> torch.Tensor:
        """On CUDA: pdserve_kernels' sorted pairs + grouped GEMM, which never waits for the GPU
        (so decode steps can be captured in CUDA graphs)."""
        from pdserve_kernels.moe import fused_experts

        return fused_experts(x, self.w13, self.w2, weights, ids)

    def _fused_fp8(self, x, weights, ids) -> torch.Tensor:
        """Block-scaled FP8 experts (pdserve_kernels' fused MoE, or its torch twin off GPU)."""
        from pdserve.layers.quant.fp8_kernels import fused_moe_fp8

        assert self.fp8_block is not None and self.w13_scale_inv is not None and self.w2_scale_inv is not None
        return fused_moe_fp8(x, self.w13, self.w13_scale_inv, self.w2, self.w2_scale_inv, weights, ids,
                             self.fp8_block)

    def keep_fp8(self, block: tuple[int, int], prefix: str, quantized: Callable[[str], bool]) -> set[str]:
        """Hold FP8 when gate and up each fill whole row blocks of w13 (I a multiple of the block,
        so up starts on one) and the TP split of I falls on blocks; not under EP (the fused
        kernel takes every expert)."""
        I = self.intermediate
        keys = [f"{prefix}.{e}.{p}.weight" for e in range(self.num_experts) for p in _PROJ]
        aligned = I % block[0] == 0 and I % block[1] == 0 and self.i_start % block[0] == 0
        if self.num_local != self.num_experts or not aligned or not all(quantized(k) for k in keys):
            return set()
        hold_fp8(self, block, "w13")
        hold_fp8(self, block, "w2")
        self.fp8_block = block
        return set(keys)

    def _use_grouped(self, x: torch.Tensor, n_local: int) -> bool:
        if self.impl != "auto":
            return self.impl == "grouped"
        # torch's grouped GEMM: CPU here (its CUDA kernel wants bf16 on Hopper).
        return x.device.type == "cpu" and n_local * self.intermediate <= self.GROUPED_MAX_ELEMENTS

    def _grouped(self, x, pairs, w, counts, T: int, K: int) -> torch.Tensor:
        if pairs.numel() == 0:
            return torch.zeros_like(x)
        offs = torch.cumsum(counts, 0).to(torch.int32)  # [El] end row of each expert
        xs = x[pairs // K]  # [Nl, H]
        h = torch._grouped_mm(xs, self.w13.transpose(1, 2), offs=offs)  # [Nl, 2I]
        o = torch._grouped_mm(silu_and_mul(h), self.w2.transpose(1, 2), offs=offs)  # [Nl, H]
        o = o.float() * w  # weighting and the K-sum in float32 (no-op cast for float32 models)
        # Scatter back to (token, slot) order and sum the K slots: deterministic, no atomics.
        out = o.new_zeros(T * K, self.hidden) if pairs.numel() < T * K else o.new_empty(T * K, self.hidden)
        out[pairs] = o
        return out.view(T, K, self.hidden).sum(dim=1).to(x.dtype)  # [T, H]

    def _sliced(self, x, pairs, w, counts, K: int) -> torch.Tensor:
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, H]
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                tok = pairs[start:start + n] // K  # [n]
                h = F.linear(x[tok], self.w13[e])  # [n, 2I]
                y = F.linear(silu_and_mul(h), self.w2[e])  # [n, H]
                out.index_add_(0, tok, y.float() * w[start:start + n])
            start += n
        return out.to(x.dtype)

    def forward_loop(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Slow twin of ``forward``: one masked gather/compute/scatter per local expert."""
        out = torch.zeros_like(x)  # [T, H]
        for e in range(self.num_local):
            tok, slot = torch.where(ids == self.expert_start + e)  # [n], [n]
            if tok.numel() == 0:
                continue
            h = silu_and_mul(F.linear(x[tok], self.w13[e]))  # [n, I]
            y = F.linear(h, self.w2[e]) * weights[tok, slot].unsqueeze(-1)  # [n, H]
            out.index_add_(0, tok, y.to(out.dtype))
        return out

    # ------------------------------------------------------------------ weights

    def weight_entries(self, prefix: str) -> Iterator[WeightEntry]:
        for e in range(self.num_experts):
            mine = self.expert_start <= e < self.expert_start + self.num_local
            for j, proj in enumerate(_PROJ):
                key = f"{prefix}.{e}.{proj}.weight"
                units = (f"{prefix}#{e}.{proj}",) if mine else ()
                yield WeightEntry(key, partial(self._load_one, key, e, j), units)
                if self.fp8_block is not None:
                    skey = key + SCALE_SUFFIX
                    yield WeightEntry(skey, partial(self._load_scale, skey, e, j), (f"{prefix}#{e}.{proj}.scale",))
        all_units = [f"{prefix}#{e}.{p}" for e in range(self.expert_start, self.expert_start + self.num_local)
                     for p in _PROJ]
        yield WeightEntry(f"{prefix}.gate_up_proj", lambda src: self._load_fused_w13(f"{prefix}.gate_up_proj", src),
                          tuple(u for u in all_units if not u.endswith("down_proj")), canonical=False)
        yield WeightEntry(f"{prefix}.down_proj", lambda src: self._load_fused_w2(f"{prefix}.down_proj", src),
                          tuple(u for u in all_units if u.endswith("down_proj")), canonical=False)

    def checkpoint_tensors(self, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
        """Inverse of loading, for unsharded experts: per-expert gate/up/down (HF names)."""
        if self.num_local != self.num_experts or self.intermediate != self.intermediate_full:
            raise ValueError(f"{prefix}: sharded experts hold no whole checkpoint tensor")
        I = self.intermediate
        for e in range(self.num_experts):
            yield f"{prefix}.{e}.gate_proj.weight", self.w13[e, :I]
            yield f"{prefix}.{e}.up_proj.weight", self.w13[e, I:]
            yield f"{prefix}.{e}.down_proj.weight", self.w2[e]

    def _load_one(self, key: str, expert: int, which: int, src: torch.Tensor) -> None:
        if not self.expert_start <= expert < self.expert_start + self.num_local:
            return  # another EP rank's expert
        e, I, i0 = expert - self.expert_start, self.intermediate, self.i_start
        if which == 2:
            check_shape(key, src, (self.hidden, self.intermediate_full))
            copy_into(key, self.w2.data[e], src[:, i0:i0 + I])
        else:
            check_shape(key, src, (self.intermediate_full, self.hidden))
            copy_into(key, self.w13.data[e, which * I:(which + 1) * I], src[i0:i0 + I])

    def _load_scale(self, key: str, expert: int, which: int, src: torch.Tensor) -> None:
        """An FP8 expert's block scales: this rank's blocks of I (gate/up rows, down columns)."""
        assert self.fp8_block is not None and self.w13_scale_inv is not None and self.w2_scale_inv is not None
        (bo, bi), e = self.fp8_block, expert - self.expert_start
        if which == 2:
            check_shape(key, src, (-(-self.hidden // bo), self.intermediate_full // bi))
            cols = self.intermediate // bi
            copy_into(key, self.w2_scale_inv.data[e], src[:, self.i_start // bi:self.i_start // bi + cols])
        else:
            check_shape(key, src, (self.intermediate_full // bo, -(-self.hidden // bi)))
            rows, r0 = self.intermediate // bo, self.i_start // bo
            copy_into(key, self.w13_scale_inv.data[e, which * rows:(which + 1) * rows], src[r0:r0 + rows])

    def _load_fused_w13(self, key: str, src: torch.Tensor) -> None:
        check_shape(key, src, (self.num_experts, 2 * self.intermediate_full, self.hidden))
        mine = src[self.expert_start:self.expert_start + self.num_local]
        for which in (0, 1):
            part = mine[:, which * self.intermediate_full:(which + 1) * self.intermediate_full]
            for e in range(self.num_local):
                self._load_one(key, self.expert_start + e, which, part[e])

    def _load_fused_w2(self, key: str, src: torch.Tensor) -> None:
        check_shape(key, src, (self.num_experts, self.hidden, self.intermediate_full))
        for e in range(self.num_local):
            self._load_one(key, self.expert_start + e, 2, src[self.expert_start + e])
