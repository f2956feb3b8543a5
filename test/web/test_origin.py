"""Requests a browser may have been tricked into sending (issue 33): the policy's answers for Host,
Origin and Content-Type, and the middleware's 403/415 in OpenAI's error shape before any route."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from pdserve.web.origin import OriginMiddleware, OriginPolicy


def scope(method="POST", **headers) -> dict:
    return {"type": "http", "method": method, "scheme": "http",
            "headers": [(k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()]}


LOOP = OriginPolicy("127.0.0.1")


@pytest.mark.parametrize("host", ["127.0.0.1:30000", "localhost:30000", "LOCALHOST", "[::1]:30000", "127.0.0.1"])
def test_loopback_bind_answers_to_loopback_names(host):
    assert LOOP.refusal(scope(host=host)) is None


@pytest.mark.parametrize("host", ["evil.example:30000", "evil.example", "10.0.0.5:30000", "127.0.0.1.evil.example"])
def test_a_rebound_name_is_refused_on_a_loopback_bind(host):
    status, message, param = LOOP.refusal(scope("GET", host=host))
    assert (status, param) == (403, "Host") and "--allowed-hosts" in message


def test_allowed_hosts_and_wildcard_binds():
    assert OriginPolicy("127.0.0.1", ("api.example",)).refusal(scope(host="api.example:443")) is None
    assert OriginPolicy("127.0.0.1", ("*",)).refusal(scope(host="anything")) is None
    # a wildcard bind cannot know its names (Kubernetes Services): Host is checked only when listed
    assert OriginPolicy("0.0.0.0").refusal(scope(host="pdserve-decode-0.pdserve-decode:30000")) is None
    assert OriginPolicy("0.0.0.0", ("api.example",)).refusal(scope(host="evil.example"))[0] == 403
    # bound to a pod's address and reached by its Service name (docker/k8s): not checked unless names are given
    assert OriginPolicy("10.0.0.5").refusal(scope(host="pdserve-prefill-0.pdserve-prefill:30000")) is None
    # bound to one address, given names: the address and the names
    ip = OriginPolicy("10.0.0.5", ("prefill-0.svc",))
    assert ip.refusal(scope(host="10.0.0.5:30000")) is None and ip.refusal(scope(host="prefill-0.svc")) is None
    assert ip.refusal(scope(host="localhost"))[0] == 403


@pytest.mark.parametrize("origin", ["http://evil.example", "http://localhost:8080", "null", "http://127.0.0.1:8080",
                                    "not an origin"])
def test_a_cross_site_post_is_refused(origin):
    status, _, param = LOOP.refusal(scope(host="127.0.0.1:30000", origin=origin, content_type="application/json",
                                          content_length="2"))
    assert (status, param) == (403, "Origin")


def test_same_origin_and_allowed_origins_pass_and_reads_are_not_checked():
    same = scope(host="127.0.0.1:30000", origin="http://127.0.0.1:30000", content_type="application/json")
    assert LOOP.refusal(same) is None  # the server's own /docs page
    assert LOOP.refusal(scope("GET", host="127.0.0.1:30000", origin="http://evil.example")) is None
    allowed = OriginPolicy("127.0.0.1", allowed_origins=("https://ui.example/",))
    assert allowed.refusal(scope(host="127.0.0.1", origin="https://ui.example")) is None
    # a rebinding page is same-origin to the browser: its Host gives it away
    assert LOOP.refusal(scope(host="evil.example:30000", origin="http://evil.example:30000"))[2] == "Host"


@pytest.mark.parametrize(("ctype", "length", "refused"), [
    ("text/plain", "20", True), ("application/x-www-form-urlencoded", "5", True),
    ("multipart/form-data; b=x", "9", True),
    ("application/json", "20", False), ("application/json; charset=utf-8", "20", False),
    ("application/merge-patch+json", "3", False), ("text/plain", "0", False), (None, "20", False)])
def test_bodies_must_be_json(ctype, length, refused):
    headers = {"host": "127.0.0.1:30000", "content_length": length}
    if ctype is not None:
        headers["content_type"] = ctype
    got = LOOP.refusal(scope(**headers))
    assert (got is not None and got[0] == 415 and got[2] == "Content-Type") if refused else got is None


def test_the_middleware_answers_in_openai_shape_before_the_route():
    app, called = FastAPI(), []

    @app.post("/flush_cache")
    async def flush():
        called.append(1)
        return {"ok": True}

    app.add_middleware(OriginMiddleware, policy=OriginPolicy("127.0.0.1"))
    client = TestClient(app, base_url="http://127.0.0.1:30000")
    r = client.post("/flush_cache", content=b"{}", headers={"Content-Type": "text/plain", "Origin": "http://evil.example"})
    assert r.status_code == 403 and r.json()["error"]["param"] == "Origin"
    r = client.post("/flush_cache", content=b"{}", headers={"Content-Type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["param"] == "Content-Type"
    assert called == []
    assert client.post("/flush_cache", json={}).status_code == 200 and called == [1]
