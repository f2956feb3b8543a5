"""RMSNorm, optionally fused with the residual add that precedes it.

On CPU float32 (eagerly, up to ``fused_cpu.MAX_ELEMENTS``) the add and the norm are one plain-C call
(``pdserve_kernels.fused_cpu``); ``rms_norm_torch`` is its twin and every other case.

Legend: T tokens, X normalised width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve_kernels import fused_cpu


class RMSNorm(nn.Module):
    """y = w * x / rms(x), statistics in float32 (as HF does, so bf16 models match it)."""

    def __init__(self, hidden: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x [..., X]. With ``residual``: returns (norm(x + residual), x + residual), the pre-norm
        block's next residual stream, so the caller never materialises the sum twice. Both are new
        tensors: neither input is written."""
        if fused_cpu.takes(x) and self.weight.dtype == torch.float32:
            return fused_cpu.rms_norm(x, self.weight, self.eps, residual)
        return rms_norm_torch(x, self.weight, self.eps, residual)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm.forward in torch ops: any device and dtype, and the fused kernel's twin."""
    if residual is not None:
        x = x + residual
        residual = x
    out = _norm(x, weight, eps)
    return out if residual is None else (out, residual)


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    # Low precision: normalise in float32, round, then scale (HF's order of operations).
    y = F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)
    return weight * y
