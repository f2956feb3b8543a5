"""Fused MoE pieces: token sort/permute by expert, and a grouped expert GEMM over the sorted
pairs (each block of rows belongs to one expert and reads that expert's weight).

Legend: T tokens, K experts per token, N = T*K (token, expert) pairs, E experts, H hidden,
I intermediate, BM rows per block; Np pairs after padding every expert's run to a multiple of BM.
Weights are stacked as pdserve's Experts holds them: w13 [E, 2I, H] (gate | up), w2 [E, H, I].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pdserve_kernels.decode_attention import _f32_dot


@dataclass(frozen=True)
class SortedPairs:
    """Pairs grouped by expert; each expert's run padded to a multiple of ``block_m`` with N
    (an index past the last pair, which the GEMM skips). Sized for the worst case, so building
    it never waits for the GPU (and can be captured in a CUDA graph): blocks past the used ones
    hold only padding."""

    pair_ids: torch.Tensor  # [Np] pair index t*K + k, or N for padding
    block_expert: torch.Tensor  # [Np / BM] the expert of each block of rows
    num_pairs: int  # N
    block_m: int


def sort_pairs(ids: torch.Tensor, num_experts: int, block_m: int) -> SortedPairs:
    """ids [T, K] expert ids in [0, E) -> the pairs sorted (stably) by expert, runs padded."""
    flat = ids.flatten()  # [N]
    N, E, dev = flat.numel(), num_experts, ids.device
    order = torch.argsort(flat, stable=True)  # [N]
    # scatter_add, not bincount: bincount sizes its output from the largest id, a host sync
    counts = torch.zeros(E, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))  # [E]
    blocks = (counts + block_m - 1) // block_m  # [E] blocks of each expert
    block_end = torch.cumsum(blocks, 0)  # [E]
    first = torch.cumsum(counts, 0) - counts  # [E] first sorted pair of each expert
    sorted_e = flat[order]  # [N]
    dest = (block_end - blocks)[sorted_e] * block_m + torch.arange(N, device=dev) - first[sorted_e]  # [N]
    max_blocks = -(-N // block_m) + E  # sum_e ceil(c_e / BM) never exceeds it
    pair_ids = torch.full((max_blocks * block_m,), N, dtype=torch.int64, device=dev)
    pair_ids[dest] = order
    j = torch.arange(max_blocks, device=dev)
    block_expert = torch.searchsorted(block_end, j, right=True).clamp_(max=E - 1)  # [max_blocks]
    return SortedPairs(pair_ids, block_expert, N, block_m)


@triton.jit
def _grouped_gemm_kernel(A, W, Out, PairIds, BlockExpert, num_pairs, a_div, n_out, k_in,
                         sa, sw_e, sw_n, so,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(BlockExpert + pid_m)
    pairs = tl.load(PairIds + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM]
    pmask = pairs < num_pairs
    a_rows = pairs // a_div  # the token of a pair (a_div = K) or the pair itself (a_div = 1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < n_out
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < k_in
        a = tl.load(A + a_rows[:, None] * sa + ks[None, :], mask=pmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(W + e * sw_e + cols[None, :] * sw_n + ks[:, None], mask=cmask[None, :] & kmask[:, None],
                    other=0.0)  # [BK, BN]: W[e] is [n_out, k_in], read transposed
        if IEEE:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    tl.store(Out + pairs[:, None] * so + cols[None, :], acc.to(Out.dtype.element_ty),
             mask=pmask[:, None] & cmask[None, :])


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, sp: SortedPairs, a_div: int,
                 block_n: int = 32, block_k: int = 32) -> torch.Tensor:
    """a [rows, k_in] (row of pair p: p // a_div), w [E, n_out, k_in] -> [N, n_out], row p = a_row @ w[e_p].T."""
    n_out, k_in = w.shape[1], w.shape[2]
    out = torch.empty(sp.num_pairs, n_out, dtype=a.dtype, device=a.device)
    blocks = sp.block_expert.shape[0]
    if blocks:
        grid = (blocks, triton.cdiv(n_out, block_n))
        _grouped_gemm_kernel[grid](a, w, out, sp.pair_ids, sp.block_expert, sp.num_pairs, a_div, n_out, k_in,
                                   a.stride(0), w.stride(0), w.stride(1), out.stride(0),
                                   BLOCK_M=sp.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                   IEEE=_f32_dot(a))
    return out


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor, block_m: int = 16) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], weights [T, K] float32, ids [T, K] ->
    sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) [T, H] (SwiGLU experts)."""
    T, K = ids.shape
    sp = sort_pairs(ids, w13.shape[0], block_m)
    gate_up = grouped_gemm(x, w13, sp, a_div=K)  # [N, 2I]
    g, u = gate_up.chunk(2, dim=-1)
    inter = (F.silu(g.float()) * u.float()).to(x.dtype)  # [N, I]
    y = grouped_gemm(inter, w2, sp, a_div=1)  # [N, H]
    return (y.float().view(T, K, -1) * weights.unsqueeze(-1)).sum(1).to(x.dtype)


def fused_experts_ref(x, w13, w2, weights, ids) -> torch.Tensor:
    """The per-expert loop: each expert runs on exactly the tokens routed to it."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():
        t, k = (ids == e).nonzero(as_tuple=True)
        g, u = (x[t].float() @ w13[e].float().T).chunk(2, dim=-1)
        y = (F.silu(g) * u).to(x.dtype).float() @ w2[e].float().T  # [n, H]
        out.index_add_(0, t, y * weights[t, k].unsqueeze(-1))
    return out.to(x.dtype)
