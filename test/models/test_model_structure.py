"""Which layers are dense and which MoE, per architecture rule, against transformers' own choice."""

from __future__ import annotations

import pytest
import torch

from fixtures.tiny_models import build_tiny_hf_model, tiny_config
from pdserve.distributed.parallel_state import SINGLE
from pdserve.layers.mlp import GatedMLP
from pdserve.layers.moe import SparseMoE
from pdserve.models.registry import get_model_class


def _kinds(model) -> list[str]:
    return ["moe" if isinstance(layer.mlp, SparseMoE) else "dense" for layer in model.model.layers]


def _hf_kinds(hf) -> list[str]:
    return ["moe" if hasattr(layer.mlp, "experts") else "dense" for layer in hf.model.layers]


@pytest.mark.parametrize("arch,overrides", [
    ("Qwen3MoeForCausalLM", dict(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])),
    ("Qwen3MoeForCausalLM", dict(num_hidden_layers=4, decoder_sparse_step=1, mlp_only_layers=[0, 2])),
    ("DeepseekV2ForCausalLM", dict(num_hidden_layers=4, first_k_dense_replace=2)),
    ("DeepseekV3ForCausalLM", dict(num_hidden_layers=4, first_k_dense_replace=0)),
])
def test_dense_and_moe_layers_match_transformers(arch, overrides):
    hf = build_tiny_hf_model(arch, **overrides)
    ours = get_model_class(arch)(hf.config, SINGLE, torch.float32)
    assert _kinds(ours) == _hf_kinds(hf)


def test_deepseek_moe_layer_freq():
    """DeepSeek's own code (transformers ignores the field): MoE on layers >= first_k_dense_replace
    whose index is a multiple of moe_layer_freq."""
    c = tiny_config("DeepseekV2ForCausalLM", num_hidden_layers=6, first_k_dense_replace=1)
    c.moe_layer_freq = 2
    ours = get_model_class("DeepseekV2ForCausalLM")(c, SINGLE, torch.float32)
    assert _kinds(ours) == ["dense", "dense", "moe", "dense", "moe", "dense"]
    assert isinstance(ours.model.layers[1].mlp, GatedMLP)
