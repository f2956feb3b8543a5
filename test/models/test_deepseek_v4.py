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
from fixtures.engine_checks import (
    GREEDY,
    STEPS,
    check_tokens_and_logprobs,
)
from fixtures.tiny_models import (
    add_v4_mtp_layer,
    check_not_degenerate,
    fill_hash_table,
    greedy_continuation,
    make_hf_model_and_dir,
)
from pdserve.config import ServerArgs

ARCH = "DeepseekV4ForCausalLM"
WINDOW, CSA_RATE, HCA_RATE, TOPK = 8, 4, 8, 3
TOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf, path = make_hf_model_and_dir(ARCH, tmp_path_factory.mktemp("v4"))
    fill_hash_table(hf)
    check_not_degenerate(hf)
    hf.save_pretrained(path, safe_serialization=True)  # again, with the hash table
    c = hf.config
    assert (c.sliding_window, c.index_topk) == (WINDOW, TOPK)
    assert c.compress_rates == {"compressed_sparse_attention": CSA_RATE, "heavily_compressed_attention": HCA_RATE}
    return hf, path


def _prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 400, (n,), generator=g).tolist()


@pytest.mark.parametrize("length", [3, 11, 6 * WINDOW + 5])
def test_greedy_tokens_and_logprobs_match_transformers(tiny, length):
    """Prompts shorter than one block, past the window, and over many windows and blocks; chunked
    prefill cuts windows open, and decode closes windows one token at a time."""
    hf, path = tiny
    engine = pdserve.Engine(model_path=path, page_size=4, chunked_prefill_size=16)
    check_tokens_and_logprobs(hf, engine, _prompt(length, seed=length), TOL)


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


REUSE = 16 * WINDOW  # reusable boundaries of the bounded layout: lcm(page, rates) multiples of >= 16 windows


def test_prefix_hits_give_identical_output(tiny):
    """Colocated, V4 keeps its window and open windows as per-request records and the state a prefix
    needs only at reusable boundaries (multiples of REUSE tokens): a hit is shortened to the last one,
    never longer, and continues from the boundary's tails exactly as recomputing the prefix would."""
    hf, path = tiny
    engine = pdserve.Engine(model_path=path, page_size=2)
    assert engine.scheduler.runner.pool.reuse_tokens == REUSE
    prompt = _prompt(2 * REUSE + 5 * WINDOW + 3, seed=7)
    first = engine.generate(input_ids=prompt, sampling_params=GREEDY, return_logprob=True, logprob_start_len=-1)
    second = engine.generate(input_ids=prompt, sampling_params=GREEDY, return_logprob=True, logprob_start_len=-1)
    assert first["meta_info"]["cached_tokens"] == 0
    assert second["meta_info"]["cached_tokens"] == 2 * REUSE
    assert second["output_ids"] == first["output_ids"] == greedy_continuation(hf, prompt, STEPS)
    got = [lp for lp, _, _ in second["meta_info"]["output_token_logprobs"]]
    assert got == pytest.approx([lp for lp, _, _ in first["meta_info"]["output_token_logprobs"]], abs=TOL)
    branch = prompt[:REUSE + 3 * WINDOW + 2] + _prompt(9, seed=8)  # shares a block, then mid CSA, HCA, window
    third = engine.generate(input_ids=branch, sampling_params=GREEDY)
    assert third["meta_info"]["cached_tokens"] == REUSE  # shortened to the boundary, never mid block
    assert third["output_ids"] == greedy_continuation(hf, branch, STEPS)
    engine.scheduler.check_memory()


def test_a_step_shorter_than_the_tail_after_a_boundary_hit(tiny):
    """A hit at a boundary followed by a step of 2 tokens (shorter than the window's tail): the decode
    steps after it read window and source rows from before the boundary out of the request's ring, which
    must have taken them from the tail (the first token alone would not show it: it reads the tail)."""
    hf, path = tiny
    engine = pdserve.Engine(model_path=path, page_size=2)
    first = _prompt(REUSE + 5 * WINDOW, seed=11)
    engine.generate(input_ids=first, sampling_params=GREEDY)
    short = first[:REUSE] + _prompt(2, seed=12)
    out = engine.generate(input_ids=short, sampling_params=GREEDY)
    assert out["meta_info"]["cached_tokens"] == REUSE
    assert out["output_ids"] == greedy_continuation(hf, short, STEPS)


def test_bounded_state_is_a_fifth_of_v3_at_64k():
    """The bounded layout's bytes per token at 64K context (pages of compressed entries and boundary
    tails, plus one request's record spread over the context) against tiny-deepseek (V3) at the same
    dims; a request's record is a fixed number of rows whatever its length (the window trimmed)."""
    from pdserve.config import ModelConfig

    v3, v4 = ModelConfig.from_path("tiny-deepseek"), ModelConfig.from_path("tiny-deepseek-v4")
    c = v4.hf_config
    assert v4.kv_bytes_per_token(page_size=64, bounded=True, context=65536) <= 0.2 * v3.kv_bytes_per_token()
    assert v4.kv_bytes_per_token(page_size=64) > v3.kv_bytes_per_token()  # the page layout: every token's rows
    engine = pdserve.Engine(model_path="tiny-deepseek-v4", page_size=64, max_running_requests=2)
    pool = engine.scheduler.runner.pool
    W, m, h = c.sliding_window, c.compress_rates["compressed_sparse_attention"], \
        c.compress_rates["heavily_compressed_attention"]
    assert {k: tuple(r.shape[1:3]) for k, r in pool.records.items()} == {
        "window_kv": (2, W - 1), "csa_src": (2, 2 * m - 1), "csa_index_src": (2, 2 * m - 1), "hca_src": (2, h - 1)}
    assert "window_kv" not in pool.buffers and "window_kv_tail" in pool.buffers
    # the budget paid for exactly the records the pool holds
    assert engine.scheduler.runner.kv_budget.record_bytes == sum(r.numel() * r.element_size()
                                                                 for r in pool.records.values())
    out = engine.generate(input_ids=_prompt(3 * pool.reuse_tokens // 2, seed=3), sampling_params=GREEDY)
    assert len(out["output_ids"]) == STEPS
    engine.shutdown()


@pytest.mark.parametrize("split", [dict(tp_size=2), dict(tp_size=2, ep_size=2)], ids=["tp2", "tp2-ep2"])
def test_two_ranks_decode_like_transformers(tiny, split):
    """Two rank processes (gloo): each holds 2 of the 4 query heads and 1 of the 2 output groups, the
    K=V head, compressors and indexer whole; the MoE splits I (tp2) or holds 4 of the 8 experts whole
    (ep2, the hash-routed layer too). Batched prompts past the window and over many blocks, chunked:
    transformers' greedy tokens, and logprobs within TOL."""
    hf, path = tiny
    prompts = [_prompt(n, seed=200 + n) for n in (3, 11, 6 * WINDOW + 5)]
    with pdserve.Engine(model_path=path, page_size=4, chunked_prefill_size=16, **split) as engine:
        assert len(engine.scheduler.ranks.pids) == 2
        outs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == [greedy_continuation(hf, p, STEPS) for p in prompts]
        check_tokens_and_logprobs(hf, engine, _prompt(4 * WINDOW + 1, seed=9), TOL)


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
    assert model.state_regions == (("window_kv", (0, 1, 2), D, 1), ("csa_src", (1,), 4 * D, 1),
                                   ("csa_kv", (1,), D, CSA_RATE), ("csa_index_src", (1,), 4 * Di, 1),
                                   ("csa_index_k", (1,), Di, CSA_RATE), ("hca_src", (2,), 2 * D, 1),
                                   ("hca_kv", (2,), D, HCA_RATE))
    per_token = 3 * D + 4 * D + D / CSA_RATE + 4 * Di + Di / CSA_RATE + 2 * D + D / HCA_RATE
    assert model.kv_bytes_per_token() == 4 * per_token
    # pages of 2 tokens: every compressed region still keeps one row a page (half of them unused)
    assert model.kv_bytes_per_token(page_size=2) == 4 * (3 * D + 4 * D + D / 2 + 4 * Di + Di / 2 + 2 * D + D / 2)
    pool = RegionKVPool(4, 2, 3, tuple(RegionSpec(*r) for r in model.state_regions), torch.float32)
    rows = torch.randn(2, D)
    pool.set_rows("csa_kv", 1, torch.tensor([5, 6]), rows)
    assert torch.equal(pool.get_rows("csa_kv", 1, torch.tensor([[6, 5]])), rows.flip(0)[None])
    with pytest.raises(KeyError, match="region 'csa_kv': layer 2 does not keep it"):
        pool.get_rows("csa_kv", 2, torch.tensor([0]))
    assert [name for name, _ in pool.page_buffers()] == [n for n, *_ in model.state_regions]


def test_compressed_regions_keep_one_row_per_rate_tokens():
    """A rate-4 region in pages of 8: two rows a page, entry w (ending at position 4w + 3) in the page
    holding that position, at row (position % 8) // 4; a rate-16 region: one row a page, used by
    every other page."""
    from pdserve.mem.region_pool import RegionKVPool, RegionSpec

    pool = RegionKVPool(6, 8, 1, (RegionSpec("c", (0,), 3, 4), RegionSpec("h", (0,), 3, 16)), torch.float32)
    assert pool.buffers["c"].shape == (1, 6, 2, 3) and pool.buffers["h"].shape == (1, 6, 1, 3)
    pages = torch.tensor([4, 1, 5])  # a request's pages: positions 0..23
    slots = pages.repeat_interleave(8) * 8 + torch.arange(8).repeat(3)  # [24]
    ends = slots[3::4]  # entries 0..5
    entries = torch.arange(6, dtype=torch.float32)[:, None].expand(6, 3)
    pool.set_rows("c", 0, ends, entries)
    assert torch.equal(pool.buffers["c"][0, :, :, 0], torch.tensor(
        [[0, 0], [2, 3], [0, 0], [0, 0], [0, 1], [4, 5]], dtype=torch.float32))
    assert torch.equal(pool.get_rows("c", 0, ends), entries)
    pool.set_rows("h", 0, slots[15::16], entries[:1] + 7)
    assert pool.buffers["h"][0, 1, 0, 0] == 7 and pool.buffers["h"][0].abs().sum() == 21


def _serve(model_path: str, *argv: str) -> subprocess.CompletedProcess:
    with socket.socket() as s:  # a port nobody listens on; the server is expected not to start
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return subprocess.run([sys.executable, "-m", "pdserve", "serve", "--model-path", model_path,
                           "--port", str(port), *argv], capture_output=True, text=True, timeout=180)


REFUSALS = [
    ({"speculative_algorithm": "EAGLE", "speculative_draft_model_path": "tiny-llama"},
     "--speculative-algorithm): EAGLE: DeepSeek-V4 drafts with NEXTN (its MTP layer) only"),
    ({"attention_backend": "triton"}, "--attention-backend): triton: DeepSeek-V4's attention runs in torch only"),
    ({"tp_size": 4}, "--tp-size): 4: DeepSeek-V4's o_groups (2) must be divisible by it"),
    ({"dp_size": 2}, "--dp-size): 2: DeepSeek-V4 runs one attention group for now"),
    ({"tp_size": 2, "dp_size": 2, "enable_dp_attention": True},
     "--enable-dp-attention): DeepSeek-V4 runs without DP attention for now"),
    ({"kv_cache_dtype": "fp8_e4m3"}, "--kv-cache-dtype): fp8_e4m3: DeepSeek-V4's state stays in the model dtype"),
    ({"enable_torch_compile": True}, "--enable-torch-compile): DeepSeek-V4's attention runs eagerly"),
]


@pytest.mark.parametrize("flags,message", REFUSALS, ids=["-".join(f) for f, _ in REFUSALS])
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


def test_fp8_expert_checkpoint_is_refused(tiny, tmp_path):
    """V4 ships FP8 linears and FP4 experts, which load; a checkpoint with FP8 experts is refused by name."""
    _, path = tiny
    q = tmp_path / "fp8"
    shutil.copytree(path, q)
    cfg = json.loads((q / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128], "expert_dtype": "fp8"}
    (q / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="quantization_config.expert_dtype: 'fp8': DeepSeek-V4 checkpoints load with "
                                         "FP4 experts"):
        ServerArgs(model_path=str(q)).model_config()


@pytest.fixture(scope="module")
def fp4_twin(tiny, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from fixtures.fp8_checkpoints import make_v4_fp4_checkpoint

    fp4_dir, plain_dir = make_v4_fp4_checkpoint(tiny[1], tmp_path_factory.mktemp("v4fp4"))
    hf = AutoModelForCausalLM.from_pretrained(plain_dir, dtype=torch.float32).eval()
    return fp4_dir, plain_dir, hf


def test_fp4_twin_ships_fp4_experts_and_fp8_linears(fp4_twin):
    from pdserve.models.loader import iter_safetensors

    raw = dict(iter_safetensors(fp4_twin[0]))
    layer = "model.layers.1."
    assert raw[layer + "ffn.experts.0.w1.weight"].dtype == torch.int8
    assert raw[layer + "ffn.experts.0.w1.scale"].dtype == torch.float8_e8m0fnu
    assert raw[layer + "attn.wq_a.weight"].dtype == raw[layer + "attn.indexer.wq_b.weight"].dtype == torch.float8_e4m3fn
    assert raw[layer + "attn.compressor.wkv.weight"].dtype == raw[layer + "attn.wo_a.weight"].dtype == torch.float32


@pytest.mark.parametrize("length", [11, 6 * WINDOW + 5])
def test_fp4_checkpoint_decodes_like_transformers_on_the_dequantized_copy(fp4_twin, length):
    from pdserve.config import ModelConfig
    from pdserve.models.base import checkpoint_tensors
    from pdserve.models.loader import load_model

    fp4_dir, plain_dir, hf = fp4_twin
    check_not_degenerate(hf)
    engine = pdserve.Engine(model_path=fp4_dir, page_size=4, chunked_prefill_size=16)
    assert engine.scheduler.runner.model_config.quantization.expert_dtype == "fp4"
    prompt = _prompt(length, seed=80 + length)
    out = engine.generate(input_ids=prompt, sampling_params=GREEDY)
    assert out["output_ids"] == greedy_continuation(hf, prompt, STEPS)
    a = dict(checkpoint_tensors(engine.scheduler.runner.model))
    b = dict(checkpoint_tensors(load_model(ModelConfig.from_path(plain_dir))))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    engine.shutdown()


def test_experts_held_in_fp4_decode_like_transformers(fp4_twin, monkeypatch):
    """The CUDA runner's load (keep_fp8: layers hold what they can) on CPU: the routed experts stay the
    checkpoint's packed bytes and run through fused_moe_fp4 (its torch twin here; the Triton kernel on
    CUDA, tested against the twin in test/kernels/test_fp4_moe.py). Greedy output is unchanged."""
    from pdserve.config import ModelConfig
    from pdserve.models import loader
    from pdserve.models.loader import iter_safetensors, load_model

    fp4_dir, _, hf = fp4_twin
    held = load_model(ModelConfig.from_path(fp4_dir), keep_fp8=True)
    raw = dict(iter_safetensors(fp4_dir))
    experts = held.model.layers[1].mlp.experts
    I = experts.gate_up_proj.shape[1] // 2
    assert experts.gate_up_proj.dtype == torch.int8 and experts.gate_up_proj_scale.dtype == torch.uint8
    assert torch.equal(experts.gate_up_proj[2, I:], raw["model.layers.1.ffn.experts.2.w3.weight"])
    assert torch.equal(experts.down_proj_scale[5], raw["model.layers.1.ffn.experts.5.w2.scale"].view(torch.uint8))
    # the runner imports load_model when it builds, and passes keep_fp8 (False on CPU): force it on
    monkeypatch.setattr(loader, "load_model", lambda *a, **kw: load_model(*a, **{**kw, "keep_fp8": True}))
    engine = pdserve.Engine(model_path=fp4_dir, page_size=4)
    assert engine.scheduler.runner.model.model.layers[0].mlp.experts.down_proj.dtype == torch.int8
    prompt = _prompt(40, seed=95)
    assert engine.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"] == greedy_continuation(
        hf, prompt, STEPS)
    engine.shutdown()


def test_fp4_preset_loads_the_full_presets_draws_quantized():
    """tiny-deepseek-v4-fp4 is tiny-deepseek-v4 through our quantizer: experts on the FP4 grid (held
    fused, [E, 2I, Hd] and [E, Hd, I]: FP4 blocks are per row, so each expert's fused rows quantize as
    its w1, w3 and w2 do), the FP8 linears FP8-representable, everything else the same draws."""
    from pdserve.config import ModelConfig
    from pdserve.layers.quant.fp4 import dequantize_fp4, is_v4_fp8_linear, quantize_fp4
    from pdserve.layers.quant.fp8 import dequantize_block_fp8, quantize_block_fp8
    from pdserve.models.base import checkpoint_tensors
    from pdserve.models.loader import load_model

    fp4 = dict(checkpoint_tensors(load_model(ModelConfig.from_path("tiny-deepseek-v4-fp4"))))
    full = dict(checkpoint_tensors(load_model(ModelConfig.from_path("tiny-deepseek-v4"))))
    assert fp4.keys() == full.keys()
    kinds = {"fp4": 0, "fp8": 0, "full": 0}
    for key, w in fp4.items():
        if key.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            kinds["fp4"] += 1
            assert torch.equal(w, torch.stack([dequantize_fp4(*quantize_fp4(x)) for x in full[key]])), key
            assert not torch.equal(w, full[key])
        elif is_v4_fp8_linear(key):
            kinds["fp8"] += 1
            assert torch.equal(w, dequantize_block_fp8(*quantize_block_fp8(full[key]))), key
        else:
            kinds["full"] += 1
            assert torch.equal(w, full[key]), key
    assert kinds["fp4"] == 3 * 2 and kinds["fp8"] == 3 * 4 + 1 + 3 * 3 and kinds["full"] > 0
    out = pdserve.Engine(model_path="tiny-deepseek-v4-fp4").generate(input_ids=_prompt(20, seed=90),
                                                                     sampling_params=GREEDY)
    assert len(out["output_ids"]) == STEPS


def test_mtp_layer_tensors_are_accepted_and_loaded_only_for_nextn(with_mtp):
    """Without NEXTN the ``mtp.*`` tensors are skipped; with it every one lands in the draft, and the
    draft shares the target's embedding and head (the checkpoint carries none for it)."""
    from safetensors.torch import load_file

    from pdserve.config import ModelConfig, SpeculativeConfig
    from pdserve.models.deepseek_v4_attention import SLIDING
    from pdserve.models.deepseek_v4_mtp import DeepseekV4MTP, mtp_key
    from pdserve.models.draft import load_draft
    from pdserve.models.loader import load_model

    hf, path = with_mtp
    prompt = _prompt(12, seed=12)
    out = pdserve.Engine(model_path=path).generate(input_ids=prompt, sampling_params=GREEDY)
    assert out["output_ids"] == greedy_continuation(hf, prompt, STEPS)
    mc = ModelConfig.from_path(path)
    target = load_model(mc)
    draft = load_draft(mc, SpeculativeConfig("NEXTN"), target, seed=0)
    assert isinstance(draft, DeepseekV4MTP) and draft.layer_id == 3 and draft.self_attn.kind == SLIDING
    assert draft.self_attn.compressor is None and not draft.mlp.gate.is_hash
    params = dict(draft.named_parameters(remove_duplicate=False)) | dict(draft.named_buffers())
    raw = {k[len("mtp.0."):]: t for k, t in load_file(f"{path}/mtp.safetensors").items()}
    for name, t in raw.items():
        key = mtp_key(name)
        if ".experts." in key:  # per-expert w1/w2/w3 fused on load
            continue
        assert torch.equal(params[key], t), name
    assert draft.embed_tokens is target.model.embed_tokens and draft.head is target.lm_head
    assert target.hidden_streams


def test_refusal_reaches_the_cli_as_one_line():
    proc = _serve("tiny-deepseek-v4", "--tp-size", "4")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "tp_size (--tp-size): 4: DeepSeek-V4's o_groups (2) must be divisible by it" in proc.stderr


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


# ------------------------------------------------------------------ NEXTN (the MTP layer, with its own mHC)
@pytest.fixture(scope="module")
def with_mtp(tiny, tmp_path_factory):
    """The tiny checkpoint plus an MTP layer in a second file, as DeepSeek ships it (transformers
    drops ``mtp.*`` on load, so its logits are the reference without it)."""
    hf, path = tiny
    d = tmp_path_factory.mktemp("v4mtp") / "ckpt"
    shutil.copytree(path, d)
    add_v4_mtp_layer(d)
    return hf, str(d)


def _reference_mtp_logits(hf, mtp: dict[str, torch.Tensor], seq: list[int]) -> torch.Tensor:
    """The MTP layer composed from transformers' V4 modules: row p reads token seq[p + 1] and the
    target's streams at p (before its hyper head) -> log-probs [len(seq) - 1, V]. Its decoder layer is
    transformers' sliding, top-k routed layer holding the weights the MTP tensors were copied from."""
    import copy

    from transformers.masking_utils import create_sliding_window_causal_mask
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4DecoderLayer, DeepseekV4HyperHead

    c = copy.deepcopy(hf.config)
    c.mlp_layer_types = ["moe"] * c.num_hidden_layers  # layer 0: sliding attention, top-k MoE
    layer = DeepseekV4DecoderLayer(c, 0).eval()
    layer.load_state_dict({k: v for k, v in hf.model.layers[2].state_dict().items() if ".compressor." not in k})
    head = DeepseekV4HyperHead(c).eval()
    head.load_state_dict({"hc_fn": mtp["mtp.0.hc_head_fn"], "hc_base": mtp["mtp.0.hc_head_base"],
                          "hc_scale": mtp["mtp.0.hc_head_scale"]})
    captured = []
    hook = hf.model.hc_head.register_forward_hook(lambda _m, args, _o: captured.append(args[0]))
    ids = torch.tensor([seq])
    with torch.no_grad():
        hf(input_ids=ids, use_cache=False)
        hook.remove()
        streams = captured[0][:, :-1]  # [1, L-1, n, H]

        def rms(x, w):
            return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + c.rms_norm_eps) * w

        e = rms(hf.model.embed_tokens(ids[:, 1:]), mtp["mtp.0.enorm.weight"])  # [1, L-1, H]
        h = (e @ mtp["mtp.0.e_proj.weight"].T).unsqueeze(2) + rms(streams, mtp["mtp.0.hnorm.weight"]) \
            @ mtp["mtp.0.h_proj.weight"].T
        pos = torch.arange(len(seq) - 1)[None]
        rope = {kind: hf.model.rotary_emb(e, position_ids=pos, layer_type=kind) for kind in ("main", "compress")}
        mask = create_sliding_window_causal_mask(config=c, inputs_embeds=e, attention_mask=None, cache=None,
                                                 position_ids=pos)
        h = layer(h, input_ids=ids[:, 1:], position_embeddings=rope, position_ids=pos, attention_mask=mask)
        logits = hf.lm_head(rms(head(h), mtp["mtp.0.norm.weight"]))[0]
    return torch.log_softmax(logits.float(), -1)


def test_mtp_layer_matches_its_definition_over_transformers_modules(with_mtp, monkeypatch):
    """The draft rows of a prompt past the window (prefilled in chunks, so its window rows are read
    back from the pool's extra layer) give the logits of the MTP block composed from transformers'
    layer: hyper-connections, window attention, MoE and the MTP's own hyper head."""
    from safetensors.torch import load_file

    from pdserve.models.deepseek_v4_mtp import DeepseekV4MTP

    hf, path = with_mtp
    prompt = _prompt(3 * WINDOW + 5, seed=30)
    rows: dict[int, torch.Tensor] = {}
    forward = DeepseekV4MTP.forward

    def recording(self, fb, target_hidden):
        out = forward(self, fb, target_hidden)
        for p, h in zip(fb.positions.tolist(), self.compute_logits(out)):
            rows.setdefault(p, h)
        return out

    monkeypatch.setattr(DeepseekV4MTP, "forward", recording)
    engine = pdserve.Engine(model_path=path, page_size=4, chunked_prefill_size=8, speculative_algorithm="NEXTN",
                            speculative_num_steps=2)
    out = engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 3})
    seq = prompt + out["output_ids"][:1]  # the prompt's last row reads the first sampled token
    ref = _reference_mtp_logits(hf, load_file(f"{path}/mtp.safetensors"), seq)  # [L, V]
    got = torch.log_softmax(torch.stack([rows[p] for p in range(len(prompt))]), -1)
    torch.testing.assert_close(got, ref, atol=1e-3, rtol=1e-3)
    assert len({int(t) for t in ref.argmax(-1)}) > 3  # a draft with opinions, not a constant


@pytest.mark.parametrize("length", [5, 4 * WINDOW + 3])
def test_nextn_keeps_greedy_output_equal_to_plain_decoding_and_transformers(with_mtp, length):
    """The MTP layer's window rows go to the pool's extra layer 3 (its record ring, and nowhere else);
    the target's output does not change."""
    hf, path = with_mtp
    prompt = _prompt(length, seed=40 + length)
    plain = pdserve.Engine(model_path=path, page_size=4).generate(input_ids=prompt, sampling_params=GREEDY)
    engine = pdserve.Engine(model_path=path, page_size=4, chunked_prefill_size=16, speculative_algorithm="NEXTN",
                            speculative_num_steps=3)
    out = engine.generate(input_ids=prompt, sampling_params=GREEDY)
    assert out["output_ids"] == plain["output_ids"] == greedy_continuation(hf, prompt, STEPS)
    assert out["meta_info"]["spec_verify_ct"] >= 1
    pool = engine.scheduler.runner.pool
    assert pool.rows["window_kv"] == {0: 0, 1: 1, 2: 2, 3: 3} and pool.records["window_kv"][3].abs().sum() > 0
    assert all(3 not in layers for name, layers in pool.rows.items() if not name.startswith("window_kv"))


def test_nextn_resumes_its_draft_layer_from_a_boundarys_tail(with_mtp, monkeypatch):
    """A radix hit at a reusable boundary with NEXTN: the MTP layer's window ring starts from the
    boundary's tail as the target's layers do. Verify would hide a wrong draft from the output, so
    the draft's own logits past the boundary are compared with the run that computed every row."""
    from pdserve.models.deepseek_v4_mtp import DeepseekV4MTP

    hf, path = with_mtp
    runs: list[dict[int, torch.Tensor]] = []
    forward = DeepseekV4MTP.forward

    def recording(self, fb, target_hidden):
        out = forward(self, fb, target_hidden)
        for p, h in zip(fb.positions.tolist(), self.compute_logits(out)):
            runs[-1].setdefault(p, h)
        return out

    monkeypatch.setattr(DeepseekV4MTP, "forward", recording)
    engine = pdserve.Engine(model_path=path, page_size=4, speculative_algorithm="NEXTN", speculative_num_steps=3)
    prompt = _prompt(REUSE + 2 * WINDOW + 3, seed=60)
    outs = []
    for _ in range(2):
        runs.append({})
        outs.append(engine.generate(input_ids=prompt, sampling_params=GREEDY))
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [0, REUSE]
    assert outs[0]["output_ids"] == outs[1]["output_ids"] == greedy_continuation(hf, prompt, STEPS)
    assert min(runs[1]) == REUSE and len(runs[1]) > 2 * WINDOW
    for p, logits in runs[1].items():
        torch.testing.assert_close(logits, runs[0][p], atol=1e-4, rtol=1e-4)
    engine.shutdown()


def test_nextn_with_accepted_drafts_keeps_the_output(with_mtp):
    """An oracle draft (the reference continuation, wrong every 5th position) makes verify accept runs
    of drafts across windows and blocks: rejected rows of every region, which later tokens overwrite,
    leave the output equal to transformers'."""
    from engine.test_speculative import OracleDecode

    hf, path = with_mtp
    prompts = [_prompt(3, seed=50), _prompt(3 * WINDOW + 1, seed=51)]
    steps = 2 * STEPS
    seqs = {tuple(p): p + greedy_continuation(hf, p, steps) for p in prompts}
    engine = pdserve.Engine(model_path=path, page_size=4, speculative_algorithm="NEXTN", speculative_num_steps=3)
    engine.scheduler.decode_step = OracleDecode(engine.scheduler, seqs)
    outs = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": steps})
    assert [o["output_ids"] for o in outs] == [list(seqs[tuple(p)][len(p):]) for p in prompts]
    for o in outs:
        assert o["meta_info"]["spec_accept_length"] > 1.5


# ------------------------------------------------------- tiers (the bounded layout at reusable boundaries)
# Colocated V4 runs the bounded layout with --enable-hierarchical-cache too: the tiers move the
# compressed regions and the boundary tails (page buffers), never the per-request rings, and a hit
# from host memory or storage resumes only at a multiple of REUSE.
TIER_PAGES = 80  # pages of 4: a prompt of two blocks and one of one fit, not with a third


def _tier_kw(**kw) -> dict:
    return dict(page_size=4, max_total_tokens=4 * TIER_PAGES, max_running_requests=2, chunked_prefill_size=64,
                enable_hierarchical_cache=True, **kw)


@pytest.fixture(scope="module")
def tier_prompts(tiny) -> dict[str, tuple[list[int], list[int]]]:
    """name -> (prompt, transformers' greedy continuation): ``one`` ends a window and a half past one
    block, ``two`` 5 tokens past two; ``mid`` shares ``one``'s first 100 tokens (mid block), then
    differs; ``other`` only fills the device."""
    hf, _ = tiny
    one, two = _prompt(REUSE + 2 * WINDOW + 3, seed=40), _prompt(2 * REUSE + 5, seed=41)
    mid = one[:REUSE - 3 * WINDOW + 4] + _prompt(WINDOW + 1, seed=43)
    other = _prompt(2 * REUSE + 5, seed=42)
    return {name: (p, greedy_continuation(hf, p, STEPS))
            for name, p in (("one", one), ("two", two), ("mid", mid), ("other", other))}


def _gen(engine, prompt: list[int], steps: int = STEPS) -> dict:
    return engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": steps})


def test_a_block_cached_whole_and_a_short_resume_from_its_tails(tiny, tier_prompts):
    """Two ways a boundary's tails went wrong (no tier involved): a request that ends inside a block
    must not cache that block's first pages (their tail rows are written only when the block's last
    tokens are computed, and a later request computing the whole block would find those pages cached
    and drop its own), and a step that resumes from a tail with fewer tokens than the tail (5 after
    2 REUSE, window 8) must leave the tail rows in its ring for the next step."""
    _, path = tiny
    prompt, want = tier_prompts["two"]
    with pdserve.Engine(model_path=path, page_size=4) as engine:
        _gen(engine, prompt[:REUSE + 12], steps=1)
        assert engine.scheduler.cache.num_cached_pages == REUSE // 4  # the whole first block only
        hits = [_gen(engine, prompt) for _ in range(2)]
        assert [o["meta_info"]["cached_tokens"] for o in hits] == [REUSE, 2 * REUSE]
        assert [o["output_ids"] for o in hits] == [want, want]
        engine.scheduler.check_memory()


def test_host_tier_hits_resume_at_reusable_boundaries(tiny, tier_prompts):
    """Pages go down to host memory as the device fills (write_back) and come back at multiples of
    REUSE, with the tails of the block before (compressed entries, index keys and the tail rows are
    page buffers; the rings are not): every answer is transformers'. ``mid`` finds a host
    continuation that ends inside a block and recomputes it without loading it; ``one`` again resumes at REUSE from a
    block whose first pages are still on the device and whose rest comes from host memory."""
    _, path = tiny
    with pdserve.Engine(model_path=path, **_tier_kw(hicache_write_policy="write_back")) as engine:
        pool = engine.scheduler.runner.pool
        assert pool.bounded is not None and pool.reuse_tokens == REUSE
        assert {name for name, _ in pool.page_buffers()} >= {"window_kv_tail", "csa_src_tail", "csa_kv", "hca_kv"}
        for name in ("one", "two", "mid", "other", "one", "two"):
            prompt, want = tier_prompts[name]
            loaded = engine.get_server_info()["host_load_bytes"]
            out = _gen(engine, prompt)
            assert out["output_ids"] == want, name
            meta = out["meta_info"]
            assert meta["cached_tokens"] % REUSE == 0, (name, meta)
            if name == "mid":  # nothing loaded that could not be resumed from
                assert meta["cached_tokens"] == 0 and engine.get_server_info()["host_load_bytes"] == loaded
        assert meta["cached_tokens"] == 2 * REUSE and meta["cached_tokens_by_tier"]["host"] > 0
        info = engine.get_server_info()
        assert info["cache_hit_tokens_host"] > 0 and info["host_load_bytes"] > 0
        engine.scheduler.check_memory()


@pytest.fixture(scope="module")
def mooncake_master():
    store = pytest.importorskip("pdserve.mem.storage.mooncake_store")
    pytest.importorskip("mooncake.store")
    with store.MooncakeMaster() as m:
        yield m


def _storage_kw(backend: str, tmp_path, request) -> dict:
    kw = dict(hicache_storage_backend=backend, hicache_storage_chunk_tokens=32,
              hicache_storage_prefetch_policy="wait_complete")
    if backend == "file":
        return dict(kw, hicache_storage_dir=str(tmp_path), hicache_storage_size_gb=0.01)
    master = request.getfixturevalue("mooncake_master")
    extra = {"master_server_address": master.address, "metadata_server": master.metadata_server,
             "global_segment_size": "32mb", "local_buffer_size": "16mb"}
    return dict(kw, hicache_storage_backend_extra_config=json.dumps(extra))


@pytest.mark.parametrize("backend", ["file", "mooncake"])
def test_storage_tier_hit_resumes_at_a_reusable_boundary(tiny, tier_prompts, backend, tmp_path, request):
    """Stored in chunks of 32 tokens, ``two`` comes back from storage alone (device and host
    flushed) as its two whole blocks, tails included, with transformers' answer."""
    _, path = tiny
    prompt, want = tier_prompts["two"]
    with pdserve.Engine(model_path=path, **_tier_kw(**_storage_kw(backend, tmp_path, request))) as engine:
        assert _gen(engine, prompt)["output_ids"] == want
        engine.scheduler.cache.storage.flush()
        assert engine.flush_cache()
        out = _gen(engine, prompt)
        assert out["output_ids"] == want
        assert out["meta_info"]["cached_tokens_by_tier"]["storage"] == 2 * REUSE
        engine.scheduler.check_memory()

