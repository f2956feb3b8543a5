"""The router's pool of upstream connections drops an idle one before a worker's keep-alive would:
a request sent on a connection just as its worker closes it is lost, and the health probes (every
5 s by default) would otherwise reuse each connection just as uvicorn's 5 s keep-alive ends it."""

from __future__ import annotations

import asyncio
import random

import uvicorn

from entrypoints.server_utils import free_port
from pdserve.router import proxy as proxy_mod
from pdserve.router.app import build_context
from pdserve.router.config import PrefillSpec, RouterArgs


def test_the_pool_forgets_idle_connections_before_the_workers_keep_alive_ends():
    assert proxy_mod.UPSTREAM_IDLE_S < uvicorn.Config(app=None).timeout_keep_alive


def test_a_connection_idle_past_the_limit_is_not_reused(monkeypatch):
    monkeypatch.setattr(proxy_mod, "UPSTREAM_IDLE_S", 0.3)
    clients: list[tuple[str, int]] = []  # the client address of each request: one port per connection

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        clients.append(scope["client"])
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async def run() -> None:
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
        serving = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        url = f"http://127.0.0.1:{port}"
        ctx = build_context(RouterArgs(prefill=(PrefillSpec(url),), decode=(url,)), random.Random(0))
        await ctx.proxy.start()
        try:
            (worker,) = ctx.decode.workers
            assert await ctx.proxy.probe(worker) is None
            assert await ctx.proxy.probe(worker) is None  # at once: the same connection
            await asyncio.sleep(0.6)
            assert await ctx.proxy.probe(worker) is None  # idle past the limit: a new one
        finally:
            await ctx.proxy.close()
            server.should_exit = True
            await serving

    asyncio.run(run())
    assert len(clients) == 3
    assert clients[0] == clients[1], clients
    assert clients[2] != clients[1], clients
