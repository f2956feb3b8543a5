"""The torch twins of ``fp8_gemm`` and ``fp8_moe`` (block-scaled W8A8, DeepSeek-V3's FP8 format),
importable without triton: the CPU path of ``pdserve.layers.quant.fp8_kernels`` runs them.

Legend: T tokens, K in-features, N out-features, G = ceil(K / bk) activation groups (= weight
scale columns), bn x bk the weight scale block, E experts, H hidden, I intermediate, k experts
per token.

Format: weights float8_e4m3fn [N, K] with float32 ``scale_inv`` [ceil(N/bn), ceil(K/bk)]
(weight ~= fp8 * scale_inv of its block; edge blocks are partial). Activations are quantized
per token and group of bk along K, dynamically: scale = amax / 448, q = e4m3(x / scale).
The twins accumulate block by block in float32 as the kernels do, so the two agree to float32
rounding; the tests check the twins against plain dequantize-then-matmul separately.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn
EPS = 1e-10  # floor of a group's amax, so an all-zero group gets a finite scale


def per_token_group_quant_ref(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (q [T, K] float8_e4m3fn, scale [T, G] float32), x ~= q * scale per group."""
    T, K = x.shape
    G = -(-K // group)
    xf = F.pad(x.float(), (0, G * group - K)).view(T, G, group)  # [T, G, bk], zero-padded edge group
    scale = xf.abs().amax(-1).clamp(min=EPS) / FP8_MAX  # [T, G]
    q = (xf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)  # round to nearest even
    return q.view(T, G * group)[:, :K], scale


def w8a8_block_matmul_ref(x: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor,
                          block_size: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """x [T, K], w [N, K] fp8, w_scale_inv [ceil(N/bn), ceil(K/bk)] -> [T, N] in x.dtype.

    Per K-block: the fp8 x fp8 product in float32, times the token's group scale and the
    weight block's scale of each output column, summed over K-blocks."""
    bn, bk = block_size
    N, K = w.shape
    q, a_scale = per_token_group_quant_ref(x, bk)  # [T, K], [T, G]
    col_scale = w_scale_inv.float().repeat_interleave(bn, 0)[:N]  # [N, G]: each column's block row
    acc = torch.zeros(x.shape[0], N, dtype=torch.float32, device=x.device)
    for g in range(-(-K // bk)):
        ks = slice(g * bk, (g + 1) * bk)
        part = q[:, ks].float() @ w[:, ks].float().T  # [T, N]
        acc += part * a_scale[:, g:g + 1] * col_scale[:, g]
    return acc.to(x.dtype)


def fused_moe_fp8_ref(x: torch.Tensor, w13: torch.Tensor, w13_scale_inv: torch.Tensor, w2: torch.Tensor,
                      w2_scale_inv: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                      block_size: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """The per-expert loop. x [T, H], w13 [E, 2I, H] (gate | up) fp8, w13_scale_inv
    [E, ceil(2I/bn), ceil(H/bk)], w2 [E, H, I] fp8, w2_scale_inv [E, ceil(H/bn), ceil(I/bk)],
    weights [T, k] float32, ids [T, k] -> sum_k weights * expert(x) [T, H] in x.dtype.

    Each GEMM quantizes its input per token group (x before w13, the SwiGLU output before w2);
    the routing weights multiply the expert outputs in float32, as the bf16 fused MoE does."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)  # [T, H]
    for e in ids.unique().tolist():
        t, k = (ids == e).nonzero(as_tuple=True)  # the (token, slot) pairs routed to e
        g, u = w8a8_block_matmul_ref(x[t], w13[e], w13_scale_inv[e], block_size).chunk(2, dim=-1)  # [n, I]
        inter = (F.silu(g.float()) * u.float()).to(x.dtype)  # [n, I]
        y = w8a8_block_matmul_ref(inter, w2[e], w2_scale_inv[e], block_size)  # [n, H]
        out.index_add_(0, t, y.float() * weights[t, k].unsqueeze(-1))
    return out.to(x.dtype)
