"""The block-FP8 format: our quantizer and the exact dequantizer (partial edge blocks, scale
orientation), the loader's pairing stream, and the quantization config's refusals."""

import pytest
import torch

from pdserve.config import Fp8BlockConfig
from pdserve.layers.quant.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    dequantize_block_fp8,
    dequantized_checkpoint,
    is_quantized_linear,
    quantize_block_fp8,
    quantized_checkpoint,
)

FP8 = Fp8BlockConfig()


def test_round_trip_with_partial_blocks_keeps_each_block_within_its_fp8_step():
    w = torch.randn(576, 200, generator=torch.Generator().manual_seed(0))  # kv_a_proj_with_mqa's 576 rows
    q, scale = quantize_block_fp8(w)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape and scale.shape == (5, 2)  # 4.5 x 1.5 blocks
    back = dequantize_block_fp8(q, scale)
    for r in range(5):
        for c in range(2):
            blk = w[r * 128:(r + 1) * 128, c * 128:(c + 1) * 128]
            err = (back[r * 128:(r + 1) * 128, c * 128:(c + 1) * 128] - blk).abs()
            assert scale[r, c] == pytest.approx(float(blk.abs().max()) / FP8_MAX, rel=1e-6)
            assert bool((err <= blk.abs() / 16 + scale[r, c] * 2 ** -9).all())  # e4m3: 3 mantissa bits
    # The largest element of every block lands on the FP8 maximum.
    assert q.float().abs().max() == FP8_MAX


def test_dequantize_is_exact_and_requantizing_reproduces_the_checkpoint():
    w = torch.randn(300, 260, generator=torch.Generator().manual_seed(1))
    q, scale = quantize_block_fp8(w)
    back = dequantize_block_fp8(q, scale, dtype=torch.float32)
    assert torch.equal(back, q.float() * scale.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :260])
    q2, scale2 = quantize_block_fp8(back)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(scale2, scale)
    assert dequantize_block_fp8(q, scale, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_scale_is_applied_per_block_row_and_column_not_transposed():
    """A 3 x 2 grid (non-square) of distinct scales: each block of ones reads back its own scale."""
    ones = torch.ones(300, 200).to(FP8_DTYPE)
    scale = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    w = dequantize_block_fp8(ones, scale)
    assert w[0, 0] == 1 and w[0, 199] == 2 and w[129, 0] == 3 and w[200, 130] == 4 and w[299, 0] == 5
    assert w[299, 199] == 6
    square = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    w = dequantize_block_fp8(torch.ones(256, 256).to(FP8_DTYPE), square)
    assert (w[0, 128], w[128, 0]) == (2, 3)


def test_scale_of_the_wrong_grid_is_refused():
    q, scale = quantize_block_fp8(torch.randn(300, 200))
    with pytest.raises(ValueError, match=r"weight_scale_inv: shape \(2, 3\).*expected \(3, 2\)"):
        dequantize_block_fp8(q, scale.T.contiguous())


def test_which_linears_are_quantized():
    yes = ["model.layers.0.self_attn.kv_a_proj_with_mqa.weight", "model.layers.0.self_attn.q_b_proj.weight",
           "model.layers.3.mlp.experts.7.down_proj.weight", "model.layers.3.mlp.shared_experts.up_proj.weight",
           "model.layers.0.self_attn.o_proj.weight", "model.layers.4.self_attn.kv_b_proj.weight",
           "model.layers.0.self_attn.indexer.wq_b.weight", "model.layers.4.self_attn.indexer.wk.weight"]
    no = ["model.layers.3.mlp.gate.weight", "model.embed_tokens.weight", "lm_head.weight",
          "model.layers.4.eh_proj.weight", "model.layers.4.shared_head.head.weight", "model.norm.weight",
          "model.layers.0.self_attn.kv_a_layernorm.weight", "model.layers.0.self_attn.o_proj.bias",
          "model.layers.0.self_attn.indexer.weights_proj.weight", "model.layers.0.self_attn.indexer.k_norm.weight"]
    assert all(map(is_quantized_linear, yes)) and not any(map(is_quantized_linear, no))


def _stream(order):
    w = {"a.q_proj.weight": torch.randn(130, 70), "a.o_proj.weight": torch.randn(64, 140)}
    q = dict(quantized_checkpoint([*w.items(), ("a.norm.weight", torch.ones(4))], FP8))
    return w, q, [(k, q[k]) for k in order]


@pytest.mark.parametrize("order", [
    ["a.q_proj.weight", "a.norm.weight", "a.q_proj.weight_scale_inv", "a.o_proj.weight_scale_inv", "a.o_proj.weight"],
    ["a.o_proj.weight_scale_inv", "a.q_proj.weight_scale_inv", "a.o_proj.weight", "a.norm.weight", "a.q_proj.weight"],
], ids=["weight-first", "scale-first"])
def test_stream_pairs_in_either_order_and_yields_dequantized_weights(order):
    w, q, stream = _stream(order)
    out = dict(dequantized_checkpoint(stream, FP8, torch.float32))
    assert sorted(out) == ["a.norm.weight", "a.o_proj.weight", "a.q_proj.weight"]  # no scale key passes
    for k in w:
        assert torch.equal(out[k], dequantize_block_fp8(q[k], q[k + "_scale_inv"]))
    kept = dict(dequantized_checkpoint(stream, FP8, torch.float32, keep={"a.o_proj.weight"}.__contains__))
    assert kept["a.o_proj.weight"].dtype == FP8_DTYPE and "a.o_proj.weight_scale_inv" in kept
    assert kept["a.q_proj.weight"].dtype == torch.float32
    # A pair the model does not load (the MTP layer, another EP rank's expert) is dropped whole.
    used = dict(dequantized_checkpoint(stream, FP8, torch.float32, unused={"a.q_proj.weight"}.__contains__))
    assert sorted(used) == ["a.norm.weight", "a.o_proj.weight"]


def test_fp8_weight_without_scale_and_scale_without_weight_are_named():
    _, q, stream = _stream(["a.q_proj.weight", "a.norm.weight"])
    with pytest.raises(ValueError, match=r"^a\.q_proj\.weight: FP8 weight without its block scale"):
        list(dequantized_checkpoint(stream, FP8, torch.float32))
    with pytest.raises(ValueError, match=r"^a\.o_proj\.weight_scale_inv: block scale without its weight"):
        list(dequantized_checkpoint([("a.o_proj.weight_scale_inv", q["a.o_proj.weight_scale_inv"])], FP8,
                                    torch.float32))
    with pytest.raises(ValueError, match=r"a\.o_proj\.weight_scale_inv: a block scale for a\.o_proj\.weight, which "
                                         r"is torch\.float32"):
        list(dequantized_checkpoint([("a.o_proj.weight_scale_inv", q["a.o_proj.weight_scale_inv"]),
                                     ("a.o_proj.weight", torch.zeros(64, 140))], FP8, torch.float32))


@pytest.mark.parametrize("raw, field", [
    ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "static", "weight_block_size": [128, 128]},
     "quantization_config.activation_scheme"),
    ({"quant_method": "awq", "bits": 4}, "quantization_config.quant_method"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [64, 64]},
     "quantization_config.weight_block_size"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "quantization_config.weight_block_size"),
    ({"quant_method": "fp8", "fmt": "e5m2", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
     "quantization_config.fmt"),
])
def test_unsupported_quantization_config_is_refused_naming_the_field(raw, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        Fp8BlockConfig.from_hf(raw)


def test_supported_configs_parse():
    assert Fp8BlockConfig.from_hf(None) is None
    cfg = Fp8BlockConfig.from_hf(FP8.to_hf())
    assert cfg == FP8 and cfg.name == "fp8-block128x128" and cfg.block == (128, 128)
    qwen = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}  # no fmt
    assert Fp8BlockConfig.from_hf(qwen) == FP8
