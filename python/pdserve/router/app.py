"""The router's HTTP server: FastAPI routes over a PDProxy, a health-check loop, and its life.

``launch_router(args)`` binds the port first (a busy port fails at once), waits
(bounded by ``worker_startup_timeout_secs``) until a prefill and a decode worker
pass their health checks, then serves until SIGINT/SIGTERM. Returns the exit
code: 0 after a signal, 1 when the port is busy or no workers became healthy.
"""

from __future__ import annotations

import asyncio
import logging
import random
import signal
import socket
from dataclasses import dataclass

import aiohttp
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pdserve import __version__
from pdserve.entrypoints.errors import RequestError, ServerError, error_body, error_response
from pdserve.entrypoints.listen import bind_socket, configure_logging
from pdserve.router.config import RouterArgs
from pdserve.router.metrics import RouterMetrics
from pdserve.router.policy import make_policy
from pdserve.router.proxy import PDProxy, WorkerUnreachable
from pdserve.router.workers import HealthChecker, Role, Worker, WorkerSet, make_worker_set

logger = logging.getLogger(__name__)

GENERATION_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")
MODEL_INFO_PATHS = ("/v1/models", "/model_info", "/get_model_info")
GRACEFUL_SHUTDOWN_S = 2.5  # open streams get this long after a signal, then their upstreams are closed


@dataclass
class RouterContext:
    """What the routes need; built once per router."""

    args: RouterArgs
    prefill: WorkerSet
    decode: WorkerSet
    metrics: RouterMetrics
    proxy: PDProxy
    checker: HealthChecker

    @property
    def sets(self) -> tuple[WorkerSet, WorkerSet]:
        return self.prefill, self.decode


def build_context(args: RouterArgs, rng: random.Random | None = None) -> RouterContext:
    rng = rng or random.Random()
    prefill = make_worker_set(Role.PREFILL, [p.url for p in args.prefill], make_policy(args.prefill_policy_name, rng),
                              [p.bootstrap_port for p in args.prefill])
    decode = make_worker_set(Role.DECODE, args.decode, make_policy(args.decode_policy_name, rng))
    metrics = RouterMetrics()
    proxy = PDProxy(prefill, decode, metrics, rng, args.request_timeout_secs, args.health_check_timeout_secs)
    checker = HealthChecker([prefill, decode], proxy.probe, args.health_check_interval_secs)
    return RouterContext(args, prefill, decode, metrics, proxy, checker)


# ------------------------------------------------------------------ app
def create_app(ctx: RouterContext) -> FastAPI:
    app = FastAPI(title="pdserve router", version=__version__, docs_url=None, redoc_url=None)
    app.add_exception_handler(RequestError, _request_error)
    app.add_exception_handler(Exception, _internal_error)
    _add_generation_routes(app, ctx)
    _add_info_routes(app, ctx)
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
        for s in ctx.sets:
            if not s.healthy:
                raise ServerError(f"no healthy {s.role.value} worker")
        return Response(status_code=200)

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

    @app.post("/flush_cache")
    async def flush_cache():
        return await _flush_cache(ctx)

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
    out = {"version": __version__, "policy": {"prefill": ctx.args.prefill_policy_name,
                                              "decode": ctx.args.decode_policy_name},
           "prefill": [], "decode": [], "internal_states": []}
    for w, info in zip(workers, infos):
        out[w.role.value].append({**w.info(), "server_info": info})
        if w.role is Role.DECODE and isinstance(info, dict):
            out["internal_states"].extend(info.get("internal_states", []))
    return out


async def _worker_server_info(ctx: RouterContext, worker: Worker) -> dict | None:
    try:
        reply = await ctx.proxy.call(worker, "GET", "/get_server_info", timeout=ctx.proxy.health_timeout)
    except (WorkerUnreachable, aiohttp.ClientError, asyncio.TimeoutError):
        return None
    return reply.json() if reply.status == 200 else None


async def _flush_cache(ctx: RouterContext) -> JSONResponse:
    """``POST /flush_cache`` on every worker; 200 only if every one flushed, else the first failure's status."""
    workers = [w for s in ctx.sets for w in s.workers]
    results = await asyncio.gather(*(_flush_one(ctx, w) for w in workers))
    failed = [r for r in results if r["status"] != 200]
    if not failed:
        return JSONResponse({"success": True, "message": f"Cache flushed on {len(results)} workers.",
                             "workers": results})
    status = failed[0]["status"]
    message = "flush_cache: failed on " + "; ".join(f"{r['role']} {r['url']} ({r['status']}: {r['message']})"
                                                    for r in failed)
    return JSONResponse({**error_body(message, status), "success": False, "workers": results}, status_code=status)


async def _flush_one(ctx: RouterContext, worker: Worker) -> dict:
    out = {"url": worker.url, "role": worker.role.value}
    try:
        reply = await ctx.proxy.call(worker, "POST", "/flush_cache", timeout=ctx.proxy.health_timeout)
    except (WorkerUnreachable, aiohttp.ClientError, asyncio.TimeoutError) as e:
        return {**out, "status": 503, "message": f"unreachable: {type(e).__name__}"}
    body = reply.json()
    if isinstance(body, dict):
        body = body.get("message") or body.get("error", {}).get("message")
    return {**out, "status": reply.status, "message": body}


async def _request_error(_request: Request, exc: RequestError) -> JSONResponse:
    return error_response(exc)


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s", request.url.path, exc_info=exc)
    return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", 500), status_code=500)


# --------------------------------------------------------------- launch
def launch_router(args: RouterArgs) -> int:
    """Run a router until a signal (-> 0) or a failure to start (-> 1)."""
    configure_logging(args.log_level, "router")
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        logger.error("port: cannot bind %s:%d (%s)", args.host, args.port, e.strerror or e)
        return 1
    return asyncio.run(_serve(build_context(args), sock))


async def _serve(ctx: RouterContext, sock: socket.socket) -> int:
    signals = _Signals(asyncio.get_running_loop())
    await ctx.proxy.start()
    health_loop = None
    try:
        if not await _wait_for_workers(ctx, signals):
            return 0 if signals.caught else 1
        health_loop = asyncio.ensure_future(ctx.checker.run())
        config = uvicorn.Config(create_app(ctx), log_level=ctx.args.log_level, access_log=False, lifespan="off",
                                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
        server = uvicorn.Server(config)
        signals.server = server
        logger.info("pdserve router on http://%s:%d: prefill %s, decode %s", ctx.args.host, ctx.args.port,
                    [w.url for w in ctx.prefill.workers], [w.url for w in ctx.decode.workers])
        await server.serve(sockets=[sock])
        return 0
    finally:
        if health_loop is not None:
            health_loop.cancel()
            await asyncio.gather(health_loop, return_exceptions=True)
        await ctx.proxy.close()
        sock.close()


async def _wait_for_workers(ctx: RouterContext, signals: _Signals) -> bool:
    """True once a prefill and a decode worker are healthy; False on a signal or after the startup timeout."""
    args = ctx.args
    logger.info("waiting up to %g s for a healthy prefill and decode worker", args.worker_startup_timeout_secs)
    wait = asyncio.ensure_future(ctx.checker.wait_ready(args.worker_startup_timeout_secs,
                                                        args.worker_startup_check_interval))
    stop = asyncio.ensure_future(signals.stopped.wait())
    await asyncio.wait({wait, stop}, return_when=asyncio.FIRST_COMPLETED)
    for task in (wait, stop):
        task.cancel()
    await asyncio.gather(wait, stop, return_exceptions=True)
    if signals.caught:
        logger.info("stopped while waiting for workers")
        return False
    if isinstance(wait.exception(), TimeoutError):
        logger.error("worker startup: %s", wait.exception())
        return False
    wait.result()  # re-raises anything unexpected
    return True


class _Signals:
    """SIGINT/SIGTERM: end the startup wait, or tell uvicorn to stop. While uvicorn serves it
    handles the signals itself and re-raises them afterwards; this handler absorbs them."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.caught = False
        self.stopped = asyncio.Event()
        self.server: uvicorn.Server | None = None
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, _sig, _frame) -> None:
        self.caught = True
        if self.server is not None:
            self.server.should_exit = True
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.stopped.set)
