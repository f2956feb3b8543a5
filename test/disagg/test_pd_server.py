"""1 prefill + 1 decode + a router, as real processes (real Mooncake, or NIXL, over loopback):
greedy outputs of concurrent mixed requests are the colocated engine's, streaming or not,
through pdserve's router and through the PyPI sglang-router. One deployment per (model, page
size, transfer backend, KV dtype), shared by the module's tests: every layout on Mooncake, GQA and
MLA on NIXL; the GQA page-16 one with FP8 KV pages on both sides (--kv-cache-dtype fp8_e4m3,
compared with a colocated FP8 engine)."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from pd_servers import RoutedPair, stream_final

import pdserve
from constrained.grammar_fixtures import CONSTRAINTS, check_output
from entrypoints.server_utils import free_port
from router.router_utils import wait_for

NEW = 16
PARAMS = [("tiny-deepseek", 1, "mooncake", "auto"), ("tiny-deepseek", 16, "mooncake", "auto"),
          ("tiny-llama", 1, "mooncake", "auto"), ("tiny-llama", 16, "mooncake", "fp8_e4m3"),
          ("tiny-deepseek", 16, "nixl", "auto"), ("tiny-llama", 1, "nixl", "auto")]


class Deployment(RoutedPair):
    def __init__(self, model: str, page_size: int, backend: str = "mooncake", kv_cache_dtype: str = "auto"):
        self.model, self.page_size, self.kv_cache_dtype = model, page_size, kv_cache_dtype
        self.chunk = 64 if page_size == 16 else 48
        self.flags = ("--page-size", str(page_size), "--chunked-prefill-size", str(self.chunk),
                      "--max-total-tokens", "16384", "--num-threads", "1", "--disaggregation-transfer-backend", backend,
                      "--kv-cache-dtype", kv_cache_dtype, "--constrained-json-disable-any-whitespace")
        super().__init__(model, *self.flags)

    def colocated(self, prompts: list[list[int]]) -> list[list[int]]:
        eng = pdserve.Engine(model_path=self.model, page_size=self.page_size, chunked_prefill_size=self.chunk,
                             num_threads=1, kv_cache_dtype=self.kv_cache_dtype)
        out = eng.generate(input_ids=prompts, sampling_params=_greedy())
        return [o["output_ids"] for o in out]


def _greedy() -> dict:
    return {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}


def _workload(n: int, seed: int) -> tuple[list[int], list[list[int]]]:
    """A shared prefix, and n prompts: one-token ones, short ones, ones longer than a chunk,
    and ones extending the prefix (both radix caches hit on those)."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda k: torch.randint(3, 1500, (k,), generator=g).tolist()  # noqa: E731
    prefix = rnd(48)
    lengths = [1, 7, 30, 130, 200, 2, 64, 97]
    prompts = [prefix + rnd(3 + i) if i % 4 == 3 else rnd(lengths[i % len(lengths)]) for i in range(n)]
    return prefix, prompts


@pytest.fixture(scope="module", params=PARAMS,
                ids=[f"{m}-page{p}-{b}" + ("" if kv == "auto" else f"-{kv}") for m, p, b, kv in PARAMS])
def pd(request):
    dep = Deployment(*request.param)
    try:
        yield dep.start()
    finally:
        dep.stop()


def _send(url: str, prompts: list[list[int]]) -> list[list[int]]:
    """Every prompt at once; even ones stream, odd ones do not."""
    def one(i: int) -> list[int]:
        body = {"input_ids": prompts[i], "sampling_params": _greedy()}
        if i % 2 == 0:
            return stream_final(url, body)["output_ids"]
        r = httpx.post(url + "/generate", json=body, timeout=180)
        r.raise_for_status()
        return r.json()["output_ids"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, range(len(prompts))))


def test_concurrent_mixed_requests_match_colocated_through_the_router(pd):
    prefix, prompts = _workload(24, seed=pd.page_size)
    warm = httpx.post(pd.router.url + "/generate", json={"input_ids": prefix + [9, 9], "sampling_params": _greedy()},
                      timeout=120)
    assert warm.status_code == 200
    before = pd.decode.info()
    got = _send(pd.router.url, prompts)
    assert got == pd.colocated(prompts)
    after = pd.decode.info()
    moved = after["kv_received"] - before["kv_received"]
    ones = sum(len(p) == 1 for p in prompts)
    assert moved == len(prompts) - ones and after["fallbacks"] == 0, after
    assert after["local_prefills"] - before["local_prefills"] == ones
    for server in (pd.prefill, pd.decode):
        server.wait_idle(60)


def test_openai_routes_and_the_timeline_through_the_router(pd):
    prompt = "The quick brown fox jumps over the lazy dog"
    via = httpx.post(pd.router.url + "/v1/completions", json={"model": pd.model, "prompt": prompt,
                                                               "max_tokens": NEW, "temperature": 0}, timeout=120)
    eng = pdserve.Engine(model_path=pd.model, page_size=pd.page_size, num_threads=1, kv_cache_dtype=pd.kv_cache_dtype)
    assert via.json()["choices"][0]["text"] == eng.generate(prompt=prompt, sampling_params={
        "max_new_tokens": NEW, "temperature": 0})["text"]
    body = httpx.post(pd.router.url + "/generate", json={"text": prompt, "sampling_params": _greedy()},
                      timeout=120).json()
    stages = body["meta_info"]["timeline"]
    assert set(stages) == {"queue", "prefill", "transfer", "decode_scheduling"}
    assert all(v >= 0 for v in stages.values()) and stages["prefill"] > 0
    metrics = pd.decode.get("/metrics").text
    assert 'pdserve:ttft_stage_seconds_count{model_name="' in metrics and "pdserve:decode_kv_received_total" in metrics
    assert "pdserve:kv_transfer_bytes_total" in pd.prefill.get("/metrics").text


def test_constrained_generate_through_the_router_is_valid_and_compiled_on_decode_only(pd):
    """json_schema, regex and ebnf through 1P1D: decode samples every token (its first one too)
    under the grammar; prefill never compiles one (it never samples)."""
    prompts = ["Give me a record:", "Once upon a time", "The answer is"]  # distinct: each one's KV moves
    before = pd.decode.info()["kv_received"]
    for i, (kind, text) in enumerate(CONSTRAINTS.items()):
        body = {"text": prompts[i], "sampling_params": {"max_new_tokens": 128, "temperature": 0, kind: text}}
        if i % 2:
            out = stream_final(pd.router.url, body)
        else:
            r = httpx.post(pd.router.url + "/generate", json=body, timeout=180)
            assert r.status_code == 200, r.text
            out = r.json()
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        check_output(kind, out["text"])
    decode, prefill = pd.decode.info(), pd.prefill.info()
    assert decode["grammar"]["requests"] >= 3 and decode["kv_received"] - before == 3
    assert prefill["grammar"]["requests"] == 0 and prefill["grammar_frontend"]["requests"] == 0
    r = httpx.post(pd.router.url + "/generate", timeout=60, json={"text": prompts[0], "sampling_params": {
        "regex": "(unclosed"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.regex"
    # decode refused it, so it never asks for the KV: the router closes prefill's half too, which
    # would otherwise wait for its other half until the disaggregation timeout
    wait_for(lambda: pd.prefill.info()["rooms_waiting"] == 0, timeout=20, what="prefill let go of the refused room")


@pytest.mark.skipif(importlib.util.find_spec("sglang_router") is None, reason="sglang-router is not installed")
def test_the_same_through_sglang_router(pd):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation", "--prefill", pd.prefill.url,
           str(pd.boot), "--decode", pd.decode.url, "--host", "127.0.0.1", "--port", str(port),
           "--prometheus-port", str(free_port())]  # its own (29000 by default: two routers at once collide)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _, prompts = _workload(8, seed=100 + pd.page_size)
        probe = {"input_ids": prompts[0], "sampling_params": _greedy()}
        wait_for(lambda: _answers(url, probe, proc), 120, "sglang-router forwards requests")
        before = pd.decode.info()["kv_received"]
        assert _send(url, prompts) == pd.colocated(prompts)
        assert pd.decode.info()["kv_received"] - before == sum(len(p) > 1 for p in prompts)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _answers(url: str, body: dict, proc: subprocess.Popen) -> bool:
    assert proc.poll() is None, f"sglang-router exited with {proc.returncode}"
    try:
        return httpx.post(url + "/generate", json=body, timeout=60).status_code == 200
    except httpx.HTTPError:
        return False
