"""DeepSeek-V4's FP4 experts (e2m1 pairs in int8, ue8m0 scales per 32 columns) and its mixed FP8/FP4
checkpoint stream: the decode checked against hand-written bytes, not against our own quantizer."""

from __future__ import annotations

import pytest
import torch

from pdserve.config import Fp8BlockConfig
from pdserve.layers.quant.fp4 import (
    dequantize_fp4,
    dequantized_v4_checkpoint,
    is_fp4_expert,
    is_v4_fp8_linear,
    quantize_fp4,
    quantized_v4_checkpoint,
    scale_key,
)

V4 = Fp8BlockConfig(expert_dtype="fp4")
E8M0 = torch.float8_e8m0fnu


def _byte(low: int, high: int) -> int:
    return low | high << 4


def test_hand_made_bytes_decode_nibble_by_nibble():
    """One row of 32 columns (16 bytes), every e2m1 code once in the low nibble and once in the high one,
    scale byte 128 (2^1); a second row with scale byte 125 (2^-2). Column 2j is byte j's low nibble."""
    values = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    row0 = [_byte(c, 15 - c) for c in range(16)]  # columns: c, 15 - c, ...
    row1 = [_byte(8, 1)] + [_byte(7, 9)] * 15
    packed = torch.tensor([row0, row1], dtype=torch.uint8).view(torch.int8)  # [2, 16]
    scale = torch.tensor([[128], [125]], dtype=torch.uint8)  # [2, 1]
    w = dequantize_fp4(packed, scale)
    want0 = [v for c in range(16) for v in (values[c] * 2, values[15 - c] * 2)]
    want1 = [-0.0, 0.5 / 4] + [6.0 / 4, -0.5 / 4] * 15
    for got, want in zip(w.tolist(), [want0, want1]):
        assert got == want
        assert [torch.signbit(torch.tensor(g)).item() for g in got] == [str(v).startswith("-") for v in want]
    assert torch.signbit(w[0, 15]) and w[0, 15] == 0  # code 8 in byte 7's high nibble: -0.0 (times 2)
    # The same bytes with their scale as float8_e8m0fnu, as DeepSeek ships it: the same weight.
    assert torch.equal(dequantize_fp4(packed, scale.view(E8M0)), w)


def test_scale_exponents_cover_the_ue8m0_range_exactly():
    packed = torch.full((3, 16), _byte(2, 2), dtype=torch.uint8).view(torch.int8)  # every element 1.0
    scale = torch.tensor([[0], [127], [254]], dtype=torch.uint8)
    w = dequantize_fp4(packed, scale)
    assert w[:, 0].tolist() == [2.0 ** -127, 1.0, 2.0 ** 127]
    with pytest.raises(ValueError, match="0xFF"):
        dequantize_fp4(packed, torch.full((3, 1), 255, dtype=torch.uint8))


def test_each_scale_covers_its_own_row_and_32_columns():
    packed = torch.full((2, 32), _byte(2, 2), dtype=torch.uint8).view(torch.int8)  # [2, 64], all 1.0
    scale = torch.tensor([[127, 128], [129, 130]], dtype=torch.uint8)
    w = dequantize_fp4(packed, scale)
    assert w[0, :32].eq(1).all() and w[0, 32:].eq(2).all() and w[1, :32].eq(4).all() and w[1, 32:].eq(8).all()


def test_scale_of_the_wrong_grid_or_dtype_is_refused():
    packed = torch.zeros(4, 16, dtype=torch.int8)
    with pytest.raises(ValueError, match=r"expected \(4, 1\)"):
        dequantize_fp4(packed, torch.zeros(1, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="expected float8_e8m0fnu or uint8"):
        dequantize_fp4(packed, torch.zeros(4, 1))


def test_quantizer_round_trips_within_one_e2m1_step_and_keeps_signs():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 96, generator=g) * torch.logspace(-3, 1, 16)[:, None]  # rows of very different sizes
    packed, scale = quantize_fp4(w)
    assert packed.dtype == torch.int8 and packed.shape == (16, 48) and scale.shape == (16, 3)
    d = dequantize_fp4(packed, scale)
    per_block = (scale.view(torch.uint8).float() - 127).exp2().repeat_interleave(32, dim=1)
    assert ((d - w).abs() <= per_block).all()  # the largest e2m1 gap (4 -> 6) is 2 * scale: half of it
    assert (d.abs() <= 6 * per_block).all()
    assert (torch.signbit(d) == torch.signbit(w)).all()


def test_which_v4_tensors_are_fp4_fp8_or_full_precision():
    fp4 = ["model.layers.1.ffn.experts.3.w1.weight", "model.layers.0.mlp.experts.15.w2.weight"]
    fp8 = ["model.layers.1.attn.wq_a.weight", "model.layers.1.self_attn.kv_proj.weight",
           "model.layers.2.attn.wo_b.weight", "model.layers.1.attn.indexer.wq_b.weight",
           "model.layers.1.self_attn.compressor.indexer.q_b_proj.weight", "model.layers.0.ffn.shared_experts.w2.weight"]
    full = ["model.layers.1.attn.wo_a.weight", "model.layers.1.attn.compressor.wkv.weight",
            "model.layers.1.self_attn.compressor.kv_proj.weight", "model.layers.1.attn.indexer.compressor.wgate.weight",
            "model.layers.1.attn.indexer.weights_proj.weight", "model.layers.1.ffn.gate.weight", "head.weight"]
    assert [is_fp4_expert(k) for k in fp4 + fp8 + full] == [True] * 2 + [False] * 13
    assert [is_v4_fp8_linear(k) for k in fp4 + fp8 + full] == [False] * 2 + [True] * 6 + [False] * 7


def test_scale_names_as_shipped_and_as_saved():
    assert scale_key("layers.0.ffn.experts.1.w1.scale") == "layers.0.ffn.experts.1.w1.weight"
    assert scale_key("model.layers.0.attn.wq_a.weight_scale_inv") == "model.layers.0.attn.wq_a.weight"
    assert scale_key("model.layers.0.attn_hc.scale") is None and scale_key("layers.0.hc_attn_scale") is None


@pytest.mark.parametrize("scales_first", [False, True])
def test_stream_pairs_fp4_and_fp8_in_either_order(scales_first):
    g = torch.Generator().manual_seed(1)
    full = {"layers.0.ffn.experts.0.w1.weight": torch.randn(64, 64, generator=g),
            "layers.0.attn.wq_a.weight": torch.randn(32, 64, generator=g),
            "layers.0.attn.wo_a.weight": torch.randn(16, 64, generator=g)}
    q = list(quantized_v4_checkpoint(full.items(), V4))
    assert {k: t.dtype for k, t in q}["layers.0.ffn.experts.0.w1.weight"] == torch.int8
    assert {k: t.dtype for k, t in q}["layers.0.attn.wq_a.weight"] == torch.float8_e4m3fn
    # DeepSeek's own names for the scales: X.scale.
    q = [(k.replace(".weight_scale_inv", ".scale"), t) for k, t in q]
    if scales_first:
        q.sort(key=lambda kv: not kv[0].endswith(".scale"))
    out = dict(dequantized_v4_checkpoint(q, V4, torch.float32))
    assert out.keys() == full.keys()
    assert torch.equal(out["layers.0.attn.wo_a.weight"], full["layers.0.attn.wo_a.weight"])
    packed, scale = quantize_fp4(full["layers.0.ffn.experts.0.w1.weight"])
    assert torch.equal(out["layers.0.ffn.experts.0.w1.weight"], dequantize_fp4(packed, scale))


def test_a_weight_or_scale_without_its_partner_is_named():
    packed, scale = quantize_fp4(torch.ones(4, 32))
    with pytest.raises(ValueError, match=r"layers.0.ffn.experts.0.w1.weight: quantized weight without its block"):
        list(dequantized_v4_checkpoint([("layers.0.ffn.experts.0.w1.weight", packed)], V4, torch.float32))
    with pytest.raises(ValueError, match=r"layers.0.ffn.experts.0.w1.scale: block scale without its weight"):
        list(dequantized_v4_checkpoint([("layers.0.ffn.experts.0.w1.scale", scale)], V4, torch.float32))
    with pytest.raises(ValueError, match=r"w1.scale: a block scale for .*w1.weight, which is torch.float32"):
        list(dequantized_v4_checkpoint([("layers.0.ffn.experts.0.w1.scale", scale),
                                        ("layers.0.ffn.experts.0.w1.weight", torch.ones(4, 32))], V4, torch.float32))


def test_expert_dtype_parses_and_other_values_are_refused():
    raw = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    assert Fp8BlockConfig.from_hf(raw | {"expert_dtype": "fp4", "scale_fmt": "ue8m0"}) == V4
    assert Fp8BlockConfig.from_hf(V4.to_hf()) == V4 and V4.name == "fp8-block128x128-fp4experts"
    assert Fp8BlockConfig.from_hf(raw).expert_dtype == "fp8"
    with pytest.raises(ValueError, match="quantization_config.expert_dtype: 'nvfp4' is not supported"):
        Fp8BlockConfig.from_hf(raw | {"expert_dtype": "nvfp4"})


def test_fused_moe_fp4_on_cpu_equals_the_models_experts_on_the_dequantized_weights():
    """The CPU dispatch (the twin) over packed experts computes what DeepSeek-V4's Experts compute
    over the same experts dequantized on load."""
    from types import SimpleNamespace

    from pdserve.layers.quant.fp4 import fused_moe_fp4
    from pdserve.models.deepseek_v4 import Experts

    E, I, Hd, T = 4, 32, 64, 6
    g = torch.Generator().manual_seed(3)
    experts = Experts(SimpleNamespace(n_routed_experts=E, moe_intermediate_size=I, hidden_size=Hd, swiglu_limit=1.0),
                      torch.float32)
    packed = [[quantize_fp4(torch.randn(r, c, generator=g)) for _ in range(E)] for r, c in ((2 * I, Hd), (Hd, I))]
    (w13, s13), (w2, s2) = ((torch.stack([p for p, _ in ws]), torch.stack([s for _, s in ws])) for ws in packed)
    experts.gate_up_proj.copy_(torch.stack([dequantize_fp4(p, s) for p, s in packed[0]]))
    experts.down_proj.copy_(torch.stack([dequantize_fp4(p, s) for p, s in packed[1]]))
    x = torch.randn(T, Hd, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)])
    weights = torch.rand(T, 2, generator=g)
    want = experts(x, weights, ids)
    got = fused_moe_fp4(x, w13, s13, w2, s2, weights, ids, swiglu_limit=1.0)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5) and want.abs().max() > 0.1
    with pytest.raises(ValueError, match=r"w2_scale: shape \(4, 64, 2\), expected \(4, 64, 1\)"):
        fused_moe_fp4(x, w13, s13, w2, torch.zeros(E, Hd, 2, dtype=torch.uint8), weights, ids)
