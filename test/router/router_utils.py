"""Test helpers: a ``pdserve router`` subprocess, and a real aiohttp echo worker on loopback.

The echo worker is a real HTTP server that answers like a tiny pdserve worker and
records what reached it, so tests can check exactly what the router sent.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from aiohttp import web

from entrypoints.server_utils import HEALTH_POLL_S, TLS, free_port
from pdserve.web.headers import BOOTSTRAP_PORT_HEADER, INSTANCE_HEADER, ROLE_HEADER

ROUTER_STARTUP_TIMEOUT_S = 60.0


def wait_for(condition, timeout: float = 30.0, what: str = "condition"):
    """Poll ``condition()`` until it is truthy; returns its value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what}: not true after {timeout} s")


class Router:
    """A ``python -m pdserve router`` subprocess in its own session; ``url`` once ``start()`` returns."""

    def __init__(self, prefill: list[str | tuple[str, int]], decode: list[str], *flags: str,
                 module: str = "pdserve", env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", module, *(["router"] if module == "pdserve" else [])]
        for p in prefill:
            cmd += ["--prefill", *([p] if isinstance(p, str) else [p[0], str(p[1])])]
        for d in decode:
            cmd += ["--decode", d]
        self.cmd = [*cmd, "--port", str(self.port), "--log-level", "info", *flags]
        key = flags[flags.index("--api-key") + 1] if "--api-key" in flags else None
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}  # get/post send it unless told otherwise
        self.log = tempfile.NamedTemporaryFile(prefix="pdserve-router-test-", suffix=".log", delete=False)
        self.env = env  # None: this process's
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = ROUTER_STARTUP_TIMEOUT_S, ready: bool = True) -> Router:
        """Start and wait until it listens (``ready``: until its /health is 200, it can serve)."""
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=self.env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=2, verify=TLS).status_code == 200 or not ready:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(HEALTH_POLL_S)
        out = self.output()  # before stop(), which removes the log
        self.stop()
        raise RuntimeError(f"router not listening after {timeout} s:\n{out}")

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(self.url + path, timeout=kw.pop("timeout", 30), headers=kw.pop("headers", self.headers),
                         verify=kw.pop("verify", TLS), **kw)

    def post(self, path: str, **kw) -> httpx.Response:
        return httpx.post(self.url + path, timeout=kw.pop("timeout", 60), headers=kw.pop("headers", self.headers),
                          verify=kw.pop("verify", TLS), **kw)

    def worker_state(self, url: str) -> dict:
        info = self.get("/get_server_info").json()
        return next(w for w in info["prefill"] + info["decode"] if w["url"] == url)

    def wait_health(self, url: str, healthy: bool, timeout: float = 30.0) -> None:
        """Poll until the router's view of worker ``url`` is ``healthy``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.worker_state(url)["healthy"] == healthy:
                return
            time.sleep(0.05)
        raise AssertionError(f"router still sees {url} as healthy={not healthy} after {timeout} s")

    def metric(self, name: str, **labels) -> float:
        """One sample of the router's /metrics (0 if absent)."""
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))  # the exposition sorts them
        for line in self.get("/metrics").text.splitlines():
            key, _, value = line.rpartition(" ")
            if key == (f"{name}{{{want}}}" if want else name):
                return float(value)
        return 0.0

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-6000:]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int | None:
        """Signal, wait, then SIGKILL the session if needed; returns the exit code the signal produced."""
        code = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                code = self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)
        if not self.log.closed:
            self.log.close()
            os.unlink(self.log.name)
        return code


@dataclass
class Received:
    method: str
    path: str
    body: dict | None
    headers: dict


@dataclass
class EchoWorker:
    """A real aiohttp server on 127.0.0.1 (own thread and loop) standing in for a pdserve worker.

    Generation routes answer ``{"worker": name, "body": <the body received>}``, or with
    ``"stream": true`` SSE events ``{"worker": name, "i": i}`` (``echo_chunks`` of them).
    ``"echo_hold": true`` keeps a stream open, sending SSE comments until the client leaves
    (without ``stream``: answers nothing until then), which is recorded in ``disconnects``.
    ``health_status`` / ``fail_status`` make it sick; ``drop_requests`` drops the connection of every
    generation request before answering (a dead backend behind a live ``/health``). On the worker
    named ``echo_die_on`` a stream breaks off after ``echo_die_after`` events.
    """

    name: str
    port: int = field(default_factory=free_port)
    host: str = "127.0.0.1"  # another loopback address (127.0.0.2 ...) stands for another pod
    health_status: int = 200
    fail_status: int | None = None  # answer generation requests with this error status
    role: str | None = None  # the P/D role its /health reports (X-PD-Role), as a server that can switch does
    bootstrap_port: int | None = None  # and, as prefill, its registry's port (X-PD-Bootstrap-Port)
    switched_to_prefill: bool = False  # answer generation requests as a server that just became prefill
    drop_requests: bool = False
    info: dict = field(default_factory=dict)  # more fields of its /get_server_info (page_size, context_length ...)
    instance: str | None = None  # the run its /health names (X-PD-Instance); 421 for a signature of another
    received: list[Received] = field(default_factory=list)
    disconnects: list[dict] = field(default_factory=list)  # bodies of streams whose client left
    open_holds: int = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def reset(self) -> None:
        self.health_status, self.fail_status, self.drop_requests = 200, None, False
        self.role, self.bootstrap_port, self.switched_to_prefill = None, None, False
        self.received.clear()
        self.disconnects.clear()

    def generation_bodies(self) -> list[dict]:
        control = ("/flush_cache", "/abort_request")
        return [r.body for r in self.received if r.method == "POST" and r.path not in control]

    # -------------------------------------------------------------- server
    def start(self) -> EchoWorker:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"echo-{self.name}", daemon=True)
        self._thread.start()
        self._call(self._start())
        return self

    def stop(self) -> None:
        """Close the listening socket and every connection (new connections are refused)."""
        self._call(self._runner.cleanup())

    def close(self) -> None:
        self.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def restart(self) -> None:
        self._call(self._start())

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(30)

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self._health)
        for path in ("/get_server_info", "/server_info", "/model_info", "/get_model_info", "/v1/models"):
            app.router.add_get(path, self._info)
        app.router.add_post("/flush_cache", self._flush)
        app.router.add_post("/abort_request", self._flush)
        app.router.add_get("/health_generate", self._health)
        for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
            app.router.add_post(path, self._generate)
        self._runner = web.AppRunner(app, shutdown_timeout=0.5)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port, reuse_address=True).start()

    # ------------------------------------------------------------ handlers
    def _record(self, request: web.Request, body: dict | None) -> None:
        self.received.append(Received(request.method, request.path, body, dict(request.headers)))

    async def _health(self, request: web.Request) -> web.Response:
        self._record(request, None)
        headers = {ROLE_HEADER: self.role} if self.role else {}
        if self.instance is not None:
            headers[INSTANCE_HEADER] = self.instance
        if self.bootstrap_port is not None:
            headers[BOOTSTRAP_PORT_HEADER] = str(self.bootstrap_port)
        return web.Response(status=self.health_status, headers=headers)

    async def _info(self, request: web.Request) -> web.Response:
        self._record(request, None)
        return web.json_response({"worker": self.name, "path": request.path,
                                  "internal_states": [{"worker": self.name}], **self.info})

    async def _flush(self, request: web.Request) -> web.Response:
        self._record(request, await request.json() if request.can_read_body else None)
        if self.fail_status:
            return web.json_response({"error": {"message": f"{self.name} is busy"}}, status=self.fail_status)
        return web.json_response({"success": True, "message": f"{self.name} flushed"})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self._record(request, body)
        if self.fail_status:
            return web.json_response({"error": {"message": f"{self.name} failed", "worker": self.name}},
                                     status=self.fail_status)
        signature = body.get("bootstrap_signature")
        if self.instance is not None and signature and f",i={self.instance}," not in signature:
            return web.json_response({"error": {"message": "signed for another run"}}, status=421)
        if self.switched_to_prefill:
            return web.json_response({"error": {"message": f"{self.name} is prefill now"}}, status=503,
                                     headers={ROLE_HEADER: "prefill"})
        if self.drop_requests or (body.get("echo_die_on") == self.name and not body.get("stream")):
            request.transport.close()  # dies before answering: the client sees the connection drop
            return web.Response()
        if body.get("stream") and "input_ids" in body:
            return await self._cumulative(request, body)
        if body.get("stream"):
            return await self._stream(request, body)
        if body.get("echo_hold"):
            return await self._hold_reply(request, body)
        return web.json_response({"worker": self.name, "body": body})

    async def _hold_reply(self, request: web.Request, body: dict) -> web.Response:
        """Answer nothing until the client closes the connection (recorded in ``disconnects``)."""
        self.open_holds += 1
        try:
            while request.transport is not None and not request.transport.is_closing():
                await asyncio.sleep(0.05)
            self.disconnects.append(body)
        finally:
            self.open_holds -= 1
        return web.Response(status=499)

    async def _stream(self, request: web.Request, body: dict) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i in range(body.get("echo_chunks", 3)):
                await resp.write(b"data: " + json.dumps({"worker": self.name, "i": i}).encode() + b"\n\n")
                await asyncio.sleep(body.get("echo_delay", 0))
                if body.get("echo_die_on") == self.name and i + 1 == body.get("echo_die_after"):
                    await asyncio.sleep(0.3)  # the events reach the reader first (see _cumulative)
                    request.transport.close()
                    return resp
            if body.get("echo_hold"):
                await self._hold(resp)
            await resp.write(b"data: [DONE]\n\n")
        except ConnectionError:
            self.disconnects.append(body)
        except asyncio.CancelledError:
            self.disconnects.append(body)
            raise
        return resp

    async def _cumulative(self, request: web.Request, body: dict) -> web.StreamResponse:
        """SGLang's cumulative /generate stream: output token i is ``1000 + len(input_ids) + i``
        (so a resumed request continues the same sequence). On the worker named ``echo_die_on`` the
        connection drops after ``echo_die_after`` events, as when the server is killed."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = body["sampling_params"]["max_new_tokens"]
        start = len(body["input_ids"])
        ids = []
        for i in range(n):
            ids.append(1000 + start + i)
            event = {"text": "".join(f"<{t}>" for t in ids), "output_ids": ids,
                     "meta_info": {"id": self.name, "prompt_tokens": start, "completion_tokens": len(ids),
                                   "finish_reason": {"type": "length", "length": n} if i == n - 1 else None}}
            await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            if body.get("echo_die_on") == self.name and i + 1 == body.get("echo_die_after"):
                # give the events a moment to reach the reader: a close right behind them can make
                # aiohttp's reader raise before handing over what had arrived (as a real crash may)
                await asyncio.sleep(0.3)
                request.transport.close()  # no end of the chunked body: the client sees a broken stream
                return resp
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def _hold(self, resp: web.StreamResponse) -> None:
        self.open_holds += 1
        try:
            while True:  # a write to a closed connection raises: that is how the client's leaving shows
                await resp.write(b": hold\n\n")
                await asyncio.sleep(0.05)
        finally:
            self.open_holds -= 1
