"""Forwarding over one aiohttp connection pool: a generation request goes to a prefill and a
decode worker at once; the decode worker's answer goes back to the client.

Decode's answer is relayed as it is: its status and JSON body, or its SSE stream chunk by
chunk as the chunks arrive. Prefill's answer is read to the end in the background and only
logged when it fails: in P/D, prefill's work is the KV transfer, and decode falls back on
its own when prefill fails.

Lifetimes: a request holds a lease on each worker until that worker's response ends. A
client that leaves closes the decode connection (so decode aborts the request) and cancels
the prefill request (its connection closes too). A decode worker refusing the connection
is marked dead and the request tries another pair.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass

import aiohttp
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from pdserve.entrypoints.errors import RequestError, ServerError, error_body
from pdserve.entrypoints.streaming import SSE_DONE, sse, until_disconnect
from pdserve.router.bootstrap import with_bootstrap
from pdserve.router.metrics import RouterMetrics
from pdserve.router.workers import Lease, NoHealthyWorker, Worker, WorkerSet

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0
FORWARDED_HEADERS = ("authorization",)  # so workers started with --api-key accept the request
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
LOGGED_BODY_BYTES = 500


class WorkerUnreachable(Exception):
    """The connection to a worker failed: the request never reached it."""


@dataclass
class UpstreamReply:
    status: int
    body: bytes
    content_type: str

    def response(self) -> Response:
        return Response(self.body, status_code=self.status, media_type=self.content_type)

    def json(self):
        """The body as JSON when it is JSON, else as text."""
        try:
            return json.loads(self.body)
        except ValueError:
            return self.body.decode(errors="replace")


class PDProxy:
    """Owns the connection pool and the background prefill tasks; ``start`` before use, ``close`` after."""

    def __init__(self, prefill: WorkerSet, decode: WorkerSet, metrics: RouterMetrics, rng: random.Random,
                 request_timeout_s: float, health_timeout_s: float):
        self.prefill = prefill
        self.decode = decode
        self.metrics = metrics
        self.rng = rng
        self.request_timeout = aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=CONNECT_TIMEOUT_S)
        self.health_timeout = aiohttp.ClientTimeout(total=health_timeout_s)
        self.session: aiohttp.ClientSession | None = None
        self.background: set[asyncio.Task] = set()

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(timeout=self.request_timeout, connector=aiohttp.TCPConnector(limit=0))

    async def close(self) -> None:
        """Cancel the prefill requests still running, then close the pool."""
        for task in list(self.background):
            task.cancel()
        await asyncio.gather(*self.background, return_exceptions=True)
        if self.session is not None:
            await self.session.close()

    def set_of(self, worker: Worker) -> WorkerSet:
        return self.prefill if worker in self.prefill.workers else self.decode

    # ------------------------------------------------------------ generation
    async def generate(self, request: Request, path: str) -> Response:
        """Forward a generation request (``path``: /generate, /v1/completions, /v1/chat/completions)."""
        body = parse_json_object(await request.body())
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        for _ in range(len(self.decode.workers) + 1):
            prefill, decode = self._pick_pair()
            try:
                return await self._exchange(request, path, body, headers, prefill, decode)
            except WorkerUnreachable:
                continue  # that decode worker is now dead: try another pair
        raise ServerError(f"decode: every decode worker refused the connection ({self._reasons(self.decode)})")

    def _pick_pair(self) -> tuple[Lease, Lease]:
        try:
            prefill = self.prefill.pick()
        except NoHealthyWorker as e:
            self.metrics.refused(e.role)
            raise ServerError(str(e)) from None
        try:
            return prefill, self.decode.pick()
        except NoHealthyWorker as e:
            prefill.release()
            self.metrics.refused(e.role)
            raise ServerError(str(e)) from None

    async def _exchange(self, request: Request, path: str, body: dict, headers: dict,
                        prefill: Lease, decode: Lease) -> Response:
        p = prefill.worker
        payload = json.dumps(with_bootstrap(body, p.bootstrap_host, p.bootstrap_port, self.rng)).encode()
        ex = _Exchange(decode, self._spawn(self._drain_prefill(prefill, path, payload, headers)), self.metrics)
        try:
            ex.resp = await until_disconnect(request, self._open_decode(decode.worker, path, payload, headers))
            if ex.resp.status == 200 and ex.resp.content_type == "text/event-stream":
                ex.streaming = True  # from here on the response owns the exchange and ends it
                return _RelayResponse(self._relay(ex), ex.finish)
            content = await until_disconnect(request, ex.resp.read())
            ex.completed = True
            self._count_status(decode.worker, ex.resp.status)
            return Response(content, status_code=ex.resp.status, media_type=ex.resp.content_type)
        except RequestError as e:
            if e.status == 499:
                self.metrics.client_disconnects.inc()
            raise
        finally:
            if not ex.streaming:
                ex.finish()

    async def _open_decode(self, worker: Worker, path: str, payload: bytes, headers: dict) -> aiohttp.ClientResponse:
        self.metrics.request(worker)
        try:
            return await self.session.post(worker.url + path, data=payload, headers=_json_headers(headers))
        except aiohttp.ClientConnectorError as e:
            self._unreachable(worker, e)
            raise WorkerUnreachable(worker.url) from e
        except asyncio.TimeoutError:
            self.metrics.error(worker, "timeout")
            raise RequestError(f"decode worker {worker.url}: no answer within the request timeout",
                               status=504, code="upstream_timeout") from None
        except aiohttp.ClientError as e:
            self.metrics.error(worker, "broken")
            raise RequestError(f"decode worker {worker.url}: {type(e).__name__}: {e}", status=502,
                               code="upstream_error") from None

    async def _relay(self, ex: _Exchange) -> AsyncIterator[bytes]:
        """Decode's SSE bytes as they arrive; a broken upstream ends the stream with an error event."""
        try:
            async for chunk in ex.resp.content.iter_any():
                yield chunk
            ex.completed = True
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            ex.broken = True
            worker = ex.decode.worker
            self.metrics.error(worker, "broken")
            logger.warning("decode worker %s: stream broke: %s: %s", worker.url, type(e).__name__, e)
            yield sse(error_body(f"decode worker {worker.url}: stream broke ({type(e).__name__})", 502))
            yield SSE_DONE

    async def _drain_prefill(self, lease: Lease, path: str, payload: bytes, headers: dict) -> None:
        """Prefill's answer, read to the end and dropped; failures are logged and counted, never raised."""
        worker = lease.worker
        self.metrics.request(worker)
        try:
            async with self.session.post(worker.url + path, data=payload, headers=_json_headers(headers)) as resp:
                if resp.status >= 400:
                    text = (await resp.read())[:LOGGED_BODY_BYTES].decode(errors="replace")
                    self._count_status(worker, resp.status)
                    logger.warning("prefill worker %s: %s answered %d: %s", worker.url, path, resp.status, text)
                    return
                async for _ in resp.content.iter_any():
                    pass
        except aiohttp.ClientConnectorError as e:
            self._unreachable(worker, e)
        except asyncio.TimeoutError:
            self.metrics.error(worker, "timeout")
            logger.warning("prefill worker %s: %s timed out", worker.url, path)
        except aiohttp.ClientError as e:
            self.metrics.error(worker, "broken")
            logger.warning("prefill worker %s: %s failed: %s: %s", worker.url, path, type(e).__name__, e)
        finally:
            lease.release()

    def _spawn(self, coro: Coroutine) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task

    def _unreachable(self, worker: Worker, err: Exception, count: bool = True) -> None:
        if count:  # generation requests only: info and control calls would skew the error rates
            self.metrics.error(worker, "connect")
        self.set_of(worker).mark_dead(worker, f"connection failed: {err}")

    def _count_status(self, worker: Worker, status: int) -> None:
        if status >= 400:
            self.metrics.error(worker, f"http_{status // 100}xx")

    @staticmethod
    def _reasons(ws: WorkerSet) -> str:
        return "; ".join(f"{w.url}: {w.last_error}" for w in ws.workers if not w.healthy)

    # ------------------------------------------------------- plain upstream calls
    async def call(self, worker: Worker, method: str, path: str, timeout: aiohttp.ClientTimeout | None = None,
                   json_body=None) -> UpstreamReply:
        """One request to a worker, read whole. Raises WorkerUnreachable (and marks it dead) if the
        connection fails; other transport errors raise aiohttp.ClientError / asyncio.TimeoutError."""
        try:
            async with self.session.request(method, worker.url + path, json=json_body,
                                            timeout=timeout or self.request_timeout) as resp:
                return UpstreamReply(resp.status, await resp.read(), resp.content_type)
        except aiohttp.ClientConnectorError as e:
            self._unreachable(worker, e, count=False)
            raise WorkerUnreachable(worker.url) from e

    async def probe(self, worker: Worker) -> str | None:
        """Health probe: None if ``GET /health`` answers 200 in time, else why not."""
        try:
            async with self.session.get(worker.url + "/health", timeout=self.health_timeout) as resp:
                return None if resp.status == 200 else f"GET /health answered {resp.status}"
        except asyncio.TimeoutError:
            return "GET /health timed out"
        except aiohttp.ClientError as e:
            return f"GET /health failed: {type(e).__name__}: {e}"


class _Exchange:
    """One request's two upstream halves: decode's response (relayed) and prefill's task (drained)."""

    def __init__(self, decode: Lease, prefill_task: asyncio.Task, metrics: RouterMetrics):
        self.decode = decode
        self.prefill_task = prefill_task
        self.metrics = metrics
        self.resp: aiohttp.ClientResponse | None = None
        self.streaming = False  # a streaming response owns the exchange
        self.completed = False  # decode's whole answer reached the router
        self.broken = False  # decode's stream broke off
        self.finished = False

    def finish(self) -> None:
        """End the exchange once. A complete decode answer leaves prefill to end on its own;
        anything else (client gone, decode broken, shutdown) closes both upstream requests."""
        if self.finished:
            return
        self.finished = True
        if self.resp is not None and self.completed:
            self.resp.release()  # back to the pool
        elif self.resp is not None:
            self.resp.close()  # drops the connection: decode sees the client leave and aborts
        if not self.completed:
            self.prefill_task.cancel()
            if self.streaming and not self.broken:
                self.metrics.client_disconnects.inc()
        self.decode.release()


class _RelayResponse(StreamingResponse):
    """An SSE relay that always ends its exchange, however the response ends (done, client gone, shutdown)."""

    def __init__(self, chunks: AsyncIterator[bytes], on_end: Callable[[], None]):
        super().__init__(chunks, media_type="text/event-stream", headers=SSE_HEADERS)
        self.on_end = on_end

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_end()


def parse_json_object(raw: bytes) -> dict:
    try:
        body = json.loads(raw or b"")
    except ValueError as e:
        raise RequestError(f"request body: invalid JSON ({e})", code="invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError("request body: must be a JSON object")
    return body


def _json_headers(headers: dict) -> dict:
    return {**headers, "Content-Type": "application/json"}
