"""The listening socket, event loop and log format shared by the server's frontend and the router."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def bind_socket(host: str, port: int) -> socket.socket:
    """A bound, not yet listening TCP socket: connections are refused until the process is ready
    (the server's scheduler is up, the router's workers are known)."""
    family, _, proto, _, _ = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    set_nodelay(sock)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(False)
    return sock


def set_nodelay(sock: socket.socket) -> None:
    """Nagle off on a listening socket; Linux copies the option to every accepted connection.

    A stream writes one small SSE event per token (the router relays them one by one). With
    Nagle on, the first event after the response headers on a reused keep-alive connection
    waits for the client's delayed ACK of the headers (~40 ms). asyncio turns Nagle off itself
    only for sockets whose ``proto`` is IPPROTO_TCP, which a socket built with proto 0 is not;
    so both are set here.
    """
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def configure_logging(level: str, process: str) -> None:
    """Root logging at ``level``, each line naming the ``process`` kind (frontend, router)."""
    logging.basicConfig(level=level.upper(),
                        format=f"[%(asctime)s {process}] %(levelname)s %(name)s: %(message)s")


def run_event_loop(main: Coroutine[Any, Any, T]) -> T:
    """Run an HTTP program's ``main`` to completion on uvloop when it is installed (a dependency; the
    frontend's per-token cost is mostly the event loop and HTTP framing), else on asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
