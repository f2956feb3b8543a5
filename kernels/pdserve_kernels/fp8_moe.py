"""Fused MoE over block-scaled FP8 experts: ``moe``'s sorted pairs and grouped GEMM, with the
activations quantized per token group and each weight block's scale applied per K-step.
Twin: ``fp8_ref.fused_moe_fp8_ref`` (the per-expert loop).

Legend: T tokens, K experts per token, N = T*K (token, expert) pairs, E experts, H hidden,
I intermediate, bn x bk the weight scale block, BM rows per block of sorted pairs.
Weights as pdserve's Experts stacks them: w13 [E, 2I, H] (gate | up) with scale_inv
[E, ceil(2I/bn), ceil(H/bk)], w2 [E, H, I] with scale_inv [E, ceil(H/bn), ceil(I/bk)].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pdserve_kernels.fp8_gemm import _scaled_dot, dot_mode, per_token_group_quant
from pdserve_kernels.moe import SortedPairs, sort_pairs


@triton.jit
def _grouped_w8a8_kernel(A, AS, W, WS, Out, PairIds, BlockExpert, num_pairs, a_div, n_out, k_in,
                         sa, sas, sw_e, sw_n, sws_e, sws_n, so, block_n,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr):
    pid_m = tl.program_id(0)
    e = tl.load(BlockExpert + pid_m)
    pairs = tl.load(PairIds + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM]
    pmask = pairs < num_pairs
    a_rows = pairs // a_div  # the token of a pair (a_div = K) or the pair itself (a_div = 1)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < n_out
    w_srow = cols // block_n  # [BN] the weight scale row of each output column
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for g in range(0, tl.cdiv(k_in, BLOCK_K)):
        ks = g * BLOCK_K + tl.arange(0, BLOCK_K)
        kmask = ks < k_in
        a = tl.load(A + a_rows[:, None] * sa + ks[None, :], mask=pmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(W + e * sw_e + cols[None, :] * sw_n + ks[:, None], mask=cmask[None, :] & kmask[:, None],
                    other=0.0)  # [BK, BN]: W[e] is [n_out, k_in], read transposed
        a_s = tl.load(AS + a_rows * sas + g, mask=pmask, other=0.0)  # [BM]
        w_s = tl.load(WS + e * sws_e + w_srow * sws_n + g, mask=cmask, other=0.0)  # [BN]
        acc += _scaled_dot(a, w, DOT) * a_s[:, None] * w_s[None, :]
    tl.store(Out + pairs[:, None] * so + cols[None, :], acc.to(Out.dtype.element_ty),
             mask=pmask[:, None] & cmask[None, :])


def grouped_w8a8(q: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor,
                 sp: SortedPairs, a_div: int, block_size: tuple[int, int], out_dtype: torch.dtype,
                 block_n: int = 64) -> torch.Tensor:
    """q [rows, k_in] fp8 with a_scale [rows, G] (row of pair p: p // a_div), w [E, n_out, k_in] fp8,
    w_scale_inv [E, ceil(n_out/bn), G] -> [N, n_out], row p = dequant(q_row) @ dequant(w[e_p]).T."""
    bn, bk = block_size
    n_out, k_in = w.shape[1], w.shape[2]
    w_scale_inv = w_scale_inv.contiguous()  # the kernel steps along K by 1 (scales are small)
    out = torch.empty(sp.num_pairs, n_out, dtype=out_dtype, device=q.device)
    blocks = sp.block_expert.shape[0]
    if blocks and sp.num_pairs:
        grid = (blocks, triton.cdiv(n_out, block_n))
        _grouped_w8a8_kernel[grid](q, a_scale, w, w_scale_inv, out, sp.pair_ids, sp.block_expert, sp.num_pairs,
                                   a_div, n_out, k_in, q.stride(0), a_scale.stride(0), w.stride(0), w.stride(1),
                                   w_scale_inv.stride(0), w_scale_inv.stride(1), out.stride(0), bn,
                                   BLOCK_M=sp.block_m, BLOCK_N=block_n, BLOCK_K=bk, DOT=dot_mode(q))
    return out


def fused_moe_fp8(x: torch.Tensor, w13: torch.Tensor, w13_scale_inv: torch.Tensor, w2: torch.Tensor,
                  w2_scale_inv: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  block_size: tuple[int, int] = (128, 128), block_m: int = 16) -> torch.Tensor:
    """``fp8_ref.fused_moe_fp8_ref``'s contract: x [T, H], weights [T, K] float32, ids [T, K] -> [T, H]."""
    T, K = ids.shape
    bk = block_size[1]
    sp = sort_pairs(ids, w13.shape[0], block_m)
    q, s = per_token_group_quant(x, bk)  # once per token, not per pair
    gate_up = grouped_w8a8(q, s, w13, w13_scale_inv, sp, K, block_size, x.dtype)  # [N, 2I]
    g, u = gate_up.chunk(2, dim=-1)
    inter = (F.silu(g.float()) * u.float()).to(x.dtype)  # [N, I]
    q2, s2 = per_token_group_quant(inter, bk)
    y = grouped_w8a8(q2, s2, w2, w2_scale_inv, sp, 1, block_size, x.dtype)  # [N, H]
    return (y.float().view(T, K, w2.shape[1]) * weights.unsqueeze(-1)).sum(1).to(x.dtype)  # [T, H]
