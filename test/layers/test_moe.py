"""MoE: routing rules vs transformers' routers, batched experts vs the per-expert loop,
EP / TP splits that sum to the whole, and both checkpoint layouts for expert weights."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config, Qwen3MoeConfig
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from pdserve.distributed.parallel_state import SINGLE, ParallelState
from pdserve.layers.moe import Experts, RoutingConfig, TopKRouter
from pdserve.models.base import load_into

H, E, I = 32, 16, 24


def _sorted(weights, ids):
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


def _compare_router(hf_router, cfg: RoutingConfig, T: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        hf_router.weight.copy_(torch.randn(hf_router.weight.shape, generator=g))
        ours = TopKRouter(H, cfg, torch.float32)
        ours.weight.copy_(hf_router.weight)
        if hasattr(hf_router, "e_score_correction_bias"):
            hf_router.e_score_correction_bias.copy_(torch.randn(E, generator=g) * 0.5)
            ours.e_score_correction_bias.copy_(hf_router.e_score_correction_bias)
        x = torch.randn(T, H, generator=g)
        _, want_w, want_ids = hf_router(x)
        got_w, got_ids = ours(x)
    want_w, want_ids = _sorted(want_w.float(), want_ids)
    got_w, got_ids = _sorted(got_w, got_ids)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("norm", [True, False])
def test_qwen_moe_router_matches_transformers(norm):
    c = Qwen3MoeConfig(hidden_size=H, num_experts=E, num_experts_per_tok=4, norm_topk_prob=norm)
    _compare_router(Qwen3MoeTopKRouter(c), RoutingConfig.qwen_moe(c))


@pytest.mark.parametrize("method,scaling", [("greedy", 1.0), ("group_limited_greedy", 16.0)])
def test_deepseek_v2_router_matches_transformers(method, scaling):
    c = DeepseekV2Config(hidden_size=H, n_routed_experts=E, num_experts_per_tok=3, topk_method=method,
                         n_group=4, topk_group=2, routed_scaling_factor=scaling, norm_topk_prob=False)
    _compare_router(DeepseekV2TopkRouter(c), RoutingConfig.deepseek_v2(c))


@pytest.mark.parametrize("norm,scaling", [(True, 2.5), (False, 1.0)])
def test_deepseek_v3_router_matches_transformers(norm, scaling):
    c = DeepseekV3Config(hidden_size=H, n_routed_experts=E, num_experts_per_tok=4, n_group=4, topk_group=2,
                         norm_topk_prob=norm, routed_scaling_factor=scaling)
    _compare_router(DeepseekV3TopkRouter(c), RoutingConfig.deepseek_v3(c))


def test_group_limited_routing_stays_inside_top_groups():
    c = DeepseekV2Config(hidden_size=H, n_routed_experts=E, num_experts_per_tok=4,
                         topk_method="group_limited_greedy", n_group=4, topk_group=2)
    router = TopKRouter(H, RoutingConfig.deepseek_v2(c), torch.float32)
    torch.nn.init.normal_(router.weight)
    _, ids = router(torch.randn(128, H))
    assert ((ids // (E // 4)).unsqueeze(-1) == (ids // (E // 4)).unsqueeze(-2)).any(-1).all()
    assert max(len(set(row)) for row in (ids // (E // 4)).tolist()) <= 2


def test_unknown_topk_method_is_a_value_error():
    c = DeepseekV2Config(hidden_size=H, n_routed_experts=E, num_experts_per_tok=2)
    c.topk_method = "noaux_tc_v9"
    with pytest.raises(ValueError, match="topk_method"):
        RoutingConfig.deepseek_v2(c)


def _expert_tensors(seed: int = 0, prefix: str = "experts") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for e in range(E):
        out[f"{prefix}.{e}.gate_proj.weight"] = torch.randn(I, H, generator=g) * 0.2
        out[f"{prefix}.{e}.up_proj.weight"] = torch.randn(I, H, generator=g) * 0.2
        out[f"{prefix}.{e}.down_proj.weight"] = torch.randn(H, I, generator=g) * 0.2
    return out


def _experts(parallel=SINGLE, dtype=torch.float32, tensors=None) -> Experts:
    ex = Experts(E, H, I, parallel, dtype)
    load_into(torch.nn.ModuleDict({"experts": ex}), (tensors or _expert_tensors()).items())
    return ex


def _routing(T: int, K: int, seed: int = 1, skew: bool = False):
    g = torch.Generator().manual_seed(seed)
    if skew:  # most tokens on two experts, several experts idle
        ids = torch.stack([torch.randperm(4, generator=g)[:K] for _ in range(T)])
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    return torch.rand(T, K, generator=g), ids, torch.randn(T, H, generator=g)


@pytest.mark.parametrize("impl", ["grouped", "sliced", "auto"])
@pytest.mark.parametrize("T,K,skew", [(1, 1, False), (7, 2, False), (64, 4, False), (50, 2, True)])
def test_batched_experts_match_loop_reference(impl, T, K, skew):
    ex = _experts()
    ex.impl = impl
    w, ids, x = _routing(T, K, skew=skew)
    torch.testing.assert_close(ex(x, w, ids), ex.forward_loop(x, w, ids), atol=1e-5, rtol=1e-5)


def test_batched_experts_bf16_close_to_loop():
    ex = _experts(dtype=torch.bfloat16)
    w, ids, x = _routing(32, 2)
    x = x.bfloat16()
    torch.testing.assert_close(ex(x, w, ids).float(), ex.forward_loop(x, w, ids).float(), atol=3e-2, rtol=3e-2)


def test_no_tokens():
    ex = _experts()
    out = ex(torch.empty(0, H), torch.empty(0, 2), torch.empty(0, 2, dtype=torch.int64))
    assert out.shape == (0, H)


@pytest.mark.parametrize("axis", ["ep", "tp"])
def test_rank_shares_sum_to_the_whole(axis):
    """EP: each rank runs its own experts; TP: each rank runs a slice of every expert's I.
    Either way the per-rank partial outputs add up to the single-rank result."""
    w, ids, x = _routing(40, 4)
    full = _experts()(x, w, ids)
    shares = []
    for r in range(2):
        ps = ParallelState(ep_rank=r, ep_size=2) if axis == "ep" else ParallelState(tp_rank=r, tp_size=2)
        ex = _experts(ps)
        assert ex.num_local == (E // 2 if axis == "ep" else E)
        shares.append(ex(x, w, ids))
        torch.testing.assert_close(shares[-1], ex.forward_loop(x, w, ids), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(shares[0] + shares[1], full, atol=1e-5, rtol=1e-5)


def test_fused_checkpoint_layout_loads_the_same_weights():
    per_expert = _expert_tensors()
    gate_up = torch.stack([torch.cat([per_expert[f"experts.{e}.gate_proj.weight"],
                                      per_expert[f"experts.{e}.up_proj.weight"]]) for e in range(E)])
    down = torch.stack([per_expert[f"experts.{e}.down_proj.weight"] for e in range(E)])
    a = _experts()
    b = _experts(tensors={"experts.gate_up_proj": gate_up, "experts.down_proj": down})
    assert torch.equal(a.w13, b.w13) and torch.equal(a.w2, b.w2)


def test_missing_expert_tensor_is_named():
    tensors = _expert_tensors()
    del tensors["experts.5.up_proj.weight"]
    with pytest.raises(ValueError, match=r"experts\.5\.up_proj\.weight"):
        _experts(tensors=tensors)
