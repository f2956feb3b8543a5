"""Block-scaled W8A8 FP8 GEMM (DeepSeek-V3's format) and the per-token-group activation quantizer
it runs after. Twins: ``fp8_ref``.

Legend: T tokens, K in-features, N out-features, bn x bk the weight scale block, G = ceil(K / bk)
activation groups; BM x BN the output tile, one K-step per bk (so each step reads one scale per
row and one per column).

y[t, n] = sum_g (q[t, g-block] . w[n, g-block]) * a_scale[t, g] * w_scale_inv[n // bn, g]
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve_kernels.fp8_ref import EPS, FP8, FP8_MAX

# How the fp8 x fp8 dot runs (a constexpr of the kernels): float32 IEEE under the interpreter
# (exact, so the twin matches tightly), fp8 tensor cores from sm89 on, bf16 (exact for e4m3) before.
DOT_F32, DOT_FP8, DOT_BF16 = 0, 1, 2


def dot_mode(t: torch.Tensor) -> int:
    if t.device.type != "cuda":
        return DOT_F32
    return DOT_FP8 if torch.cuda.get_device_capability(t.device) >= (8, 9) else DOT_BF16


@triton.jit
def _round_e4m3(v):
    """v float32 with |v| <= 448 -> the nearest e4m3 value (ties to even), still float32.

    The cast that follows is then exact: the interpreter's float32 -> fp8 cast drops the carry
    when rounding crosses a power of two (124.3 -> 64), and the GPU's rounds the same way as this."""
    bits = v.to(tl.int32, bitcast=True)
    exp = tl.maximum((bits >> 23) & 0xFF, 121)  # biased; e4m3's spacing stops shrinking at 2^-6 (subnormals)
    ulp = ((exp - 3) << 23).to(tl.float32, bitcast=True)  # 2^(e-3): three mantissa bits
    y = tl.abs(v) / ulp  # exact (a power of two)
    f = tl.floor(y)
    d = y - f
    up = (d > 0.5) | ((d == 0.5) & ((f.to(tl.int32) & 1) == 1))
    r = (f + tl.where(up, 1.0, 0.0)) * ulp
    return tl.where(v < 0, -r, r)


@triton.jit
def _group_quant_kernel(X, Q, S, n_cols, n_groups, sx, sq, ss, eps, fp8_max,
                        GROUP: tl.constexpr, GROUPS: tl.constexpr):
    row = tl.program_id(0)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)  # [GROUPS] group ids
    cols = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [GROUPS, GROUP]
    mask = cols < n_cols
    x = tl.load(X + row * sx + cols, mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), 1), eps)  # [GROUPS]
    s = tl.div_rn(amax, fp8_max)  # IEEE division, as torch's: the twin's scales bit for bit
    v = tl.clamp(tl.div_rn(x, s[:, None]), -fp8_max, fp8_max)
    tl.store(Q + row * sq + cols, _round_e4m3(v).to(Q.dtype.element_ty), mask=mask)
    tl.store(S + row * ss + g, s, mask=g < n_groups)


def per_token_group_quant(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8_ref.per_token_group_quant_ref``'s contract: x [T, K] -> (q [T, K] fp8, scale [T, G] fp32)."""
    x = x.contiguous()
    T, K = x.shape
    G = triton.cdiv(K, group)
    q = torch.empty(T, K, dtype=FP8, device=x.device)
    s = torch.empty(T, G, dtype=torch.float32, device=x.device)
    per_prog = min(triton.next_power_of_2(G), 8)
    if T:
        _group_quant_kernel[(T, triton.cdiv(G, per_prog))](x, q, s, K, G, x.stride(0), q.stride(0), s.stride(0),
                                                           EPS, FP8_MAX, GROUP=group, GROUPS=per_prog)
    return q, s


@triton.jit
def _scaled_dot(a, w, DOT: tl.constexpr):
    """a [BM, BK] fp8, w [BK, BN] fp8 -> their product in float32."""
    if DOT == 0:
        return tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    elif DOT == 1:
        return tl.dot(a, w)
    else:
        return tl.dot(a.to(tl.bfloat16), w.to(tl.bfloat16))


@triton.jit
def _w8a8_kernel(A, AS, W, WS, Out, M, N, K, sa, sas, sw, sws, so, block_n,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask, cmask = rows < M, cols < N
    w_srow = cols // block_n  # [BN] the weight scale row of each output column
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for g in range(0, tl.cdiv(K, BLOCK_K)):
        ks = g * BLOCK_K + tl.arange(0, BLOCK_K)
        kmask = ks < K
        a = tl.load(A + rows[:, None] * sa + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(W + cols[None, :] * sw + ks[:, None], mask=cmask[None, :] & kmask[:, None],
                    other=0.0)  # [BK, BN]: W is [N, K], read transposed
        a_s = tl.load(AS + rows * sas + g, mask=rmask, other=0.0)  # [BM]
        w_s = tl.load(WS + w_srow * sws + g, mask=cmask, other=0.0)  # [BN]
        acc += _scaled_dot(a, w, DOT) * a_s[:, None] * w_s[None, :]
    tl.store(Out + rows[:, None] * so + cols[None, :], acc.to(Out.dtype.element_ty),
             mask=rmask[:, None] & cmask[None, :])


def w8a8_block_matmul(x: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor,
                      block_size: tuple[int, int] = (128, 128), block_m: int | None = None,
                      block_n: int | None = None) -> torch.Tensor:
    """``fp8_ref.w8a8_block_matmul_ref``'s contract: x [T, K], w [N, K] fp8,
    w_scale_inv [ceil(N/bn), ceil(K/bk)] -> [T, N] in x.dtype. bk must be a power of two."""
    bn, bk = block_size
    q, a_scale = per_token_group_quant(x, bk)  # [T, K] fp8, [T, G]
    return w8a8_scaled_matmul(q, a_scale, w, w_scale_inv, block_size, x.dtype, block_m, block_n)


def w8a8_scaled_matmul(q: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor,
                       block_size: tuple[int, int], out_dtype: torch.dtype, block_m: int | None = None,
                       block_n: int | None = None) -> torch.Tensor:
    """The GEMM alone, on activations already quantized: q [T, K] fp8, a_scale [T, G] -> [T, N].
    Tiles default by T: decode's few rows in thin tiles (more programs over N), prefill's in wide ones."""
    bn, bk = block_size
    (T, K), N = q.shape, w.shape[0]
    tile_m, tile_n = (16, 64) if T <= 16 else (32, 64) if T <= 64 else (64, 128)
    block_m, block_n = block_m or tile_m, block_n or tile_n
    w_scale_inv = w_scale_inv.contiguous()  # the kernel steps along K by 1 (scales are small)
    out = torch.empty(T, N, dtype=out_dtype, device=q.device)
    if T and N:
        grid = (triton.cdiv(T, block_m), triton.cdiv(N, block_n))
        _w8a8_kernel[grid](q, a_scale, w, w_scale_inv, out, T, N, K, q.stride(0), a_scale.stride(0), w.stride(0),
                           w_scale_inv.stride(0), out.stride(0), bn,
                           BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk, DOT=dot_mode(q))
    return out
