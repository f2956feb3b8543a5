"""web/app.py: what both HTTP programs put around their routes. The framework's own refusals (no
such route, a method the route does not take) answer in OpenAI's error shape, as every other
error does, not FastAPI's ``{"detail": ...}``; a 405 keeps its Allow header."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import FastAPI

from pdserve.web.app import add_error_handlers, guard_routes


def _app() -> FastAPI:
    app = FastAPI()
    add_error_handlers(app)

    async def ok():
        return {"ok": True}

    app.post("/generate")(ok)
    app.get("/health")(ok)
    guard_routes(app, api_key=None, admin_api_key=None)
    return app


def _send(method: str, path: str) -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=_app())
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            return await c.request(method, path)

    return asyncio.run(go())


@pytest.mark.parametrize("method, path, status, param, code, says", [
    ("GET", "/no/such/route", 404, "path", "not_found", "path: /no/such/route is not a route of this server"),
    ("POST", "/v1/nothing", 404, "path", "not_found", "path: /v1/nothing is not a route"),
    ("GET", "/generate", 405, "method", "method_not_allowed",
     "method: GET is not allowed on /generate (allowed: POST)"),
    ("DELETE", "/health", 405, "method", "method_not_allowed", "method: DELETE is not allowed on /health"),
])
def test_framework_refusals_answer_in_openai_s_shape(method, path, status, param, code, says):
    r = _send(method, path)
    assert r.status_code == status
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"].startswith(says)
    assert (body["error"]["param"], body["error"]["code"]) == (param, code)
    if status == 405:
        assert r.headers["allow"]
    else:
        assert body["error"]["type"] == "not_found_error"
