"""Real prefill and decode servers for end-to-end tests, and a client that plays the router's
part when a test must choose the prefill itself."""

from __future__ import annotations

import json
import os
import random
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx

from entrypoints.server_utils import TLS, Server, free_port
from router.router_utils import Router, wait_for


def start_all(servers: list[Server]) -> list[Server]:
    """Start servers side by side (each start waits for /health); stop them all if one fails."""
    with ThreadPoolExecutor(len(servers)) as pool:
        futures = [pool.submit(s.start) for s in servers]
        errors = [f.exception() for f in futures]
    if any(errors):
        for s in servers:
            s.kill()
        raise next(e for e in errors if e)
    return servers


def prefill_server(model: str, *flags: str, env: dict | None = None) -> tuple[Server, int]:
    boot = free_port()
    return Server("--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(boot), *flags,
                  model=model, env=env), boot


def decode_server(model: str, *flags: str) -> Server:
    return Server("--disaggregation-mode", "decode", *flags, model=model)


class RoutedPair:
    """One prefill and one decode of ``model`` with the same ``flags``, behind pdserve's router;
    ``start`` returns once the router sees both healthy."""

    def __init__(self, model: str, *flags: str):
        self.prefill, self.boot = prefill_server(model, *flags)
        self.decode = decode_server(model, *flags)
        self.router: Router | None = None

    def start(self):
        start_all([self.prefill, self.decode])
        self.router = Router([(self.prefill.url, self.boot)], [self.decode.url]).start()
        wait_for(lambda: self.router.get("/health").status_code == 200, 60, "router sees healthy workers")
        return self

    def stop(self) -> None:
        if self.router is not None:
            self.router.stop()
        for s in (self.prefill, self.decode):
            s.stop()


def kill9(server: Server) -> None:
    """SIGKILL the whole server (frontend and scheduler), as a crashed machine would vanish."""
    os.killpg(server.proc.pid, signal.SIGKILL)
    server.proc.wait(10)


def routed(prefill: Server, boot: int, decode: Server, body: dict, timeout: float = 120.0,
           room: int | None = None) -> dict:
    """POST /generate to both halves with one room (random unless given), as a router does;
    returns decode's JSON (prefill's answer, or its failure, is not the client's business)."""
    room = random.getrandbits(63) if room is None else room
    body = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": boot, "bootstrap_room": room}
    with ThreadPoolExecutor(2) as pool:
        p = pool.submit(_post_quietly, prefill.url + "/generate", body, timeout)
        d = pool.submit(httpx.post, decode.url + "/generate", json=body, timeout=timeout, verify=TLS)
        resp = d.result()
        p.result()
    resp.raise_for_status()
    return resp.json()


def _post_quietly(url: str, body: dict, timeout: float) -> None:
    try:
        httpx.post(url, json=body, timeout=timeout, verify=TLS)
    except httpx.HTTPError:
        pass


def stream_final(url: str, body: dict, timeout: float = 120.0) -> dict:
    """The last event of a streamed /generate (SGLang's events are cumulative)."""
    last = None
    with httpx.stream("POST", url + "/generate", json={**body, "stream": True}, timeout=timeout, verify=TLS) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                last = json.loads(line[len("data: "):])
    return last


def stats(server: Server) -> dict:
    return server.info()
