"""DeepSeek-V3.2's FP8 index cache (``--index-cache-dtype fp8_e4m3``, the default on CUDA): index keys
stored as e4m3 with a float32 scale per block of 128 values (the whole key when smaller), as DeepSeek's
reference stores them; tested on CPU against formulas written here, transformers' model whose indexer
keys pass through the same quantization, and the P/D and host-tier paths that carry the scale region."""

from __future__ import annotations

import pytest
import torch

import pdserve
from fixtures.engine_checks import GREEDY, STEPS, check_host_tier_hit
from fixtures.fp8_index_keys import e4m3_round_trip, fp8_index_keys
from fixtures.tiny_models import greedy_continuation, make_hf_model_and_dir
from pdserve.config import ModelConfig, ServerArgs, resolve_index_cache_dtype
from pdserve.mem.kv_pool import MLAKVPool, dequantize_index_keys, index_key_block, quantize_index_keys

ARCH = "DeepseekV32ForCausalLM"
TOPK = 8
FP8 = {"index_cache_dtype": "fp8_e4m3"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf, path = make_hf_model_and_dir(ARCH, tmp_path_factory.mktemp("v32fp8"))
    assert hf.config.index_topk == TOPK
    return hf, path


def _prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 400, (n,), generator=g).tolist()


# ------------------------------------------------------------------ quantization
def test_representable_values_round_trip_exactly_and_scales_are_amax_over_448():
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = codes[torch.isfinite(codes)]  # every e4m3 value; amax 448 makes the scale 1
    k = finite[torch.randperm(finite.numel(), generator=torch.Generator().manual_seed(0))][:128].clone()
    k[0] = 448.0
    block2 = torch.randn(128, generator=torch.Generator().manual_seed(1)) * 7
    keys = torch.stack([torch.cat([k, block2]), torch.zeros(256)])  # [2, 256]: blocks (exact, random), (0, 0)
    q, scale = quantize_index_keys(keys, 128)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (2, 2)
    assert scale[0, 0].item() == 1.0
    assert scale[0, 1].item() == pytest.approx(block2.abs().max().item() / 448, rel=1e-6)
    assert scale[1].tolist() == [pytest.approx(1e-4 / 448)] * 2  # zero blocks: a finite scale, zeros stored
    back = dequantize_index_keys(q, scale, torch.float32)
    assert torch.equal(back[0, :128], k) and torch.equal(back[1], torch.zeros(256))
    assert torch.equal(back[0, 128:], e4m3_round_trip(block2))
    assert back[0, 128:].abs().max().item() == pytest.approx(block2.abs().max().item(), rel=1e-6)


def test_block_is_128_or_the_whole_key():
    assert index_key_block(128) == 128 and index_key_block(512) == 128 and index_key_block(32) == 32
    with pytest.raises(ValueError, match="index_head_dim: an FP8 index cache needs a multiple of 128"):
        index_key_block(192)


def test_pool_keeps_e4m3_keys_and_their_scales_as_regions_of_the_pages():
    pool = MLAKVPool(6, 4, 2, kv_lora_rank=8, rope_dim=4, dtype=torch.float32, index_head_dim=32,
                     index_cache_dtype="fp8_e4m3")
    assert pool.index_k.dtype == torch.float8_e4m3fn and pool.index_k_scale.shape == (2, 6, 4, 1)
    assert [n for n, _ in pool.page_buffers()] == ["latent", "index_k", "index_k_scale"]
    k = torch.randn(5, 32, generator=torch.Generator().manual_seed(2)) * 3
    loc = torch.tensor([1, 2, 9, 14, 23])
    pool.set_index_k(1, loc, k)
    want = e4m3_round_trip(k)
    assert torch.equal(pool.get_index_k_slots(1, loc), want) and torch.equal(pool.round_trip_index_k(k), want)
    pages = pool.get_index_k_pages(1, torch.tensor([[0, 2, 3]]))  # [1, 12, 32]: slots 1, 2, 9 at columns 1, 2, 5
    assert torch.equal(pages[0, [1, 2, 5]], want[:3]) and not pages[0, 0].any()
    with pytest.raises(ValueError, match="index_cache_dtype"):
        MLAKVPool(6, 4, 2, 8, 4, torch.float32, index_head_dim=32, index_cache_dtype="fp8")


def test_scores_and_picks_equal_the_torch_twin_on_dequantized_keys():
    """The fp8 pool's reads are what the scoring paths see: the C kernel's float32 twin (select_top_tokens)
    over the dequantized keys picks what the reference formula picks."""
    from pdserve.layers.attention.torch_native import select_top_tokens
    from pdserve_kernels import sparse_mla_ref as ref

    g = torch.Generator().manual_seed(3)
    pool = MLAKVPool(8, 4, 1, 8, 4, torch.float32, index_head_dim=32, index_cache_dtype="fp8_e4m3")
    L = 30
    k = torch.randn(L, 32, generator=g)
    slots = torch.randperm(32, generator=g)[:L]
    pool.set_index_k(0, slots, k)
    q, w = torch.randn(1, 2, 4, 32, generator=g), torch.randn(1, 2, 4, generator=g)
    keys = pool.get_index_k_slots(0, slots)[None]  # [1, L, 32]
    chosen, _ = select_top_tokens(q, w, keys, None, 0.2, 6)
    req, vis = torch.zeros(2, dtype=torch.long), torch.full((2,), L)
    want = ref.index_topk_ref(q[0], w[0], pool.index_k[0], slots[None], req, vis, 0.2, 6, pool.index_k_scale[0])
    assert sorted(slots[chosen[0, 0]].tolist()) == sorted(want[0].tolist())
    assert sorted(slots[chosen[0, 1]].tolist()) == sorted(want[1].tolist())
    plain = ref.index_topk_ref(q[0], w[0], e4m3_round_trip(k)[None], torch.arange(L)[None], req, vis, 0.2, 6)
    assert sorted(slots[plain[0]].tolist()) == sorted(want[0].tolist())


# ------------------------------------------------------------------ config
def test_auto_is_fp8_on_cuda_and_full_precision_on_cpu():
    assert resolve_index_cache_dtype("auto", "cuda") == "fp8_e4m3"
    assert resolve_index_cache_dtype("auto", "cpu") == "model"
    assert resolve_index_cache_dtype("fp8_e4m3", "cpu") == "fp8_e4m3"


def test_bad_or_pointless_index_cache_dtype_is_refused_at_start_up(tiny):
    _, path = tiny
    with pytest.raises(ValueError, match="index_cache_dtype: 'fp16' is not one of"):
        ServerArgs(model_path=path, index_cache_dtype="fp16").cache_config()
    with pytest.raises(ValueError, match=r"index_cache_dtype \(--index-cache-dtype\): fp8_e4m3: the model keeps no "
                                         r"index keys"):
        ServerArgs(model_path="tiny-deepseek", **FP8).model_config()


def test_refusal_reaches_the_cli_as_one_line():
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:  # a port nobody listens on; the server is expected not to start
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.run([sys.executable, "-m", "pdserve", "serve", "--model-path", "tiny-deepseek", "--port",
                           str(port), "--index-cache-dtype", "fp8_e4m3"], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "index_cache_dtype (--index-cache-dtype): fp8_e4m3: the model keeps no index keys" in proc.stderr


def test_kv_budget_counts_e4m3_keys_and_their_scales(tiny):
    _, path = tiny
    mc = ModelConfig.from_path(path)
    c = mc.hf_config
    latent, index = c.kv_lora_rank + c.qk_rope_head_dim, c.index_head_dim
    assert mc.kv_bytes_per_token(index_cache_dtype="fp8_e4m3") == mc.num_layers * (latent * 4 + index + 4)
    assert mc.kv_bytes_per_token("fp8_e4m3", index_cache_dtype="fp8_e4m3") == mc.num_layers * (latent + index + 4)


# ------------------------------------------------------------------ end to end against transformers
@pytest.fixture
def hf_with_fp8_index_keys(tiny):
    """transformers' model whose indexer scores keys read back through the same quantization."""
    with fp8_index_keys(tiny[0]) as hf:
        yield hf


@pytest.mark.parametrize("length", [5, 4 * TOPK + 5])
def test_greedy_output_equals_transformers_with_fp8_index_keys(tiny, hf_with_fp8_index_keys, length):
    hf, path = tiny
    prompt = _prompt(length, seed=70 + length)
    engine = pdserve.Engine(model_path=path, page_size=4, **FP8)
    pool = engine.scheduler.runner.pool
    assert pool.index_k.dtype == torch.float8_e4m3fn and pool.index_k_scale is not None
    out = engine.generate(input_ids=prompt, sampling_params=GREEDY)
    assert out["output_ids"] == greedy_continuation(hf_with_fp8_index_keys, prompt, STEPS)


def test_oracle_patch_changes_transformers_picks_on_long_prompts(tiny, hf_with_fp8_index_keys):
    """The patched oracle is another model on long prompts (the quantization reaches its scores)."""
    import transformers.models.deepseek_v32.modeling_deepseek_v32 as m

    hf, _ = tiny
    prompt = torch.tensor([_prompt(6 * TOPK, seed=5)])
    calls = []
    indexer = hf.model.layers[0].self_attn.indexer
    handle = indexer.register_forward_hook(lambda mod, a, out: calls.append(out.clone()))
    with torch.no_grad():
        hf(input_ids=prompt, use_cache=False)
        quantized = calls.pop()
        saved, m.torch = m.torch, torch  # the unpatched module for one forward
        try:
            hf(input_ids=prompt, use_cache=False)
        finally:
            m.torch = saved
    handle.remove()
    assert not torch.equal(quantized.sort(-1).values, calls.pop().sort(-1).values)


def test_host_tier_hit_restores_fp8_keys_and_scales(tiny, hf_with_fp8_index_keys):
    _, path = tiny
    prompts = [_prompt(28, seed=40), _prompt(30, seed=41), _prompt(TOPK - 3, seed=42)]
    check_host_tier_hit(hf_with_fp8_index_keys, path, prompts, **FP8)


# ------------------------------------------------------------------ P/D: one more region
def test_pd_layout_moves_the_scales_and_the_record_refuses_another_index_dtype(tiny):
    from pdserve.disagg.bootstrap import CompatRecord, IncompatiblePeer
    from pdserve.disagg.layout import KVLayout

    _, path = tiny
    pool = MLAKVPool(4, 2, 2, kv_lora_rank=8, rope_dim=4, dtype=torch.float32, index_head_dim=32, **FP8)
    dtypes = {name: str(buf.dtype).removeprefix("torch.") for name, buf in pool.page_buffers()}
    layout = KVLayout.from_descriptors("mla", 1, 1, 2, "float32", pool.buffer_descriptors(), region_dtypes=dtypes)
    assert layout.buffers == ("latent", "index_k", "index_k_scale")
    assert layout.geometry("index_k") == (2 * 32, 4 * 2 * 32) and layout.geometry("index_k_scale") == (2 * 4, 4 * 2 * 4)
    mc = ModelConfig.from_path(path)
    fp8 = CompatRecord.from_model(mc, 4, index_cache_dtype="fp8_e4m3")
    full = CompatRecord.from_model(mc, 4)
    assert fp8.state_layout == "latent+index_k[32]:float8_e4m3fn+index_k_scale[1]:float32"
    with pytest.raises(IncompatiblePeer, match="state_layout: prefill has latent\\+index_k\\[32\\]:float8_e4m3fn"):
        fp8.check(full)
