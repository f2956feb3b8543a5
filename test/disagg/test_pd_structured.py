"""Structured output and tool calls through P/D: one prefill and one decode (tiny-llama, random
weights, Mooncake over loopback), with ``pdserve router`` and the PyPI sglang-router both in front
of the pair, module-wide. The openai-client checks of the colocated test run through each router:
the grammar travels with the request to decode (prefill never samples and never compiles it), and
only the grammar can make these replies valid. Decode's received-KV count shows each request was
served disaggregated (decode's prefix cache is flushed before each check: a prompt it already holds
would need no transfer).

Parallel sampling (``n`` > 1, ``best_of``) through each router: prefill runs the prompt once, decode
receives its KV once and forks the samples from it; each sample is the colocated engine's with the
same seeds. A grammar decode refuses ends prefill's half of the request at once, with decode's
reason, even behind sglang-router (the pair's --disaggregation-timeout-s is long, so only decode's word
can end it before the test's wait gives up)."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys

import httpx
import openai
import pytest
from pd_servers import RoutedPair

import pdserve
from entrypoints.server_utils import free_port
from entrypoints.structured_checks import (
    check_ebnf,
    check_json_fuzz,
    check_json_schema,
    check_regex,
    check_required_tool_call,
)
from router.router_utils import wait_for

MODEL = "tiny-llama"
ROUTERS = ["pdserve", "sglang"]
TIMEOUT_S = 900  # --disaggregation-timeout-s: far past any wait here, so only an abort ends a room early


@pytest.fixture(scope="module")
def pd():
    pair = RoutedPair(MODEL, "--max-total-tokens", "8192", "--num-threads", "1",
                      "--disaggregation-timeout-s", str(TIMEOUT_S))
    try:
        yield pair.start()
    finally:
        pair.stop()


@pytest.fixture(scope="module")
def sglang_router(pd):
    if importlib.util.find_spec("sglang_router") is None:
        pytest.skip("sglang-router is not installed")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation", "--prefill", pd.prefill.url,
           str(pd.boot), "--decode", pd.decode.url, "--host", "127.0.0.1", "--port", str(port),
           "--prometheus-port", str(free_port())]  # its own (29000 by default: two routers at once collide)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        probe = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        wait_for(lambda: _answers(url, probe, proc), 120, "sglang-router forwards requests")
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _answers(url: str, body: dict, proc: subprocess.Popen) -> bool:
    assert proc.poll() is None, f"sglang-router exited with {proc.returncode}"
    try:
        return httpx.post(url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(params=ROUTERS)
def url(request, pd) -> str:
    return pd.router.url if request.param == "pdserve" else request.getfixturevalue("sglang_router")


@pytest.fixture
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=180)


@pytest.fixture(scope="module")
def engine():
    """The colocated reference (the servers' page size and threads)."""
    return pdserve.Engine(model_path=MODEL, num_threads=1)


def _disaggregated(pd, check, client) -> None:
    """Runs ``check``; its first request must take its KV from prefill. Decode's prefix cache is
    emptied first: a prompt decode already holds needs no transfer (and the checks repeat prompts)."""
    pd.decode.wait_idle()
    assert pd.decode.post("/flush_cache").status_code == 200
    before = pd.decode.info()["kv_received"]
    check(client, MODEL)
    assert pd.decode.info()["kv_received"] > before, "served by decode's local fallback, not through P/D"


def test_json_schema(pd, client):
    _disaggregated(pd, check_json_schema, client)


def test_required_tool_call(pd, client):
    _disaggregated(pd, check_required_tool_call, client)


def test_regex(pd, client):
    _disaggregated(pd, check_regex, client)


def test_ebnf(pd, client):
    _disaggregated(pd, check_ebnf, client)


def test_a_thinking_part_stays_free_on_decode(pd):
    """``think_end`` (what the OpenAI API sets under a reasoning parser) through the pair: decode
    leaves the thinking part free, so a constrained request whose model never writes the marker
    decodes the unconstrained request's tokens (greedy); without it the grammar holds at once.
    (engine/test_grammar.py and test_pd_grammar.py make the model write it and check what follows.)"""
    def generate(**sp) -> dict:
        body = {"text": "Describe an engineer as JSON.", "sampling_params": {"max_new_tokens": 16, "temperature": 0,
                                                                            **sp}}
        r = httpx.post(pd.router.url + "/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    free = generate()
    thinking = generate(regex="(yes|no)", think_end="</think>")
    assert thinking["output_ids"] == free["output_ids"] and not free["text"].startswith("{")
    assert generate(regex="(yes|no)")["text"] in ("yes", "no")


# ------------------------------------------------------------ parallel sampling
PROMPT = [17, 230, 5, 981, 44, 1200, 7, 63, 512, 90, 311, 8, 1023, 77, 400, 6, 19, 888]
SEEDED = {"max_new_tokens": 10, "temperature": 1.0, "seed": 1234, "ignore_eos": True}


def _moved_once(pd, call) -> dict:
    """Runs ``call``; prefill served its room once and decode received that KV once (decode's
    cache flushed first, so the prompt must come from prefill)."""
    for server in (pd.prefill, pd.decode):
        server.wait_idle()
    assert pd.decode.post("/flush_cache").status_code == 200
    before = (pd.prefill.info()["rooms_completed"], pd.decode.info()["kv_received"])
    out = call()
    for server in (pd.prefill, pd.decode):
        server.wait_idle()
    after = (pd.prefill.info()["rooms_completed"], pd.decode.info()["kv_received"])
    assert (after[0] - before[0], after[1] - before[1]) == (1, 1), (before, after)
    return out


def _post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(url + path, json=body, timeout=180)
    assert r.status_code == 200, r.text
    return r.json()


def test_generate_n_seeded_samples_are_the_colocated_engine_s(pd, engine):
    """Through pdserve's router: sglang-router drops /generate's ``sampling_params.seed`` (SGLang
    names it ``sampling_seed``), so seeded /generate samples cannot be compared through it."""
    body = {"input_ids": PROMPT, "sampling_params": {**SEEDED, "n": 3}}
    got = _moved_once(pd, lambda: _post(pd.router.url, "/generate", body))
    want = engine.generate(input_ids=PROMPT, sampling_params={**SEEDED, "n": 3})
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    assert len({tuple(g["output_ids"]) for g in got}) > 1  # each sample has its own seed
    assert [g["meta_info"]["cached_tokens"] for g in got] == [len(PROMPT) - 1] * 3  # forked from the received KV


def test_generate_greedy_n_samples_through_each_router(pd, url, engine):
    greedy = {**SEEDED, "temperature": 0}
    got = _moved_once(pd, lambda: _post(url, "/generate", {"input_ids": PROMPT, "sampling_params": {**greedy, "n": 2}}))
    want = engine.generate(input_ids=PROMPT, sampling_params=greedy)["output_ids"]
    assert [g["output_ids"] for g in got] == [want, want]


def test_completions_n_and_best_of(pd, url, engine):
    text = "The quick brown fox jumps over the lazy dog and then"  # sglang-router refuses token-id prompts
    body = {"model": MODEL, "prompt": text, "max_tokens": 10, "temperature": 1.0, "seed": 1234, "n": 3,
            "ignore_eos": True}
    got = _moved_once(pd, lambda: _post(url, "/v1/completions", body))
    want = [w["text"] for w in engine.generate(prompt=text, sampling_params={**SEEDED, "n": 3})]
    assert [c["text"] for c in sorted(got["choices"], key=lambda c: c["index"])] == want
    best = _moved_once(pd, lambda: _post(url, "/v1/completions", {**body, "n": 1, "best_of": 3}))
    assert len(best["choices"]) == 1 and best["choices"][0]["text"] in want


def test_chat_n_samples(pd, client):
    ask = [{"role": "user", "content": "Name three colours."}]
    one = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=12, temperature=0)
    two = _moved_once(pd, lambda: client.chat.completions.create(model=MODEL, messages=ask, max_tokens=12,
                                                                   temperature=0, n=2))
    assert [c.message.content for c in two.choices] == [one.choices[0].message.content] * 2
    seeded = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=12, temperature=1.0, seed=5, n=3)
    again = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=12, temperature=1.0, seed=5, n=3)
    assert [c.message.content for c in seeded.choices] == [c.message.content for c in again.choices]
    assert len({c.message.content for c in seeded.choices}) > 1


def test_a_grammar_decode_refuses_ends_prefill_s_half_at_once(pd, sglang_router):
    """Decode answers 400 before it asks for the KV; sglang-router (unlike pdserve's) does not
    cancel prefill's half, so decode tells prefill itself (the signed control path): prefill's
    half ends with decode's reason, whichever half reached prefill first, long before the
    disaggregation timeout would end it."""
    for server in (pd.prefill, pd.decode):
        server.wait_idle()
    before = pd.prefill.info()
    r = httpx.post(sglang_router + "/generate", timeout=60, json={"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": 4, "regex": "(unclosed"}})
    assert r.status_code == 400 and "sampling_params.regex" in r.text, r.text
    wait_for(lambda: pd.prefill.info()["rooms_aborted"] > before["rooms_aborted"], timeout=TIMEOUT_S / 10,
             what="prefill's half aborted on decode's word")
    after = pd.prefill.wait_idle()
    assert after["rooms_waiting"] == 0 and after["rooms_expired"] == before["rooms_expired"]
    assert after["rooms_aborted"] == before["rooms_aborted"] + 1


def test_random_samples_are_strict_compact_json(pd, client):
    """Issue 32 through P/D: sampled json_schema replies, streamed and not, are strict compact JSON."""
    _disaggregated(pd, lambda c, m: check_json_fuzz(c, m, per_request=5), client)
