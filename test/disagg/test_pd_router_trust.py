"""Real prefill and decode servers under a P/D token behind pdserve's router (issue 33, round 3):

- decode acts only on bootstrap fields the router signed: a client calling decode itself with
  ``bootstrap_host``/``bootstrap_port`` is refused (403 naming the field), forged signatures too;
- prefill's connection reset mid-body (a TCP proxy in front of it resets after a few bytes): the
  router sends the request to a new pair at once, and decode does not wait out its (here very long)
  disaggregation timeout: the request is answered through prefill's KV, with no fallback.
"""

from __future__ import annotations

import os
import random
import socket
import struct
import threading

import httpx
import pytest

from entrypoints.server_utils import Server, free_port
from router.router_utils import Router, wait_for

TOKEN = "router-trust-pd-token"
ENV = {"PDSERVE_DISAGGREGATION_AUTH_TOKEN": TOKEN}
MODEL = "tiny-llama"
SAMPLING = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
LONG_TIMEOUT_S = "900"  # decode would wait this long for KV that never comes (the old router's outcome)
CLIENT_TIMEOUT_S = 300  # far below it: a request that waits it out fails the test


class ResettingProxy:
    """TCP on 127.0.0.1 in front of ``upstream``; the next ``reset`` POST /generate requests have their
    connection reset (RST) after ``after_bytes`` of them went through: a connection dropped mid-body
    (the router keeps connections open, so it is the request that is picked, not the connection)."""

    def __init__(self, upstream_port: int, after_bytes: int = 200):
        self.upstream_port, self.after_bytes = upstream_port, after_bytes
        self.reset, self.resets = 0, 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _doom(self, data: bytes) -> bool:
        with self.lock:
            if self.reset > 0 and data.startswith(b"POST /generate"):
                self.reset -= 1
                return True
        return False

    def _pump(self, src: socket.socket, dst: socket.socket, from_client: bool) -> None:
        sent, doomed = 0, False
        try:
            while data := src.recv(65536):
                if from_client and not doomed and self._doom(data):
                    doomed, sent = True, 0
                if doomed and sent + len(data) > self.after_bytes:
                    dst.sendall(data[:self.after_bytes - sent])
                    for s in (src, dst):  # linger 0: close sends RST
                        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    with self.lock:
                        self.resets += 1
                    break
                dst.sendall(data)
                sent += len(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def pd():
    boot = free_port()
    prefill = Server("--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(boot),
                     "--disaggregation-timeout-s", LONG_TIMEOUT_S, model=MODEL, env=ENV)
    decode = Server("--disaggregation-mode", "decode", "--disaggregation-timeout-s", LONG_TIMEOUT_S, model=MODEL,
                    env=ENV)
    router = proxy = None
    try:
        for s in (prefill, decode):
            s.launch()
        for s in (prefill, decode):
            s.wait_healthy()
        proxy = ResettingProxy(prefill.port)
        router = Router([(proxy.url, boot)], [decode.url], "--health-check-interval-secs", "0.5",
                        "--retry-initial-backoff-ms", "1", env={**os.environ, **ENV}).start()
        wait_for(lambda: router.get("/health").json()["status"] == "ok", 60, "router sees both workers")
        yield prefill, boot, decode, router, proxy
    finally:
        if router is not None:
            router.stop()
        if proxy is not None:
            proxy.close()
        for s in (prefill, decode):
            s.stop()


def _generate(router: Router, ids: list[int]) -> httpx.Response:
    return router.post("/generate", json={"input_ids": ids, "sampling_params": SAMPLING}, timeout=CLIENT_TIMEOUT_S)


def test_through_the_router_decode_takes_the_signed_fields(pd):
    _, _, decode, router, _ = pd
    before = decode.info()
    resp = _generate(router, list(range(10, 40)))
    assert resp.status_code == 200, resp.text
    after = decode.info()
    assert after["kv_received"] == before["kv_received"] + 1 and after["fallbacks"] == before["fallbacks"]


@pytest.mark.parametrize("fields,param", [
    ({"bootstrap_host": "127.0.0.1"}, "bootstrap_host"),  # even the loopback: this decode holds a token
    ({"bootstrap_host": "10.255.255.1"}, "bootstrap_host"),
    ({"bootstrap_host": "127.0.0.1", "bootstrap_signature": "e=1,n=" + "0" * 32 + ",i=x,mac=00"},
     "bootstrap_signature"),
])
def test_a_client_cannot_point_decode_at_a_registry(pd, fields, param):
    _, boot, decode, _, _ = pd
    before = decode.info()
    body = {"input_ids": list(range(10, 40)), "sampling_params": SAMPLING, "bootstrap_port": boot,
            "bootstrap_room": random.getrandbits(63), **fields}
    resp = httpx.post(decode.url + "/generate", json=body, timeout=60)
    assert resp.status_code in (403, 421), resp.text
    assert resp.json()["error"]["param"] == param
    after = decode.info()
    assert after["requests_disaggregated"] == before["requests_disaggregated"]


def test_a_prefill_connection_reset_mid_body_is_sent_to_a_new_pair(pd):
    _, _, decode, router, proxy = pd
    ids = list(range(50, 90))  # a prompt decode has not cached: it must receive the KV
    before = decode.info()
    proxy.reset = 1
    resp = _generate(router, ids)
    assert resp.status_code == 200, resp.text
    assert proxy.resets == 1
    after = decode.info()
    assert resp.json()["output_ids"] == _generate(router, ids).json()["output_ids"]
    # answered through prefill's KV on the second pair: decode neither fell back nor timed out
    assert after["kv_received"] == before["kv_received"] + 1
    assert after["fallbacks"] == before["fallbacks"] and after["transfer_failures"] == before["transfer_failures"]
    assert router.metric("pdserve_router:retries_total", role="prefill", worker=proxy.url, reason="broken") == 1


def test_with_no_retry_left_decode_is_told_to_prefill_locally_at_once(pd):
    """The same reset under --disable-retries: the router tells decode (signed) that prefill's half
    broke, and decode prefills the request itself instead of waiting out its timeout."""
    prefill, boot, decode, _, proxy = pd
    router = Router([(proxy.url, boot)], [decode.url], "--health-check-interval-secs", "0.5", "--disable-retries",
                    env={**os.environ, **ENV}).start()
    try:
        wait_for(lambda: router.get("/health").json()["status"] == "ok", 60, "router sees both workers")
        ids = list(range(100, 140))  # not cached on decode
        before, resets = decode.info(), proxy.resets
        proxy.reset = 1
        resp = _generate(router, ids)
        assert resp.status_code == 200, resp.text
        assert proxy.resets == resets + 1
        after = decode.info()
        assert after["fallbacks"] == before["fallbacks"] + 1  # prefilled here, told so by the router
        assert after["kv_received"] == before["kv_received"]
        assert resp.json()["output_ids"] == _generate(router, ids).json()["output_ids"]
    finally:
        router.stop()


def test_only_the_router_may_say_prefill_broke(pd):
    _, boot, decode, _, _ = pd
    body = {"refs": [["127.0.0.1", boot, 12345]], "signature": None}
    resp = httpx.post(decode.url + "/disaggregation/prefill_lost", json=body, timeout=60)
    assert resp.status_code == 403 and resp.json()["error"]["param"] == "signature", resp.text
