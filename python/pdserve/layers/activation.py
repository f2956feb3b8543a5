"""Gated activations. Legend: T tokens, I intermediate size (per rank).

On CPU float32 (eagerly, up to ``fused_cpu.SILU_MAX_ELEMENTS``) SiLU x mul is one plain-C call
(``pdserve_kernels.fused_cpu``) on as many threads as torch's intra-op ones (idle between the
projections around it); ``silu_and_mul_torch`` is its twin and every other case."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve_kernels import fused_cpu


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] = [gate | up] -> silu(gate) * up [..., I]."""
    if fused_cpu.takes(x, fused_cpu.SILU_MAX_ELEMENTS):
        return fused_cpu.silu_and_mul(x, torch.get_num_threads())
    return silu_and_mul_torch(x)


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)  # into silu's fresh output: one pass and one allocation fewer


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
