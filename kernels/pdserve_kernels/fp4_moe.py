"""Fused MoE over FP4 experts (DeepSeek-V4's e2m1 format, ue8m0 scales per 32 columns): ``moe``'s
sorted pairs and grouped GEMM, each weight tile dequantized in-kernel from its packed nibbles, the
activations in the model dtype (W4A16). Twin: ``fp4_ref.fused_moe_fp4_ref`` (the per-expert loop).

Legend: T tokens, K experts per token, N = T*K (token, expert) pairs, E experts, H hidden,
I intermediate, B = 32 the scale block along the reduction dim (one K-step of the kernel), BM rows
per block of sorted pairs. Weights as pdserve's Experts stacks them, packed: w13 int8 [E, 2I, H/2]
(gate | up rows) with scales uint8 [E, 2I, H/B], w2 int8 [E, H, I/2] with scales uint8 [E, H, I/B].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve_kernels.decode_attention import _f32_dot
from pdserve_kernels.fp4_ref import FP4_BLOCK, clamped_swiglu
from pdserve_kernels.moe import SortedPairs, sort_pairs


@triton.jit
def _e2m1(code):
    """e2m1 codes (int32 0..15) -> float32: bit 3 the sign, bits 1-2 the exponent, bit 0 the mantissa."""
    e = (code >> 1) & 3
    m = (code & 1).to(tl.float32)
    mag = tl.where(e == 0, m * 0.5, (1.0 + m * 0.5) * (1 << e).to(tl.float32) * 0.5)
    return tl.where((code & 8) != 0, -mag, mag)


@triton.jit
def _grouped_w4_kernel(A, W, WS, Out, PairIds, BlockExpert, num_pairs, a_div, n_out, k_in,
                       sa, sw_e, sw_n, sws_e, sws_n, so,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HALF_K: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    e = tl.load(BlockExpert + pid_m)
    pairs = tl.load(PairIds + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM]
    pmask = pairs < num_pairs
    a_rows = pairs // a_div  # the token of a pair (a_div = K) or the pair itself (a_div = 1)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < n_out
    j = tl.arange(0, HALF_K)  # byte j of a K-step holds columns 2j (low nibble) and 2j + 1 (high)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for g in range(0, k_in // (2 * HALF_K)):
        ks = g * 2 * HALF_K + 2 * j  # [B/2] the even columns of this scale block
        amask = pmask[:, None] & (ks[None, :] < k_in)
        a_even = tl.load(A + a_rows[:, None] * sa + ks[None, :], mask=amask, other=0.0)  # [BM, B/2]
        a_odd = tl.load(A + a_rows[:, None] * sa + ks[None, :] + 1, mask=amask, other=0.0)
        byte = tl.load(W + e * sw_e + cols[None, :] * sw_n + g * HALF_K + j[:, None], mask=cmask[None, :],
                       other=0).to(tl.int32) & 0xFF  # [B/2, BN]: W[e] is [n_out, k_in / 2], read transposed
        lo = _e2m1(byte & 0xF).to(a_even.dtype)  # e2m1 values are exact in bf16 and fp16
        hi = _e2m1(byte >> 4).to(a_even.dtype)
        scale = tl.exp2(tl.load(WS + e * sws_e + cols * sws_n + g, mask=cmask, other=127).to(tl.float32) - 127.0)
        if IEEE:
            part = tl.dot(a_even.to(tl.float32), lo.to(tl.float32), input_precision="ieee")
            part += tl.dot(a_odd.to(tl.float32), hi.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(a_even, lo) + tl.dot(a_odd, hi)
        acc += part * scale[None, :]
    tl.store(Out + pairs[:, None] * so + cols[None, :], acc.to(Out.dtype.element_ty),
             mask=pmask[:, None] & cmask[None, :])


def grouped_w4(a: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, sp: SortedPairs, a_div: int,
               block_n: int = 32) -> torch.Tensor:
    """a [rows, k_in] (row of pair p: p // a_div), w int8 [E, n_out, k_in / 2], w_scale uint8
    [E, n_out, k_in / B] -> [N, n_out] in a.dtype, row p = a_row @ dequant(w[e_p]).T."""
    n_out, k_in = w.shape[1], 2 * w.shape[2]
    out = torch.empty(sp.num_pairs, n_out, dtype=a.dtype, device=a.device)
    blocks = sp.block_expert.shape[0]
    if blocks and sp.num_pairs:
        grid = (blocks, triton.cdiv(n_out, block_n))
        _grouped_w4_kernel[grid](a, w, w_scale, out, sp.pair_ids, sp.block_expert, sp.num_pairs, a_div, n_out, k_in,
                                 a.stride(0), w.stride(0), w.stride(1), w_scale.stride(0), w_scale.stride(1),
                                 out.stride(0), BLOCK_M=sp.block_m, BLOCK_N=block_n, HALF_K=FP4_BLOCK // 2,
                                 IEEE=_f32_dot(a))
    return out


def fused_moe_fp4(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                  w2_scale: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  swiglu_limit: float | None = None, block_m: int = 16) -> torch.Tensor:
    """``fp4_ref.fused_moe_fp4_ref``'s contract: x [T, H], weights [T, K] float32, ids [T, K] -> [T, H]."""
    T, K = ids.shape
    sp = sort_pairs(ids, w13.shape[0], block_m)
    gate_up = grouped_w4(x.contiguous(), w13, w13_scale.contiguous(), sp, K)  # [N, 2I]
    g, u = gate_up.chunk(2, dim=-1)
    inter = clamped_swiglu(g, u, swiglu_limit).to(x.dtype)  # [N, I]
    y = grouped_w4(inter, w2, w2_scale.contiguous(), sp, 1)  # [N, H]
    return (y.float().view(T, K, w2.shape[1]) * weights.unsqueeze(-1)).sum(1).to(x.dtype)  # [T, H]
