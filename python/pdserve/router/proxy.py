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

Retries (``breaker.Backoff``): a decode whose connection fails, or whose answer breaks off,
before any byte reached the client sends the request again to a newly picked pair (a new
prefill and a new room too) after a jittered, growing back-off, at most ``--retry-max-retries``
times. Once a stream has started, nothing is sent twice: ``resume`` continues a /generate
stream from what the client has, any other stream ends with an error event. Every outcome
(connection failed, timed out, broke off, a 5xx; or an answer) goes to the worker's circuit
breaker, which keeps a failing worker out of the picks for a while (``breaker``).

Failures: with no healthy prefill a request goes to a decode alone, without bootstrap fields
(degraded: decode prefills it as a colocated request). A streamed ``/generate`` whose decode
breaks off is resumed on another decode (``resume``); other broken streams end with an error event.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Coroutine, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import aiohttp
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from pdserve.disagg.auth import PeerAuth
from pdserve.disagg.bootstrap import with_bootstrap
from pdserve.disagg.routed import route_refs
from pdserve.router.breaker import Backoff, answer_verdict
from pdserve.router.metrics import RouterMetrics
from pdserve.router.resume import GenerateStream, prompt_ids_from_probe, prompt_probe, resumable, without_bootstrap
from pdserve.router.state import RouterState
from pdserve.router.workers import Lease, NoHealthyWorker, Role, Worker, WorkerSet
from pdserve.web.api_key import CLIENT_TOKEN_HEADER
from pdserve.web.errors import RequestError, ServerError, error_body, read_body
from pdserve.web.headers import BOOTSTRAP_PORT_HEADER, INSTANCE_HEADER, ROLE_HEADER
from pdserve.web.streaming import SSE_DONE, sse, until_disconnect

if TYPE_CHECKING:
    from pdserve.router.cache_view import CacheView, Placement

logger = logging.getLogger(__name__)
T = TypeVar("T")
CACHED_TOKENS = re.compile(rb'"cached_tokens":\s*(\d+)')

CONNECT_TIMEOUT_S = 10.0
# An idle pooled connection is dropped after this, below uvicorn's 5 s keep-alive (pdserve's and
# SGLang's workers both run it): a worker closes an idle connection at 5 s, and a request sent on it
# as it closes is lost ("connection dropped before an answer"). The health probes run every 5 s by
# default, so without this each probe reused a connection just as its worker closed it.
UPSTREAM_IDLE_S = 3.0
FORWARDED_HEADERS = ("authorization",)  # so workers started with --api-key accept the request
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
LOGGED_BODY_BYTES = 500
DRAINING = "draining: switching"  # a P/D server's /health during POST /pd_role_switch (entrypoints/http_server.py)


class WorkerUnreachable(Exception):
    """The connection to a worker failed: the request never reached it."""


class _PrefillBroke(Exception):
    """Prefill's half failed (its connection refused or dropped) before decode's answer began: decode
    would wait for KV that never comes, until the disaggregation timeout."""

    def __init__(self, worker: Worker):
        super().__init__(worker.url)
        self.worker = worker


class _BrokeOff(Exception):
    """A decode's whole-JSON answer broke off before it was read: the client has nothing yet."""

    def __init__(self, worker: Worker, switched: bool = False, misdirected: bool = False):
        super().__init__(worker.url)
        self.worker = worker
        self.switched = switched  # it answered that it had become prefill
        self.misdirected = misdirected  # it answered 421: signed for another instance (it restarted)


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
                 request_timeout_s: float, health_timeout_s: float, worker_api_key: str | None = None,
                 state: RouterState | None = None, backoff: Backoff | None = None, health_path: str = "/health",
                 max_request_bytes: int = 32 << 20, route_auth: PeerAuth | None = None):
        self.prefill = prefill
        self.route_auth = route_auth or PeerAuth()  # with the P/D token: bootstrap fields are signed
        self.max_request_bytes = max_request_bytes
        self.backoff = backoff or Backoff()
        self.health_path = health_path
        self.cache: CacheView | None = None  # cache_aware: the prompt's page hashes for the prefill choice
        self.decode = decode
        self.metrics = metrics
        self.rng = rng
        self.state = state
        # With a worker key every upstream call carries it; without one, a client's own
        # Authorization header is passed on (workers started with --api-key check it).
        self.worker_headers = {"Authorization": f"Bearer {worker_api_key}"} if worker_api_key else {}
        self.request_timeout = aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=CONNECT_TIMEOUT_S)
        self.health_timeout = aiohttp.ClientTimeout(total=health_timeout_s)
        self.session: aiohttp.ClientSession | None = None
        # one thread: a tokenizer is not safe to share between threads, and hashing is CPU work anyway
        self.hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="router-hash")
        self.background: set[asyncio.Task] = set()
        # One round of health checks now (set by the app): a decode answered that it switched roles.
        self.refresh_roles: Callable[[], Awaitable[None]] | None = None

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(timeout=self.request_timeout,
                                             connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=UPSTREAM_IDLE_S))

    @property
    def http(self) -> aiohttp.ClientSession:
        """The upstream connection pool, opened by ``start`` before the router serves."""
        if self.session is None:
            raise RuntimeError("router proxy: start() was not called (no upstream session)")
        return self.session

    async def close(self) -> None:
        """Cancel the prefill requests still running, then close the pool."""
        for task in list(self.background):
            task.cancel()
        await asyncio.gather(*self.background, return_exceptions=True)
        self.hasher.shutdown(wait=False, cancel_futures=True)
        if self.session is not None:
            await self.session.close()

    def upstream_headers(self, request: Request) -> dict:
        """The worker key (else the client's own), and the client's token: the workers tie a request to
        its client by both, so only that client (or the admin key) aborts it by rid (web/api_key.py)."""
        token = request.headers.get(CLIENT_TOKEN_HEADER)
        own = {CLIENT_TOKEN_HEADER: token} if token is not None else {}
        if self.worker_headers:
            return {**self.worker_headers, **own}
        return {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS} | own

    def set_of(self, worker: Worker) -> WorkerSet:
        return self.prefill if worker in self.prefill.workers else self.decode

    # ------------------------------------------------------------ generation
    async def generate(self, request: Request, path: str) -> Response:
        """Forward a generation request (``path``: /generate, /v1/completions, /v1/chat/completions)."""
        body = parse_json_object(await read_body(request, self.max_request_bytes))
        headers = self.upstream_headers(request)
        hashes = await self._prompt_hashes(path, body)
        try:
            return await self._generate(request, path, body, headers, hashes)
        except RequestError as e:
            if e.status == 499:
                self.metrics.client_disconnects.inc()
            raise

    async def _prompt_hashes(self, path: str, body: dict) -> list[int]:
        """The prompt's page hashes for cache_aware, computed on the hashing thread: a long prompt's
        tokenization and hashing never hold up the event loop (health checks, other requests)."""
        if self.cache is None or not self.cache.hashes_prompts:
            return []
        return await asyncio.get_running_loop().run_in_executor(self.hasher, self.cache.prompt_hashes, path, body)

    async def _generate(self, request: Request, path: str, body: dict, headers: dict, hashes: list[int]) -> Response:
        """A decode that breaks off before a whole JSON answer is retried on another decode (nothing
        reached the client yet); each decode is tried at most once. A decode that answers it became
        prefill has the roles re-checked first (no back-off: nothing failed): the server that took its
        place may have become decode since the request arrived, and the next health check could still
        be an interval away."""
        attempts = _Attempts(self.backoff, self.rng, self.metrics)
        tried: list[Worker] = []
        resigned: set[str] = set()  # decodes the request was signed again for (once each)
        while True:
            try:
                ex = await until_disconnect(request, self._open_exchange(path, body, headers, tried, hashes,
                                                                         attempts))
                return await self._answer(request, ex, path, body, headers)
            except _BrokeOff as e:
                switched = e.switched
                if e.misdirected and e.worker.url not in resigned:
                    # it restarted since the last health check: learn its new instance, sign again
                    resigned.add(e.worker.url)
                    if self.refresh_roles is not None:
                        await self.refresh_roles()
                    continue
                tried.append(e.worker)
            except _PrefillBroke as e:
                logger.warning("prefill worker %s: its half broke before decode answered; sending the request to "
                               "a new pair", e.worker.url)
                if not await until_disconnect(request, attempts.retry(e.worker, "broken")):
                    raise RequestError(f"prefill worker {e.worker.url}: connection broke ({attempts.spent})",
                                       status=502, code="upstream_error") from None
                continue
            if switched and self.refresh_roles is not None:
                await self.refresh_roles()
            where = f"decode worker {tried[-1].url}: answer broke off"
            if not [w for w in self.decode.available if w not in tried]:
                raise RequestError(f"{where} and no other decode could take it", status=502, code="upstream_error")
            if not switched and not await until_disconnect(request, attempts.retry(tried[-1], "broken")):
                raise RequestError(f"{where} ({attempts.spent})", status=502, code="upstream_error")

    async def _answer(self, request: Request, ex: _Exchange, path: str, body: dict, headers: dict) -> Response:
        try:
            if ex.response.status == 200 and ex.placement is not None and self.cache is not None:
                self.cache.accepted(ex.placement)  # decode took it, so prefill did too (both check it alike)
            if ex.response.status == 503 and ex.response.headers.get(ROLE_HEADER) == "prefill":
                # it switched to prefill as the request arrived (its next health check moves it)
                worker = ex.decode.worker
                logger.info("decode worker %s: switched to prefill; sending the request elsewhere", worker.url)
                worker.reported_role = Role.PREFILL
                raise _BrokeOff(worker, switched=True)
            if ex.response.status == 421 and ex.decode.worker.instance is not None:
                worker = ex.decode.worker
                logger.info("decode worker %s: refused a signature for its previous run; checking it again",
                            worker.url)
                worker.instance = None
                raise _BrokeOff(worker, switched=True, misdirected=True)
            if ex.response.status == 200 and ex.response.content_type == "text/event-stream":
                try:
                    first = await until_disconnect(request, self._unless_prefill_broke(ex,
                                                                                      ex.response.content.readany()))
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    first = b""  # broken already: the relay meets it and resumes or says so
                relay = _Relay(ex, GenerateStream(body) if resumable(path, body) else None, first)
                ex.streaming = True  # from here on the response owns the exchange and ends it
                return _RelayResponse(self._relay(relay, path, headers), relay.finish)
            try:
                content = await until_disconnect(request, self._unless_prefill_broke(ex, ex.response.read()))
            except aiohttp.ClientError as e:
                ex.broken = True
                self._failed(ex.decode.worker, "broken")
                logger.warning("decode worker %s: answer broke off (%s: %s)", ex.decode.worker.url,
                               type(e).__name__, e)
                raise _BrokeOff(ex.decode.worker) from None
            except asyncio.TimeoutError:
                self._failed(ex.decode.worker, "timeout")
                raise RequestError(f"decode worker {ex.decode.worker.url}: no answer within the request timeout",
                                   status=504, code="upstream_timeout") from None
            ex.completed = True
            self._count_status(ex.decode.worker, ex.response.status)
            self._answered(ex.decode.worker, ex.response.status)
            if ex.response.status == 200:
                ex.note_cached(content)
            return Response(content, status_code=ex.response.status, media_type=ex.response.content_type)
        finally:
            if not ex.streaming:
                ex.finish()

    async def _open_exchange(self, path: str, body: dict, headers: dict, avoid: Collection[Worker] = (),
                             hashes: Sequence[int] = (), attempts: _Attempts | None = None) -> _Exchange:
        """A decode response opened for ``body`` (with a prefill half when one is healthy). A decode
        refusing the connection is marked dead and the request sent to a new pair after the back-off,
        while ``attempts`` has retries left. ``avoid``: decodes not to pick; ``hashes``: the prompt's
        page hashes (cache_aware)."""
        retry = attempts  # given (a new request, not a resume): a broken prefill half is resent
        attempts = attempts or _Attempts(self.backoff, self.rng, self.metrics)
        while True:
            prefill, decode = self._pick_pair(avoid, hashes)
            placement = self.cache.take_placement() if self.cache is not None else None
            try:
                return await self._start_exchange(path, body, headers, prefill, decode, placement, retry)
            except WorkerUnreachable:
                if not await attempts.retry(decode.worker, "connect"):
                    raise ServerError(f"decode worker {decode.worker.url}: connection failed ({attempts.spent}; "
                                      f"{self._reasons(self.decode)})") from None

    def _pick_pair(self, avoid: Collection[Worker] = (), hashes: Sequence[int] = ()) -> tuple[Lease | None, Lease]:
        """A prefill lease (None when no prefill is healthy, or every healthy one's breaker is open:
        degraded) and a decode lease."""
        try:
            decode = self.decode.pick(exclude=avoid)
        except NoHealthyWorker as e:
            self.metrics.refused(e.role)
            raise ServerError(str(e)) from None
        self._count_decision(self.decode, decode)
        try:
            prefill = self.prefill.pick(block_hashes=hashes)
            self._count_decision(self.prefill, prefill)
            return prefill, decode
        except NoHealthyWorker:
            self.metrics.degraded_requests.inc()
            if self.state is not None:
                self.state.update()  # logs the move to degraded once, before the first such request
            return None, decode

    def _count_decision(self, ws: WorkerSet, lease: Lease) -> None:
        self.metrics.decision(lease.worker, ws.policy_name, ws.policy.reason)
        if lease.cached_blocks and self.cache is not None and self.cache.page_size is not None:
            self.metrics.predicted_cached.labels(lease.worker.role.value, lease.worker.url).inc(
                lease.cached_blocks * self.cache.page_size)

    async def _start_exchange(self, path: str, body: dict, headers: dict, prefill: Lease | None,
                              decode: Lease, placement: Placement | None = None,
                              attempts: _Attempts | None = None) -> _Exchange:
        refs: list = []
        if prefill is None:  # degraded: decode serves it as a colocated request
            payload, task = json.dumps(without_bootstrap(body)).encode(), None
        else:
            p = prefill.worker
            routed = with_bootstrap(body, p.bootstrap_host, p.prefill_bootstrap_port)
            payload = json.dumps(self._signed(routed, decode.worker)).encode()
            refs = route_refs(routed)
            task = self._spawn(self._drain_prefill(prefill, path, payload, headers))
        ex = _Exchange(decode, task, self.metrics, prefill.worker if prefill is not None else None)
        ex.placement = placement if prefill is not None else None
        ex.refs, ex.headers = refs, headers
        if attempts is not None:
            ex.may_retry = lambda: attempts.left
        try:
            ex.resp = await self._unless_prefill_broke(ex, self._open_decode(decode.worker, path, payload, headers))
        except BaseException:
            ex.finish()
            raise
        return ex

    async def _unless_prefill_broke(self, ex: _Exchange, step: Awaitable[T]) -> T:
        """``step`` of decode's answer (its headers, its body, its first bytes), unless prefill's half
        breaks first and the request may still be retried: then ``_PrefillBroke`` (decode's request is
        closed by the caller, so decode aborts it). Without a retry left, decode is waited for (it
        falls back to a local prefill at its disaggregation timeout)."""
        task = asyncio.ensure_future(step)
        prefill = ex.prefill_task
        if prefill is None or prefill.done():
            return await task
        try:
            await asyncio.wait({task, prefill}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if not task.done() and not prefill.cancelled() and prefill.result() and ex.prefill is not None:
            if ex.may_retry():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise _PrefillBroke(ex.prefill)
            await self._prefill_lost(ex)
        return await task

    async def _prefill_lost(self, ex: _Exchange) -> None:
        """Tell decode (signed under the P/D token, for its instance) that prefill's half broke, so
        it prefills the request locally now; failures are logged (decode still falls back at its
        timeout)."""
        worker = ex.decode.worker
        signature = self.route_auth.sign_route(ex.refs, worker.instance or "", purpose="prefill-lost")
        body = {"refs": ex.refs, "signature": signature}
        try:
            reply = await self.call(worker, "POST", "/disaggregation/prefill_lost", timeout=self.health_timeout,
                                    json_body=body, headers=ex.headers)
        except (WorkerUnreachable, aiohttp.ClientError, asyncio.TimeoutError) as e:
            logger.warning("decode worker %s: could not tell it prefill's half broke: %s", worker.url, e)
            return
        if reply.status != 200:
            logger.warning("decode worker %s: refused the news that prefill's half broke (%d): %s", worker.url,
                           reply.status, str(reply.json())[:LOGGED_BODY_BYTES])
        else:
            logger.info("decode worker %s: prefills the request itself (prefill's half broke, no retry left)",
                        worker.url)

    def _signed(self, routed: dict, decode: Worker) -> dict:
        """``routed`` with the router's ``bootstrap_signature`` for ``decode`` (disagg/routed.py): with
        the P/D token, for a decode that names its instance (a pdserve server; sglang's take none)."""
        if self.route_auth.token is None or decode.instance is None:
            return routed
        return {**routed, "bootstrap_signature": self.route_auth.sign_route(route_refs(routed), decode.instance)}

    async def _open_decode(self, worker: Worker, path: str, payload: bytes, headers: dict) -> aiohttp.ClientResponse:
        self.metrics.request(worker)
        try:
            return await self.http.post(worker.url + path, data=payload, headers=_json_headers(headers))
        except aiohttp.ClientConnectorError as e:
            self._unreachable(worker, e)
            raise WorkerUnreachable(worker.url) from e
        except asyncio.TimeoutError:
            self._failed(worker, "timeout")
            raise RequestError(f"decode worker {worker.url}: no answer within the request timeout",
                               status=504, code="upstream_timeout") from None
        except aiohttp.ClientError as e:  # the request reached it, then the connection dropped
            self._failed(worker, "broken")
            logger.warning("decode worker %s: connection dropped before an answer (%s: %s)", worker.url,
                           type(e).__name__, e)
            raise _BrokeOff(worker) from None

    async def _relay(self, relay: _Relay, path: str, headers: dict) -> AsyncIterator[bytes]:
        """Decode's SSE bytes as they arrive. A broken upstream resumes the stream on another decode
        when it can (``resume``), else ends the stream with an error event."""
        while True:
            ex = relay.ex
            try:
                async for chunk in _after(relay, ex.response.content.iter_any()):
                    ex.note_cached(chunk)
                    out = relay.stream.feed(chunk) if relay.stream is not None else chunk
                    if out:
                        yield out
                ex.completed = True
                self._answered(ex.decode.worker, ex.response.status)
                return
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                ex.broken = True
                worker = ex.decode.worker
                self._failed(worker, "broken")
                logger.warning("decode worker %s: stream broke: %s: %s", worker.url, type(e).__name__, e)
            if relay.stream is not None and relay.stream.finished:
                if not relay.stream.done:
                    yield SSE_DONE  # the final event had arrived: nothing is lost
                return
            resumed = await self._resume(relay, relay.stream, path, headers) if relay.stream is not None else None
            if resumed is None:
                yield sse(error_body(f"decode worker {ex.decode.worker.url}: stream broke", 502))
                yield SSE_DONE
                return
            relay.switch(resumed)

    async def _resume(self, relay: _Relay, stream: GenerateStream, path: str, headers: dict) -> _Exchange | None:
        """The stream (``relay.stream``) continued on another decode worker, or None if none can take it."""
        failed = relay.ex.decode.worker
        for _ in range(len(self.decode.workers)):
            try:
                prompt = stream.known_prompt_ids() or await self._prompt_ids(stream.body, headers, failed)
                ex = await self._open_exchange(path, stream.resume_body(prompt), headers, avoid=(failed,))
            except _BrokeOff as e:
                failed = e.worker
                continue
            except (RequestError, WorkerUnreachable, NoHealthyWorker, aiohttp.ClientError, asyncio.TimeoutError,
                    ValueError) as e:
                logger.warning("stream of %s: cannot resume: %s", failed.url, e)
                return None
            if ex.response.status == 200:
                self.metrics.resumed.inc()
                logger.warning("decode worker %s died mid-stream: resumed on %s after %d tokens", failed.url,
                               ex.decode.worker.url, len(stream.base["output_ids"]) if stream.base else 0)
                return ex
            logger.warning("stream of %s: resume on %s answered %d", failed.url, ex.decode.worker.url,
                           ex.response.status)
            ex.finish()
            failed = ex.decode.worker
        return None

    async def _prompt_ids(self, body: dict, headers: dict, avoid: Worker) -> list[int]:
        """A text prompt's token ids, from a healthy decode worker's tokenizer."""
        decode = self.decode.pick(avoid)
        try:
            reply = await self.call(decode.worker, "POST", "/generate", json_body=prompt_probe(body),
                                    headers=headers)
        finally:
            decode.release()
        if reply.status != 200:
            raise ValueError(f"prompt probe on {decode.worker.url} answered {reply.status}")
        return prompt_ids_from_probe(reply.json())

    async def _drain_prefill(self, lease: Lease, path: str, payload: bytes, headers: dict) -> bool:
        """Prefill's answer, read to the end and dropped; failures are logged and counted, never raised.
        True when its connection failed or broke (decode will not get the KV)."""
        worker = lease.worker
        self.metrics.request(worker)
        try:
            async with self.http.post(worker.url + path, data=payload, headers=_json_headers(headers)) as resp:
                if resp.status >= 400:
                    text = (await resp.read())[:LOGGED_BODY_BYTES].decode(errors="replace")
                    self._count_status(worker, resp.status)
                    self._answered(worker, resp.status)
                    # a 4xx is the client's error (decode answers it the same): no worker fault
                    logger.log(logging.DEBUG if resp.status < 500 else logging.WARNING,
                               "prefill worker %s: %s answered %d: %s", worker.url, path, resp.status, text)
                    return False
                async for _ in resp.content.iter_any():
                    pass
                self._answered(worker, resp.status)
                return False
        except aiohttp.ClientConnectorError as e:
            self._unreachable(worker, e)
            return True
        except asyncio.TimeoutError:
            self._failed(worker, "timeout")
            logger.warning("prefill worker %s: %s timed out", worker.url, path)
            return False
        except aiohttp.ClientError as e:
            self._failed(worker, "broken")
            logger.warning("prefill worker %s: %s failed: %s: %s", worker.url, path, type(e).__name__, e)
            return True
        finally:
            lease.release()

    def _spawn(self, coro: Coroutine) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task

    def _unreachable(self, worker: Worker, err: Exception, count: bool = True) -> None:
        if count:  # generation requests only: info and control calls would skew the error rates
            self._failed(worker, "connect", f"connection failed: {err}")
        self.set_of(worker).mark_dead(worker, f"connection failed: {err}")

    def _failed(self, worker: Worker, kind: str, why: str = "") -> None:
        """A generation request to ``worker`` failed (connect, timeout, broken): counted, and its breaker told."""
        self.metrics.error(worker, kind)
        if worker.breaker is not None:
            worker.breaker.record(False, why or kind)

    @staticmethod
    def _answered(worker: Worker, status: int) -> None:
        """``worker`` answered a generation request: 502-504 are its failure, a 500 nothing, the rest success
        (``breaker.answer_verdict``)."""
        verdict = answer_verdict(status)
        if worker.breaker is not None and verdict is not None:
            worker.breaker.record(verdict, f"answered {status}")

    def _count_status(self, worker: Worker, status: int) -> None:
        if status >= 400:
            self.metrics.error(worker, f"http_{status // 100}xx")

    @staticmethod
    def _reasons(ws: WorkerSet) -> str:
        return "; ".join(f"{w.url}: {w.last_error}" for w in ws.workers if not w.healthy)

    # ------------------------------------------------------- plain upstream calls
    async def call(self, worker: Worker, method: str, path: str, timeout: aiohttp.ClientTimeout | None = None,
                   json_body=None, headers: dict | None = None) -> UpstreamReply:
        """One request to a worker, read whole (with the worker key, or ``headers``). Raises
        WorkerUnreachable (and marks it dead) if the connection fails; other transport errors
        raise aiohttp.ClientError / asyncio.TimeoutError."""
        try:
            async with self.http.request(method, worker.url + path, json=json_body,
                                            headers=self.worker_headers if headers is None else headers,
                                            timeout=timeout or self.request_timeout) as resp:
                return UpstreamReply(resp.status, await resp.read(), resp.content_type)
        except aiohttp.ClientConnectorError as e:
            self._unreachable(worker, e, count=False)
            raise WorkerUnreachable(worker.url) from e

    async def probe(self, worker: Worker) -> str | None:
        """Health probe: None if ``GET <health path>`` answers 200 in time, else why not. A P/D server
        draining for a role switch answers 503 saying so (``worker.draining``: out at once)."""
        what = f"GET {self.health_path}"
        try:
            async with self.http.get(worker.url + self.health_path, headers=self.worker_headers,
                                     timeout=self.health_timeout) as resp:
                _learn_role(worker, resp.headers)
                if resp.status == 200:
                    worker.draining = False
                    return None
                text = (await resp.content.read(LOGGED_BODY_BYTES)).decode(errors="replace")
                worker.draining = resp.status == 503 and DRAINING in text
                return f"{what} answered {resp.status}"
        except asyncio.TimeoutError:
            return f"{what} timed out"
        except aiohttp.ClientError as e:
            return f"{what} failed: {type(e).__name__}: {e}"


def _learn_role(worker: Worker, headers: Mapping[str, str]) -> None:
    """A P/D server names its role (and its registry's port) in /health's headers."""
    role = headers.get(ROLE_HEADER)
    worker.reported_role = Role(role) if role in ("prefill", "decode") else None
    worker.instance = headers.get(INSTANCE_HEADER)
    port = headers.get(BOOTSTRAP_PORT_HEADER, "")
    if worker.reported_role is Role.PREFILL and port.isdigit():
        worker.bootstrap_port = int(port)


class _Attempts:
    """One request's retry budget: each failure before any byte reached the client spends a retry
    and waits the back-off; with none left the failure is the answer."""

    def __init__(self, backoff: Backoff, rng: random.Random, metrics: RouterMetrics):
        self.backoff = backoff
        self.rng = rng
        self.metrics = metrics
        self.retries = 0

    async def retry(self, failed: Worker, reason: str) -> bool:
        """False when no retry is left; else counts one, waits its back-off and returns True."""
        if self.retries >= self.backoff.max_retries:
            if self.backoff.max_retries:
                self.metrics.retries_exhausted.inc()
            return False
        delay = self.backoff.delay(self.retries, self.rng)
        self.retries += 1
        self.metrics.retry(failed, reason)
        logger.info("%s worker %s: %s; retry %d/%d on a new pair in %.0f ms", failed.role.value, failed.url,
                    "connection failed" if reason == "connect" else "answer broke off", self.retries,
                    self.backoff.max_retries, delay * 1000)
        await asyncio.sleep(delay)
        return True

    @property
    def left(self) -> bool:
        return self.retries < self.backoff.max_retries

    @property
    def spent(self) -> str:
        if not self.backoff.max_retries:
            return "retries disabled"
        return f"{self.retries} retries spent, --retry-max-retries {self.backoff.max_retries}"


class _Exchange:
    """One request's two upstream halves: decode's response (relayed) and prefill's task (drained)."""

    def __init__(self, decode: Lease, prefill_task: asyncio.Task | None, metrics: RouterMetrics,
                 prefill: Worker | None = None):
        self.decode = decode
        self.prefill_task = prefill_task
        self.metrics = metrics
        self.prefill = prefill
        self.cached_tokens: int | None = None  # the last cached_tokens the answer carried
        self.placement: Placement | None = None  # cache_aware's choice, told the cache view once accepted
        self.may_retry: Callable[[], bool] = lambda: False  # whether the request may go to a new pair
        self.refs: list = []  # the (host, port, room) of the bootstrap fields sent (signed for decode)
        self.headers: dict = {}  # the upstream headers the request went with
        self.resp: aiohttp.ClientResponse | None = None
        self.streaming = False  # a streaming response owns the exchange
        self.completed = False  # decode's whole answer reached the router
        self.broken = False  # decode's stream broke off
        self.finished = False

    @property
    def response(self) -> aiohttp.ClientResponse:
        """Decode's response; set by ``_start_exchange`` before the exchange is handed out."""
        if self.resp is None:
            raise RuntimeError(f"decode worker {self.decode.worker.url}: the exchange has no response yet")
        return self.resp

    def note_cached(self, data: bytes) -> None:
        """Remember the answer's ``cached_tokens`` (SGLang meta_info, OpenAI usage; a stream's last)."""
        found = CACHED_TOKENS.findall(data)
        if found:
            self.cached_tokens = int(found[-1])

    def finish(self) -> None:
        """End the exchange once. A complete decode answer leaves prefill to end on its own;
        anything else (client gone, decode broken or refusing, shutdown) closes both upstream requests."""
        if self.finished:
            return
        self.finished = True
        # counted once seen, complete or not: a client that closes on [DONE] cuts the relay short
        if self.prefill is not None and self.cached_tokens is not None:
            self.metrics.reported_cached.labels(self.prefill.role.value, self.prefill.url).inc(self.cached_tokens)
        if self.resp is not None and self.completed:
            self.resp.release()  # back to the pool
        elif self.resp is not None:
            self.resp.close()  # drops the connection: decode sees the client leave and aborts
        # decode refused the request (a 4xx, e.g. a grammar that does not compile, checked on decode
        # alone): it will never ask prefill for the KV, so prefill's half is closed too (prefill sees
        # its client leave and aborts) instead of waiting for its other half until the timeout
        refused = self.resp is not None and 400 <= self.resp.status < 500
        if (refused or not self.completed) and self.prefill_task is not None:
            self.prefill_task.cancel()
            if self.streaming and not self.broken:
                self.metrics.client_disconnects.inc()
        self.decode.release()


class _Relay:
    """A streamed answer to one client: the current exchange (a new one after each resume) and,
    for a resumable /generate, what the client has received."""

    def __init__(self, ex: _Exchange, stream: GenerateStream | None, first: bytes = b""):
        self.ex = ex
        self.stream = stream
        self.first = first  # decode's first bytes, read before the response began

    def switch(self, ex: _Exchange) -> None:
        """Continue on ``ex``; the broken exchange is ended (its decode lease released)."""
        self.ex.finish()
        ex.streaming = True
        self.ex = ex

    def finish(self) -> None:
        self.ex.finish()


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


async def _after(relay: _Relay, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The relay's first bytes (once), then ``chunks``."""
    first, relay.first = relay.first, b""
    if first:
        yield first
    async for chunk in chunks:
        yield chunk


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
