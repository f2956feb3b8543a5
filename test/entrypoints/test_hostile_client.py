"""One hostile client against a real server (issue 33): every parse or validation error a request
causes is a 400 (never the 500 a router's breaker would count against the worker), stop strings
are capped, a client's grammar compiles queue apart from the others', streamed logprobs are sent
once, and a browser on another site (or a rebound DNS name) cannot drive a keyless server."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import openai
import pytest

from pdserve.constrained.limits import LIMITS
from pdserve.engine.request import MAX_STOP_CHARS, MAX_STOP_STRINGS
from server_utils import Server, descendants

DEEP = 3000  # past Python's recursion limit


@pytest.fixture(scope="module")
def server():
    s = Server("--grammar-max-compiles-per-client", "1", "--max-logprobs", "20", "--grammar-compile-memory-mb", "64")
    try:
        yield s.start()
    finally:
        s.stop()


def _nested(depth: int) -> str:
    return '{"a": ' * depth + "1" + "}" * depth


def _chat(**extra) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}


def _deep_value(depth: int):
    """A value nested ``depth`` deep: a dict when json.dumps can write it, else a marker that
    ``_body_text`` replaces with the nested JSON text."""
    if depth > 500:
        return f"__DEEP_{depth}__"
    value: object = 1
    for _ in range(depth):
        value = {"a": value}
    return value


def _body_text(body: dict) -> str:
    return json.dumps(body).replace(f'"__DEEP_{DEEP}__"', _nested(DEEP))


# Every field that holds JSON or a grammar, nested past the stack (as a string) or as deep as the body's
# JSON parser lets through (as a value): each is a 400, never a 500.
HOSTILE = [
    ("/generate", {"text": "x", "sampling_params": {"json_schema": _nested(DEEP)}}, "sampling_params.json_schema"),
    ("/generate", {"text": "x", "sampling_params": {"json_schema": "[" * DEEP + "]" * DEEP}},
     "sampling_params.json_schema"),
    ("/generate", {"text": "x", "sampling_params": {"regex": "(" * DEEP + "a" + ")" * DEEP}}, "sampling_params.regex"),
    ("/generate", {"text": "x", "sampling_params": {"regex": "a{100000}"}}, "sampling_params.regex"),
    ("/generate", {"text": "x", "sampling_params": {"ebnf": 'root ::= ' + "(" * DEEP + '"a"' + ")" * DEEP}},
     "sampling_params.ebnf"),
    ("/generate", {"text": "x", "sampling_params": {"json_schema": json.dumps(
        {"type": "array", "minItems": 100000, "items": {"type": "integer"}})}}, "sampling_params.json_schema"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "regex": "(" * DEEP + ")" * DEEP}, "regex"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "response_format": {
        "type": "json_schema", "json_schema": {"name": "n", "schema": _deep_value(100)}}},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", _chat(response_format={"type": "json_schema", "json_schema": {
        "name": "n", "schema": _deep_value(DEEP)}}), None),
    ("/v1/chat/completions", _chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": _deep_value(100)}}], tool_choice="required"), "tools"),
    ("/v1/chat/completions", _chat(tool_choice={"type": "function", "function": _deep_value(DEEP)}), None),
    ("/v1/chat/completions", _chat(chat_template_kwargs=_deep_value(DEEP)), None),
    ("/v1/chat/completions", _chat(logit_bias=_deep_value(DEEP)), None),
    ("/v1/chat/completions", _chat(stop=[[["x"]]]), "stop[0]"),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": [_deep_value(DEEP)]}]), None),
    ("/v1/chat/completions", _chat(messages=[{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": _nested(DEEP)}}]},
        {"role": "user", "content": "hi"}]), "messages[0].tool_calls[0].function.arguments"),
]


@pytest.mark.parametrize(("path", "body", "field"), HOSTILE, ids=[f"{p}:{i}" for i, (p, _, _) in enumerate(HOSTILE)])
def test_every_hostile_field_is_a_400_naming_it(server, path, body, field):
    r = server.post(path, content=_body_text(body), headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    if field is not None:
        assert err["param"] == field and err["message"].startswith(field), err
    assert server.get("/health").status_code == 200


def test_a_deep_chat_template_kwarg_under_the_body_limit_is_not_a_500(server):
    """A value as deep as the body parser lets through reaches the chat template: a 200 or a 400."""
    r = server.post("/v1/chat/completions", json=_chat(chat_template_kwargs=_deep_value(150)))
    assert r.status_code in (200, 400), r.text


def test_constraint_limits_name_the_limit(server):
    schema = json.dumps({"type": "string", "maxLength": LIMITS.max_repeat + 1})
    r = server.post("/generate", json={"text": "x", "sampling_params": {"json_schema": schema}})
    assert r.status_code == 400 and f"maxLength {LIMITS.max_repeat + 1} is over the limit" in r.text


# ------------------------------------------------------------------ stop strings
@pytest.mark.parametrize(("stop", "why"), [
    (["s"] * (MAX_STOP_STRINGS + 1), f"{MAX_STOP_STRINGS + 1} stop strings, at most {MAX_STOP_STRINGS}"),
    (["x" * (MAX_STOP_CHARS + 1)], f"a stop string of {MAX_STOP_CHARS + 1} characters, at most {MAX_STOP_CHARS}")])
def test_stop_strings_are_capped(server, stop, why):
    r = server.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stop": stop})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop" and why in r.text, r.text
    r = server.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2, "stop": stop}})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("sampling_params.stop"), r.text
    ok = server.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stop": ["y" * MAX_STOP_CHARS]
                                              * MAX_STOP_STRINGS})
    assert ok.status_code == 200, ok.text


# ------------------------------------------------------------ grammar compiles
def _schema(fields: int, variant: str) -> str:
    props = {f"{variant}_{i}": {"type": "string", "pattern": "^[a-z]{1,12}$"} if i % 2 else
             {"type": "integer", "minimum": 0, "maximum": 10_000} for i in range(fields)}
    return json.dumps({"type": "object", "properties": props, "required": list(props)})


def test_one_clients_compiles_queue_apart_and_over_its_share_are_429(server):
    """Server started with --grammar-max-compiles-per-client 1: mallory's compiles beyond the one it
    has queued are refused at once, naming the flag; alice, another client, is served meanwhile."""

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            def send(token: str, schema: str):
                return c.post("/generate", headers={"X-Client-Token": token},
                              json={"text": "x", "sampling_params": {"max_new_tokens": 1, "json_schema": schema}})

            hostile = [asyncio.ensure_future(send("mallory", _schema(300, f"m{i}"))) for i in range(4)]
            await asyncio.sleep(0)
            alice = await send("alice", _schema(2, "alice"))
            return alice, await asyncio.gather(*hostile)

    alice, hostile = asyncio.run(run())
    assert alice.status_code == 200, alice.text
    codes = sorted(r.status_code for r in hostile)
    assert 429 in codes and set(codes) <= {200, 429}, [r.text for r in hostile]
    busy = next(r for r in hostile if r.status_code == 429).json()["error"]
    assert busy["param"] == "sampling_params.json_schema" and "--grammar-max-compiles-per-client" in busy["message"]


def _compile_children(server: Server) -> list[int]:
    """The server's grammar-check processes (constrained/isolation.py), zombies included."""
    out = []
    for pid in descendants(server.proc.pid) + _zombies(server.proc.pid):
        try:
            if b"pdserve.constrained.isolation" in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.append(pid)
        except OSError:
            pass
    return out


def _zombies(parent: int) -> list[int]:
    """Children of ``parent`` that exited and were not reaped."""
    out = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text() if entry.name.isdigit() else ""
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split() if stat else []
        if fields and fields[0] == "Z" and int(fields[1]) == parent:
            out.append(int(entry.name))
    return out


def _patterns_schema(fields: int, variant: str) -> str:
    """Seconds of CPU to compile, little memory: strings under a pattern of counted repeats."""
    pattern = "^([a-z][0-9]){1,40}(x|y|z){2,30}$"
    props = {f"{variant}_{i}": {"type": "string", "pattern": pattern} for i in range(fields)}
    return json.dumps({"type": "object", "properties": props, "required": list(props)})


def _schema_request(schema: str) -> dict:
    return {"text": "x", "sampling_params": {"max_new_tokens": 1, "json_schema": schema}}


def test_a_grammar_past_the_compile_memory_limit_is_a_400_and_the_server_serves_on(server):
    """Server started with --grammar-compile-memory-mb 64: a wide schema (shallow, within every
    constraint limit) that needs more to compile is a 400 naming the field and the flag; the server
    serves the next schema and stays healthy."""
    r = server.post("/generate", json=_schema_request(_schema(3000, "big")), timeout=300)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "sampling_params.json_schema" and "--grammar-compile-memory-mb" in error["message"]
    assert server.post("/generate", json=_schema_request(_schema(2, "after"))).status_code == 200
    assert server.get("/health").status_code == 200


def test_an_abandoned_compile_is_killed_and_leaves_no_process(server):
    """A client that sends a slow schema and hangs up: its compile's child process is killed (once it ran
    KILL_GRACE_S) and reaped (no orphan, no zombie), the kill is counted, and the next schema compiles."""
    assert server.post("/generate", json=_schema_request(_schema(2, "warm"))).status_code == 200  # children up
    killed = server.info()["grammar_frontend"]["killed"]
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/generate", json=_schema_request(_patterns_schema(800, "gone")), timeout=0.5)
    seen = _compile_children(server)
    deadline = time.monotonic() + 60
    while server.info()["grammar_frontend"]["killed"] == killed:
        assert time.monotonic() < deadline, server.output()
        time.sleep(0.1)
    # the kill is counted when it is sent; the compile thread reaps the child right after
    while all(Path(f"/proc/{pid}").exists() for pid in seen):
        assert time.monotonic() < deadline, f"no compile child reaped: {seen}"
        time.sleep(0.1)
    assert not _zombies(server.proc.pid)
    assert server.post("/generate", json=_schema_request(_schema(2, "next"))).status_code == 200
    assert len(_compile_children(server)) <= 2  # one per compile thread at most: nothing piles up


# ------------------------------------------------------------ streamed logprobs
def test_streamed_logprobs_carry_each_entry_once(server):
    """A stream's bytes grow with its tokens, not with their square: the prompt's logprobs once, each
    output token's once (issue 33: 126 MiB streamed against 1.6 MiB unstreamed)."""
    body = {"input_ids": list(range(5, 205)), "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 20,
            "sampling_params": {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}}
    whole = server.post("/generate", json=body)
    assert whole.status_code == 200
    with httpx.stream("POST", server.url + "/generate", json={**body, "stream": True}, timeout=120) as s:
        raw = b"".join(s.iter_bytes())
    events = [json.loads(line[6:]) for line in raw.decode().split("\n\n") if line.startswith("data: {")]
    assert len(events) > 10
    entries = sum(len(e["meta_info"]["output_top_logprobs"]) + len(e["meta_info"]["input_top_logprobs"])
                  for e in events)
    assert entries == 200 + 40  # every position's top-20 exactly once
    assert len(raw) < 2 * len(whole.content)  # text and ids stay cumulative, logprobs do not


# ------------------------------------------------------------ cross-site requests
def test_a_cross_site_page_cannot_flush_the_cache(server):
    server.post("/generate", json={"input_ids": list(range(10, 40)), "sampling_params": {"max_new_tokens": 1}})
    cached = server.info()["cached_pages"]
    assert cached > 0
    for headers, status, param in [
        ({"Content-Type": "text/plain", "Origin": "http://evil.example"}, 403, "Origin"),
        ({"Content-Type": "text/plain"}, 415, "Content-Type"),
        ({"Content-Type": "application/x-www-form-urlencoded"}, 415, "Content-Type"),
        ({"Host": "evil.example:" + str(server.port)}, 403, "Host"),  # DNS rebinding
    ]:
        r = server.post("/flush_cache", content=b"{}", headers=headers)
        assert r.status_code == status and r.json()["error"]["param"] == param, r.text
    assert server.info()["cached_pages"] == cached  # nothing was flushed
    r = httpx.get(server.url + "/get_server_info", headers={"Host": "rebound.example"})
    assert r.status_code == 403  # a rebound page cannot read the server either


def test_ordinary_clients_still_pass(server):
    """The openai package, curl-style bodies with Content-Type, bodyless POSTs, and localhost names."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    assert client.completions.create(model="m", prompt="hi", max_tokens=2).choices[0].text is not None
    local = f"http://localhost:{server.port}"
    assert httpx.post(local + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1}},
                      timeout=60).status_code == 200
    assert httpx.post(server.url + "/flush_cache", timeout=60).status_code == 200  # no body, no Content-Type
    same_origin = {"Origin": server.url, "Content-Type": "application/json"}
    assert server.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1}},
                       headers=same_origin).status_code == 200
