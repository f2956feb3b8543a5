"""web/api_key.py: which key opens which route, whose request a rid abort may reach, the start-up warning.

The middleware is driven in-process (httpx's ASGI transport) over a small app with one route of each
access class; the servers' and the router's own routes are checked by their tests.
"""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest
from fastapi import FastAPI, Request

from pdserve.web.api_key import (
    WORKER_HEADER,
    AccessMiddleware,
    check_classified,
    holds_admin_key,
    may_administer,
    request_owner,
    warn_if_unauthenticated,
    worker_credential,
)

INFERENCE, ADMIN = {"Authorization": "Bearer inf"}, {"Authorization": "Bearer adm"}


def _app(api_key: str | None, admin_api_key: str | None, worker: str | None = None) -> FastAPI:
    app = FastAPI()

    async def echo(request: Request):
        return {"owner": request_owner(), "admin": holds_admin_key(request.scope),
                "administer": may_administer(request.scope)}

    for path in ("/generate", "/flush_cache", "/abort_request", "/health", "/kv_events/snapshot"):
        app.post(path)(echo)
    check_classified([route.path for route in app.routes])  # type: ignore[attr-defined]
    app.add_middleware(AccessMiddleware, api_key=api_key, admin_api_key=admin_api_key, worker_credential=worker)
    return app


def _statuses(api_key: str | None, admin_api_key: str | None, headers: dict) -> dict[str, int]:
    async def go():
        transport = httpx.ASGITransport(app=_app(api_key, admin_api_key))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            return {p: (await c.post(p, headers=headers)).status_code
                    for p in ("/generate", "/flush_cache", "/abort_request", "/health")}

    return asyncio.run(go())


def _post(api_key: str | None, admin_api_key: str | None, path: str, headers: dict,
          worker: str | None = None) -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=_app(api_key, admin_api_key, worker))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            return await c.post(path, headers=headers)

    return asyncio.run(go())


CASES = [  # keys set, key sent -> /generate, /flush_cache, /abort_request, /health
    (("inf", "adm"), INFERENCE, (200, 403, 200, 200)),  # the inference key opens no admin route
    (("inf", "adm"), ADMIN, (401, 200, 200, 200)),  # the admin key is not a client's key (SGLang)
    (("inf", "adm"), {}, (401, 401, 401, 200)),
    (("inf", None), INFERENCE, (200, 200, 200, 200)),  # no admin key: admin routes as inference (SGLang)
    (("inf", None), {}, (401, 401, 401, 200)),
    ((None, "adm"), {}, (200, 401, 200, 200)),
    ((None, "adm"), ADMIN, (200, 200, 200, 200)),
    ((None, None), {}, (200, 200, 200, 200)),
]


@pytest.mark.parametrize("keys,headers,want", CASES, ids=[f"{k}-{h}" for k, h, _ in CASES])
def test_which_key_opens_which_route(keys, headers, want):
    got = _statuses(*keys, headers)
    assert tuple(got.values()) == want, got


CREDENTIAL = worker_credential(b"k" * 32)
WORKER_CASES = [  # keys set (inference, admin, worker credential), headers sent -> /kv_events/snapshot
    (("inf", None, None), INFERENCE, 403),  # the inference key used to open it: every cached prompt's hashes
    (("inf", "adm", CREDENTIAL), INFERENCE, 403),
    (("inf", "adm", CREDENTIAL), {}, 401),
    (("inf", "adm", CREDENTIAL), ADMIN, 200),
    (("inf", "adm", CREDENTIAL), {WORKER_HEADER: CREDENTIAL}, 200),  # the router's, from the shared hash key
    (("inf", "adm", CREDENTIAL), {WORKER_HEADER: worker_credential(b"x" * 32)}, 403),
    (("inf", None, CREDENTIAL), {**INFERENCE, WORKER_HEADER: CREDENTIAL}, 200),
    ((None, None, CREDENTIAL), {}, 401),  # a keyed server's snapshot is for its router only
    ((None, None, None), {}, 200),  # no key of any kind: open, as every route
]


@pytest.mark.parametrize("keys,headers,want", WORKER_CASES, ids=[f"{k}-{sorted(h)}" for k, h, _ in WORKER_CASES])
def test_the_snapshot_is_a_worker_only_route(keys, headers, want):
    r = _post(keys[0], keys[1], "/kv_events/snapshot", headers, worker=keys[2])
    assert r.status_code == want, r.text
    if want != 200:
        err = r.json()["error"]
        assert err["param"] == "Authorization" and "worker-only" in err["message"]


def test_no_credential_without_a_hash_key():
    assert worker_credential(b"") is None
    assert worker_credential(b"a" * 32) != worker_credential(b"b" * 32)


def test_a_refusal_says_which_key_is_missing():
    err = _post("inf", "adm", "/flush_cache", INFERENCE).json()["error"]
    assert err["param"] == "Authorization" and err["message"].startswith("flush_cache: needs the admin key")
    assert "inference key is not enough" in err["message"]
    err = _post("inf", "adm", "/generate", {}).json()["error"]
    assert err["code"] == "invalid_api_key"


def test_the_owner_is_the_key_and_the_client_token():
    def owner(headers: dict) -> str:
        return _post("inf", "adm", "/generate", headers).json()["owner"]

    alice = owner({**INFERENCE, "X-Client-Token": "alice"})
    assert alice == owner({**INFERENCE, "x-client-token": "alice"})
    assert len({alice, owner({**INFERENCE, "X-Client-Token": "bob"}), owner(INFERENCE)}) == 3
    flags = _post("inf", "adm", "/abort_request", ADMIN).json()
    assert flags["admin"] is True and flags["administer"] is True
    flags = _post("inf", "adm", "/abort_request", INFERENCE).json()
    assert flags["admin"] is False and flags["administer"] is False


def test_an_unclassified_route_is_refused():
    with pytest.raises(RuntimeError, match="/new_route"):
        check_classified(["/generate", "/new_route"])


@pytest.mark.parametrize("host,keys,warns", [
    ("0.0.0.0", (None, None), True), ("::", (None, None), True), ("10.0.0.5", (None, None), True),
    ("myhost", (None, None), True), ("127.0.0.1", (None, None), False), ("127.0.0.2", (None, None), False),
    ("::1", (None, None), False), ("localhost", (None, None), False), ("0.0.0.0", ("k", None), False),
    ("0.0.0.0", (None, "a"), False),
])
def test_unauthenticated_beyond_loopback_warns(caplog, host, keys, warns):
    caplog.set_level(logging.WARNING, "pdserve.web.api_key")
    assert warn_if_unauthenticated(host, *keys, "the server") is warns
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == int(warns)
    if warns:
        assert host in lines[0] and "--api-key" in lines[0] and "--admin-api-key" in lines[0]
