"""DeepSeek-V4 (sliding, CSA and HCA layers, mHC, hash-routed MoE) through the offline Engine against
transformers' ``DeepseekV4ForCausalLM`` on a tiny float32 checkpoint: a window of 8 and compression
rates 4 (CSA) and 8 (HCA), so prompts of a few dozen tokens cross many window and block boundaries,
and ``index_topk`` 3, so CSA queries attend to a strict subset of the compressed entries."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys

import pytest
import torch

import pdserve
from entrypoints.server_utils import Server
from fixtures.tiny_models import check_not_degenerate, greedy_continuation, make_hf_model_and_dir
from pdserve.config import ServerArgs

ARCH = "DeepseekV4ForCausalLM"
WINDOW, CSA_RATE, HCA_RATE, TOPK = 8, 4, 8, 3
TOL = 1e-4
STEPS = 10
GREEDY = {"max_new_tokens": STEPS, "temperature": 0.0, "ignore_eos": True}


def _hash_table(hf, seed: int = 0) -> None:
    """transformers leaves ``tid2eid`` zero (a checkpoint fills it): draw k distinct experts per token."""
    c = hf.config
    g = torch.Generator().manual_seed(seed)
    table = torch.stack([torch.randperm(c.n_routed_experts, generator=g)[:c.num_experts_per_tok]
                         for _ in range(c.vocab_size)])
    for layer, kind in zip(hf.model.layers, c.mlp_layer_types):
        if kind == "hash_moe":
            layer.mlp.gate.tid2eid.copy_(table)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf, path = make_hf_model_and_dir(ARCH, tmp_path_factory.mktemp("v4"))
    _hash_table(hf)
    check_not_degenerate(hf)
    hf.save_pretrained(path, safe_serialization=True)  # again, with the hash table
    c = hf.config
    assert (c.sliding_window, c.index_topk) == (WINDOW, TOPK)
    assert c.compress_rates == {"compressed_sparse_attention": CSA_RATE, "heavily_compressed_attention": HCA_RATE}
    return hf, path


def _prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 400, (n,), generator=g).tolist()


def _hf_logprobs(hf, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(input_ids=torch.tensor([seq]), use_cache=False).logits[0].float(), -1)  # [L, V]


@pytest.mark.parametrize("length", [3, 11, 6 * WINDOW + 5])
def test_greedy_tokens_and_logprobs_match_transformers(tiny, length):
    """Prompts shorter than one block, past the window, and over many windows and blocks; chunked
    prefill cuts windows open, and decode closes windows one token at a time."""
    hf, path = tiny
    engine = pdserve.Engine(model_path=path, page_size=4, chunked_prefill_size=16)
    prompt = _prompt(length, seed=length)
    out = engine.generate(input_ids=prompt, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0)
    assert out["output_ids"] == greedy_continuation(hf, prompt, STEPS)
    seq = prompt + out["output_ids"]
    ref = _hf_logprobs(hf, seq)
    meta = out["meta_info"]
    for j, (lp, tok, _) in enumerate(meta["input_token_logprobs"][1:] + meta["output_token_logprobs"], start=1):
        assert tok == seq[j]
        assert lp == pytest.approx(float(ref[j - 1, tok]), abs=TOL), j


def test_decode_crosses_windows_and_blocks_token_by_token(tiny):
    """A short prompt, then 3 windows' worth of decode: every window and HCA block closes in decode."""
    hf, path = tiny
    engine = pdserve.Engine(model_path=path, page_size=4)
    prompt = _prompt(5, seed=5)
    steps = 3 * WINDOW
    out = engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": steps})
    assert out["output_ids"] == greedy_continuation(hf, prompt, steps)


def test_batched_requests_of_mixed_lengths_match_transformers(tiny):
    hf, path = tiny
    engine = pdserve.Engine(model_path=path, page_size=1, chunked_prefill_size=32)
    prompts = [_prompt(n, seed=n) for n in (2, 9, 30, 61)]
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == [greedy_continuation(hf, p, STEPS) for p in prompts]


def test_prefix_hits_give_identical_output(tiny):
    """Every region is per token and causal, so a radix hit at any page boundary (inside an open
    window and mid HCA block here) restores exactly what recomputing the prefix would write."""
    hf, path = tiny
    engine = pdserve.Engine(model_path=path, page_size=2)
    prompt = _prompt(5 * WINDOW + 3, seed=7)
    first = engine.generate(input_ids=prompt, sampling_params=GREEDY, return_logprob=True, logprob_start_len=-1)
    second = engine.generate(input_ids=prompt, sampling_params=GREEDY, return_logprob=True, logprob_start_len=-1)
    assert first["meta_info"]["cached_tokens"] == 0
    assert second["meta_info"]["cached_tokens"] >= 4 * WINDOW
    assert second["output_ids"] == first["output_ids"] == greedy_continuation(hf, prompt, STEPS)
    got = [lp for lp, _, _ in second["meta_info"]["output_token_logprobs"]]
    assert got == pytest.approx([lp for lp, _, _ in first["meta_info"]["output_token_logprobs"]], abs=TOL)
    branch = prompt[:3 * WINDOW + 2] + _prompt(9, seed=8)  # shares 26 tokens: 2 past a CSA block, mid HCA block
    third = engine.generate(input_ids=branch, sampling_params=GREEDY)
    assert third["meta_info"]["cached_tokens"] == 3 * WINDOW + 2  # mid CSA block, mid HCA block, mid window
    assert third["output_ids"] == greedy_continuation(hf, branch, STEPS)


def test_index_topk_selection_matters_on_long_prompts(tiny, tmp_path):
    """With index_topk past every entry count the CSA layer attends to all closed entries: a long
    prompt's logprobs change, and a prompt with at most index_topk entries does not."""
    _, path = tiny
    dense = tmp_path / "dense"
    shutil.copytree(path, dense)
    cfg = json.loads((dense / "config.json").read_text())
    cfg["index_topk"] = 4096
    (dense / "config.json").write_text(json.dumps(cfg))
    short, long = _prompt(TOPK * CSA_RATE + 2, seed=1), _prompt(12 * CSA_RATE, seed=2)
    params = {**GREEDY, "max_new_tokens": 1}
    lps = {}
    for name, model in (("sparse", path), ("dense", str(dense))):
        engine = pdserve.Engine(model_path=model, page_size=4)
        for key, p in (("short", short), ("long", long)):
            o = engine.generate(input_ids=p, sampling_params=params, return_logprob=True, logprob_start_len=0)
            lps[name, key] = [lp for lp, _, _ in o["meta_info"]["input_token_logprobs"][1:]]
    assert lps["sparse", "short"] == pytest.approx(lps["dense", "short"], abs=TOL)
    assert max(abs(a - b) for a, b in zip(lps["sparse", "long"], lps["dense", "long"])) > 1e-2


def test_pool_holds_each_region_on_its_layers_only(tiny):
    from pdserve.config import ModelConfig
    from pdserve.mem.region_pool import RegionKVPool, RegionSpec

    _, path = tiny
    model = ModelConfig.from_path(path)
    D, Di = 32, 16
    assert model.state_regions == (("window_kv", (0, 1, 2), D), ("csa_src", (1,), 4 * D), ("csa_kv", (1,), D),
                                   ("csa_index_src", (1,), 4 * Di), ("csa_index_k", (1,), Di),
                                   ("hca_src", (2,), 2 * D), ("hca_kv", (2,), D))
    assert model.kv_bytes_per_token() == 4 * (3 * D + 4 * D + D + 4 * Di + Di + 2 * D + D)
    pool = RegionKVPool(4, 2, 3, tuple(RegionSpec(n, ls, w) for n, ls, w in model.state_regions), torch.float32)
    rows = torch.randn(2, D)
    pool.set_rows("csa_kv", 1, torch.tensor([5, 6]), rows)
    assert torch.equal(pool.get_rows("csa_kv", 1, torch.tensor([[6, 5]])), rows.flip(0)[None])
    with pytest.raises(KeyError, match="region 'csa_kv': layer 2 does not keep it"):
        pool.get_rows("csa_kv", 2, torch.tensor([0]))
    assert [name for name, _ in pool.page_buffers()] == [n for n, _, _ in model.state_regions]


def _serve(model_path: str, *argv: str) -> subprocess.CompletedProcess:
    with socket.socket() as s:  # a port nobody listens on; the server is expected not to start
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return subprocess.run([sys.executable, "-m", "pdserve", "serve", "--model-path", model_path,
                           "--port", str(port), *argv], capture_output=True, text=True, timeout=180)


REFUSALS = [
    ({"speculative_algorithm": "NEXTN"}, "--speculative-algorithm): NEXTN: no speculative decoding for DeepSeek-V4"),
    ({"attention_backend": "triton"}, "--attention-backend): triton: DeepSeek-V4's attention runs in torch only"),
    ({"tp_size": 2}, "--tp-size): DeepSeek-V4 runs on one rank"),
    ({"kv_cache_dtype": "fp8_e4m3"}, "--kv-cache-dtype): fp8_e4m3: DeepSeek-V4's state stays in the model dtype"),
    ({"enable_torch_compile": True}, "--enable-torch-compile): DeepSeek-V4's attention runs eagerly"),
]


@pytest.mark.parametrize("flags,message", REFUSALS, ids=[next(iter(f)) for f, _ in REFUSALS])
def test_unsupported_modes_are_refused_at_start_up(tiny, flags, message):
    _, path = tiny
    with pytest.raises(ValueError) as err:
        ServerArgs(model_path=path, **flags).model_config()
    assert message in str(err.value)


def test_cuda_graphs_are_refused(tiny):
    """Refused from the arguments alone, before any device is touched (so this runs on a CPU host)."""
    _, path = tiny
    with pytest.raises(ValueError, match=r"disable_cuda_graph \(--disable-cuda-graph\): DeepSeek-V4's decode is not "
                                         r"captured in CUDA graphs yet"):
        ServerArgs(model_path=path, device="cuda", attention_backend="torch_native").model_config()


def test_quantized_checkpoint_is_refused(tiny, tmp_path):
    """V4 ships FP8 linears and FP4 experts; neither loads yet."""
    _, path = tiny
    q = tmp_path / "fp8"
    shutil.copytree(path, q)
    cfg = json.loads((q / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128], "expert_dtype": "fp4"}
    (q / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="quantization_config: FP8/FP4 DeepSeek-V4 checkpoints are not supported"):
        ServerArgs(model_path=str(q)).model_config()


def test_mtp_layer_tensors_are_accepted_and_not_loaded(tiny, tmp_path):
    """A checkpoint with ``mtp.*`` tensors (num_nextn_predict_layers 1) loads; its MTP layer is unused."""
    from safetensors.torch import load_file, save_file

    hf, path = tiny
    mtp = tmp_path / "mtp"
    shutil.copytree(path, mtp)
    tensors = load_file(str(mtp / "model.safetensors"))
    tensors["mtp.0.hc_head_fn"] = torch.zeros(4, 4 * 64)
    save_file(tensors, str(mtp / "model.safetensors"), metadata={"format": "pt"})
    prompt = _prompt(12, seed=12)
    out = pdserve.Engine(model_path=str(mtp)).generate(input_ids=prompt, sampling_params=GREEDY)
    assert out["output_ids"] == greedy_continuation(hf, prompt, STEPS)


def test_refusal_reaches_the_cli_as_one_line():
    proc = _serve("tiny-deepseek-v4", "--tp-size", "2")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "tp_size (--tp-size): DeepSeek-V4 runs on one rank for now" in proc.stderr


def test_preset_serves_a_chat_request():
    """``pdserve serve --model-path tiny-deepseek-v4`` (random weights from the config) answers a chat
    completion whose prompt spans several windows (16) and HCA blocks (16)."""
    server = Server(model="tiny-deepseek-v4").start()
    try:
        r = server.post("/v1/chat/completions", json={
            "model": "tiny-deepseek-v4", "max_tokens": 24, "temperature": 0,
            "messages": [{"role": "user", "content": "Tell me about the lighthouse keeper and the 112 steps. " * 3}]})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["prompt_tokens"] > 3 * 16
        assert body["usage"]["completion_tokens"] >= 1 and isinstance(body["choices"][0]["message"]["content"], str)
        server.wait_idle()
    finally:
        server.stop()


def test_query_blocks_give_the_same_tokens(tiny, monkeypatch):
    """A prefill chunk is attended QUERY_BLOCK queries at a time; blocks of 5 (windows, CSA and HCA
    blocks all cut across) give transformers' tokens too."""
    from pdserve.models.deepseek_v4_attention import DeepseekV4Attention

    hf, path = tiny
    monkeypatch.setattr(DeepseekV4Attention, "QUERY_BLOCK", 5)
    prompt = _prompt(4 * WINDOW + 3, seed=4)
    out = pdserve.Engine(model_path=path, page_size=4).generate(input_ids=prompt, sampling_params=GREEDY)
    assert out["output_ids"] == greedy_continuation(hf, prompt, STEPS)


def test_compress_rope_with_yarn_matches_transformers():
    """V4-Flash ships YaRN on the compressed layers' rope only, with no mscale on cos/sin
    (transformers forces attention_factor 1.0): same angles as transformers' rotary."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    from fixtures.tiny_models import tiny_config
    from pdserve.layers.rotary import get_rope

    yarn = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64, "beta_fast": 32,
            "beta_slow": 1}
    c = tiny_config(ARCH, rope_parameters=yarn)
    assert c.rope_parameters["main"]["rope_type"] == "default"
    assert c.rope_parameters["compress"]["attention_factor"] == 1.0
    hf_rope = DeepseekV4RotaryEmbedding(c)
    pos = torch.arange(0, 4000, 37)
    for kind in ("main", "compress"):
        ours = get_rope(c.qk_rope_head_dim, 1024, c.rope_parameters[kind], interleaved=True)
        ours.ensure_capacity(4000)
        cos, sin = hf_rope(torch.zeros(1), pos[None], layer_type=kind)  # [1, P, R/2]
        got_cos, got_sin = ours.lookup(pos)  # [P, 1, R/2]
        torch.testing.assert_close(got_cos[:, 0], cos[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(got_sin[:, 0], sin[0], atol=1e-6, rtol=0)


def test_retracted_requests_resume_with_transformers_tokens(tiny):
    """Under a tiny KV budget decode retracts requests; recomputed on return, their regions (window rows,
    sources, entries) are rebuilt from the tokens, and every page comes back."""
    hf, path = tiny
    engine = pdserve.Engine(model_path=path, page_size=4, max_total_tokens=96)
    prompts = [_prompt(12 + i, seed=20 + i) for i in range(6)]
    outs = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 20})
    assert engine.scheduler.num_retractions > 0
    assert [o["output_ids"] for o in outs] == [greedy_continuation(hf, p, 20) for p in prompts]
    s = engine.scheduler
    s.check_memory()
    assert s.allocator.num_free + s.cache.num_cached_pages == s.allocator.num_pages


# ------------------------------------------------------------------ tiers (every region, host and file)
TIER_KW = dict(page_size=4, max_total_tokens=64, max_running_requests=2, chunked_prefill_size=64,
               enable_hierarchical_cache=True)


def _tier_prompts() -> list[list[int]]:
    """Two prompts several windows and HCA blocks long and one shorter than a window; 16 device pages
    of 4 tokens cannot keep all three, so pages cycle through host memory."""
    return [_prompt(3 * WINDOW + 4, seed=40), _prompt(3 * WINDOW + 6, seed=41), _prompt(WINDOW - 3, seed=42)]


def test_host_tier_hit_restores_every_region(tiny):
    """A prefix found only in host memory comes back with every region (window rows, compressor
    sources, compressed entries, index keys): the second round's tokens are transformers' (a page
    whose compressed regions stayed behind would attend to stale entries)."""
    hf, path = tiny
    prompts = _tier_prompts()
    want = [greedy_continuation(hf, p, STEPS) for p in prompts]
    with pdserve.Engine(model_path=path, hicache_write_policy="write_back", **TIER_KW) as engine:
        outs = [engine.generate(input_ids=p, sampling_params=GREEDY) for p in prompts + prompts]
        assert [o["output_ids"] for o in outs] == want * 2
        meta = outs[3]["meta_info"]  # prompt 0 again (28 tokens, the last held back): 6 whole pages hit, some
        # only on host (the device evicted them)
        assert meta["cached_tokens"] == 24 and meta["cached_tokens_by_tier"]["host"] > 0
        info = engine.get_server_info()
        assert info["cache_hit_tokens_host"] > 0 and info["host_load_bytes"] > 0
        engine.scheduler.check_memory()


def test_file_tier_stores_every_region_across_a_restart(tiny, tmp_path):
    hf, path = tiny
    prompt = _tier_prompts()[0]
    want = greedy_continuation(hf, prompt, STEPS)
    kw = dict(TIER_KW, hicache_storage_backend="file", hicache_storage_dir=str(tmp_path),
              hicache_storage_size_gb=0.01, hicache_storage_chunk_tokens=8,
              hicache_storage_prefetch_policy="wait_complete")
    with pdserve.Engine(model_path=path, **kw) as engine:
        assert engine.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"] == want
        engine.scheduler.cache.storage.flush()
    with pdserve.Engine(model_path=path, **kw) as restarted:
        out = restarted.generate(input_ids=prompt, sampling_params=GREEDY)
        assert out["output_ids"] == want
        assert out["meta_info"]["cached_tokens_by_tier"]["storage"] == 24  # 3 whole chunks of 8
