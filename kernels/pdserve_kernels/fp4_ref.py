"""Torch twins of pdserve_kernels.fp4_moe: FP4 experts (DeepSeek-V4's e2m1 format) dequantized, then
the per-expert loop.

Legend: T tokens, k experts per token, E experts, H hidden, I intermediate, B = 32 columns per scale.
An FP4 weight [rows, cols] is int8 [rows, cols / 2] (column 2j in byte j's low nibble, 2j + 1 in its
high one; e2m1 codes: bit 3 the sign, bits 0-2 index 0, 0.5, 1, 1.5, 2, 3, 4, 6) with ue8m0 scales
uint8 [rows, cols / B], each worth 2^(byte - 127).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP4_BLOCK = 32
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_fp4_ref(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """packed int8 [..., rows, P], scale uint8 [..., rows, 2P / B] -> float32 [..., rows, 2P] (exact)."""
    u8 = packed.view(torch.uint8).long()
    codes = torch.stack([u8 & 0xF, u8 >> 4], dim=-1).flatten(-2)  # [..., rows, 2P]
    values = torch.tensor(_E2M1, dtype=torch.float32, device=packed.device)[codes]
    return values * (scale.float() - 127).exp2().repeat_interleave(FP4_BLOCK, dim=-1)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """silu(gate) * up, DeepSeek-V4's clamps first (``swiglu_limit``; None: none), in float32."""
    gate, up = gate.float(), up.float()
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


def fused_moe_fp4_ref(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                      w2_scale: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                      swiglu_limit: float | None = None) -> torch.Tensor:
    """x [T, H], w13 int8 [E, 2I, H / 2] (gate | up rows) with w13_scale uint8 [E, 2I, H / B], w2 int8
    [E, H, I / 2] with w2_scale uint8 [E, H, I / B], weights [T, k] float32, ids [T, k] ->
    sum_k weights * down(swiglu(gate, up)) [T, H] in x.dtype. Activations stay in x.dtype (W4A16):
    each GEMM multiplies x.dtype inputs by the exactly dequantized weight, accumulating in float32."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)  # [T, H]
    for e in ids.unique().tolist():
        t, k = (ids == e).nonzero(as_tuple=True)  # the (token, slot) pairs routed to e
        g, u = (x[t].float() @ dequantize_fp4_ref(w13[e], w13_scale[e]).T).to(x.dtype).chunk(2, dim=-1)  # [n, I]
        inter = clamped_swiglu(g, u, swiglu_limit).to(x.dtype)  # [n, I]
        y = (inter.float() @ dequantize_fp4_ref(w2[e], w2_scale[e]).T).to(x.dtype)  # [n, H]
        out.index_add_(0, t, y.float() * weights[t, k].unsqueeze(-1))
    return out.to(x.dtype)
