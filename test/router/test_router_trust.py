"""What a client may make the router do (issue 33, round 3): a body larger than
``--max-request-bytes`` is refused as it arrives; a long prompt is hashed only up to the context
length, off the event loop, and enters the routing guess only once the workers accepted it."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading

import pytest
from router_utils import EchoWorker, Router, wait_for

from pdserve.router.app import build_context
from pdserve.router.config import PrefillSpec, RouterArgs

FAST_HEALTH = ("--health-check-interval-secs", "0.1", "--health-check-timeout-secs", "2")
CONTEXT = 64


@pytest.fixture(scope="module")
def echo():
    info = {"page_size": 1, "total_pages": 1 << 20, "context_length": CONTEXT}
    workers = {name: EchoWorker(name, info=dict(info)).start() for name in ("p1", "d1")}
    yield workers
    for w in workers.values():
        w.close()


@pytest.fixture
def router(echo):
    routers = []

    def make(*flags: str) -> Router:
        r = Router([echo["p1"].url], [echo["d1"].url], *FAST_HEALTH, *flags)
        routers.append(r)
        return r.start()

    yield make
    for r in routers:
        assert r.stop() in (0, None), r.output()


def _status_line(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data.split(b"\r\n", 1)[0]


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/abort_request"])
def test_a_chunked_body_over_the_limit_is_refused_before_it_ends(router, echo, path):
    """The client sends more than the limit and never ends the body: the 413 comes anyway (the old
    router read the body to its end, however large, before looking at it)."""
    r = router("--max-request-bytes", "4096")
    host, port = r.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     "Transfer-Encoding: chunked\r\n\r\n".encode())
        chunk = b'{"text": "' + b"a" * 1000
        for _ in range(8):  # 8 KB: past the limit, and the body's end is never sent
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            chunk = b"a" * 1000
        assert _status_line(sock) == b"HTTP/1.1 413 Request Entity Too Large"
    assert echo["d1"].generation_bodies() == [] and echo["p1"].generation_bodies() == []


def test_a_declared_length_over_the_limit_is_refused_unread(router):
    r = router("--max-request-bytes", "4096")
    resp = r.post("/generate", content=b'{"text": "' + b"a" * 5000 + b'"}',
                  headers={"Content-Type": "application/json"})
    assert resp.status_code == 413
    assert "--max-request-bytes" in resp.json()["error"]["message"]
    assert r.post("/generate", json={"text": "short"}).status_code == 200


def test_a_long_prompt_is_hashed_up_to_the_context_and_only_once_accepted(router, echo):
    r = router("--policy", "cache_aware")
    def blocks() -> int:
        view = r.get("/get_server_info").json()["prefill"][0]["cache_view"]
        return view["approximate"]["blocks"] if view else -1

    wait_for(lambda: r.get("/get_server_info").json()["cache_view"]["page_size"] == 1, what="page size known")
    # refused by decode (as a too-long prompt is): the guess learns nothing
    echo["d1"].fail_status = 400
    assert r.post("/generate", json={"input_ids": list(range(100_000))}).status_code == 400
    assert blocks() == 0
    echo["d1"].fail_status = None
    assert r.post("/generate", json={"input_ids": list(range(100_000))}).status_code == 200
    # the context's pages, not 100,000: one long body no longer evicts everything else
    assert blocks() == CONTEXT - 1  # the last token of a prompt is never cached


def test_prompts_are_hashed_off_the_event_loop():
    args = RouterArgs(prefill=(PrefillSpec("http://127.0.0.1:1"),), decode=("http://127.0.0.1:2",))
    ctx = build_context(args)
    ctx.cache.page_size = 1
    seen = []

    class Tokenizer:
        def encode(self, text):
            seen.append(threading.current_thread())
            return [ord(c) for c in text]

    ctx.cache.tokenizer = Tokenizer()

    async def run() -> list[int]:
        loop_thread = threading.current_thread()
        hashes = await ctx.proxy._prompt_hashes("/generate", {"text": "x" * 10})
        ctx.proxy.hasher.shutdown()
        assert seen and seen[0] is not loop_thread
        return hashes

    assert len(asyncio.run(run())) == 9


@pytest.mark.parametrize("command", [
    ["router", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"],
    ["serve", "--model-path", "tiny-llama"],
    ["up", "--model-path", "tiny-llama"],
])
def test_no_listener_beyond_the_loopback_without_a_key_unless_told(command):
    """The shipped images and manifests listen on every interface: without --api-key that is refused,
    in one line naming the way out."""
    env = {k: v for k, v in os.environ.items() if k not in ("PDSERVE_API_KEY", "PDSERVE_ADMIN_API_KEY")}
    proc = subprocess.run([sys.executable, "-m", "pdserve", *command, "--host", "0.0.0.0", "--port", "1"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and "--allow-no-api-key" in proc.stderr
    assert "api_key: the" in proc.stderr and "0.0.0.0" in proc.stderr


def test_bootstrap_fields_are_signed_for_decode_s_run_and_again_after_a_restart(echo):
    """With the P/D token the router signs what it adds for the decode run its health check saw; a
    decode that restarted since (421) is checked again and the request signed for its new run."""
    d1, p1 = echo["d1"], echo["p1"]
    d1.instance = "run-1"
    r = Router([p1.url], [d1.url], *FAST_HEALTH, "--health-check-interval-secs", "30",
               env={**os.environ, "PDSERVE_DISAGGREGATION_AUTH_TOKEN": "t0ken"}).start()
    try:
        d1.received.clear()
        body = {"text": "hi", "bootstrap_host": "10.9.9.9", "bootstrap_signature": "e=1,n=2,i=run-1,mac=forged"}
        assert r.post("/generate", json=body).status_code == 200
        (sent,) = d1.generation_bodies()
        assert sent["bootstrap_host"] == "127.0.0.1" and ",i=run-1," in sent["bootstrap_signature"]
        assert "forged" not in sent["bootstrap_signature"]
        d1.instance = "run-2"  # restarted between two health checks (30 s apart here)
        assert r.post("/generate", json={"text": "hi"}).status_code == 200
        signed_for = [b["bootstrap_signature"].split(",i=")[1].split(",")[0] for b in d1.generation_bodies()]
        assert signed_for == ["run-1", "run-1", "run-2"]
    finally:
        d1.instance = None
        assert r.stop() in (0, None), r.output()
