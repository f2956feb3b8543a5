"""Block-FP8 checkpoints (DeepSeek-V3's and Qwen3-*-FP8's format, written by our own quantizer with
partial edge blocks, sharded so pairs cross files) serve token-identically to transformers running
the dequantized copy; what an FP8 checkpoint lacks is named; dummy FP8 presets go through the
same quantize -> load path."""

import json
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import pdserve
from fixtures.fp8_checkpoints import FP8, make_fp8_checkpoint
from fixtures.tiny_models import greedy_continuation
from pdserve.config import ModelConfig
from pdserve.distributed.parallel_state import ParallelState
from pdserve.layers.activation import silu_and_mul
from pdserve.layers.moe.experts import Experts
from pdserve.layers.quant.fp8 import FP8_DTYPE, dequantize_block_fp8, is_quantized_linear, quantize_block_fp8
from pdserve.models.base import checkpoint_tensors
from pdserve.models.loader import load_model

STEPS = 16
PROMPTS = ([5, 17, 99, 3, 250], list(range(40, 77)), [1000, 7, 7, 1200, 64, 9, 31, 2000, 11])
GREEDY = {"max_new_tokens": STEPS, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module", params=["DeepseekV3ForCausalLM", "Qwen3ForCausalLM"])
def fp8_pair(request, tmp_path_factory):
    """(fp8 dir, dequantized dir, transformers' greedy tokens on the dequantized copy)."""
    arch = request.param
    fp8_dir, plain_dir = make_fp8_checkpoint(arch, tmp_path_factory.mktemp(arch),
                                             mtp_layer=arch.startswith("Deepseek"))
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(plain_dir, dtype=torch.float32).eval()
    return fp8_dir, plain_dir, [greedy_continuation(hf, p, STEPS) for p in PROMPTS]


def test_the_checkpoint_is_in_the_official_format(fp8_pair):
    fp8_dir = Path(fp8_pair[0])
    index = json.loads((fp8_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) == 2
    tensors = {}
    for f in set(index.values()):
        tensors |= load_file(str(fp8_dir / f))
    scales = [k for k in tensors if k.endswith("_scale_inv")]
    assert scales and all(tensors[k[:-len("_scale_inv")]].dtype == FP8_DTYPE for k in scales)
    assert any(index[k] != index[k[:-len("_scale_inv")]] for k in scales)  # pairs split over the files
    partial = [k for k in scales if any(d % 128 for d in tensors[k[:-len("_scale_inv")]].shape)]
    assert any(tensors[k].numel() > 1 for k in partial)  # several blocks, the edge ones partial
    assert tensors["lm_head.weight"].dtype == tensors["model.embed_tokens.weight"].dtype == torch.float32
    assert all(tensors[k].dtype == torch.float32 for k in tensors if k.endswith(".mlp.gate.weight"))


def test_greedy_output_matches_transformers_on_the_dequantized_copy(fp8_pair):
    fp8_dir, _, expected = fp8_pair
    engine = pdserve.Engine(model_path=fp8_dir, page_size=4)
    assert engine.scheduler.runner.model_config.quantization == FP8
    out = engine.generate(input_ids=list(PROMPTS), sampling_params=GREEDY)
    assert [o["output_ids"] for o in out] == expected
    engine.shutdown()


def test_loaded_weights_equal_the_dequantized_checkpoint(fp8_pair):
    fp8_dir, plain_dir, _ = fp8_pair
    a, b = load_model(ModelConfig.from_path(fp8_dir)), load_model(ModelConfig.from_path(plain_dir))
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _copy_without(src: str, dst: Path, drop: str) -> None:
    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    shard = dst / index["weight_map"].pop(drop)
    tensors = load_file(str(shard))
    del tensors[drop]
    save_file(tensors, str(shard))
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("drop, message", [
    ("model.layers.1.self_attn.o_proj.weight_scale_inv",
     r"^model\.layers\.1\.self_attn\.o_proj\.weight: FP8 weight without its block scale"),
    ("model.layers.0.mlp.down_proj.weight", r"^model\.layers\.0\.mlp\.down_proj\.weight_scale_inv: block scale "
                                            r"without its weight"),
])
def test_a_half_pair_is_named(fp8_pair, tmp_path, drop, message):
    _copy_without(fp8_pair[0], tmp_path / "ckpt", drop)
    with pytest.raises(ValueError, match=message):
        load_model(ModelConfig.from_path(str(tmp_path / "ckpt")))


def test_unsupported_quant_method_is_refused_naming_the_field(fp8_pair, tmp_path):
    shutil.copytree(fp8_pair[0], tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"^quantization_config\.quant_method: 'awq' is not supported"):
        ModelConfig.from_path(str(tmp_path / "ckpt"))


@pytest.mark.parametrize("preset, full", [("tiny-deepseek-fp8", "tiny-deepseek"), ("tiny-qwen3-fp8", None)])
def test_dummy_fp8_presets_load_their_seeded_weights_through_the_quantizer(preset, full):
    """Every quantized linear holds FP8-representable block values (requantizing changes nothing);
    the router, norms and embeddings are the full-precision draws."""
    model = load_model(ModelConfig.from_path(preset))
    weights = dict(checkpoint_tensors(model))
    quantized = [k for k in weights if is_quantized_linear(k)]
    assert len(quantized) > 8 and not any(map(is_quantized_linear, ("lm_head.weight", "model.embed_tokens.weight")))
    for key in quantized:
        q, s = quantize_block_fp8(weights[key])
        assert torch.equal(dequantize_block_fp8(q, s), weights[key]), key
    if full is not None:  # same seed, same draws: the FP8 preset is the full one, quantized
        ref = dict(checkpoint_tensors(load_model(ModelConfig.from_path(full))))
        assert ref.keys() == weights.keys()
        for key, w in weights.items():
            assert torch.equal(w, ref[key]) != (key in quantized), key
            torch.testing.assert_close(w, ref[key], rtol=0.07, atol=0.02)


def _stand_in_kernels() -> types.ModuleType:
    """pdserve.layers.quant.fp8_kernels' interface, computed exactly (dequantize, then the plain
    matmul): what these tests check is which layers keep FP8 and that they hold the checkpoint's
    pairs, not the kernels (those have their own tests)."""
    def gemm(x, w, scale, block):
        return F.linear(x, dequantize_block_fp8(w, scale, block, x.dtype))

    def moe(x, w13, s13, w2, s2, topk_weights, topk_ids, block):
        out = torch.zeros(x.shape, dtype=torch.float32)
        for e in range(w13.shape[0]):
            tok, slot = torch.where(topk_ids == e)
            h = silu_and_mul(gemm(x[tok], w13[e], s13[e], block))
            out.index_add_(0, tok, gemm(h, w2[e], s2[e], block).float() * topk_weights[tok, slot, None])
        return out.to(x.dtype)

    stub = types.ModuleType("pdserve.layers.quant.fp8_kernels")
    stub.w8a8_block_matmul, stub.fused_moe_fp8 = gemm, moe  # type: ignore[attr-defined]
    return stub


@pytest.mark.parametrize("preset, kept_kinds", [
    ("tiny-deepseek-fp8", {"RowParallelLinear", "ColumnParallelLinear", "Experts"}),
    ("tiny-qwen3-fp8", {"RowParallelLinear", "QKVParallelLinear", "ColumnParallelLinear"}),
])
def test_layers_that_keep_fp8_hold_the_checkpoint_pairs_and_compute_the_dequantized_layer(
        monkeypatch, preset, kept_kinds):
    """The CUDA path's storage, on CPU: aligned layers hold FP8 weights and block scales; each
    computes what the dequantized model's layer does; misaligned ones were dequantized."""
    monkeypatch.setitem(sys.modules, "pdserve.layers.quant.fp8_kernels", _stand_in_kernels())
    config = ModelConfig.from_path(preset)
    fp8, plain = load_model(config, keep_fp8=True), load_model(config)
    plain_modules = dict(plain.named_modules())
    gen = torch.Generator().manual_seed(0)
    kinds = set()
    for name, m in fp8.named_modules():
        if getattr(m, "fp8_block", None) is None:
            continue
        kinds.add(type(m).__name__)
        ref = plain_modules[name]
        if isinstance(m, Experts):
            assert m.w13.dtype == m.w2.dtype == FP8_DTYPE and m.w13_scale_inv.shape[0] == m.num_local
            x = torch.randn(6, m.hidden, generator=gen)
            ids = torch.randint(0, m.num_experts, (6, 2), generator=gen)
            w = torch.rand(6, 2, generator=gen)
            torch.testing.assert_close(m(x, w, ids), ref.forward_loop(x, w, ids), atol=1e-5, rtol=1e-5)
        else:
            assert m.weight.dtype == FP8_DTYPE and m.weight_scale_inv.dtype == torch.float32
            torch.testing.assert_close(dequantize_block_fp8(m.weight, m.weight_scale_inv), ref.weight, rtol=0, atol=0)
            x = torch.randn(5, ref.weight.shape[1], generator=gen)
            torch.testing.assert_close(m(x), ref(x), atol=1e-5, rtol=1e-5)
    assert kinds == kept_kinds
    if preset == "tiny-deepseek-fp8":  # q_a | kv_a: kv_a starts at row 64, inside a block -> dequantized
        assert fp8.model.layers[0].self_attn.fused_qkv_a_proj.fp8_block is None
        assert fp8.model.layers[0].self_attn.kv_b_proj.fp8_block is None  # split into w_kc/w_vc


def test_a_tp_shard_keeps_fp8_only_where_it_falls_on_blocks_and_holds_its_own_scales():
    """Rank 1 of TP 2 on tiny-qwen3-fp8: o_proj's input columns [128, 256) are one whole block
    (kept, scale column 1); k/v (64 rows each) and the MLP (192 per rank) are not (dequantized)."""
    config = ModelConfig.from_path("tiny-qwen3-fp8")
    rank1 = ParallelState(tp_rank=1, tp_size=2)
    fp8, plain = load_model(config, rank1, keep_fp8=True), load_model(config, rank1)
    attn, ref = fp8.model.layers[0].self_attn, plain.model.layers[0].self_attn
    kept = {name for name, m in fp8.named_modules() if getattr(m, "fp8_block", None) is not None}
    assert kept == {f"model.layers.{i}.self_attn.o_proj" for i in range(config.num_layers)}
    assert attn.o_proj.weight_scale_inv.shape == (1, 1) and attn.o_proj.in_start == 128
    torch.testing.assert_close(dequantize_block_fp8(attn.o_proj.weight, attn.o_proj.weight_scale_inv),
                               ref.o_proj.weight, rtol=0, atol=0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("preset", ["tiny-deepseek-fp8", "tiny-qwen3-fp8"])
def test_fp8_layers_run_the_block_scaled_kernels_close_to_the_dequantized_layer(preset, device):
    """The real dispatch (fp8_kernels: the kernels on CUDA, their torch twin on CPU; W8A8, so
    activations are quantized per 128-group too): close, not equal."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    config = ModelConfig.from_path(preset, dtype=str(dtype).removeprefix("torch."))
    fp8, plain = load_model(config, keep_fp8=True).to(device), load_model(config).to(device)
    plain_modules = dict(plain.named_modules())
    gen = torch.Generator(device=device).manual_seed(0)
    checked = 0
    for name, m in fp8.named_modules():
        if getattr(m, "fp8_block", None) is None:
            continue
        ref = plain_modules[name]
        if isinstance(m, Experts):
            x = torch.randn(6, m.hidden, generator=gen, device=device).to(dtype)
            ids = torch.randint(0, m.num_experts, (6, 2), generator=gen, device=device)
            w = torch.rand(6, 2, generator=gen, device=device)
            got, want = m(x, w, ids), ref.forward_loop(x, w, ids)
        else:
            x = torch.randn(5, ref.weight.shape[1], generator=gen, device=device).to(dtype)
            got, want = m(x), ref(x)
        assert got.dtype == dtype
        assert float((got.float() - want.float()).norm() / want.float().norm()) < 0.05, name
        checked += 1
    assert checked > 8


@pytest.mark.gpu
def test_on_cuda_the_engine_serves_an_fp8_checkpoint_with_fp8_weights(fp8_pair):
    """End to end on the GPU path: the aligned layers hold FP8 and greedy output stays the
    dequantized model's for the first tokens (W8A8 rounding may part them later)."""
    fp8_dir, _, expected = fp8_pair
    engine = pdserve.Engine(model_path=fp8_dir, device="cuda", dtype="bfloat16", page_size=16)
    model = engine.scheduler.runner.model
    assert any(getattr(m, "fp8_block", None) for m in model.modules())
    out = engine.generate(input_ids=list(PROMPTS), sampling_params=GREEDY)
    assert all(len(o["output_ids"]) == STEPS for o in out)
    assert [o["output_ids"][0] for o in out] == [e[0] for e in expected]
    engine.shutdown()
