"""Acceptance tests of the HTTP server against a real ``pdserve serve --model-path tiny-deepseek``.

One server (with ``--api-key``, and ``--admin-api-key`` from the environment as ``pdserve up``
passes it) serves the whole module; the offline Engine on
the same preset is the oracle for greedy text. Both store their KV as FP8 pages
(``--kv-cache-dtype fp8_e4m3``), so every test here also serves the colocated FP8 path.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time

import httpx
import openai
import pytest

import pdserve
from constrained.grammar_fixtures import CONSTRAINTS, PERSON, check_output
from pdserve.web.chat import chat_prompt_ids
from server_utils import PRESET, Server

API_KEY = "test-key"
ADMIN_KEY = "test-admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
MAX_TOTAL_TOKENS = "8192"
KV_CACHE_DTYPE = "fp8_e4m3"
PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3,"]
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def server():
    s = Server("--max-total-tokens", MAX_TOTAL_TOKENS, "--kv-cache-dtype", KV_CACHE_DTYPE,
               "--constrained-json-disable-any-whitespace", api_key=API_KEY, env={"PDSERVE_ADMIN_API_KEY": ADMIN_KEY})
    try:
        yield s.start()
    finally:
        s.stop()


@pytest.fixture(scope="module")
def engine():
    e = pdserve.Engine(model_path=PRESET, max_total_tokens=int(MAX_TOTAL_TOKENS), kv_cache_dtype=KV_CACHE_DTYPE)
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def engine_text(engine, max_tokens: int, prompt=None, input_ids=None) -> str:
    out = engine.generate(prompt=prompt, input_ids=input_ids,
                          sampling_params={"max_new_tokens": max_tokens, "temperature": 0})
    return out["text"]


# ---------------------------------------------------------------- OpenAI
@pytest.mark.parametrize("prompt", PROMPTS)
def test_completions_greedy_matches_engine(client, engine, prompt):
    want = engine.generate(prompt=prompt, sampling_params={"max_new_tokens": 12, "temperature": 0})
    meta = want["meta_info"]
    r = client.completions.create(model=PRESET, prompt=prompt, max_tokens=12, temperature=0)
    assert r.choices[0].text == want["text"]
    assert r.choices[0].finish_reason == meta["finish_reason"]["type"]
    assert r.usage.completion_tokens == meta["completion_tokens"] == len(want["output_ids"])
    assert r.usage.prompt_tokens == meta["prompt_tokens"] == len(engine.tokenizer.encode(prompt))
    stream = client.completions.create(model=PRESET, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want["text"]
    assert chunks[-2].choices[0].finish_reason == meta["finish_reason"]["type"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == meta["completion_tokens"]


def test_chat_greedy_matches_engine(client, engine, server):
    ids = chat_prompt_ids(engine.tokenizer, CHAT)
    want = engine_text(engine, 12, input_ids=ids)
    r = client.chat.completions.create(model=PRESET, messages=CHAT, max_tokens=12, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want
    assert r.usage.prompt_tokens == len(ids)
    stream = client.chat.completions.create(model=PRESET, messages=CHAT, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == r.usage.total_tokens
    assert chunks[-2].choices[0].finish_reason == r.choices[0].finish_reason


def test_stream_ends_with_done(server):
    body = {"model": PRESET, "prompt": "hi", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=server.headers) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [PRESET]


# ------------------------------------------------------------ /generate
def test_generate_matches_engine(server, engine):
    for prompt in PROMPTS:
        want = engine.generate(prompt=prompt, sampling_params={"max_new_tokens": 8, "temperature": 0})
        r = server.post("/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": 8,
                                                                               "temperature": 0}})
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["text"] == want["text"] and got["output_ids"] == want["output_ids"]
        assert set(got["meta_info"]) == set(want["meta_info"])
        assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]


def test_generate_stream_logprobs_and_batch(server, engine):
    ids = [5, 17, 99, 3]
    want = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 6, "temperature": 0},
                           return_logprob=True)
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 6, "temperature": 0},
            "return_logprob": True, "stream": True}
    with httpx.stream("POST", server.url + "/generate", json=body, headers=server.headers) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    last = events[-1]
    assert last["output_ids"] == want["output_ids"] and last["text"] == want["text"]
    # logprobs are incremental (each event its own tokens'): joined, they are the engine's
    lps = [lp for e in events for lp, _, _ in e["meta_info"]["output_token_logprobs"]]
    assert lps == pytest.approx([lp for lp, _, _ in want["meta_info"]["output_token_logprobs"]], abs=1e-4)
    assert [len(e["output_ids"]) for e in events] == sorted(len(e["output_ids"]) for e in events)
    # A batch: one seeded sampled request, one greedy; each equals the engine's run of it.
    sps = [{"max_new_tokens": 7, "temperature": 1.0, "seed": 3}, {"max_new_tokens": 3, "temperature": 0}]
    batch = [ids, ids[:2]]
    r = server.post("/generate", json={"input_ids": batch, "sampling_params": sps})
    assert r.status_code == 200, r.text
    wants = engine.generate(input_ids=batch, sampling_params=sps)
    assert len(r.json()) == 2
    for got, want in zip(r.json(), wants):
        assert got["output_ids"] == want["output_ids"] and got["text"] == want["text"]
        for key in ("finish_reason", "prompt_tokens", "completion_tokens"):
            assert got["meta_info"][key] == want["meta_info"][key], key


# ----------------------------------------------------------- concurrency
def test_32_concurrent_streams_free_all_pages(server):
    async def one(aclient, i: int) -> int:
        stream = await aclient.completions.create(
            model=PRESET, prompt=f"Request number {i} says", max_tokens=16, temperature=0.7, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
        return usage.completion_tokens

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0,
                                      timeout=120) as aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(32)))

    assert asyncio.run(main()) == [16] * 32
    info = server.wait_idle(timeout=10)
    assert info["free_pages"] + info["cached_pages"] == info["total_pages"]


# Far more tokens than the server makes in the few seconds a disconnect may take to notice,
# so a request that is not aborted shows up as thousands of extra forward steps.
DISCONNECT_ASKED = 4000


def _leave_mid_stream(server: Server, body: dict, path: str = "/generate") -> None:
    with httpx.stream("POST", server.url + path, json=body, headers=server.headers, timeout=60) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: {")
            if seen == 3:
                break  # leaving the block closes the connection mid-stream


def _give_up_waiting(server: Server, body: dict) -> None:
    # Nothing is sent before the end, so the client's read timeout is what ends the call.
    with pytest.raises(httpx.ReadTimeout):
        server.post("/generate", json=body, timeout=httpx.Timeout(60.0, read=1.5))


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
def test_client_disconnect_aborts_the_request(server, stream):
    """The request of a client that goes away is aborted: the scheduler runs far fewer steps
    after the disconnect than the request asked for, then every page is free or cached."""
    server.wait_idle()
    body = {"text": "Tell me a very long story", "stream": stream,
            "sampling_params": {"max_new_tokens": DISCONNECT_ASKED, "ignore_eos": True}}
    (_leave_mid_stream if stream else _give_up_waiting)(server, body)
    steps_at_disconnect = server.info()["forward_steps"]
    deadline = time.monotonic() + 120
    while True:  # until idle, or (a bug) until it has clearly gone on generating
        info = server.info()
        idle = info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0
        if idle or info["forward_steps"] - steps_at_disconnect >= DISCONNECT_ASKED // 4:
            break
        assert time.monotonic() < deadline, f"not idle after 120 s: {info}"
        time.sleep(0.1)
    assert info["forward_steps"] - steps_at_disconnect < DISCONNECT_ASKED // 4, info
    info = server.wait_idle()
    assert info["num_inflight_requests"] == 0


def test_a_completions_client_leaving_mid_stream_aborts_its_request(server):
    """The OpenAI stream (its own path from the request to the SSE response) aborts as /generate's."""
    server.wait_idle()
    body = {"prompt": "Tell me a very long story", "stream": True, "max_tokens": DISCONNECT_ASKED,
            "ignore_eos": True}
    _leave_mid_stream(server, body, "/v1/completions")
    steps_at_disconnect = server.info()["forward_steps"]
    deadline = time.monotonic() + 120
    info = server.info()
    while info["num_running_reqs"] or info["num_waiting_reqs"]:
        if info["forward_steps"] - steps_at_disconnect >= DISCONNECT_ASKED // 4 or time.monotonic() > deadline:
            break  # (a bug) it has clearly gone on generating
        time.sleep(0.1)
        info = server.info()
    assert info["forward_steps"] - steps_at_disconnect < DISCONNECT_ASKED // 4, info
    assert server.wait_idle()["num_inflight_requests"] == 0


def test_abort_request_ends_stream(server):
    body = {"text": "abort me", "rid": "abort-me", "stream": True,
            "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
    with httpx.stream("POST", server.url + "/generate", json=body, headers=server.headers, timeout=60) as r:
        events = []
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
                if len(events) == 2:
                    assert server.post("/abort_request", json={"rid": "abort-me"}).status_code == 200
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(events[-1]["output_ids"]) < 2000
    server.wait_idle()


# ------------------------------------------------------------ bad inputs
MSG = [{"role": "user", "content": "hi"}]
BAD_INPUTS = [
    ("/v1/completions", b"{not json", "request body"),
    ("/v1/completions", [1, 2], "request body"),
    ("/v1/completions", {"max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": 3}, "frequency_penalty"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**6}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**6, "stream": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "", "max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": [], "max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": 10**6}, "max_tokens"),
    ("/v1/chat/completions", {"messages": MSG, "stream": "yes"}, "stream"),
    ("/v1/chat/completions", {"messages": MSG, "top_k": 0}, "top_k"),
    ("/generate", {"text": "x", "sampling_params": {"temperature": -0.5}}, "sampling_params.temperature"),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": "many"}}, "sampling_params.max_new_tokens"),
    ("/generate", {"text": "x", "sampling_params": {"bogus": 1}}, "sampling_params.bogus"),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 10**6}}, "sampling_params.max_new_tokens"),
    ("/generate", {"input_ids": [1, 10**6]}, "input_ids"),
    ("/generate", {"input_ids": []}, "input_ids"),
    ("/generate", {"input_ids": [1, 2.5]}, "input_ids"),
    ("/generate", {"text": ""}, "text"),
    ("/generate", {"text": "x", "input_ids": [1]}, "text"),
    ("/generate", {"text": "x", "stream": True, "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
    # constrained decoding: a constraint that does not compile is refused before it runs
    ("/generate", {"text": "x", "sampling_params": {"json_schema": "{not json"}}, "sampling_params.json_schema"),
    ("/generate", {"text": "x", "sampling_params": {"json_schema": '{"type": "nonsense"}'}},
     "sampling_params.json_schema"),
    ("/generate", {"text": "x", "stream": True, "sampling_params": {"json_schema": '{"type": "nonsense"}'}},
     "sampling_params.json_schema"),
    ("/generate", {"text": "x", "sampling_params": {"json_schema": {"type": "object"}}}, "sampling_params.json_schema"),
    ("/generate", {"text": "x", "sampling_params": {"regex": "(unclosed"}}, "sampling_params.regex"),
    ("/generate", {"text": "x", "sampling_params": {"ebnf": "root ::= missing_rule"}}, "sampling_params.ebnf"),
    ("/generate", {"text": "x", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}}, "sampling_params.ebnf"),
    ("/generate", {"text": "x", "sampling_params": {"regex": "a" * 300_000}}, "sampling_params.regex"),
    ("/generate", {"text": ["x", "y"], "sampling_params": [{}, {"regex": "("}]}, "sampling_params.regex"),
]


@pytest.mark.parametrize("path,body,field", BAD_INPUTS, ids=[f"{p}-{f}-{i}" for i, (p, _, f) in
                                                              enumerate(BAD_INPUTS)])
def test_bad_input_is_400_naming_the_field(server, path, body, field):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = server.post(path, **kw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"].startswith(field), err
    assert server.get("/health").status_code == 200


def test_api_key_is_required(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "x"}, headers=headers)
        assert r.status_code == 401
        assert "API key" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/health").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_the_kv_events_snapshot_needs_a_key(server):
    """The snapshot lists the blocks a server caches (what its prompts were): without a key, or with a
    wrong one, it is refused before the route runs; it is a worker-only route, so the inference key is
    refused too (403) and the admin key opens it (this server publishes no events: the route's own
    400 naming kv_events)."""
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.get(server.url + "/kv_events/snapshot", headers=headers)
        refusals = ("invalid_api_key", "worker_key_required")
        assert r.status_code in (401, 403) and r.json()["error"]["code"] in refusals, r.text
    r = httpx.get(server.url + "/kv_events/snapshot", headers=server.headers)
    assert r.status_code == 403, r.text
    r = httpx.get(server.url + "/kv_events/snapshot", headers=ADMIN)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("kv_events:"), r.text


# ------------------------------------------------------- info and control
def test_server_info_and_aliases(server):
    info = server.info()
    for key in ("args", "total_pages", "free_pages", "cached_pages", "num_running_reqs", "num_waiting_reqs"):
        assert key in info
    assert info["args"]["api_key"] == "***"
    assert server.get("/server_info").json()["total_pages"] == info["total_pages"]
    model_info = server.get("/model_info").json()
    assert model_info["model_path"] == PRESET and model_info["is_generation"] is True


def test_health_generate_and_flush_cache(server):
    assert server.get("/health_generate").status_code == 200
    server.wait_idle()
    r = server.post("/flush_cache", headers=ADMIN)
    assert r.status_code == 200 and r.json()["success"] is True
    info = server.info()
    assert info["cached_pages"] == 0 and info["free_pages"] == info["total_pages"]


# ------------------------------------------------------------ admin key
def test_admin_routes_refuse_the_inference_key(server):
    """--admin-api-key set: the inference key opens no admin route (403 saying so), no key a 401."""
    calls = [("/flush_cache", None), ("/pd_role_switch", {"target_role": "decode"}), ("/abort_request",
                                                                                      {"abort_all": True})]
    for path, body in calls:
        r = server.post(path, json=body)
        assert r.status_code == 403, (path, r.text)
        assert "admin key" in r.json()["error"]["message"] and r.json()["error"]["param"] == "Authorization"
        assert httpx.post(server.url + path, json=body).status_code == 401
    server.wait_idle()
    assert server.post("/flush_cache", headers=ADMIN).json()["success"] is True
    r = server.post("/pd_role_switch", json={"target_role": "decode"}, headers=ADMIN)
    assert r.status_code == 400 and r.json()["error"]["param"] == "target_role"  # past the key: not P/D
    assert server.post("/abort_request", json={"abort_all": True}, headers=ADMIN).json()["success"] is True
    assert server.info()["args"]["admin_api_key"] == "***"


def _stream_while(server: Server, rid: str, token: str, max_new_tokens: int, meanwhile) -> list[dict]:
    """Streams ``rid`` as the client holding ``token``; ``meanwhile()`` runs after its second event."""
    body = {"text": "mine", "rid": rid, "stream": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True}}
    headers = {**server.headers, "X-Client-Token": token}
    with httpx.stream("POST", server.url + "/generate", json=body, headers=headers, timeout=60) as r:
        events = []
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
                if len(events) == 2:
                    meanwhile()
    return events


def test_a_client_cannot_abort_another_clients_request(server):
    """Same inference key, another X-Client-Token (or none): the abort reaches nothing and answers as for
    an unknown rid (it used to be a 403, an oracle of which rids are in flight), the stream runs to its
    end; the admin key may abort it."""
    def foreign_aborts():
        for headers in ({"X-Client-Token": "mallory"}, {}):
            r = server.post("/abort_request", json={"rid": "alice-1"}, headers=headers)
            unknown = server.post("/abort_request", json={"rid": "nobody-has-this-rid"}, headers=headers)
            assert (r.status_code, r.json()) == (unknown.status_code, unknown.json()) == (200, {"success": True})

    events = _stream_while(server, "alice-1", "alice", 200, foreign_aborts)
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert len(events[-1]["output_ids"]) == 200

    def admin_aborts():
        assert server.post("/abort_request", json={"rid": "alice-2"}, headers=ADMIN).status_code == 200

    events = _stream_while(server, "alice-2", "alice", 2000, admin_aborts)
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    server.wait_idle()


def test_rids_live_in_their_owner_s_namespace(server):
    """A rid in flight is "already in use" to its own client only: another client may use the same rid at
    the same time (it used to get a 400 naming it: an oracle of other clients' rids), and aborting its
    own request of that name ends only that one."""
    outcome: dict = {}

    def meanwhile():
        own = server.post("/generate", json={"text": "again", "rid": "shared-1"},
                          headers={"X-Client-Token": "alice"})
        outcome["own"] = own
        body = {"text": "mine too", "rid": "shared-1", "stream": True,
                "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
        with httpx.stream("POST", server.url + "/generate", json=body, timeout=60,
                          headers={**server.headers, "X-Client-Token": "mallory"}) as r:
            outcome["other_status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    # mallory ends her own shared-1; alice's runs on
                    assert server.post("/abort_request", json={"rid": "shared-1"},
                                       headers={"X-Client-Token": "mallory"}).status_code == 200
                    outcome.setdefault("other_events", []).append(json.loads(line[6:]))

    events = _stream_while(server, "shared-1", "alice", 300, meanwhile)
    assert outcome["own"].status_code == 400 and "already in use" in outcome["own"].json()["error"]["message"]
    assert outcome["other_status"] == 200
    assert outcome["other_events"][-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert outcome["other_events"][-1]["meta_info"]["id"] == "shared-1"  # the client sees its own rid
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length" and len(events[-1]["output_ids"]) == 300
    assert events[-1]["meta_info"]["id"] == "shared-1"
    server.wait_idle()


def test_metrics(server):
    server.post("/generate", json={"text": "metrics", "sampling_params": {"max_new_tokens": 4}})
    text = server.get("/metrics").text
    for name in ("num_running_reqs", "num_queue_reqs", "token_usage", "prompt_tokens_total",
                 "generation_tokens_total", "time_to_first_token_seconds_count",
                 "inter_token_latency_seconds_count", "e2e_request_latency_seconds_count"):
        assert f"pdserve:{name}" in text, name
    count = re.search(r'pdserve:e2e_request_latency_seconds_count\{[^}]*\} (\S+)', text)
    assert float(count.group(1)) >= 1


# ------------------------------------------------- sequences per request, fair admission
MAX_SEQS = 256  # --max-seqs-per-request's default, which the module's server runs with
ONE = {"max_new_tokens": 1}  # should a cap let them through, they end soon
OVER_MAX_SEQS = [
    ("/generate", {"input_ids": [[5, 6]] * 3, "sampling_params": {**ONE, "n": 128}}, "sampling_params.n"),
    ("/generate", {"input_ids": [[5, 6]] * 3, "sampling_params": [ONE, *[{**ONE, "n": 128}] * 2]},
     "sampling_params.n"),  # 1 + 128 + 128
    ("/generate", {"input_ids": [[5, 6]] * (MAX_SEQS + 1), "sampling_params": ONE}, "input_ids"),
    ("/generate", {"text": ["x"] * (MAX_SEQS + 1), "sampling_params": ONE}, "text"),
    ("/v1/completions", {"prompt": [[5, 6]] * 3, "n": 100, "max_tokens": 1}, "n"),
    ("/v1/completions", {"prompt": [[5, 6]] * 3, "n": 2, "best_of": 100, "max_tokens": 1}, "best_of"),
    ("/v1/completions", {"prompt": ["x"] * (MAX_SEQS + 1), "max_tokens": 1}, "prompt"),
]


@pytest.mark.parametrize("path,body,field", OVER_MAX_SEQS, ids=[f"{p}-{f}-{i}" for i, (p, _, f) in
                                                                enumerate(OVER_MAX_SEQS)])
def test_sequences_over_max_seqs_per_request_is_400_naming_the_flag(server, path, body, field):
    """500 prompts x n 128 in one request held another client's 16 tokens for 25 s: prompts x n
    (x best_of) over --max-seqs-per-request is refused before anything runs."""
    steps = server.info()["forward_steps"]
    r = server.post(path, json=body)
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["message"].startswith(field + ":") and err["param"] == field, err
    assert f"--max-seqs-per-request ({MAX_SEQS})" in err["message"], err
    assert server.info()["forward_steps"] == steps  # refused before any of it ran


def test_a_small_request_is_served_while_a_big_one_still_waits(server):
    """Fair admission between requests: one request of 4 prompts x n 64 fills every running slot
    and queues the rest; a one-token request sent after it is admitted in the next wave, so when
    it returns the big one still has sequences waiting (in arrival order it would come last, when
    none are left waiting)."""
    server.wait_idle()
    big = {"input_ids": [[7, 8, 9, 10 + i] for i in range(4)],
           "sampling_params": {"n": 64, "max_new_tokens": 64, "ignore_eos": True}}
    small = {"input_ids": [11, 12, 13], "sampling_params": {"max_new_tokens": 1}}

    async def main() -> tuple[httpx.Response, dict]:
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=300) as c:
            task = asyncio.create_task(c.post("/generate", json=big))
            try:
                while (await c.get("/get_server_info")).json()["num_waiting_reqs"] == 0:
                    assert not task.done(), task.result().text[:300]
                    await asyncio.sleep(0.05)
                answer = await c.post("/generate", json=small)
                return answer, (await c.get("/get_server_info")).json()
            finally:
                task.cancel()  # closes its connection: the server aborts the rest of the big request

    answer, info = asyncio.run(main())
    assert answer.status_code == 200 and answer.json()["meta_info"]["completion_tokens"] == 1, answer.text
    assert info["num_waiting_reqs"] > 0, info
    assert server.wait_idle(timeout=120)["num_inflight_requests"] == 0


def test_the_server_runs_the_kv_cache_dtype_it_was_given(server, engine):
    """--kv-cache-dtype reaches the server's scheduler: the pool the oracle engine builds from the
    same flags is fp8, and the server reports the flag."""
    info = httpx.get(server.url + "/get_server_info", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    assert info["kv_cache_dtype"] == KV_CACHE_DTYPE
    assert str(engine.scheduler.runner.pool.dtype) == "torch.float8_e4m3fn"


def test_the_server_reports_its_kv_pool_size_and_where_it_came_from(server):
    """/get_server_info's kv_pool: --max-total-tokens alone sized the pool, at fp8's bytes per token."""
    from pdserve.config import ModelConfig

    info = httpx.get(server.url + "/get_server_info", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    pool = info["kv_pool"]
    assert pool["source"] == "max_total_tokens" and pool["budget_bytes"] is None
    assert pool["max_total_tokens"] == info["max_total_num_tokens"] == int(MAX_TOTAL_TOKENS)
    assert pool["bytes_per_token"] == ModelConfig.from_path(PRESET).kv_bytes_per_token(KV_CACHE_DTYPE)


# ------------------------------------------------------- constrained decoding (native /generate)
def test_generate_constraints_hold(server):
    """json_schema, regex and ebnf (SGLang's sampling_params) on a random-weight model: only the
    grammar makes these valid. One batch, one request each, plus n = 2 samples of a schema."""
    kinds = list(CONSTRAINTS)
    sps = [{"max_new_tokens": 128, "temperature": 0, kind: CONSTRAINTS[kind]} for kind in kinds]
    r = server.post("/generate", json={"text": PROMPTS, "sampling_params": sps})
    assert r.status_code == 200, r.text
    for body, kind in zip(r.json(), kinds):
        assert body["meta_info"]["finish_reason"]["type"] == "stop", body
        check_output(kind, body["text"])
    r = server.post("/generate", json={"text": PROMPTS[0], "sampling_params": {
        "max_new_tokens": 128, "temperature": 1.0, "n": 2, "json_schema": CONSTRAINTS["json_schema"]}})
    assert r.status_code == 200, r.text
    for body in r.json():
        check_output("json_schema", body["text"])


def test_generate_stream_deltas_are_valid_prefixes(server):
    """Every streamed (cumulative) text is a prefix of the final one, and the grammar accepts it
    as a prefix (a client may parse partial JSON as it arrives)."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from pdserve.config import resolve_model_path

    body = {"text": PROMPTS[1], "stream": True,
            "sampling_params": {"max_new_tokens": 128, "temperature": 0, "json_schema": CONSTRAINTS["json_schema"]}}
    with httpx.stream("POST", server.url + "/generate", json=body, headers=server.headers, timeout=120) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    final = events[-1]["text"]
    check_output("json_schema", final)
    assert len(events) > 3
    tok = AutoTokenizer.from_pretrained(str(resolve_model_path(PRESET)[0]))
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok)).compile_json_schema(
        json.dumps(PERSON), any_whitespace=False)
    for e in events:
        assert final.startswith(e["text"])
        assert xgr.GrammarMatcher(compiled).accept_string(e["text"]), e["text"]


def test_max_new_tokens_and_stop_strings_cut_a_constrained_output_as_sglang_does(server):
    """max_new_tokens ends a JSON mid-way (finish length); a stop string inside the grammar's
    output ends it there (finish stop, the string cut)."""
    r = server.post("/generate", json={"text": PROMPTS[0], "sampling_params": {
        "max_new_tokens": 4, "temperature": 0, "json_schema": CONSTRAINTS["json_schema"]}})
    body = r.json()
    assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    assert body["text"].startswith("{")
    r = server.post("/generate", json={"text": PROMPTS[0], "sampling_params": {
        "max_new_tokens": 64, "temperature": 0, "regex": CONSTRAINTS["regex"], "stop": ["-"]}})
    body = r.json()
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": "-"}
    assert body["text"] in ("cat", "dog")


def test_grammar_metrics(server):
    server.post("/generate", json={"text": "m", "sampling_params": {"max_new_tokens": 16, "regex": "[a-c]{3}"}})
    text = server.get("/metrics").text
    for name in ("grammar_compilation_time_seconds_count", "num_grammar_cache_hit_total", "num_grammar_total",
                 "num_grammar_aborted_total", "grammar_mask_time_seconds_count", "num_grammar_queue_reqs"):
        assert f"pdserve:{name}" in text, name
    mask = re.search(r'pdserve:grammar_mask_time_seconds_count\{[^}]*process="scheduler"[^}]*\} (\S+)', text)
    assert mask and float(mask.group(1)) >= 3
    hits = re.search(r'pdserve:num_grammar_total\{[^}]*process="frontend"[^}]*\} (\S+)', text)
    assert hits and float(hits.group(1)) >= 1


def test_server_info_shows_the_thread_layout_and_the_handoff_profile(server):
    """The scheduler's threads as chosen at start-up (overlap scheduling on: a core is left to its
    thread), and each stage a streamed token passed through on its way out."""
    r = server.post("/generate", json={"text": PROMPTS[0], "stream": True,
                                       "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}})
    # Tokens that reach the frontend before its stream wakes go out in one chunk (how many do is
    # timing): every chunk extends the one before it, and the last holds all six.
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text
    chunks = [json.loads(line[len("data: "):]) for line in r.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    ids = [c["output_ids"] for c in chunks]
    assert ids and all(b[:len(a)] == a and len(b) > len(a) for a, b in zip(ids, ids[1:])), ids
    assert len(ids[-1]) == 6 and chunks[-1]["meta_info"]["finish_reason"]["type"] == "length", chunks[-1]
    info = httpx.get(server.url + "/get_server_info", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    layout = info["thread_layout"]
    assert info["overlap_schedule"] is True and layout["overlap"] and layout["frontend"]
    env = os.environ.get("OMP_NUM_THREADS", "")
    want = int(env) if env.isdigit() and int(env) > 0 else max(1, layout["cores"] - 2)
    assert layout["torch_threads"] == want and layout["source"] == ("OMP_NUM_THREADS" if env.isdigit() else "cores")
    tuning = info["thread_tuning"]  # the session's OMP_NUM_THREADS pins the count, as an operator's would
    assert tuning["enabled"] is (not env.isdigit()) and (tuning["enabled"] or tuning["threads"] == want), tuning
    assert tuning["omp_wait_policy"] == os.environ.get("OMP_WAIT_POLICY", "passive" if tuning["enabled"] else "")
    stages = info["handoff"]
    assert set(stages) == {"emit", "socket", "route", "wake", "detokenize", "write"}
    for name in ("emit", "socket", "route", "wake", "detokenize", "write"):
        assert stages[name]["count"] > 0 and 0 <= stages[name]["p50_ms"] <= stages[name]["max_ms"], (name, stages)
