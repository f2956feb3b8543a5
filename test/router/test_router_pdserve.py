"""``pdserve router`` and the PyPI sglang-router in front of real pdserve servers (tiny-llama).

The P/D modes do not exist yet, so the "prefill" and "decode" workers are colocated
servers with different ``--random-seed`` (different dummy weights, so different greedy
outputs): an answer equal to the decode server's own proves decode's answer is returned.

Abort ownership holds whatever keys the server has: servers and router here have none, and
``keyed`` adds a server with ``--api-key`` only (no admin key) and a router holding that key.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from router_utils import Router

from entrypoints.server_utils import Server, free_port

MODEL = "tiny-llama"
GREEDY = {"max_new_tokens": 12, "temperature": 0.0}
CHAT = {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 10, "temperature": 0}


@pytest.fixture(scope="module")
def servers():
    named = {"prefill": Server("--random-seed", "0", model=MODEL), "decode": Server("--random-seed", "1", model=MODEL),
             "victim": Server("--random-seed", "2", model=MODEL)}
    try:
        with ThreadPoolExecutor(len(named)) as pool:
            list(pool.map(lambda s: s.start(), named.values()))
        yield named
    finally:
        for s in named.values():
            s.stop()


@pytest.fixture(scope="module")
def router(servers):
    r = Router([servers["prefill"].url], [servers["decode"].url]).start()
    yield r
    assert r.stop() == 0, r.output()


KEY = "inference-key"


@pytest.fixture(scope="module")
def keyed(servers):
    """(a server with --api-key only, a router with that key whose decode it is); the router's
    prefill is the keyless prefill server, which takes whatever key it is sent."""
    server = Server(model=MODEL, api_key=KEY)
    router = None
    try:
        server.start()
        router = Router([servers["prefill"].url], [server.url], "--api-key", KEY).start()
        yield server, router
    finally:
        if router is not None:
            assert router.stop() == 0, router.output()
        server.stop()


def generate(url: str, text: str, **extra) -> dict:
    r = httpx.post(url + "/generate", json={"text": text, "sampling_params": GREEDY, **extra}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def answer(out: dict) -> tuple:
    """What must match token for token (ids, timing and cache hits may differ)."""
    return out["output_ids"], out["text"], out["meta_info"]["finish_reason"]


def stream_events(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def metric_sum(server: Server, name: str) -> float:
    """Sum of every sample of ``name`` on a pdserve server's /metrics."""
    samples = [line.rpartition(" ") for line in server.get("/metrics").text.splitlines()]
    return sum(float(value) for key, _, value in samples if key.split("{")[0] == name)


def test_decode_answers_not_prefill(servers, router):
    prompt = "The router sends this to both"
    via_router = generate(router.url, prompt)
    assert answer(via_router) == answer(generate(servers["decode"].url, prompt))
    assert answer(via_router) != answer(generate(servers["prefill"].url, prompt))  # the seeds differ


def test_openai_routes_through_the_router(servers, router):
    body = {"prompt": ["one prompt", "and another"], "max_tokens": 6, "temperature": 0}
    via = httpx.post(router.url + "/v1/completions", json=body, timeout=120).json()
    direct = servers["decode"].post("/v1/completions", json=body).json()
    assert [c["text"] for c in via["choices"]] == [c["text"] for c in direct["choices"]]
    via = httpx.post(router.url + "/v1/chat/completions", json=CHAT, timeout=120).json()
    direct = servers["decode"].post("/v1/chat/completions", json=CHAT).json()
    assert via["choices"][0]["message"] == direct["choices"][0]["message"]
    assert router.get("/v1/models").json()["data"][0]["id"] == MODEL


def test_streaming_is_token_identical_to_decode(servers, router):
    body = {"text": "Stream me some tokens", "sampling_params": GREEDY}
    via = stream_events(router.url, "/generate", body)
    direct = stream_events(servers["decode"].url, "/generate", body)
    final = direct[-1]["output_ids"]
    assert via[-1]["output_ids"] == final and len(final) == GREEDY["max_new_tokens"]
    assert all(e["output_ids"] == final[:len(e["output_ids"])] for e in via)  # every event a prefix
    assert via[-1]["text"] == direct[-1]["text"]

    def chat_text(events):
        return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))

    assert chat_text(stream_events(router.url, "/v1/chat/completions", CHAT)) == \
        chat_text(stream_events(servers["decode"].url, "/v1/chat/completions", CHAT))


def test_decode_errors_reach_the_client_as_decode_sent_them(servers, router):
    body = {"text": "x", "sampling_params": {"temperature": -1}}
    via = httpx.post(router.url + "/generate", json=body, timeout=60)
    direct = servers["decode"].post("/generate", json=body)
    assert via.status_code == direct.status_code == 400
    assert via.json() == direct.json() and via.json()["error"]["param"] == "sampling_params.temperature"


def test_client_disconnect_aborts_on_both_servers(servers, router):
    prefill, decode = servers["prefill"], servers["decode"]
    finished_before = [metric_sum(s, "pdserve:generation_tokens_total") for s in (prefill, decode)]
    body = {"text": "Tell me a very long story", "stream": True,
            "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
    with httpx.stream("POST", router.url + "/generate", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(line for line in lines if line.startswith("data: {"))
        # Decode runs it. Prefill's part (the prompt, the KV transfer) may already be over after three
        # decode tokens (timing): the disconnect then has only decode's request to end; either way both
        # must end idle with nothing counted as generated (below).
        assert decode.info()["num_running_reqs"] == 1 and prefill.info()["num_running_reqs"] in (0, 1)
    for s in (prefill, decode):
        s.wait_idle(timeout=60)
    # an aborted request never counts its tokens as generated; one that ran to the end would add 4000
    assert [metric_sum(s, "pdserve:generation_tokens_total") for s in (prefill, decode)] == finished_before
    assert router.worker_state(decode.url)["in_flight"] == 0 == router.worker_state(prefill.url)["in_flight"]


OWNER_ABORT_AT = 300  # tokens the stream holds before its owner aborts it


def _foreign_then_own_abort(url: str, headers: dict, rid: str) -> tuple[list[int], dict]:
    """Streams ``rid`` (up to 2000 tokens) from ``url`` as the client with X-Client-Token ``alice``; at
    its second event POSTs ``/abort_request`` for it with another token, then with none; once it holds
    ``OWNER_ABORT_AT`` tokens, with alice's. Returns (the three answers' statuses, the stream's last event).

    The stream is long so that the foreign aborts reach a request still running, and the owner waits
    for hundreds of tokens more: an abort that was wrongly honoured lands within a few steps, so a
    stream that reaches the owner's abort shows the foreign ones stopped nothing."""
    body = {"text": "mine", "rid": rid, "stream": True,
            "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
    foreign, own = [{"X-Client-Token": "mallory"}, {}], [{"X-Client-Token": "alice"}]
    statuses, events = [], []

    def abort(extra: dict) -> None:
        statuses.append(httpx.post(url + "/abort_request", json={"rid": rid}, headers={**headers, **extra},
                                   timeout=60).status_code)

    with httpx.stream("POST", url + "/generate", json=body, headers={**headers, "X-Client-Token": "alice"},
                      timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
                if len(events) == 2:
                    for extra in foreign:
                        abort(extra)
                elif len(statuses) == 2 and len(events[-1]["output_ids"]) >= OWNER_ABORT_AT:
                    abort(own[0])
    return statuses, events[-1]


@pytest.mark.parametrize("keys", ["no_keys", "api_key_only"])
def test_only_the_client_that_started_a_request_may_abort_it(keys, request, servers, router):
    """Without an admin key, "may this caller administer?" is true for every caller (no key at all,
    or the one inference key all clients share), so it must never stand in for "did it present the
    admin key?": another X-Client-Token, or none, aborts nothing and the stream runs on, on the server
    and through the router, until the client that started it aborts it. The foreign aborts answer as
    for an unknown rid (200: rids live in their owner's namespace, so the answer tells no one which
    rids are in flight); only the stream running on past them shows they were refused."""
    server, via = (servers["decode"], router) if keys == "no_keys" else request.getfixturevalue("keyed")
    headers = {"Authorization": f"Bearer {KEY}"} if keys == "api_key_only" else {}
    for name, url in (("server", server.url), ("router", via.url)):
        statuses, last = _foreign_then_own_abort(url, headers, f"alice-{keys}-{name}")
        assert statuses == [200, 200, 200], (name, statuses)
        assert last["meta_info"]["finish_reason"]["type"] == "abort", name
        assert OWNER_ABORT_AT <= len(last["output_ids"]) < 2000, name  # past the refused aborts, to its owner's
    for s in (server, servers["prefill"]):
        s.wait_idle(timeout=60)


def test_killed_decode_is_dropped_after_the_health_check(servers):
    prefill, decode, victim = servers["prefill"], servers["decode"], servers["victim"]
    fast = ("--health-check-interval-secs", "0.3")
    both = Router([prefill.url], [decode.url, victim.url], "--policy", "round_robin", *fast).start()
    only_victim = Router([prefill.url], [victim.url], *fast).start()
    try:
        prompt = "Which decode answers?"
        from_decode, from_victim = (answer(generate(s.url, prompt)) for s in (decode, victim))
        assert [answer(generate(both.url, prompt)) for _ in range(2)] == [from_decode, from_victim]
        victim.kill()
        both.wait_health(victim.url, False)
        only_victim.wait_health(victim.url, False)
        sent_to_victim = both.metric("pdserve_router:requests_total", role="decode", worker=victim.url)
        assert [answer(generate(both.url, prompt)) for _ in range(3)] == [from_decode] * 3
        assert both.metric("pdserve_router:requests_total", role="decode", worker=victim.url) == sent_to_victim
        r = httpx.post(only_victim.url + "/generate", json={"text": prompt}, timeout=60)
        assert r.status_code == 503
        assert r.json()["error"]["message"].startswith(f"no healthy decode worker ({victim.url}: GET /health")
    finally:
        assert both.stop() == 0 and only_victim.stop() == 0


# ------------------------------------------------------------ sglang-router
@pytest.mark.skipif(importlib.util.find_spec("sglang_router") is None, reason="sglang-router is not installed")
def test_sglang_router_in_front_of_pdserve(servers):
    prefill, decode = servers["prefill"], servers["decode"]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation", "--prefill", prefill.url,
           "8998", "--decode", decode.url, "--host", "127.0.0.1", "--port", str(port),
           "--prometheus-port", str(free_port())]  # its own (29000 by default: two routers at once collide)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        prompt = "Through the Rust router"
        first = _first_answer(proc, url, prompt)
        assert answer(first) == answer(generate(decode.url, prompt))
        via = stream_events(url, "/generate", {"text": prompt, "sampling_params": GREEDY})
        assert via[-1]["output_ids"] == first["output_ids"]
        via = httpx.post(url + "/v1/chat/completions", json={**CHAT, "model": MODEL}, timeout=120).json()
        direct = decode.post("/v1/chat/completions", json=CHAT).json()
        assert via["choices"][0]["message"] == direct["choices"][0]["message"]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _first_answer(proc: subprocess.Popen, url: str, prompt: str, timeout: float = 120.0) -> dict:
    """sglang-router registers workers in the background: poll /generate until it answers 200."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"sglang-router exited with {proc.returncode}"
        try:
            r = httpx.post(url + "/generate", json={"text": prompt, "sampling_params": GREEDY}, timeout=60)
            if r.status_code == 200:
                return r.json()
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"sglang-router did not answer within {timeout} s")
