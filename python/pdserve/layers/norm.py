"""RMSNorm, optionally fused with the residual add that precedes it.

Legend: T tokens, X normalised width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """y = w * x / rms(x), statistics in float32 (as HF does, so bf16 models match it)."""

    def __init__(self, hidden: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x [..., X]. With ``residual``: returns (norm(x + residual), x + residual), the pre-norm
        block's next residual stream, so the caller never materialises the sum twice."""
        if residual is not None:
            x = x + residual
            residual = x
        out = self._norm(x)
        return out if residual is None else (out, residual)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # Low precision: normalise in float32, round, then scale (HF's order of operations).
        y = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)
        return self.weight * y
