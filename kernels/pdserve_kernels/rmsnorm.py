"""RMSNorm fused with the residual add before it: one read of x and the residual, one write of
each result, instead of an add, a write, and the norm's reads.

Legend: T rows, X width. Statistics in float32; the normalised value is rounded to the input
dtype before the weight multiplies it (HF's order, which pdserve's RMSNorm follows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_kernel(X, R, W, Y, sx, sr, sy, n_cols, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * sx + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        x = x + tl.load(R + row * sr + cols, mask=mask, other=0.0).to(tl.float32)
        x = x.to(R.dtype.element_ty)
        tl.store(R + row * sr + cols, x, mask=mask)  # the next residual stream, in place
        x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n_cols + eps)
    y = (x * rstd).to(Y.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * sy + cols, (w * y).to(Y.dtype.element_ty), mask=mask)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """x [T, X] -> y [T, X]; with ``residual`` [T, X] (updated in place to x + residual)
    returns (y, residual), as pdserve's RMSNorm does."""
    T, X = x.shape
    y = torch.empty_like(x)
    r = residual if residual is not None else x
    if T:
        _rmsnorm_kernel[(T,)](x, r, weight, y, x.stride(0), r.stride(0), y.stride(0), X, eps,
                              HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(X))
    return y if residual is None else (y, residual)


def rmsnorm_ref(x, weight, eps, residual=None):
    if residual is not None:
        residual.copy_(x + residual)
        x = residual
    y = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)
    y = (weight.float() * y.float()).to(x.dtype)
    return y if residual is None else (y, residual)
