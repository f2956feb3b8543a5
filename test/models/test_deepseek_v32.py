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
from fixtures.tiny_models import greedy_continuation, make_hf_model_and_dir
from pdserve.config import ServerArgs

ARCH = "DeepseekV32ForCausalLM"
TOPK = 8
TOL = 1e-4
STEPS = 10
GREEDY = {"max_new_tokens": STEPS, "temperature": 0.0, "ignore_eos": True}


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


def _hf_logprobs(hf, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(input_ids=torch.tensor([seq])).logits[0].float(), -1)  # [L, V]


@pytest.mark.parametrize("length", [5, 3 * TOPK + 1, 6 * TOPK])
def test_greedy_tokens_and_logprobs_match_transformers(tiny, length):
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


def test_batched_requests_of_mixed_lengths_match_transformers(tiny):
    hf, path = tiny
    engine = pdserve.Engine(model_path=path, page_size=1)
    prompts = [_prompt(n, seed=n) for n in (3, 20, 41)]
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == [greedy_continuation(hf, p, STEPS) for p in prompts]


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
    ({"disaggregation_mode": "prefill"}, "--disaggregation-mode): prefill: DeepSeek-V3.2's index keys do not move"),
    ({"enable_hierarchical_cache": True}, "--enable-hierarchical-cache): DeepSeek-V3.2's index keys have no host"),
    ({"speculative_algorithm": "NEXTN"}, "--speculative-algorithm): NEXTN: DeepSeek-V3.2 has no draft"),
    ({"attention_backend": "flashinfer", "device": "cuda"},
     "--attention-backend): flashinfer: DeepSeek-V3.2's sparse attention runs on torch_native or triton"),
    ({"tp_size": 2}, "--tp-size): DeepSeek-V3.2 runs on one rank"),
    ({"kv_cache_dtype": "fp8_e4m3"}, "--kv-cache-dtype): fp8_e4m3: DeepSeek-V3.2's pool stays in the model dtype"),
    ({"enable_torch_compile": True}, "--enable-torch-compile): DeepSeek-V3.2's sparse attention runs eagerly"),
]


@pytest.mark.parametrize("flags,message", REFUSALS, ids=[next(iter(f)) for f, _ in REFUSALS])
def test_unsupported_modes_are_refused_at_start_up(tiny, flags, message):
    _, path = tiny
    with pytest.raises(ValueError) as err:
        ServerArgs(model_path=path, **flags).model_config()
    assert message in str(err.value)


def test_fp8_checkpoint_is_refused(tiny, tmp_path):
    _, path = tiny
    fp8 = tmp_path / "fp8"
    shutil.copytree(path, fp8)
    cfg = json.loads((fp8 / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    (fp8 / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="quantization_config: FP8 DeepSeek-V3.2 checkpoints are not supported"):
        ServerArgs(model_path=str(fp8)).model_config()


def test_refusal_reaches_the_cli_as_one_line():
    proc = _serve("tiny-deepseek-v32", "--disaggregation-mode", "decode")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "disaggregation_mode (--disaggregation-mode): decode: DeepSeek-V3.2's index keys do not move in P/D yet" \
        in proc.stderr


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


def test_pd_layout_refuses_a_pool_with_index_keys():
    """Defence in depth behind the start-up refusal: the P/D layout names the extra region."""
    from pdserve.disagg.layout import KVLayout, LayoutError
    from pdserve.mem.kv_pool import MLAKVPool

    pool = MLAKVPool(4, 2, 2, kv_lora_rank=8, rope_dim=4, dtype=torch.float32, index_head_dim=8)
    with pytest.raises(LayoutError, match=r"a mla pool has buffers \('latent',\), got \('latent', 'index_k'\)"):
        KVLayout.from_descriptors("mla", 1, 1, 2, "float32", pool.buffer_descriptors())


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
