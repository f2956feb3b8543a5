"""Qwen3-MoE: Qwen3 attention (q/k norm) with sparse MoE feed-forward on selected layers.

Legend: T tokens, H hidden.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.distributed.parallel_state import ParallelState
from pdserve.layers.mlp import GatedMLP
from pdserve.layers.moe import RoutingConfig, SparseMoE
from pdserve.models.decoder import GQACausalLM


def qwen_moe_layer_is_sparse(c, layer_id: int) -> bool:
    """HF's rule: sparse unless listed in mlp_only_layers, and only every decoder_sparse_step-th layer."""
    if layer_id in (getattr(c, "mlp_only_layers", None) or []):
        return False
    return c.num_experts > 0 and (layer_id + 1) % c.decoder_sparse_step == 0


class Qwen3MoeForCausalLM(GQACausalLM):
    qk_norm = True

    def make_mlp(self, layer_id: int, parallel: ParallelState, dtype: torch.dtype) -> nn.Module:
        c = self.config
        if not qwen_moe_layer_is_sparse(c, layer_id):
            return GatedMLP(c.hidden_size, c.intermediate_size, parallel, dtype, c.hidden_act)
        return SparseMoE(c.hidden_size, c.moe_intermediate_size, RoutingConfig.qwen_moe(c), parallel, dtype,
                         hidden_act=c.hidden_act)
