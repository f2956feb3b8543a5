"""The router's HTTP server: FastAPI routes over a PDProxy, a health-check loop, and its life.

``launch_router(args)`` binds the port first (a busy port fails at once), probes every
worker once (bounded by the health-check timeout), then listens and serves until
SIGINT/SIGTERM, whatever the workers' state: workers that are not up yet are named in
the log and in ``/health`` and probed until they are (see ``state``). Returns the exit
code: 0 after a signal, 1 when the port is busy or a discovery source cannot start.
"""

from __future__ import annotations

import asyncio
import logging
import random
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import aiohttp
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pdserve import __version__
from pdserve.disagg.auth import PeerAuth
from pdserve.router.admission import Admission, AdmissionMiddleware
from pdserve.router.breaker import Backoff, BreakerConfig, BreakerState, CircuitBreaker
from pdserve.router.cache_view import CacheView, PrefixView
from pdserve.router.config import NO_LIMIT, RouterArgs
from pdserve.router.discovery import DiscoveryError, Reconciler, WorkerSource, make_sources
from pdserve.router.kv_events import KVEventSubscriber
from pdserve.router.metrics import RouterMetrics
from pdserve.router.policy import Policy, make_policy
from pdserve.router.proxy import PDProxy, WorkerUnreachable, parse_json_object
from pdserve.router.state import RouterState
from pdserve.router.workers import Fleet, HealthChecker, Role, Worker, WorkerSet, make_worker_set
from pdserve.web.api_key import (
    WORKER_HEADER,
    admin_refusal,
    holds_admin_key,
    may_administer,
    warn_if_unauthenticated,
    worker_credential,
)
from pdserve.web.app import add_error_handlers, guard_routes
from pdserve.web.errors import ServerError, error_body, read_body
from pdserve.web.listen import bind_socket, configure_logging, run_event_loop
from pdserve.web.origin import OriginPolicy

logger = logging.getLogger(__name__)

GENERATION_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")
MODEL_INFO_PATHS = ("/v1/models", "/model_info", "/get_model_info")
GRACEFUL_SHUTDOWN_S = 2.5  # open streams get this long after a signal, then their upstreams are closed
REMOVED_SWEEPS = 3  # health rounds after a worker's removal in which a late KV follower of it is stopped


@dataclass
class RouterContext:
    """What the routes need; built once per router."""

    args: RouterArgs
    prefill: WorkerSet
    decode: WorkerSet
    metrics: RouterMetrics
    proxy: PDProxy
    checker: HealthChecker
    state: RouterState
    cache: CacheView
    # a fleet (_arm_fleet): workers discovery adds and removes, the concurrency cap
    fleet: Fleet
    admission: Admission
    sources: list[WorkerSource] = field(default_factory=list)
    removed: list[_Removed] = field(default_factory=list)  # removed lately: a late KV follower is stopped
    # the /health_generate fan-out in flight: callers meanwhile share it (one token per worker at a time)
    health_generate_round: asyncio.Future | None = None

    @property
    def sets(self) -> tuple[WorkerSet, WorkerSet]:
        return self.prefill, self.decode


def build_context(args: RouterArgs, rng: random.Random | None = None) -> RouterContext:
    rng = rng or random.Random()
    prefill = make_worker_set(Role.PREFILL, [p.url for p in args.prefill], _policy(args, args.prefill_policy_name, rng),
                              [p.bootstrap_port for p in args.prefill], args.prefill_policy_name)
    decode = make_worker_set(Role.DECODE, args.decode, _policy(args, args.decode_policy_name, rng),
                             policy_name=args.decode_policy_name)
    metrics = RouterMetrics()
    state = RouterState(prefill, decode, args.worker_startup_timeout_secs)
    proxy = PDProxy(prefill, decode, metrics, rng, args.request_timeout_secs, args.health_check_timeout_secs,
                    args.worker_key, state, _backoff(args), args.health_check_endpoint, args.max_request_bytes,
                    PeerAuth(args.disaggregation_auth_token))
    checker = HealthChecker([prefill, decode], proxy.probe, args.health_check_interval_secs,
                            args.health_failure_threshold, args.health_success_threshold)
    proxy.refresh_roles = checker.check_all
    checker.on_move.append(metrics.moved)
    checker.after_check.append(state.update)
    checker.next_interval = lambda: _check_interval(args, state)
    hash_key = args.hash_key()
    cache = CacheView(prefill, decode, proxy.call, proxy.worker_headers, args.tokenizer_path,
                      args.kv_events_timeout_secs, args.health_check_timeout_secs,
                      args.prefill_policy_name == "cache_aware", args.decode_policy_name == "cache_aware",
                      args.approximate_index, hash_key=hash_key,
                      snapshot_headers=_worker_headers(args, proxy, hash_key))
    proxy.cache = cache
    checker.after_check.append(cache.schedule_refresh)
    ctx = RouterContext(args, prefill, decode, metrics, proxy, checker, state, cache, Fleet(prefill, decode),
                        _admission(args, metrics))
    _arm_fleet(ctx)
    return ctx


def _policy(args: RouterArgs, name: str, rng: random.Random) -> Policy:
    return make_policy(name, rng, args.balance_abs_threshold, args.balance_rel_threshold, args.cache_threshold)


# ---------------------------------------------------------------- fleet
def _backoff(args: RouterArgs) -> Backoff:
    return Backoff(0 if args.disable_retries else args.retry_max_retries, args.retry_initial_backoff_ms / 1000,
                   args.retry_max_backoff_ms / 1000, args.retry_backoff_multiplier, args.retry_jitter_factor)


def _admission(args: RouterArgs, metrics: RouterMetrics) -> Admission:
    limit = None if args.max_concurrent_requests == NO_LIMIT else args.max_concurrent_requests
    admission = Admission(limit, args.queue_size, args.queue_timeout_secs,
                          on_refuse=lambda reason: metrics.rejected.labels(reason).inc())

    def gauges() -> None:
        metrics.admitted.set(admission.active)
        metrics.queued.set(admission.queued)

    metrics.on_render.append(gauges)
    return admission


def _arm_fleet(ctx: RouterContext) -> None:
    """Breakers on every worker (on those discovery adds too), discovery's sources, and what a
    removed worker leaves behind let go (its KV follower, its gauges)."""
    for w in ctx.prefill.workers + ctx.decode.workers:
        _arm_breaker(ctx, w)
    ctx.fleet.on_add.append(lambda w: _arm_breaker(ctx, w))
    ctx.fleet.on_remove.append(lambda w: _forget(ctx, w))
    ctx.checker.after_check.append(lambda: _sweep_removed(ctx))
    ctx.sources = make_sources(ctx.args)


def _arm_breaker(ctx: RouterContext, worker: Worker) -> None:
    if ctx.args.disable_circuit_breaker:
        return
    config = BreakerConfig(ctx.args.cb_failure_threshold, ctx.args.cb_success_threshold,
                           ctx.args.cb_timeout_duration_secs)

    def moved(old: BreakerState, new: BreakerState, why: str) -> None:
        ctx.metrics.breaker_moved(worker, new)
        log = logger.warning if new is BreakerState.OPEN else logger.info
        log("%s worker %s: circuit breaker %s -> %s (%s)", worker.role.value, worker.url, old.value, new.value, why)

    worker.breaker = CircuitBreaker(config, moved)


@dataclass
class _Removed:
    worker: Worker
    rounds: int = REMOVED_SWEEPS


def _forget(ctx: RouterContext, worker: Worker) -> None:
    ctx.metrics.forget(worker)
    _stop_follower(ctx, worker)
    ctx.removed.append(_Removed(worker))
    ctx.state.update()


def _stop_follower(ctx: RouterContext, worker: Worker) -> None:
    kv, worker.kv = worker.kv, None
    if isinstance(kv, PrefixView):
        kv.unfollow()
    elif isinstance(kv, KVEventSubscriber):
        kv.stop()
    if all(w.url != worker.url for w in ctx.prefill.workers):  # not re-added meanwhile
        ctx.cache.drop(worker.url)


def _sweep_removed(ctx: RouterContext) -> None:
    """A cache refresh that was reading a worker's info as discovery removed it may still start
    following its KV events: that follower is stopped in the next rounds."""
    for entry in ctx.removed:
        _stop_follower(ctx, entry.worker)
        entry.rounds -= 1
    ctx.removed = [e for e in ctx.removed if e.rounds > 0]


async def _start_sources(ctx: RouterContext) -> None:
    """Raises DiscoveryError when a source cannot start."""
    for source in ctx.sources:
        def counted(event: str, name: str = source.name) -> None:
            ctx.metrics.discovered.labels(name, event).inc()

        await source.start(Reconciler(ctx.fleet, source.name, counted))


def _check_interval(args: RouterArgs, state: RouterState) -> float:
    """Workers not yet seen healthy are probed at the start-up interval (if shorter), so the router
    notices them as soon as they are up."""
    if state.waiting_for:
        return min(args.worker_startup_check_interval, args.health_check_interval_secs)
    return args.health_check_interval_secs


# ------------------------------------------------------------------ app
def create_app(ctx: RouterContext) -> FastAPI:
    app = FastAPI(title="pdserve router", version=__version__, docs_url=None, redoc_url=None)
    add_error_handlers(app)
    _add_generation_routes(app, ctx)
    _add_info_routes(app, ctx)
    _add_control_routes(app, ctx)
    # inside the key check (added after it, so it runs after it): a refused key takes no slot
    app.add_middleware(AdmissionMiddleware, admission=ctx.admission, paths=GENERATION_PATHS)
    guard_routes(app, ctx.args.api_key, ctx.args.admin_api_key,
                 OriginPolicy(ctx.args.host, ctx.args.allowed_hosts, ctx.args.allowed_origins))
    return app


def _add_generation_routes(app: FastAPI, ctx: RouterContext) -> None:
    def route(path: str):
        async def generate(request: Request):
            return await ctx.proxy.generate(request, path)

        return generate

    for path in GENERATION_PATHS:
        app.post(path)(route(path))


def _add_info_routes(app: FastAPI, ctx: RouterContext) -> None:
    @app.get("/health")
    async def health():
        status, body = ctx.state.health()
        return JSONResponse(body, status_code=status)

    @app.get("/health_generate")
    async def health_generate():
        return await _health_generate(ctx)

    def model_info_route(path: str):
        async def model_info():
            return await _from_a_decode_worker(ctx, path)

        return model_info

    for path in MODEL_INFO_PATHS:
        app.get(path)(model_info_route(path))

    async def server_info():
        return await _server_info(ctx)

    for path in ("/get_server_info", "/server_info"):
        app.get(path)(server_info)

    @app.get("/metrics")
    async def metrics():
        return Response(ctx.metrics.render(ctx.sets), media_type=ctx.metrics.content_type)


async def _from_a_decode_worker(ctx: RouterContext, path: str) -> Response:
    """``GET path`` answered by the first healthy decode worker that answers."""
    for worker in ctx.decode.healthy:
        try:
            return (await ctx.proxy.call(worker, "GET", path)).response()
        except (WorkerUnreachable, aiohttp.ClientError, asyncio.TimeoutError) as e:
            logger.warning("decode worker %s: GET %s failed: %s", worker.url, path, e)
    raise ServerError(f"no healthy decode worker answered GET {path}")


async def _server_info(ctx: RouterContext) -> dict:
    """The router's view of every worker, each with its own server info (None when it did not answer).
    ``internal_states`` concatenates the decode workers' (as sglang's bench tools expect)."""
    workers = [w for s in ctx.sets for w in s.workers]
    infos = await asyncio.gather(*(_worker_server_info(ctx, w) for w in workers))
    out: dict[str, Any] = {"version": __version__, "policy": {"prefill": ctx.args.prefill_policy_name,
                                                              "decode": ctx.args.decode_policy_name},
                           "prefill": [], "decode": [], "internal_states": []}
    out["cache_view"] = ctx.cache.summary()
    for w, info in zip(workers, infos):
        out[w.role.value].append({**w.info(), **ctx.cache.status(w), "load": w.load, "server_info": info})
        if w.role is Role.DECODE and isinstance(info, dict):
            out["internal_states"].extend(info.get("internal_states", []))
    return out


async def _worker_server_info(ctx: RouterContext, worker: Worker) -> dict | None:
    try:
        reply = await ctx.proxy.call(worker, "GET", "/get_server_info", timeout=ctx.proxy.health_timeout)
    except (WorkerUnreachable, aiohttp.ClientError, asyncio.TimeoutError):
        return None
    return reply.json() if reply.status == 200 else None


def _add_control_routes(app: FastAPI, ctx: RouterContext) -> None:
    @app.post("/flush_cache")
    async def flush_cache():
        reply = await _broadcast(ctx, "/flush_cache", None, "Cache flushed", _admin_headers(ctx))
        if reply.status_code == 200:
            ctx.cache.forget()  # the router's guesses of the caches flushed with them
        return reply

    @app.post("/abort_request")
    async def abort_request(request: Request):
        # the rid reached both halves of a request in its body, so every worker may hold it
        body = parse_json_object(await read_body(request, ctx.args.max_request_bytes))
        if body.get("abort_all") and not may_administer(request.scope):
            raise admin_refusal("abort_all")
        # a client's own abort goes with its token and the worker key, so the workers check that it
        # started the rid; the admin's goes with the admin key
        admin = holds_admin_key(request.scope) or body.get("abort_all")
        headers = _admin_headers(ctx) if admin else ctx.proxy.upstream_headers(request)
        return await _broadcast(ctx, "/abort_request", body, "Abort sent", headers)


def _admin_headers(ctx: RouterContext) -> dict:
    """What the router sends the workers for an admin call: its admin key, else the worker key."""
    return _admin_headers_of(ctx.args, ctx.proxy)


def _worker_headers(args: RouterArgs, proxy: PDProxy, hash_key: bytes) -> dict:
    """What the router sends for a worker-only route (/kv_events/snapshot): its admin key and the
    credential of the deployment's hash key (web/api_key.py, ``Access.WORKER``)."""
    credential = worker_credential(hash_key)
    return {**_admin_headers_of(args, proxy), **({WORKER_HEADER: credential} if credential else {})}


def _admin_headers_of(args: RouterArgs, proxy: PDProxy) -> dict:
    if args.admin_api_key:
        return {"Authorization": f"Bearer {args.admin_api_key}"}
    return dict(proxy.worker_headers)


async def _broadcast(ctx: RouterContext, path: str, body: dict | None, done: str, headers: dict) -> JSONResponse:
    """``POST path`` on every worker; 200 only if every one answered 200, else the first failure's status."""
    workers = [w for s in ctx.sets for w in s.workers]
    results = await asyncio.gather(*(_post_one(ctx, w, path, body, headers) for w in workers))
    failed = [r for r in results if r["status"] != 200]
    if not failed:
        return JSONResponse({"success": True, "message": f"{done} on {len(results)} workers.", "workers": results})
    status = failed[0]["status"]
    message = f"{path.lstrip('/')}: failed on " + "; ".join(
        f"{r['role']} {r['url']} ({r['status']}: {r['message']})" for r in failed)
    return JSONResponse({**error_body(message, status), "success": False, "workers": results}, status_code=status)


async def _post_one(ctx: RouterContext, worker: Worker, path: str, body: dict | None, headers: dict) -> dict:
    out = {"url": worker.url, "role": worker.role.value}
    try:
        reply = await ctx.proxy.call(worker, "POST", path, timeout=ctx.proxy.health_timeout, json_body=body,
                                     headers=headers)
    except (WorkerUnreachable, aiohttp.ClientError, asyncio.TimeoutError) as e:
        return {**out, "status": 503, "message": f"unreachable: {type(e).__name__}"}
    answer = reply.json()
    if isinstance(answer, dict):
        answer = answer.get("message") or (answer.get("error") or {}).get("message")
    return {**out, "status": reply.status, "message": answer}


async def _health_generate(ctx: RouterContext) -> JSONResponse:
    """Every healthy worker's ``GET /health_generate`` (one token each); 200 when a decode worker
    generated (the router can serve, disaggregated or degraded), else 503. Each result is listed.

    It bypasses admission (a health check must answer when the queue is full), so it is bounded
    here instead: one fan-out at a time, and a caller arriving meanwhile gets that round's answer,
    however many call."""
    if ctx.health_generate_round is None:
        ctx.health_generate_round = asyncio.ensure_future(_health_generate_round(ctx))
        ctx.health_generate_round.add_done_callback(lambda _: setattr(ctx, "health_generate_round", None))
    body, status = await asyncio.shield(ctx.health_generate_round)
    return JSONResponse(body, status_code=status)


async def _health_generate_round(ctx: RouterContext) -> tuple[dict, int]:
    workers = [w for s in ctx.sets for w in s.healthy]
    results = await asyncio.gather(*(_get_one(ctx, w, "/health_generate") for w in workers))
    serving = any(r["status"] == 200 and r["role"] == Role.DECODE.value for r in results)
    body = {"status": ctx.state.health()[1]["status"] if serving else "down", "workers": results}
    if not serving:
        body.update(error_body("health_generate: no decode worker generated a token", 503))
    return body, 200 if serving else 503


async def _get_one(ctx: RouterContext, worker: Worker, path: str) -> dict:
    out = {"url": worker.url, "role": worker.role.value}
    try:
        reply = await ctx.proxy.call(worker, "GET", path, timeout=ctx.proxy.request_timeout)
    except (WorkerUnreachable, aiohttp.ClientError, asyncio.TimeoutError) as e:
        return {**out, "status": 503, "message": f"unreachable: {type(e).__name__}"}
    return {**out, "status": reply.status}


# --------------------------------------------------------------- launch
def launch_router(args: RouterArgs) -> int:
    """Run a router until a signal (-> 0) or a failure to start (-> 1)."""
    configure_logging(args.log_level, "router")
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        logger.error("port: cannot bind %s:%d (%s)", args.host, args.port, e.strerror or e)
        return 1
    warn_if_unauthenticated(args.host, args.api_key, args.admin_api_key, "the router")
    return run_event_loop(_serve(build_context(args), sock))


async def _serve(ctx: RouterContext, sock: socket.socket) -> int:
    signals = _Signals(asyncio.get_running_loop())
    await ctx.proxy.start()
    health_loop = None
    try:
        try:
            await _start_sources(ctx)
        except DiscoveryError as e:
            logger.error("%s", e)
            return 1
        # one round before listening (bounded by the probe timeout), so the first requests
        # meet known workers; from then on, serve whatever the workers' state
        await ctx.checker.check_all()
        if signals.caught:
            return 0
        health_loop = asyncio.ensure_future(ctx.checker.run())
        config = uvicorn.Config(create_app(ctx), log_level=ctx.args.log_level, access_log=False, lifespan="off",
                                # typed int; uvicorn hands it to asyncio.wait_for, so a float works
                                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)  # type: ignore[arg-type]
        server = _Server(config, on_exit=lambda: _stopping(ctx, health_loop))
        signals.attach(server)
        logger.info("pdserve router on http://%s:%d (%s): prefill %s, decode %s", ctx.args.host, ctx.args.port,
                    ctx.state.mode.value if ctx.state.mode else "not checked yet",
                    [w.url for w in ctx.prefill.workers], [w.url for w in ctx.decode.workers])
        await server.serve(sockets=[sock])
        return 0
    finally:
        if health_loop is not None:
            health_loop.cancel()
            await asyncio.gather(health_loop, return_exceptions=True)
        for source in ctx.sources:
            await source.stop()
        ctx.cache.close()
        await ctx.proxy.close()
        sock.close()


def _stopping(ctx: RouterContext, health_loop: asyncio.Future | None) -> None:
    """A signal arrived: the workers are likely stopping too (``pdserve up``, a rollout), so no more
    health rounds, and the state's transitions are no outage."""
    ctx.state.stopping = True
    if health_loop is not None:
        health_loop.cancel()


class _Server(uvicorn.Server):
    """uvicorn's server, telling the router as soon as a signal asks it to stop (uvicorn handles
    the signals itself while it serves)."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]):
        super().__init__(config)
        self.on_exit = on_exit
        self.loop = asyncio.get_running_loop()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        self.loop.call_soon_threadsafe(self.on_exit)  # a signal handler: touch the loop only this way


class _Signals:
    """SIGINT/SIGTERM: note it before serving, or tell uvicorn to stop. While uvicorn serves it
    handles the signals itself and re-raises them afterwards; this handler absorbs them."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.caught = False
        self.stopped = asyncio.Event()
        self.server: uvicorn.Server | None = None
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def attach(self, server: uvicorn.Server) -> None:
        """From now on a signal stops ``server``; one caught before stops it as soon as it starts."""
        self.server = server
        server.should_exit = self.caught

    def _handle(self, _sig, _frame) -> None:
        self.caught = True
        if self.server is not None:
            self.server.should_exit = True
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.stopped.set)
