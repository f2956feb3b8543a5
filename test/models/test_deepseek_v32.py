"""DeepSeek-V3.2 (MLA + DSA sparse attention) through the offline Engine against transformers'
``DeepseekV32ForCausalLM`` on a tiny float32 checkpoint with ``index_topk`` 8, so prompts of
several times that length attend to a strict subset of their tokens."""

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
    check_file_tier_restart,
    check_host_tier_hit,
    check_tokens_and_logprobs,
)
from fixtures.tiny_models import greedy_continuation, make_hf_model_and_dir
from pdserve.config import ServerArgs
from pdserve_kernels import index_topk_cpu

ARCH = "DeepseekV32ForCausalLM"
TOPK = 8
TOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf, path = make_hf_model_and_dir(ARCH, tmp_path_factory.mktemp("v32"))
    assert hf.config.index_topk == TOPK
    return hf, path


def _prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 400, (n,), generator=g).tolist()


def _serve(model_path: str, *argv: str) -> subprocess.CompletedProcess:
    with socket.socket() as s:  # a port nobody listens on; the server is expected not to start
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return subprocess.run([sys.executable, "-m", "pdserve", "serve", "--model-path", model_path,
                           "--port", str(port), *argv], capture_output=True, text=True, timeout=180)


@pytest.mark.parametrize("length", [5, 3 * TOPK + 1, 6 * TOPK])
def test_greedy_tokens_and_logprobs_match_transformers(tiny, length):
    hf, path = tiny
    engine = pdserve.Engine(model_path=path, page_size=4, chunked_prefill_size=16)
    check_tokens_and_logprobs(hf, engine, _prompt(length, seed=length), TOL)


def test_batched_requests_of_mixed_lengths_match_transformers(tiny):
    hf, path = tiny
    engine = pdserve.Engine(model_path=path, page_size=1)
    prompts = [_prompt(n, seed=n) for n in (3, 20, 41)]
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == [greedy_continuation(hf, p, STEPS) for p in prompts]
    # the indexer's top-k ran in the CPU kernel wherever it builds (else the torch twin), and says so;
    # sparse attention keeps its own decode path, not the dense CPU decode kernel
    want = "cpu_kernel" if index_topk_cpu.load() is not None else "torch"
    assert engine.get_server_info()["attention"] == {"attention_backend": "torch_native", "index_topk": want,
                                                     "decode_attention": "torch", "extend_attention": "sdpa",
                                                     "decode_stack": "layers"}


def test_cpu_kernel_and_torch_twin_give_the_same_logprobs(tiny):
    """The indexer's top-k through the CPU kernel (keys by slot from the pool) and through the torch
    twin (staged keys): a batch decoding together, prompts below and several times index_topk, every
    prompt and output logprob the same bits."""
    hf, path = tiny
    prompts = [_prompt(n, seed=n) for n in (3, 20, 41)]
    runs = {}
    for impl in (None, "torch"):  # None: the backend's own choice
        engine = pdserve.Engine(model_path=path, page_size=4, chunked_prefill_size=16)
        engine.scheduler.runner.backend.index_topk_impl = impl
        outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0)
        runs[engine.get_server_info()["attention"]["index_topk"]] = [
            (o["output_ids"], o["meta_info"]["input_token_logprobs"], o["meta_info"]["output_token_logprobs"])
            for o in outs]
        engine.shutdown()
    if index_topk_cpu.load() is None:
        pytest.skip("no C compiler: only the torch path ran")
    assert runs["cpu_kernel"] == runs["torch"]
    assert [r[0] for r in runs["torch"]] == [greedy_continuation(hf, p, STEPS) for p in prompts]


def test_selection_matters_on_long_prompts(tiny, tmp_path):
    """With index_topk past every length (the indexer keeps all tokens) a long prompt's output
    changes, and a prompt shorter than index_topk does not: the top-k selection is what differs."""
    hf, path = tiny
    dense = tmp_path / "dense"
    shutil.copytree(path, dense)
    cfg = json.loads((dense / "config.json").read_text())
    cfg["index_topk"] = 4096
    (dense / "config.json").write_text(json.dumps(cfg))
    sparse_engine = pdserve.Engine(model_path=path, page_size=4)
    dense_engine = pdserve.Engine(model_path=str(dense), page_size=4)
    short, long = _prompt(TOPK - 2, seed=1), _prompt(8 * TOPK, seed=2)
    params = {**GREEDY, "max_new_tokens": 1}
    s_short, s_long = (sparse_engine.generate(input_ids=p, sampling_params=params, return_logprob=True,
                                              logprob_start_len=0) for p in (short, long))
    d_short, d_long = (dense_engine.generate(input_ids=p, sampling_params=params, return_logprob=True,
                                             logprob_start_len=0) for p in (short, long))
    lps = lambda o: [lp for lp, _, _ in o["meta_info"]["input_token_logprobs"][1:]]  # noqa: E731
    assert lps(s_short) == pytest.approx(lps(d_short), abs=TOL)
    diff = max(abs(a - b) for a, b in zip(lps(s_long), lps(d_long)))
    assert diff > 1e-2  # past index_topk tokens, attending to all of them is a different model


def test_prefix_hit_gives_identical_output(tiny):
    """The index keys are a region of the latent's pages: a radix hit restores both."""
    hf, path = tiny
    engine = pdserve.Engine(model_path=path, page_size=4)
    prompt = _prompt(5 * TOPK + 3, seed=7)
    first = engine.generate(input_ids=prompt, sampling_params=GREEDY, return_logprob=True, logprob_start_len=-1)
    second = engine.generate(input_ids=prompt, sampling_params=GREEDY, return_logprob=True, logprob_start_len=-1)
    assert first["meta_info"]["cached_tokens"] == 0
    assert second["meta_info"]["cached_tokens"] == (len(prompt) - 1) // 4 * 4
    assert second["output_ids"] == first["output_ids"] == greedy_continuation(hf, prompt, STEPS)
    got = [lp for lp, _, _ in second["meta_info"]["output_token_logprobs"]]
    assert got == pytest.approx([lp for lp, _, _ in first["meta_info"]["output_token_logprobs"]], abs=TOL)


REFUSALS = [
    ({"attention_backend": "flashinfer", "device": "cuda"},
     "--attention-backend): flashinfer: DeepSeek-V3.2's sparse attention runs on torch_native or triton"),
]


@pytest.mark.parametrize("flags,message", REFUSALS, ids=[next(iter(f)) for f, _ in REFUSALS])
def test_unsupported_modes_are_refused_at_start_up(tiny, flags, message):
    _, path = tiny
    with pytest.raises(ValueError) as err:
        ServerArgs(model_path=path, **flags).model_config()
    assert message in str(err.value)


def test_refusal_reaches_the_cli_as_one_line():
    proc = _serve("tiny-deepseek-v32", "--device", "cuda", "--attention-backend", "flashinfer")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "attention_backend (--attention-backend): flashinfer: DeepSeek-V3.2's sparse attention runs on " \
        "torch_native or triton" in proc.stderr


def test_preset_serves_a_chat_request():
    """``pdserve serve --model-path tiny-deepseek-v32`` (random weights from the config) answers
    a chat completion long enough to pass index_topk (32) tokens of context."""
    server = Server(model="tiny-deepseek-v32").start()
    try:
        r = server.post("/v1/chat/completions", json={
            "model": "tiny-deepseek-v32", "max_tokens": 24, "temperature": 0,
            "messages": [{"role": "user", "content": "Tell me about the lighthouse keeper and the 112 steps. " * 3}]})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["prompt_tokens"] > 32
        assert body["usage"]["completion_tokens"] >= 1 and isinstance(body["choices"][0]["message"]["content"], str)
        server.wait_idle()
    finally:
        server.stop()


def test_pd_layout_carries_the_index_keys_as_a_region():
    """The P/D layout takes the pool's index keys as one more replicated region of its pages."""
    from pdserve.disagg.layout import KVLayout
    from pdserve.mem.kv_pool import MLAKVPool

    pool = MLAKVPool(4, 2, 2, kv_lora_rank=8, rope_dim=4, dtype=torch.float32, index_head_dim=8)
    layout = KVLayout.from_descriptors("mla", 1, 1, 2, "float32", pool.buffer_descriptors())
    assert layout.buffers == ("latent", "index_k") and layout.geometry("index_k") == (2 * 8 * 4, 4 * 2 * 8 * 4)


def test_attention_reads_only_the_selected_latent_rows(tiny, monkeypatch):
    """Sparse, not masked: no whole-context latent read; each query gathers at most index_topk rows."""
    from pdserve.mem.kv_pool import MLAKVPool

    hf, path = tiny
    shapes = []
    gather = MLAKVPool.get_latent_slots

    def no_dense(*_):
        raise AssertionError("a dense latent read in DeepSeek-V3.2's attention")

    def recording(self, layer, slots):
        shapes.append(tuple(slots.shape))
        return gather(self, layer, slots)

    monkeypatch.setattr(MLAKVPool, "get_latent_pages", no_dense)
    monkeypatch.setattr(MLAKVPool, "get_latent_slots", recording)
    engine = pdserve.Engine(model_path=path, page_size=4)
    prompt = _prompt(5 * TOPK, seed=3)
    out = engine.generate(input_ids=prompt, sampling_params=GREEDY)
    assert out["output_ids"] == greedy_continuation(hf, prompt, STEPS)
    assert shapes and all(s[-1] == TOPK for s in shapes)  # [B, Q, k]: k rows per query, never the context
    assert (1, len(prompt), TOPK) in shapes and (1, 1, TOPK) in shapes  # the prefill and a decode step


# ---------------------------------------------------------------- the host and storage tiers
def _tier_prompts() -> list[list[int]]:
    """Two prompts several times index_topk and one shorter than it; 16 device pages of 4 tokens
    cannot keep all three, so pages cycle through host memory."""
    return [_prompt(28, seed=40), _prompt(30, seed=41), _prompt(TOPK - 3, seed=42)]


def test_host_tier_hit_restores_the_index_keys(tiny):
    """A prefix found only in host memory comes back with its index keys (a page whose index keys
    were left behind would select other tokens)."""
    hf, path = tiny
    check_host_tier_hit(hf, path, _tier_prompts())


def test_file_tier_stores_the_index_keys_across_a_restart(tiny, tmp_path):
    hf, path = tiny
    check_file_tier_restart(hf, path, _tier_prompts()[0], tmp_path)


# ------------------------------------------------------------------ NEXTN (the MTP layer, with its own indexer)
@pytest.fixture(scope="module")
def with_mtp(tiny, tmp_path_factory):
    """The tiny checkpoint plus DeepSeek-V3.2's MTP layer (``model.layers.{n}.*``: a V3.2 decoder
    layer, lightning indexer included, as the official checkpoint carries) in a second file."""
    from safetensors.torch import load_file, save_file

    from fixtures.fp8_checkpoints import _mtp_layer

    hf, path = tiny
    d = tmp_path_factory.mktemp("v32mtp") / "ckpt"
    shutil.copytree(path, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    n = cfg["num_hidden_layers"]
    tensors = _mtp_layer(load_file(str(d / "model.safetensors")), cfg)  # the last layer's copy, + MTP parts
    assert f"model.layers.{n}.self_attn.indexer.wk.weight" in tensors
    save_file({k: t.contiguous() for k, t in tensors.items()}, str(d / "mtp.safetensors"))
    return hf, str(d), n


def test_nextn_loads_the_mtp_layers_own_indexer(with_mtp):
    from safetensors.torch import load_file

    from pdserve.config import ModelConfig, SpeculativeConfig
    from pdserve.models.deepseek_v32 import MLASparseAttention
    from pdserve.models.draft import load_draft
    from pdserve.models.loader import load_model

    _, path, n = with_mtp
    mc = ModelConfig.from_path(path)
    draft = load_draft(mc, SpeculativeConfig("NEXTN"), load_model(mc), seed=0)
    raw = load_file(f"{path}/mtp.safetensors")
    assert isinstance(draft.self_attn, MLASparseAttention) and draft.layer_id == n
    for name in ("wq_b", "wk", "weights_proj"):
        assert torch.equal(getattr(draft.self_attn.indexer, name).weight,
                           raw[f"model.layers.{n}.self_attn.indexer.{name}.weight"])
    assert torch.equal(draft.self_attn.indexer.k_norm.bias, raw[f"model.layers.{n}.self_attn.indexer.k_norm.bias"])


@pytest.mark.parametrize("length", [5, 4 * TOPK + 3])
def test_nextn_keeps_greedy_output_equal_to_plain_decoding_and_transformers(with_mtp, length, monkeypatch):
    """The MTP layer attends sparsely too: its indexer scores the index keys it wrote to the pool's
    extra layer n (never a dense latent read), and the target's output does not change."""
    from pdserve.mem.kv_pool import MLAKVPool

    hf, path, n = with_mtp
    prompt = _prompt(length, seed=40 + length)
    plain = pdserve.Engine(model_path=path, page_size=4).generate(input_ids=prompt, sampling_params=GREEDY)
    reads: list[tuple[int, tuple]] = []
    gather = MLAKVPool.get_latent_slots

    def no_dense(*_):
        raise AssertionError("a dense latent read in DeepSeek-V3.2's attention")

    def recording(self, layer, slots):
        reads.append((layer, tuple(slots.shape)))
        return gather(self, layer, slots)

    monkeypatch.setattr(MLAKVPool, "get_latent_pages", no_dense)
    monkeypatch.setattr(MLAKVPool, "get_latent_slots", recording)
    engine = pdserve.Engine(model_path=path, page_size=4, chunked_prefill_size=16, speculative_algorithm="NEXTN",
                            speculative_num_steps=3)
    out = engine.generate(input_ids=prompt, sampling_params=GREEDY)
    assert out["output_ids"] == plain["output_ids"] == greedy_continuation(hf, prompt, STEPS)
    assert out["meta_info"]["spec_verify_ct"] >= 1
    draft_reads = [shape for layer, shape in reads if layer == n]
    assert draft_reads and all(s[-1] <= TOPK for s in draft_reads)  # [B, Q, k]: never the whole context
    if length > TOPK:
        assert any(s[-1] == TOPK for s in draft_reads)  # the draft's queries keep index_topk of more tokens
    pool = engine.scheduler.runner.pool
    assert pool.index_k is not None and pool.index_k.shape[0] == n + 1 and pool.index_k[n].abs().sum() > 0


def test_nextn_with_accepted_drafts_keeps_the_output(with_mtp):
    """An oracle draft (the reference continuation, wrong every 5th position) makes verify accept
    runs of drafts: the target's sparse verify rows and the index keys of rejected rows, which
    later tokens overwrite, leave the output equal to transformers'."""
    from engine.test_speculative import OracleDecode

    hf, path, _ = with_mtp
    prompts = [_prompt(3, seed=50), _prompt(5 * TOPK, seed=51)]
    steps = 2 * STEPS
    seqs = {tuple(p): p + greedy_continuation(hf, p, steps) for p in prompts}
    engine = pdserve.Engine(model_path=path, page_size=4, speculative_algorithm="NEXTN", speculative_num_steps=3)
    engine.scheduler.decode_step = OracleDecode(engine.scheduler, seqs)
    outs = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": steps})
    assert [o["output_ids"] for o in outs] == [list(seqs[tuple(p)][len(p):]) for p in prompts]
    for o in outs:
        assert o["meta_info"]["spec_accept_length"] > 1.5


# ------------------------------------------------------------------ FP8 block-quantized checkpoints
@pytest.fixture(scope="module")
def fp8_v32(tmp_path_factory):
    """DeepSeek-V3.2 in the official FP8 format (indexer wq_b/wk quantized, weights_proj not), its MTP
    layer included; the dequantized copy for transformers."""
    from transformers import AutoModelForCausalLM

    from fixtures.fp8_checkpoints import make_fp8_checkpoint

    fp8_dir, plain_dir = make_fp8_checkpoint(ARCH, tmp_path_factory.mktemp("v32fp8"), mtp_layer=True)
    hf = AutoModelForCausalLM.from_pretrained(plain_dir, dtype=torch.float32).eval()
    assert hf.config.index_topk == TOPK
    return fp8_dir, plain_dir, hf


def test_fp8_checkpoint_quantizes_the_indexers_wq_b_and_wk_only(fp8_v32):
    from pdserve.layers.quant.fp8 import FP8_DTYPE, SCALE_SUFFIX
    from pdserve.models.loader import iter_safetensors

    fp8_dir, _, hf = fp8_v32
    raw = dict(iter_safetensors(fp8_dir))
    n = hf.config.num_hidden_layers
    for layer in (0, n):  # a target layer and the MTP layer
        idx = f"model.layers.{layer}.self_attn.indexer."
        assert raw[idx + "wq_b.weight"].dtype == raw[idx + "wk.weight"].dtype == FP8_DTYPE
        assert idx + "wq_b.weight" + SCALE_SUFFIX in raw and idx + "wk.weight" + SCALE_SUFFIX in raw
        assert raw[idx + "weights_proj.weight"].dtype == torch.float32
        assert idx + "weights_proj.weight" + SCALE_SUFFIX not in raw


@pytest.mark.parametrize("length", [5, 5 * TOPK + 1])
def test_fp8_checkpoint_decodes_like_transformers_on_the_dequantized_copy(fp8_v32, length):
    from pdserve.config import ModelConfig
    from pdserve.models.base import checkpoint_tensors
    from pdserve.models.loader import load_model

    fp8_dir, plain_dir, hf = fp8_v32
    engine = pdserve.Engine(model_path=fp8_dir, page_size=4)
    assert engine.scheduler.runner.model_config.quantization is not None
    prompt = _prompt(length, seed=60 + length)
    out = engine.generate(input_ids=prompt, sampling_params=GREEDY)
    assert out["output_ids"] == greedy_continuation(hf, prompt, STEPS)
    a = dict(checkpoint_tensors(engine.scheduler.runner.model))
    b = dict(checkpoint_tensors(load_model(ModelConfig.from_path(plain_dir))))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    engine.shutdown()


def test_fp8_checkpoint_with_nextn_keeps_greedy_output(fp8_v32):
    fp8_dir, _, hf = fp8_v32
    prompt = _prompt(4 * TOPK, seed=70)
    out = pdserve.Engine(model_path=fp8_dir, page_size=4, speculative_algorithm="NEXTN").generate(
        input_ids=prompt, sampling_params=GREEDY)
    assert out["output_ids"] == greedy_continuation(hf, prompt, STEPS)
    assert out["meta_info"]["spec_verify_ct"] >= 1


def test_fp8_preset_loads_the_full_presets_draws_quantized():
    """tiny-deepseek-v32-fp8 is tiny-deepseek-v32 through our quantizer: the indexer's wq_b/wk (and
    every other quantized linear) FP8-representable, weights_proj and the norms the same draws."""
    from pdserve.config import ModelConfig
    from pdserve.layers.quant.fp8 import dequantize_block_fp8, is_quantized_linear, quantize_block_fp8
    from pdserve.models.base import checkpoint_tensors
    from pdserve.models.loader import load_model

    fp8 = dict(checkpoint_tensors(load_model(ModelConfig.from_path("tiny-deepseek-v32-fp8"))))
    full = dict(checkpoint_tensors(load_model(ModelConfig.from_path("tiny-deepseek-v32"))))
    assert fp8.keys() == full.keys()
    quantized = {k for k in fp8 if is_quantized_linear(k)}
    assert {"model.layers.1.self_attn.indexer.wq_b.weight", "model.layers.1.self_attn.indexer.wk.weight"} <= quantized
    assert "model.layers.1.self_attn.indexer.weights_proj.weight" not in quantized
    for key, w in fp8.items():
        assert torch.equal(w, full[key]) != (key in quantized), key
        if key in quantized:
            assert torch.equal(dequantize_block_fp8(*quantize_block_fp8(w)), w), key


@pytest.mark.parametrize("length", [24, 100])
def test_fp8_preset_serves_with_nextn(length):
    """The preset's 4 index heads often score tokens exactly 0 (every head's ReLU off). Past its
    index_topk (32) such ties straddle the cut; the indexer takes them from the lowest position, so a
    verify's 4 rows pick what a decode's one row picks and speculation keeps the plain tokens."""
    prompt = _prompt(length, seed=80)
    plain = pdserve.Engine(model_path="tiny-deepseek-v32-fp8").generate(input_ids=prompt, sampling_params=GREEDY)
    spec = pdserve.Engine(model_path="tiny-deepseek-v32-fp8", speculative_algorithm="NEXTN").generate(
        input_ids=prompt, sampling_params=GREEDY)
    assert spec["output_ids"] == plain["output_ids"] and spec["meta_info"]["spec_verify_ct"] >= 1


# ------------------------------------------------------------------ FP8 KV cache (--kv-cache-dtype fp8_e4m3)
def _fp8_round_trip(x: torch.Tensor) -> torch.Tensor:
    """The pool's e4m3 store and read at scale 1 (saturating), written apart from pdserve's."""
    return x.float().clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(x.dtype)


@pytest.fixture
def hf_with_fp8_latent(tiny):
    """transformers' model whose MLA reads its cached latent (compressed KV and rotated k_pe) through
    e4m3, as an FP8 pool holds it; the indexer's keys untouched (the pool keeps them full precision)."""
    hf, _ = tiny
    originals = []
    for layer in hf.model.layers:
        attn = layer.self_attn
        originals.append(attn.expand_kv)
        attn.expand_kv = (lambda f: lambda kv, k_rot: f(_fp8_round_trip(kv), _fp8_round_trip(k_rot)))(attn.expand_kv)
    yield hf
    for layer, f in zip(hf.model.layers, originals):
        layer.self_attn.expand_kv = f


@pytest.mark.parametrize("length", [5, 4 * TOPK + 5])
def test_fp8_kv_cache_decodes_like_transformers_reading_an_fp8_latent(tiny, hf_with_fp8_latent, length):
    hf, path = tiny
    prompt = _prompt(length, seed=90 + length)
    engine = pdserve.Engine(model_path=path, page_size=4, kv_cache_dtype="fp8_e4m3")
    pool = engine.scheduler.runner.pool
    assert pool.latent.dtype == torch.float8_e4m3fn and pool.index_k is not None
    assert pool.index_k.dtype == torch.float32  # index keys stay at full precision on CPU
    out = engine.generate(input_ids=prompt, sampling_params=GREEDY)
    plain = pdserve.Engine(model_path=path, page_size=4).generate(input_ids=prompt, sampling_params=GREEDY)
    assert out["output_ids"] == greedy_continuation(hf_with_fp8_latent, prompt, STEPS)
    if length > TOPK:  # the FP8 latent is a different model here: the oracle would not catch a full-precision pool
        assert out["output_ids"] != plain["output_ids"]


def test_fp8_kv_budget_counts_full_precision_index_keys(tiny):
    from pdserve.config import ModelConfig

    _, path = tiny
    mc = ModelConfig.from_path(path)
    c = mc.hf_config
    latent, index = c.kv_lora_rank + c.qk_rope_head_dim, c.index_head_dim
    assert mc.kv_bytes_per_token("fp8_e4m3") == mc.num_layers * (latent * 1 + index * 4)
    assert mc.kv_bytes_per_token() == mc.num_layers * (latent + index) * 4


# ------------------------------------------------------------------ --enable-torch-compile
def test_compiled_decode_gives_the_eager_tokens(tiny):
    """Decode steps run compiled layers (the indexer's projections inside them); the indexer's
    scoring, top-k and the sparse MLA run eagerly behind the graph break, on the real rows. The
    graphs compiled at start-up serve every step (a recompile fails the run)."""
    hf, path = tiny
    kw = {"model_path": path, "num_threads": 1, "disable_radix_cache": True, "page_size": 4,
          "torch_compile_max_bs": 1}
    prompts = [_prompt(4 * TOPK, seed=100), _prompt(TOPK - 3, seed=101)]
    params = [{**GREEDY, "max_new_tokens": n} for n in (STEPS, STEPS // 2)]  # batches of 2 (eager), then 1
    engine = pdserve.Engine(enable_torch_compile=True, **kw)
    with torch.compiler.set_stance("fail_on_recompile"):
        outs = engine.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in outs] == [greedy_continuation(hf, p, sp["max_new_tokens"])
                                               for p, sp in zip(prompts, params)]
    steps = engine.scheduler.runner.compiled.steps
    assert dict(steps) == {1: STEPS - STEPS // 2}  # the batch of 2 ran eagerly
    engine.shutdown()
