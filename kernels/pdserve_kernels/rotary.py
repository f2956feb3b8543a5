"""Rotary position embedding applied in place to q and k (no new tensors per layer).

Legend: T tokens, H heads, D head dim, R rotated dims (<= D), F = R/2, P cached positions.
``cos_sin`` is pdserve's table [P, 2F] (cos then sin). Neox pairs (x[i], x[i+F]); interleaved
pairs (x[2i], x[2i+1]) and, like pdserve's rotary layer, writes the result de-interleaved
([rotated evens | rotated odds]): q and k get the same permutation, so q.k is unchanged.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(X, Pos, CS, sx_t, sx_h, scs, F: tl.constexpr, INTERLEAVED: tl.constexpr,
                   BLOCK_F: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    f = tl.arange(0, BLOCK_F)
    mask = f < F
    pos = tl.load(Pos + t)
    cos = tl.load(CS + pos * scs + f, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(CS + pos * scs + F + f, mask=mask, other=0.0).to(tl.float32)
    base = X + t * sx_t + h * sx_h
    if INTERLEAVED:
        i1, i2 = 2 * f, 2 * f + 1
    else:
        i1, i2 = f, f + F
    x1 = tl.load(base + i1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + i2, mask=mask, other=0.0).to(tl.float32)
    # Both halves are loaded before either is stored, so the de-interleaving write is safe.
    tl.store(base + f, (x1 * cos - x2 * sin).to(X.dtype.element_ty), mask=mask)
    tl.store(base + F + f, (x2 * cos + x1 * sin).to(X.dtype.element_ty), mask=mask)


def rotary_(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """x [T, H, D] rotated in place over its first R = cos_sin.shape[1] dims; returns x."""
    T, H, _ = x.shape
    F = cos_sin.shape[1] // 2
    assert x.stride(2) == 1, "rotary_: the head dim must be contiguous"
    if T:
        _rotary_kernel[(T, H)](x, positions, cos_sin, x.stride(0), x.stride(1), cos_sin.stride(0), F=F,
                               INTERLEAVED=interleaved, BLOCK_F=triton.next_power_of_2(F))
    return x


def rotary_ref(x, positions, cos_sin, interleaved=False) -> torch.Tensor:
    F = cos_sin.shape[1] // 2
    cs = cos_sin[positions].float().unsqueeze(1)  # [T, 1, 2F]
    cos, sin = cs[..., :F], cs[..., F:]
    rot = x[..., :2 * F].float()
    x1, x2 = (rot[..., 0::2], rot[..., 1::2]) if interleaved else (rot[..., :F], rot[..., F:])
    x[..., :2 * F] = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    return x
