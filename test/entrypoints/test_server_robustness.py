"""What a robustness probe of the server found: shutdown during a long prefill, huge bodies and
prompts, values no request may carry. Real servers; the one killed on purpose is its own."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import threading
import time

import httpx
import pytest

import pdserve
from pdserve.config import ServerArgs
from pdserve.entrypoints.tokenizer_manager import INLINE_TOKENIZE_CHARS, TokenizerManager
from server_utils import PRESET, Server, alive, descendants, port_is_free

MAX_REQUEST_BYTES = 1_000_000
MAX_TOTAL_TOKENS = 512


@pytest.fixture(scope="module")
def server():
    s = Server("--max-total-tokens", str(MAX_TOTAL_TOKENS), "--max-request-bytes", str(MAX_REQUEST_BYTES))
    try:
        yield s.start()
    finally:
        s.stop()


# ---------------------------------------------------------------- bodies
def test_oversized_body_is_refused_before_parsing(server):
    big = {"prompt": "x" * (MAX_REQUEST_BYTES + 10), "max_tokens": 1}
    r = server.post("/v1/completions", json=big)
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert str(MAX_REQUEST_BYTES) in err["message"] and "--max-request-bytes" in err["message"]

    def chunks():  # no Content-Length: the limit is enforced while reading
        for _ in range(12):
            yield b" " * 100_000

    r = server.post("/generate", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "--max-request-bytes" in r.json()["error"]["message"]
    assert server.get("/health").status_code == 200


def test_huge_prompt_is_tokenized_off_the_event_loop(server):
    """A prompt far over the context (under the body limit) is a 400 naming it; /health keeps
    answering while it is tokenized."""
    text = "hello world " * (MAX_REQUEST_BYTES // 13)
    result = {}

    def send():
        result["r"] = server.post("/v1/completions", json={"prompt": text, "max_tokens": 1}, timeout=120)

    t = threading.Thread(target=send)
    t.start()
    health = []
    while t.is_alive():
        health.append(httpx.get(server.url + "/health", timeout=30).status_code)
    t.join()
    assert set(health) <= {200}
    r = result["r"]
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


def test_encode_runs_long_texts_on_a_worker_thread():
    """While a long text is being tokenized, the event loop keeps running other tasks."""

    class GatedTokenizer:  # a real tokenizer that waits for a gate before encoding long texts
        def __init__(self, inner):
            self.inner, self.gate, self.threads = inner, threading.Event(), []

        def encode(self, text, **kw):
            self.threads.append(threading.get_ident())
            if len(text) > INLINE_TOKENIZE_CHARS:
                assert self.gate.wait(30)
            return self.inner.encode(text, **kw)

    engine_tok = pdserve.Engine(model_path=PRESET, max_total_tokens=64).tokenizer
    tok = GatedTokenizer(engine_tok)
    tm = TokenizerManager(ServerArgs(model_path=PRESET), tok)

    async def main():
        long = asyncio.ensure_future(tm.encode("word " * 2000))
        while not tok.threads:  # the loop keeps running while the worker blocks in encode
            await asyncio.sleep(0.01)
        short = await tm.encode("a short prompt")
        assert not long.done()
        tok.gate.set()
        return short, await long

    try:
        short, long_ids = asyncio.run(main())
    finally:
        tm._tokenize_pool.shutdown(wait=True)
    assert short == engine_tok.encode("a short prompt")
    assert long_ids == engine_tok.encode("word " * 2000)
    assert tok.threads[0] != threading.get_ident() == tok.threads[1]  # long on a worker, short inline


# ----------------------------------------------------------- bad values
BAD = [
    ("/v1/completions", {"prompt": "x", "seed": 2**70}, "seed"),
    ("/v1/completions", {"prompt": "x", "seed": -(2**63) - 1}, "seed"),
    ("/generate", {"text": "x", "sampling_params": {"seed": 2**64}}, "sampling_params.seed"),
    ("/v1/completions", {"prompt": [1, [2]]}, "prompt[1]"),
    ("/v1/completions", {"prompt": [[1], 2]}, "prompt[1]"),
    ("/v1/completions", {"prompt": ["a", ""]}, "prompt[1]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                              "top_logprobs": 99}, "top_logprobs"),
    # Within the context (4096) but more KV than the whole pool holds: known at arrival.
    ("/v1/completions", {"prompt": [5] * 10, "max_tokens": MAX_TOTAL_TOKENS}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 4000},
     "max_completion_tokens"),
    ("/generate", {"input_ids": [5] * 10, "sampling_params": {"max_new_tokens": MAX_TOTAL_TOKENS}},
     "sampling_params.max_new_tokens"),
]


@pytest.mark.parametrize("path,body,field", BAD, ids=[f"{p}-{f}-{i}" for i, (p, _, f) in enumerate(BAD)])
def test_bad_value_is_400_naming_the_field(server, path, body, field):
    r = server.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"].startswith(field + ":") and err["param"] == field, err


def test_max_tokens_that_just_fit_the_pool_run_to_the_end(server):
    """The KV check is exact: prompt + max_tokens - 1 slots == the pool is served in full."""
    prompt = [7] * 10
    r = server.post("/generate", json={"input_ids": prompt, "sampling_params": {
        "max_new_tokens": MAX_TOTAL_TOKENS + 1 - len(prompt), "ignore_eos": True, "temperature": 0}}, timeout=300)
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == MAX_TOTAL_TOKENS + 1 - 10
    server.wait_idle()


def test_engine_refuses_more_kv_than_the_pool():
    engine = pdserve.Engine(model_path=PRESET, max_total_tokens=64)
    with pytest.raises(ValueError, match="^sampling_params.max_new_tokens:.*KV"):
        engine.generate(input_ids=[5] * 10, sampling_params={"max_new_tokens": 56})
    out = engine.generate(input_ids=[5] * 10, sampling_params={"max_new_tokens": 55, "ignore_eos": True})
    assert out["meta_info"]["completion_tokens"] == 55


# -------------------------------------------------------------- shutdown
def _collect(server: Server, path: str, body: dict, out: dict, key: str) -> None:
    try:
        if body.get("stream"):
            with httpx.stream("POST", server.url + path, json=body, timeout=60) as r:
                out[key] = (r.status_code, r.headers.get("content-type", ""), [line for line in r.iter_lines() if line])
        else:
            r = httpx.post(server.url + path, json=body, timeout=60)
            out[key] = (r.status_code, r.headers.get("content-type", ""), r.text)
    except httpx.HTTPError as e:
        out[key] = ("error", "", repr(e))


def test_sigterm_during_a_long_prefill_ends_every_request_cleanly():
    """Requests in flight while the scheduler is inside a multi-second prefill step: streams end
    with finish_reason abort then [DONE], others with a 503 in the JSON error shape; never a 500."""
    s = Server("--max-total-tokens", "16384", "--chunked-prefill-size", "-1", "--max-prefill-tokens", "4000")
    try:
        s.start()
        children = descendants(s.proc.pid)
        long_ids = [[16 + (i * 7 + k) % 1900 for i in range(3900)] for k in range(4)]
        many = {"max_new_tokens": 100, "ignore_eos": True}
        calls = {
            "generate": ("/generate", {"input_ids": long_ids[0], "sampling_params": many}),
            "completions": ("/v1/completions", {"prompt": long_ids[1], "max_tokens": 100}),
            "generate_stream": ("/generate", {"input_ids": long_ids[2], "sampling_params": many, "stream": True}),
            "completions_stream": ("/v1/completions", {"prompt": long_ids[3], "max_tokens": 100, "stream": True}),
        }
        out: dict = {}
        threads = [threading.Thread(target=_collect, args=(s, path, body, out, key))
                   for key, (path, body) in calls.items()]
        for t in threads:
            t.start()
        time.sleep(1.5)  # let them arrive; the first prefill step alone takes seconds
        s.signal(signal.SIGTERM)
        try:
            rc = s.wait(10)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running 10 s after SIGTERM:\n{s.output()}")
        for t in threads:
            t.join(10)
        assert rc == 0, s.output()
        for key in ("generate", "completions"):
            status, ctype, text = out[key]
            assert status == 503 and ctype.startswith("application/json"), (key, out[key])
            assert set(json.loads(text)["error"]) == {"message", "type", "param", "code"}
        status, _, lines = out["generate_stream"]
        assert status == 200 and lines[-1] == "data: [DONE]", out["generate_stream"]
        assert json.loads(lines[-2][6:])["meta_info"]["finish_reason"]["type"] == "abort"
        status, _, lines = out["completions_stream"]
        assert status == 200 and lines[-1] == "data: [DONE]", out["completions_stream"]
        assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "abort"
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(alive(p) for p in children):
            time.sleep(0.1)
        assert not [p for p in children if alive(p)] and port_is_free(s.port)
    finally:
        s.stop()
