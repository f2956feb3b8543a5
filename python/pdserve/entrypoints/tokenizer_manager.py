"""Frontend half of a server: the request table, IPC to the scheduler process, output routing.

Runs on the HTTP server's event loop (one thread). One dispatch task reads the
scheduler's per-step ``BatchTokenOutput`` messages and appends each output to
its request's state, then sets that request's event (a stream: on its first
token, every ``stream_interval`` outputs and at the end, as SGLang's
``--stream-interval``; otherwise only at the end). The request's own coroutine
wakes, takes everything that arrived since its last wake-up (so a slow client
gets fewer, larger chunks instead of falling behind) and detokenizes it. A
watchdog task turns a dead scheduler into errors for every waiting request and
a fatal-callback for the server.

Sends use a plain (non-async) ZMQ socket with NOBLOCK: an abort must leave from
inside a cancelled coroutine, where nothing may be awaited.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import logging
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from pdserve.config import ServerArgs
from pdserve.disagg.auth import AuthError, Misdirected, peer_auth
from pdserve.disagg.routed import BootstrapGate
from pdserve.engine.codec import DropCounter
from pdserve.engine.io_struct import (
    AbortReq,
    BatchTokenOutput,
    BootstrapRef,
    FlushCacheReq,
    FlushCacheResp,
    GetStatsReq,
    KVEventsSnapshotReq,
    KVEventsSnapshotResp,
    PrefillLostReq,
    RejectedReq,
    RoleSwitchReq,
    RoleSwitchResp,
    SchedulerFailed,
    SchedulerReady,
    ShutdownReq,
    StatsResp,
    TokenizedGenerateReq,
    TokenOutput,
)
from pdserve.engine.node_sockets import FrontendSockets, frontend_sockets
from pdserve.engine.request import RequestLimits, SamplingParams, check_request, finish_abort
from pdserve.engine.scheduler_loop import SchedulerEndpoints, decode_frame, send_message
from pdserve.engine.tokenizer import IncrementalDetokenizer, output_text, text_decoder
from pdserve.entrypoints.grammar_check import GrammarCheck, compile_owner
from pdserve.entrypoints.logprobs import TokenTexts
from pdserve.entrypoints.scheduler_process import RankProcesses, SchedulerProcess, scheduler_processes
from pdserve.obs import handoff
from pdserve.obs.handoff import HandoffProfile
from pdserve.obs.metrics import ServerMetrics
from pdserve.obs.role import LiveRole
from pdserve.obs.timeline import ReqTimeline
from pdserve.web.api_key import request_owner
from pdserve.web.errors import RequestError, RoleChanged, ServerError

logger = logging.getLogger(__name__)

WATCHDOG_INTERVAL_S = 0.5
SIGNAL_GRACE_S = 2.0
SHUTDOWN_EXIT_CODES = (-signal.SIGTERM, -signal.SIGINT)  # a process killed by a signal exits with -signum
CONTROL_TIMEOUT_S = 10.0
# Texts longer than this are tokenized on a worker thread (~50 us of work inline at most).
INLINE_TOKENIZE_CHARS = 4096
TOKENIZE_THREADS = 2


class StartupError(RuntimeError):
    """The scheduler process died, failed or timed out before it was ready."""


class StartupCancelled(RuntimeError):
    """Shutdown was requested while waiting for the scheduler to become ready."""


@dataclass
class GenerateChunk:
    """What a request yields per wake-up: tokens (and their text) new since the previous chunk.
    Without streaming there is one chunk, holding the whole output.

    With ``return_logprob``: ``logprobs`` (and ``top_logprobs``, if top_logprobs_num > 0) of
    these tokens; the prompt's (``input_logprobs``, ``input_top_logprobs``) come with the first chunk.
    """

    rid: str
    text: str
    token_ids: list[int]
    logprobs: list[float] | None
    finished: bool
    finish_reason: dict | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    top_logprobs: list | None = None
    input_logprobs: list | None = None
    input_top_logprobs: list | None = None
    timeline: dict | None = None  # TTFT breakdown (obs.timeline.STAGES), once the first token is out
    cached_tokens_by_tier: dict | None = None  # cached_tokens split by tier (device, host, storage)
    decode_cached_tokens: int | None = None  # a decode server's own prefix-cache hit
    spec: dict | None = None  # speculative decoding's meta_info figures (io_struct.spec_meta)


class _Wake:
    """A request's wake-up: ``set`` by the router, awaited by the request's one coroutine.

    What asyncio.Event did here, at less cost per token: the coroutine awaits a bare future
    (``pending``), not a coroutine that makes one, keeps it in a list of waiters and removes it.
    """

    __slots__ = ("flag", "waiter")

    def __init__(self) -> None:
        self.flag = False
        self.waiter: asyncio.Future | None = None

    def is_set(self) -> bool:
        return self.flag

    def set(self) -> None:
        self.flag = True
        waiter = self.waiter
        if waiter is not None and not waiter.done():  # done: cancelled with its request's coroutine
            waiter.set_result(None)

    def clear(self) -> None:
        self.flag = False

    def pending(self) -> asyncio.Future | None:
        """None if set; else a future the next ``set`` completes."""
        if self.flag:
            return None
        self.waiter = asyncio.get_running_loop().create_future()
        return self.waiter


@dataclass(eq=False)
class _ReqState:
    rid: str  # the client's
    return_logprob: bool
    wake_every: int  # wake the request's coroutine once this many outputs are pending
    prompt_tokens: int = 0
    event: _Wake = field(default_factory=_Wake)
    outputs: list[TokenOutput] = field(default_factory=list)
    last: TokenOutput | None = None  # the latest output routed to this request
    timeline: ReqTimeline = field(default_factory=ReqTimeline)
    error: RequestError | None = None
    routed_at: float = 0.0  # handoff.now() when outputs were routed to it and its coroutine woken
    owner: str = field(default_factory=request_owner)  # who may abort it by rid (the HTTP request's client)

    @property
    def streaming(self) -> bool:
        return self.wake_every != sys.maxsize


def scoped_rid(rid: str, owner: str) -> str:
    """``rid`` in ``owner``'s namespace: clients choose rids, and one client's rid must tell another
    nothing (not "already in use", not a different answer to an abort) and reach none of its requests."""
    return f"{owner[:16]}/{rid}" if owner else rid


class TokenizerManager:
    """Owns the scheduler process, both sockets and every in-flight request of one server.

    Lifecycle: ``await start()`` (spawns the scheduler, waits for it to be ready),
    serve via ``generate`` / ``abort`` / ``get_stats`` / ``flush_cache``, then
    ``close()`` (stops the child, removes the socket directory). After a fatal
    scheduler error ``healthy`` is False and ``on_fatal(message)`` has been called once.
    """

    def __init__(self, args: ServerArgs, tokenizer, metrics: ServerMetrics | None = None,
                 stream_interval: int = 1):
        self.args = args
        self.stream_interval = max(1, stream_interval)
        self.tokenizer = tokenizer
        # Token id -> text for logprobs, one memo for the server's life (at most a vocabulary of
        # strings): a top-k request shows k alternatives per token, each decoded once, not per request.
        self.token_texts = TokenTexts(tokenizer)
        # Every stream's detokenizer decodes through this one (choosing it costs ~15 us, before the send).
        self._decode = None if tokenizer is None else text_decoder(tokenizer)
        self.metrics = metrics
        self.limits: RequestLimits | None = None
        self.healthy = False
        self.closing = False  # set at shutdown: new requests get a 503
        self.signalled = False  # a shutdown signal arrived (it may reach the scheduler too: not a crash)
        self.fatal_error: str | None = None
        self.on_fatal: Callable[[str], None] | None = None
        self.scheduler: SchedulerProcess | RankProcesses | None = None
        self._reqs: dict[str, _ReqState] = {}
        self._rooms: set[int] = set()  # bootstrap rooms of the requests in flight (each must be unique)
        self._stats_waiters: deque[asyncio.Future] = deque()
        self._flush_waiters: deque[asyncio.Future] = deque()
        self._snapshot_waiters: deque[asyncio.Future] = deque()
        self._switch_waiters: deque[asyncio.Future] = deque()
        # which bootstrap fields decode acts on; its instance names this process on /health
        self.bootstrap_gate = BootstrapGate(peer_auth(args.disagg_config()), args.disagg_config().bootstrap_allow)
        self.live_role = LiveRole(args.disaggregation_mode)  # POST /pd_role_switch changes it
        self.last_admit = 0.0  # time.monotonic() of the last request admitted (a role switch waits for quiet)
        self._role_gate: asyncio.Event | None = None  # cleared while the scheduler switches roles
        self._ids = itertools.count()
        self._tasks: list[asyncio.Task] = []
        self._tmpdir: str | None = None
        self._ctx: zmq.Context | None = None
        self._actx: zmq.asyncio.Context | None = None
        self._send: zmq.Socket | None = None
        self._recv: zmq.asyncio.Socket | None = None
        self._binder: FrontendSockets | None = None
        self.drops = DropCounter("frontend")  # frames from the scheduler side that were none of our messages
        self.handoff = HandoffProfile()  # where streamed tokens wait on their way out (obs/handoff.py)
        self._tokenize_pool = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="pdserve-tokenize")
        self.grammar = GrammarCheck(args.grammar_config(), tokenizer)  # json_schema / regex / ebnf: 400 if bad

    @property
    def role(self) -> str:
        """The P/D role now (``live_role``'s value)."""
        return self.live_role.value

    # Set by ``start``; the HTTP server serves only after it returned.
    @property
    def request_limits(self) -> RequestLimits:
        if self.limits is None:
            raise ServerError("server is not ready (the scheduler has not reported its limits)")
        return self.limits

    @property
    def running_scheduler(self) -> SchedulerProcess | RankProcesses:
        if self.scheduler is None:
            raise ServerError("server is not ready (no scheduler started)")
        return self.scheduler

    @property
    def _receiver(self) -> zmq.asyncio.Socket:
        if self._recv is None:
            raise ServerError("server is not ready (the scheduler's output socket is not open)")
        return self._recv

    # ------------------------------------------------------------ lifecycle
    async def start(self, timeout: float, should_stop: Callable[[], bool] = lambda: False) -> SchedulerReady:
        self._tmpdir = tempfile.mkdtemp(prefix="pdserve-")
        endpoints = SchedulerEndpoints.for_args(self.args, self._tmpdir)
        self._open_sockets(endpoints)
        self.scheduler = scheduler_processes(self.args, endpoints, self._tmpdir)
        self.scheduler.start()
        ready = await self._wait_ready(timeout, should_stop)
        self.limits = RequestLimits(ready.context_len, ready.vocab_size, ready.max_total_tokens)
        self.healthy = True
        self._tasks = [asyncio.create_task(self._dispatch_loop(), name="pdserve-dispatch"),
                       asyncio.create_task(self._watchdog(), name="pdserve-watchdog")]
        logger.info("scheduler ready (pid %d): %d pages x %d tokens, context %d",
                    ready.pid, ready.total_pages, ready.page_size, ready.context_len)
        return ready

    def _open_sockets(self, endpoints: SchedulerEndpoints) -> None:
        self._ctx, self._actx = zmq.Context(), zmq.asyncio.Context()
        self._binder = frontend_sockets(self.args)  # several nodes: the node's address, CURVE under the token
        self._send = self._binder.bind(self._ctx, zmq.PUSH, endpoints.to_scheduler)
        self._recv = self._binder.bind(self._actx, zmq.PULL, endpoints.to_frontend)

    async def _recv_message(self):
        """The next message from the scheduler side; None for a frame that is none of ours (counted)."""
        return decode_frame(await self._receiver.recv(copy=False), self.drops)

    async def _wait_ready(self, timeout: float, should_stop: Callable[[], bool]) -> SchedulerReady:
        deadline = time.monotonic() + timeout
        while True:
            if await self._receiver.poll(250):
                msg = await self._recv_message()
                if isinstance(msg, SchedulerReady):
                    return msg
                if isinstance(msg, SchedulerFailed):
                    raise StartupError(f"scheduler failed to start: {msg.message}")
                continue
            if should_stop():
                raise StartupCancelled("shutdown requested during startup")
            if not self.running_scheduler.is_alive():
                raise StartupError(f"{self.running_scheduler.describe_exit()} during startup (see its log above)")
            if time.monotonic() > deadline:
                raise StartupError(f"scheduler not ready after {timeout:.0f} s")

    async def close(self) -> None:
        """Fail what is still waiting, stop the scheduler, release sockets and the socket dir."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._fail_all(ServerError("server is shutting down"))
        self.healthy = False
        if self.scheduler is not None:
            self.scheduler.stop(send_shutdown=lambda: self._try_send(ShutdownReq()))
        for sock in (self._send, self._recv):
            if sock is not None:
                sock.close(linger=0)
        if self._binder is not None:
            self._binder.close()
        for ctx in (self._ctx, self._actx):
            if ctx is not None:
                ctx.term()
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)
        self.grammar.close()

    # ------------------------------------------------------------- requests
    def new_rid(self, rid: str | None = None) -> str:
        """A fresh rid, or ``rid`` if the calling client (``request_owner``) has none of that name in flight."""
        if rid is None:
            return f"{next(self._ids)}-{uuid.uuid4().hex[:12]}"
        if scoped_rid(rid, request_owner()) in self._reqs:
            raise RequestError(f"rid: {rid!r} is already in use", param="rid")
        return rid

    def cache_salt(self, requested: str | None) -> str:
        """A request's prefix cache tree: its ``cache_salt`` field; with ``--cache-salt-per-client`` within
        its client's (key and X-Client-Token: ``request_owner``), so clients never share a page."""
        salt = requested or ""
        if self.args.cache_salt_per_client:
            return f"{request_owner()}\0{salt}"
        return salt

    def bootstraps(self, body, n: int, samples: int = 1) -> list[BootstrapRef | None]:
        """Each prompt's disaggregation pairing from a request ``body`` (``protocol._Bootstrap``),
        checked against this server's mode: a prefill server needs it; a colocated one ignores it.
        A room pairs one prefill of its prompt, whatever its ``samples`` (``parallel_sampling``)."""
        mode = self.role
        if mode == "null":
            return [None] * n
        refs = body.bootstraps(n, self.args.disaggregation_bootstrap_port, samples)
        if mode == "decode" and refs[0] is not None:
            self._check_routed(refs, body.bootstrap_signature)
        if mode == "prefill" and refs[0] is None:
            if self.args.disaggregation_mode != "prefill":
                # switched to prefill at run time: a router whose view still has it as a decode sent this
                # (503 with X-PD-Role: the router sends it elsewhere and moves this server)
                raise RoleChanged("this server switched to prefill; send the request to a decode server")
            raise RequestError("bootstrap_room: a prefill server serves only requests routed with "
                               "bootstrap_host/bootstrap_port/bootstrap_room (put a P/D router in front)",
                               param="bootstrap_room")
        return refs

    def _check_routed(self, refs: list, signature: str | None) -> None:
        """Decode fetches from the registry a request names only when the router signed it or it is
        allowed (disagg/routed.py): 403 naming the field, 421 when signed for another instance."""
        try:
            self.bootstrap_gate.check([(r.host, r.port, r.room) for r in refs], signature)
        except Misdirected as e:
            raise RequestError(str(e), param="bootstrap_signature", status=421, code="misdirected_request") from None
        except AuthError as e:
            field = str(e).partition(":")[0]
            raise RequestError(str(e), param=field, status=403, code="bootstrap_not_allowed") from None

    def prefill_lost(self, refs: list[tuple[str, int, int]], signature: str | None, peer: str | None) -> None:
        """The router saw the prefill halves of ``refs`` break: decode prefills those rooms locally
        now (disagg/routed.py says who may say so)."""
        if self.role != "decode":
            raise RequestError(f"refs: this server is {self.role}, not decode", param="refs")
        try:
            self.bootstrap_gate.check_lost(refs, signature, peer)
        except AuthError as e:
            raise RequestError(str(e), param=str(e).partition(":")[0], status=403,
                               code="bootstrap_not_allowed") from None
        self._send_or_fail(PrefillLostReq([room for _, _, room in refs], "the router saw prefill's half break"))

    def check_input(self, input_ids: list[int], max_new_tokens: int, prompt_field: str,
                    max_tokens_field: str) -> None:
        """The scheduler's admission checks, done early with the caller's field names."""
        try:
            check_request(input_ids, max_new_tokens, self.request_limits, prompt_field, max_tokens_field)
        except ValueError as e:
            raise RequestError(str(e), param=str(e).split(":", 1)[0]) from None

    async def generate(self, input_ids: list[int], sampling: SamplingParams, return_logprob: bool = False,
                       rid: str | None = None, stream: bool = True, logprob_start_len: int = -1,
                       top_logprobs_num: int = 0, bootstrap: BootstrapRef | None = None, group: str | None = None,
                       cache_salt: str = "") -> AsyncGenerator[GenerateChunk, None]:
        """Submit one request and yield its chunks until it finishes; ``group``: the API call it is
        one sequence of (the scheduler's admission lets groups take turns).

        Raises RequestError (400) if the scheduler rejects it, ServerError (503) if the
        scheduler dies. Leaving early (client gone, task cancelled) aborts the request,
        which frees its pages in the scheduler.
        """
        await self._pass_role_gate(bootstrap)
        self._check_healthy()
        try:
            await self.grammar.check(sampling, self.role, self.request_limits.vocab_size, compile_owner())
        except RequestError as e:
            if bootstrap is not None:  # whatever router is in front, prefill's half must not wait for ours
                self._try_send(AbortReq("", refused=bootstrap, message=e.message))
            raise
        rid = self.new_rid(rid)
        key = scoped_rid(rid, request_owner())  # its name in the table and to the scheduler
        room = bootstrap.room if bootstrap is not None else None
        if room is not None and room in self._rooms:  # checked and taken with no await in between
            raise RequestError(f"bootstrap_room: {room} is already used by a request in flight (rooms must be "
                               f"unique; a P/D router draws a random one per request)", param="bootstrap_room")
        # Without streaming nothing is shown before the end, so only the finish wakes the request.
        state = _ReqState(rid, return_logprob, self.stream_interval if stream else sys.maxsize, len(input_ids))
        self._reqs[key] = state
        self.last_admit = time.monotonic()
        if room is not None:
            self._rooms.add(room)
        detok = self._detokenizer(sampling) if stream else None
        acc = _Accumulator()
        finished = False
        try:
            self._send_or_fail(TokenizedGenerateReq(key, input_ids, sampling, return_logprob, logprob_start_len,
                                                    top_logprobs_num, bootstrap, group, cache_salt))
            while not finished:
                waiting = state.event.pending()
                if waiting is not None:
                    await waiting
                woke = handoff.now()
                if state.routed_at:
                    self.handoff.add("wake", woke - state.routed_at)
                    state.routed_at = 0.0
                state.event.clear()
                if state.error is not None:
                    raise state.error
                outs, state.outputs = state.outputs, []
                if not outs:
                    continue
                chunk = self._chunk(state, outs)
                finished = chunk.finished
                if finished and _refused(chunk):  # the scheduler could not compile its grammar
                    raise RequestError.from_value_error(ValueError((chunk.finish_reason or {})["message"]))
                if finished:
                    self._record_finish(state, chunk)
                if stream:
                    chunk.text = self._stream_text(detok, chunk)
                    handed = handoff.now()
                    self.handoff.add("detokenize", handed - woke)
                    yield chunk
                    self.handoff.add("write", handoff.now() - handed)
                else:
                    acc.add(chunk)
            if not stream:
                yield acc.final(self.tokenizer, sampling)
        finally:
            self._reqs.pop(key, None)
            self._rooms.discard(room)
            if not finished and state.error is None:
                self._try_send(AbortReq(key))

    def abort(self, rid: str, owner: str, every_owner: bool = False) -> int:
        """Abort ``owner``'s request ``rid`` (``every_owner``, the admin's: anyone's of that rid); how
        many were in flight. Another client's rid is not found, as an unknown one: no oracle."""
        if every_owner:
            keys = [k for k, state in self._reqs.items() if state.rid == rid]
        else:
            keys = [k for k in (scoped_rid(rid, owner),) if k in self._reqs]
        for k in keys:
            self._try_send(AbortReq(k))
        return len(keys)

    def abort_all(self) -> None:
        self._try_send(AbortReq("", abort_all=True))

    def end_inflight(self, message: str = "server is shutting down") -> None:
        """Abort everything and end every in-flight request now, without waiting for the
        scheduler (it may be inside a long step): a stream gets a final chunk with
        finish_reason abort, a non-streaming request a ServerError (503)."""
        self.closing = True
        self.abort_all()
        for state in self._reqs.values():
            if state.last is not None and state.last.finished:
                continue  # its real end is already queued for it
            if state.streaming:
                last = state.last
                done, cached = (last.completion_tokens, last.cached_tokens) if last else (0, 0)
                state.outputs.append(TokenOutput(state.rid, [], None, True, finish_abort(message),
                                                 state.prompt_tokens, done, cached))
            else:
                state.error = ServerError(message)
            state.event.set()

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. Long texts are tokenized on a worker thread (the tokenizer
        releases the GIL), so one huge prompt never stalls the event loop; short ones inline,
        where a thread hop would cost more than the work."""
        if len(text) <= INLINE_TOKENIZE_CHARS:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return await asyncio.get_running_loop().run_in_executor(
            self._tokenize_pool, functools.partial(self.tokenizer.encode, text, add_special_tokens=add_special_tokens))

    def _detokenizer(self, sampling: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, sampling.skip_special_tokens, sampling.stop, self._decode)

    @staticmethod
    def _stream_text(detok: IncrementalDetokenizer | None, chunk: GenerateChunk) -> str:
        if detok is None:
            return ""
        return detok.add_last(chunk.token_ids, chunk.finish_reason) if chunk.finished else detok.add(chunk.token_ids)

    @staticmethod
    def _chunk(state: _ReqState, outs: list[TokenOutput]) -> GenerateChunk:
        last = outs[-1]
        stages = state.timeline.stages
        if len(outs) == 1 and not state.return_logprob:  # the common streaming case, kept cheap
            return GenerateChunk(state.rid, "", last.new_token_ids, None, last.finished, last.finish_reason,
                                 last.prompt_tokens, last.completion_tokens, last.cached_tokens, timeline=stages,
                                 cached_tokens_by_tier=last.cached_tokens_by_tier,
                                 decode_cached_tokens=last.decode_cached_tokens, spec=last.spec_meta() or None)
        ids: list[int] = []
        for o in outs:
            ids += o.new_token_ids
        chunk = GenerateChunk(state.rid, "", ids, None, last.finished, last.finish_reason, last.prompt_tokens,
                              last.completion_tokens, last.cached_tokens, timeline=stages,
                              cached_tokens_by_tier=last.cached_tokens_by_tier,
                              decode_cached_tokens=last.decode_cached_tokens, spec=last.spec_meta() or None)
        if state.return_logprob:
            _add_logprobs(chunk, outs)
        return chunk

    def _record_finish(self, state: _ReqState, chunk: GenerateChunk) -> None:
        state.timeline.on_finish()
        if self.metrics is not None:
            kind = (chunk.finish_reason or {}).get("type", "unknown")
            self.metrics.observe_finished(state.timeline, chunk.prompt_tokens, chunk.completion_tokens, kind)

    # -------------------------------------------------------------- control
    async def get_stats(self) -> dict:
        resp: StatsResp = await self._control(GetStatsReq(), self._stats_waiters)
        resp.stats["grammar_frontend"] = self.grammar.stats.to_dict()
        resp.stats["handoff"] = self.handoff.summary()
        if self.metrics is not None:
            self.metrics.set_scheduler_stats(resp.stats)
        return resp.stats

    async def flush_cache(self) -> bool:
        resp: FlushCacheResp = await self._control(FlushCacheReq(), self._flush_waiters)
        return resp.success

    async def kv_events_snapshot(self) -> dict | None:
        """Every block the KV cache holds and the event batch it is current to (None: no KV events)."""
        resp: KVEventsSnapshotResp = await self._control(KVEventsSnapshotReq(), self._snapshot_waiters)
        return resp.snapshot

    async def switch_role(self, target: str) -> RoleSwitchResp:
        """Ask the scheduler to switch to ``target`` now (it refuses while anything is in flight).
        Requests arriving meanwhile wait: sent behind the switch, the new mode would get them."""
        gate = self._role_gate = asyncio.Event()
        try:
            resp: RoleSwitchResp = await self._control(RoleSwitchReq(target), self._switch_waiters)
            if resp.success:
                self.live_role.set(resp.role)
            return resp
        finally:
            gate.set()
            self._role_gate = None

    async def _pass_role_gate(self, bootstrap: BootstrapRef | None) -> None:
        """Wait out a role switch in progress; refuse (RoleChanged) a request routed for the role
        this server no longer has: on a prefill server anything but a prefill half naming its own
        registry, on a decode server such a prefill half."""
        gate = self._role_gate
        if gate is None:
            return
        await gate.wait()
        ours = bootstrap is not None and bootstrap.port == self.args.disaggregation_bootstrap_port
        if (self.role == "prefill") != ours:
            raise RoleChanged(f"this server switched to {self.role} while the request arrived; send it to another "
                              "server")

    async def _control(self, msg, waiters: deque, timeout: float = CONTROL_TIMEOUT_S):
        """Send a control message; replies come back in order, so waiters are a FIFO."""
        self._check_healthy()
        fut = asyncio.get_running_loop().create_future()
        waiters.append(fut)
        self._send_or_fail(msg)
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise ServerError(f"scheduler did not answer {type(msg).__name__} within {timeout:.0f} s") from None

    @property
    def num_inflight(self) -> int:
        return len(self._reqs)

    # ------------------------------------------------------------- plumbing
    def _check_healthy(self) -> None:
        if not self.healthy:
            raise ServerError(self.fatal_error or "server is not ready")
        if self.closing:
            raise ServerError("server is shutting down")

    def _try_send(self, msg) -> bool:
        if self._send is None:
            return False  # not started
        try:
            send_message(self._send, msg, zmq.NOBLOCK)
            return True
        except (zmq.Again, zmq.ZMQError, AttributeError):
            return False  # no scheduler connected (gone or not started)

    def _send_or_fail(self, msg) -> None:
        if not self._try_send(msg):
            raise ServerError("scheduler is not reachable")

    async def _dispatch_loop(self) -> None:
        while True:
            try:
                msg = await self._recv_message()
            except Exception as e:  # noqa: BLE001 - without this loop no request can finish
                self._fatal(f"frontend lost the scheduler's output socket: {type(e).__name__}: {e}")
                return
            if msg is None:
                continue
            try:
                self._on_message(msg)
            except Exception:  # noqa: BLE001 - one bad message must not stop routing
                logger.exception("frontend: failed to route %s", type(msg).__name__)

    def _on_message(self, msg) -> None:
        if isinstance(msg, BatchTokenOutput):
            self._route_outputs(msg.outputs, msg.sent_at, msg.sampled_at)
        elif isinstance(msg, RejectedReq):
            self._reject(msg)
        elif isinstance(msg, StatsResp):
            _resolve(self._stats_waiters, msg)
        elif isinstance(msg, FlushCacheResp):
            _resolve(self._flush_waiters, msg)
        elif isinstance(msg, KVEventsSnapshotResp):
            _resolve(self._snapshot_waiters, msg)
        elif isinstance(msg, RoleSwitchResp):
            _resolve(self._switch_waiters, msg)
        elif isinstance(msg, SchedulerFailed):
            self._fatal(f"scheduler failed: {msg.message}")
        else:
            logger.warning("frontend: unexpected message %s", type(msg).__name__)

    def _route_outputs(self, outputs: list[TokenOutput], sent_at: float = 0.0, sampled_at: float = 0.0) -> None:
        arrived = handoff.now()
        self.handoff.socket(sent_at, arrived, sampled_at)
        now = time.perf_counter()
        for o in outputs:
            state = self._reqs.get(o.rid)
            if state is None:
                continue  # already aborted by the frontend
            state.outputs.append(o)
            state.last = o
            state.timeline.on_tokens(len(o.new_token_ids), now)
            if o.timeline is not None:
                state.timeline.set_stages(o.timeline)
            if o.finished or len(state.outputs) >= state.wake_every or o.completion_tokens == 1:
                if not state.event.is_set():
                    state.routed_at = handoff.now()
                state.event.set()
        self.handoff.add("route", handoff.now() - arrived)

    def _reject(self, msg: RejectedReq) -> None:
        state = self._reqs.get(msg.rid)
        if state is not None:
            state.error = RequestError.from_value_error(ValueError(msg.message))
            state.event.set()

    async def _watchdog(self) -> None:
        while self.healthy:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
            if not self.running_scheduler.is_alive():
                await self._scheduler_exited()

    async def _scheduler_exited(self) -> None:
        """A scheduler killed by SIGTERM/SIGINT was most likely signalled with this whole process group
        (``kill -TERM -PGID``, a service manager): this process's own handler may run a moment later,
        so it gets SIGNAL_GRACE_S to say so before the exit counts as a crash."""
        scheduler = self.running_scheduler
        code = scheduler.exitcode
        if code is not None and code in SHUTDOWN_EXIT_CODES:
            deadline = time.monotonic() + SIGNAL_GRACE_S
            while not self.signalled and time.monotonic() < deadline:
                await asyncio.sleep(WATCHDOG_INTERVAL_S / 10)
        if self.signalled:
            logger.info("%s during shutdown", scheduler.describe_exit())
            self.healthy = False
            self._fail_all(ServerError("server is shutting down"))
            return
        self._fatal(f"{scheduler.describe_exit()} unexpectedly")

    def _fatal(self, message: str) -> None:
        if self.fatal_error is not None:
            return
        logger.error("%s; the server stops", message)
        self.fatal_error = message
        self.healthy = False
        self._fail_all(ServerError(message))
        if self.on_fatal is not None:
            self.on_fatal(message)

    def _fail_all(self, err: RequestError) -> None:
        for state in self._reqs.values():
            state.error = err
            state.event.set()
        for waiters in (self._stats_waiters, self._flush_waiters, self._snapshot_waiters):
            while waiters:
                fut = waiters.popleft()
                if not fut.done():
                    fut.set_exception(err)


def _refused(chunk: GenerateChunk) -> bool:
    """An abort the scheduler marks as the client's error (a grammar that failed to compile there)
    before any token: the API answers 400 naming the field, as for a request refused at once."""
    reason = chunk.finish_reason or {}
    return reason.get("type") == "abort" and reason.get("status_code") == 400 and not chunk.completion_tokens


def _add_logprobs(chunk: GenerateChunk, outs: list[TokenOutput]) -> None:
    """Join the logprobs of ``outs`` into ``chunk`` (the prompt's arrive with one of them)."""
    chunk.logprobs = []
    for o in outs:
        chunk.logprobs += o.new_logprobs or []
        if o.new_top_logprobs is not None:
            chunk.top_logprobs = (chunk.top_logprobs or []) + o.new_top_logprobs
        if o.input_token_logprobs is not None:
            chunk.input_logprobs, chunk.input_top_logprobs = o.input_token_logprobs, o.input_top_logprobs


class _Accumulator:
    """Joins a non-streaming request's chunks into one; the text is decoded once at the end."""

    def __init__(self):
        self.chunks: list[GenerateChunk] = []

    def add(self, chunk: GenerateChunk) -> None:
        self.chunks.append(chunk)

    def final(self, tokenizer, sampling: SamplingParams) -> GenerateChunk:
        if len(self.chunks) == 1:
            c = self.chunks[0]
        else:
            c = dataclasses.replace(self.chunks[-1], token_ids=[t for x in self.chunks for t in x.token_ids])
            if c.logprobs is not None:
                _join_logprobs(c, self.chunks)
        c.text = output_text(tokenizer, c.token_ids, c.finish_reason, sampling.skip_special_tokens)
        return c


def _join_logprobs(c: GenerateChunk, chunks: list[GenerateChunk]) -> None:
    c.logprobs = [lp for x in chunks for lp in x.logprobs or []]  # set on every chunk when asked for
    if any(x.top_logprobs is not None for x in chunks):
        c.top_logprobs = [t for x in chunks for t in x.top_logprobs or []]
    first = next((x for x in chunks if x.input_logprobs is not None), None)
    if first is not None:
        c.input_logprobs, c.input_top_logprobs = first.input_logprobs, first.input_top_logprobs


def _resolve(waiters: deque, msg) -> None:
    """Replies arrive in request order: the oldest waiter gets this one (even if it gave up)."""
    if waiters:
        fut = waiters.popleft()
        if not fut.done():
            fut.set_result(msg)
