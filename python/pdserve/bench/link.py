"""The prefill->decode link a run's KV went over, for the TTFT breakdown's verdict (metrics.KVLink).

Bytes: the ``kv_bytes_received`` counters of the decode servers (``internal_states`` of the target's
``/get_server_info``: one server's, or every decode worker's behind a router), read before and after
the run. Bandwidth: ``--kv-link-gbps`` when given; else, when the target and every worker it names
are on the loopback, the loopback's own, measured here with one TCP stream (the transfer engine's
transport on one host); else unknown.
"""

from __future__ import annotations

import socket
import threading
import time
from urllib.parse import urlsplit

import aiohttp

from pdserve.bench.config import EndpointConfig
from pdserve.bench.metrics import KVLink
from pdserve.web.api_key import is_loopback

LOOPBACK_PROBE_BYTES = 64 << 20


async def server_info(session: aiohttp.ClientSession, ep: EndpointConfig) -> dict | None:
    """The target's ``/get_server_info`` (None: a server without it, or it failed)."""
    try:
        async with session.get(ep.url + "/get_server_info", headers=ep.headers()) as r:
            return await r.json() if r.status == 200 else None
    except (aiohttp.ClientError, ValueError):
        return None


def kv_bytes_received(info: dict | None) -> int | None:
    """The decode servers' KV bytes received so far, summed; None when none reports the counter."""
    states = (info or {}).get("internal_states") or []
    counts = [s["kv_bytes_received"] for s in states if isinstance(s, dict) and "kv_bytes_received" in s]
    return sum(counts) if counts else None


def all_on_loopback(url: str, info: dict | None) -> bool:
    """The target and every worker its server info names (a router's prefill and decode lists)."""
    urls = [url] + [w.get("url", "") for role in ("prefill", "decode") for w in (info or {}).get(role) or []
                    if isinstance(w, dict)]
    return all(is_loopback(urlsplit(u).hostname or "") for u in urls)


def loopback_bandwidth(nbytes: int = LOOPBACK_PROBE_BYTES) -> float:
    """Bytes/s of one TCP stream over 127.0.0.1, sending ``nbytes`` in 1 MiB writes."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        chunk = bytes(1 << 20)

        def send() -> None:
            with socket.create_connection(("127.0.0.1", port)) as c:
                for _ in range(nbytes // len(chunk)):
                    c.sendall(chunk)

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        conn, _ = server.accept()
        with conn:
            t0, got, buf = time.perf_counter(), 0, bytearray(1 << 20)
            while got < nbytes // len(chunk) * len(chunk):
                n = conn.recv_into(buf)
                if not n:
                    break
                got += n
            elapsed = time.perf_counter() - t0
        sender.join()
    return got / elapsed


def kv_link(url: str, info_after: dict | None, bytes_before: int | None, link_gbps: float | None) -> KVLink:
    """What the run's verdict compares: bytes received during it, and the link's bandwidth."""
    after = kv_bytes_received(info_after)
    moved = after - bytes_before if after is not None and bytes_before is not None else None
    if link_gbps:
        return KVLink(moved, link_gbps / 8e-9, "--kv-link-gbps")
    if moved and all_on_loopback(url, info_after):
        return KVLink(moved, loopback_bandwidth(), "loopback, measured")
    return KVLink(moved)
