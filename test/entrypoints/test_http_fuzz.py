"""schemathesis against a real colocated ``pdserve serve`` (tiny preset): requests generated from
the server's own ``/openapi.json``, positive and negative. Checks: no 5xx, status codes, content
types and bodies as the schema declares them, and every call answered within CALL_TIMEOUT_S.

Bounded for CI: a few examples per operation, generated token counts clamped (see ``_clamp``),
a small context length so an unclamped request cannot generate for long.
"""

from __future__ import annotations

from dataclasses import fields

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from pdserve.engine.request import SamplingParams
from pdserve.entrypoints.protocol import OPENAPI_BODIES
from server_utils import Server

MAX_EXAMPLES = 25  # per operation
CALL_TIMEOUT_S = 30.0  # a call still unanswered then is a hang
MAX_TOKENS = 4  # generated max_tokens / max_new_tokens are clamped to this (the CPU engine stays fast)
MAX_N = 2  # and n / best_of to this
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def server():
    s = Server("--context-length", "96", "--max-total-tokens", "2048")
    try:
        yield s.start()
    finally:
        s.stop()


@pytest.fixture(scope="module")
def api_schema(server):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    schema.config.update(base_url=server.url)
    return schema


def _clamp_tokens(d: dict, *names: str) -> None:
    for name in names:
        if isinstance(d.get(name), int) and not isinstance(d.get(name), bool):
            d[name] = max(min(d[name], MAX_TOKENS), 0) if d[name] >= 0 else d[name]
    for name in ("n", "best_of"):
        if isinstance(d.get(name), int) and not isinstance(d.get(name), bool) and d[name] > MAX_N:
            d[name] = MAX_N


def _clamp(path: str, body) -> None:
    """Small generations only: the schema allows any max_tokens the context holds (as SGLang and
    OpenAI do), so the bound is applied to the generated case, not written into the API."""
    if not isinstance(body, dict):
        return
    if path == "/generate":
        sps = body.get("sampling_params")
        if sps is None:
            body["sampling_params"] = sps = {}
        for sp in sps if isinstance(sps, list) else [sps]:
            if isinstance(sp, dict):
                if sp.get("max_new_tokens") is None:
                    sp["max_new_tokens"] = MAX_TOKENS  # unset: SGLang's default of 128
                _clamp_tokens(sp, "max_new_tokens")
    elif path in ("/v1/completions", "/v1/chat/completions"):
        if path.endswith("chat/completions") and body.get("max_tokens") is None:
            body["max_tokens"] = MAX_TOKENS  # unset: chat generates up to the context length
        _clamp_tokens(body, "max_tokens", "max_completion_tokens")


def test_api_conforms(api_schema):
    """Every operation, with cases that fit the schema and cases that do not. The operations are
    walked here rather than through schemathesis' pytest plugin, which reaches into pytest
    internals that pytest 9.1 removed (``Function._nodeid``)."""
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/generate", "/v1/completions", "/v1/chat/completions"}
    for operation in operations:
        # An operation without a body or parameters has no invalid input to generate.
        negative = len(operation.body) > 0 or any(True for _ in operation.iter_parameters())
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if negative else (GenerationMode.POSITIVE,):
            _fuzz(operation, mode)


def _fuzz(operation, mode: GenerationMode) -> None:
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None,
              derandomize=True)  # the same cases every run: CI never meets a new one by chance
    def run(case):
        _clamp(case.operation.path, case.body)
        try:
            case.call_and_validate(checks=CHECKS, timeout=CALL_TIMEOUT_S)
        except Exception as e:
            e.add_note(f"{operation.method.upper()} {operation.path} ({mode} case)")
            raise

    run()


# --- the schema ---------------------------------------------------------------------------------


def test_openapi_declares_the_request_bodies(server):
    spec = httpx.get(server.url + "/openapi.json", timeout=CALL_TIMEOUT_S).json()
    components = spec["components"]["schemas"]
    for path, model in OPENAPI_BODIES.items():
        ref = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{model.__name__}"
        assert set(components[model.__name__]["properties"]) == set(model.model_fields)
    assert components["ChatCompletionRequest"]["required"] == ["messages"]
    assert components["CompletionRequest"]["required"] == ["prompt"]
    # /generate's sampling_params documents exactly the fields SamplingParams.from_dict takes
    assert set(components["GenerateSamplingParams"]["properties"]) == {f.name for f in fields(SamplingParams)}
    assert httpx.get(server.url + "/docs", timeout=CALL_TIMEOUT_S).status_code == 200


# --- what the fuzzing found (each failed before its fix) ------------------------------------------


def post(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=CALL_TIMEOUT_S)


@pytest.mark.parametrize("name,value", [("skip_special_tokens", []), ("ignore_eos", "yes"), ("ignore_eos", 1)])
def test_sampling_flags_must_be_booleans(server, name, value):
    """Was a 500 (TypeError from the tokenizer's decode); with a stop string the scheduler's stop
    matcher raised it, the scheduler died and the server exited."""
    r = post(server, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2, "stop": "x", name: value}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == f"sampling_params.{name}"
    assert r.json()["error"]["message"].startswith(f"sampling_params.{name}: must be a boolean")


@pytest.mark.parametrize("body,message", [
    ({"input_ids": [[1, 2], [3]], "rid": ["a", "a"]}, "rid[1]: 'a' collides with rid[0]"),
    ({"input_ids": [[1, 2], [3]], "rid": "b"}, "rid[1]: 'b' collides with rid[0]"),
    ({"input_ids": [[1, 2], [3]], "rid": ["c", "c-0"], "sampling_params": [{"n": 2, "max_new_tokens": 2}, {}]},
     "rid[1]: 'c-0' collides with rid[0] (as 'c-0')"),
])
def test_a_batch_with_colliding_rids_is_refused(server, body, message):
    """Was a 500 (InvalidStateError: one prompt refused while the others ran)."""
    r = post(server, "/generate", {"sampling_params": {"max_new_tokens": 2}, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "rid"
    assert r.json()["error"]["message"].startswith(message)
    server.wait_idle()


def test_a_top_k_past_the_vocabulary_samples_from_all_of_it(server):
    """Was a dead server: a top_k beyond int64 (or beyond the vocabulary) overflowed the sampler's
    tensor and the scheduler exited ("Overflow when unpacking long long")."""
    for top_k in (10**6, (1 << 63) - 1):
        r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                  "max_tokens": 2, "top_k": top_k})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 2
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                              "max_tokens": 2, "top_k": 45248084324472647057408})
    assert r.status_code == 400, r.text
    assert "top_k" in r.json()["error"]["message"]
    server.wait_idle()


def test_distinct_rids_in_a_batch_still_run(server):
    r = post(server, "/generate", {"input_ids": [[1, 2], [3]], "rid": ["d", "e"],
                                   "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200, r.text
    assert [b["meta_info"]["id"] for b in r.json()] == ["d", "e"]


def test_server_survived(server):
    """After the fuzzing (module order), the server still serves and holds no request."""
    assert httpx.get(server.url + "/health_generate", timeout=CALL_TIMEOUT_S).status_code == 200
    server.wait_idle()
