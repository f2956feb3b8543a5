"""The server's and the router's listening sockets hand uvicorn connections with Nagle off.

Small SSE events written after the response headers on a reused keep-alive connection
would otherwise wait for the client's delayed ACK. The test reads TCP_NODELAY on the
server side of real accepted connections (uvicorn's own connection set), after a request
on a kept-alive connection and on a second one; it measures no time.
"""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import uvicorn

from pdserve.entrypoints import http_server
from pdserve.router import app as router_app
from pdserve.web import listen


def nodelay_of_connections(server: uvicorn.Server) -> list[int]:
    """TCP_NODELAY of every connection uvicorn holds open, read on the server's side."""
    return [conn.transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            for conn in server.server_state.connections]


def reporting_app(holder: dict):
    """An ASGI app answering every request with the server-side TCP_NODELAY of open connections."""
    async def app(scope, receive, send):
        body = json.dumps(nodelay_of_connections(holder["server"])).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})
    return app


async def serve_and_ask(sock: socket.socket, requests: int) -> list[list[int]]:
    """Serve ``sock`` with uvicorn as the server does; send ``requests`` on one kept-alive connection."""
    holder: dict = {}
    config = uvicorn.Config(reporting_app(holder), log_level="warning", lifespan="off")
    server = holder["server"] = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    try:
        while not server.started:
            assert not task.done(), task.exception()
            await asyncio.sleep(0.01)
        port = sock.getsockname()[1]
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            return [(await client.get("/")).json() for _ in range(requests)]
    finally:
        server.should_exit = True
        await task


def test_server_and_router_bind_the_same_way():
    assert http_server.bind_socket is listen.bind_socket
    assert router_app.bind_socket is listen.bind_socket


def test_accepted_connections_have_nodelay():
    sock = listen.bind_socket("127.0.0.1", 0)
    try:
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        first, reused = asyncio.run(serve_and_ask(sock, requests=2))
    finally:
        sock.close()
    # The same connection served both requests (keep-alive), and Nagle was off on it both times.
    assert first == [1]
    assert reused == [1]


def test_plain_socket_would_keep_nagle():
    """The bug being guarded: a proto-0 listening socket served by asyncio keeps Nagle on."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    try:
        (flags,) = asyncio.run(serve_and_ask(sock, requests=1))
    finally:
        sock.close()
    assert flags == [0]
