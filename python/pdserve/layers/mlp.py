"""Dense SwiGLU feed-forward. Legend: T tokens, H hidden, I intermediate (I/p per TP rank)."""

from __future__ import annotations

import torch
from torch import nn

from pdserve.distributed.parallel_state import ParallelState
from pdserve.layers.activation import silu_and_mul
from pdserve.layers.linear import MergedColumnParallelLinear, RowParallelLinear


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); gate and up run as one column-parallel matmul.

    Checkpoint keys (HF): ``gate_proj``, ``up_proj``, ``down_proj`` under this module.
    ``reduce_results=False`` leaves the TP partial sum for the caller to reduce together
    with other partials (MoE shared experts).
    """

    def __init__(self, hidden: int, intermediate: int, parallel: ParallelState, dtype: torch.dtype,
                 hidden_act: str = "silu", reduce_results: bool = True):
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"hidden_act: {hidden_act!r} is not supported (supported: silu)")
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate, intermediate], parallel,
                                                       dtype=dtype, ckpt_names=("gate_proj", "up_proj"))
        self.down_proj = RowParallelLinear(intermediate, hidden, parallel, dtype=dtype,
                                           reduce_results=reduce_results)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))  # [T, 2I/p] -> [T, I/p] -> [T, H]
