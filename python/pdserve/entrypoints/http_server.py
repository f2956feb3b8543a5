"""The HTTP server: FastAPI routes over a TokenizerManager, run by a programmatic uvicorn.

``launch_server(args)`` is the whole server's life: bind the port (so a busy
port fails before the model loads), spawn the scheduler and wait until it is
ready, listen, serve, and on SIGINT/SIGTERM or a scheduler crash stop the
scheduler, release the port and the socket directory. Returns the exit code:
0 after a signal, 1 after a startup failure or a scheduler crash.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import socket
import sys
from dataclasses import dataclass
from typing import Any

import orjson
import uvicorn
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from pdserve import __version__
from pdserve.config import ModelFiles, ServerArgs
from pdserve.engine.request import SamplingParams
from pdserve.engine.tokenizer import load_tokenizer
from pdserve.entrypoints import native_api, openai_api
from pdserve.entrypoints.protocol import (
    OPENAPI_BODIES,
    OPENAPI_EXTRA_MODELS,
    AbortRequest,
    PrefillLostRequest,
    RoleSwitchRequest,
)
from pdserve.entrypoints.role_switch import RoleSwitcher
from pdserve.entrypoints.tokenizer_manager import StartupCancelled, StartupError, TokenizerManager
from pdserve.obs.metrics import ServerMetrics
from pdserve.web.api_key import (
    admin_refusal,
    holds_admin_key,
    may_administer,
    owner_of_scope,
    warn_if_unauthenticated,
    worker_credential,
)
from pdserve.web.app import add_error_handlers, guard_routes
from pdserve.web.errors import (
    ErrorResponse,
    RequestError,
    RoleChanged,
    ServerError,
    error_body,
    parse_body,
    read_body,
)
from pdserve.web.headers import BOOTSTRAP_PORT_HEADER, INSTANCE_HEADER, ROLE_HEADER
from pdserve.web.listen import bind_socket, configure_logging, run_event_loop
from pdserve.web.origin import OriginPolicy
from pdserve.web.streaming import collect

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0
# Shutdown budget (< 10 s in all): after SIGINT/SIGTERM in-flight requests run DRAIN_S more, then the
# frontend ends them itself (streams with finish_reason abort, others with a 503), without waiting for
# a scheduler that may be inside a long step; uvicorn would cancel what is still open after
# GRACEFUL_SHUTDOWN_S (a 500); the scheduler gets SchedulerProcess.stop's budget (about 3 s) on top.
DRAIN_S = 1.0
GRACEFUL_SHUTDOWN_S = 2.5
HEALTH_GENERATE_TIMEOUT_S = 20.0
HEALTH_STATS_TIMEOUT_S = 1.0
FALLBACK_ALARM_RATE = 0.5  # decode /health reports "degraded" above this recent fallback rate
FALLBACK_ALARM_MIN = 4  # ... once at least this many disaggregated requests were seen


@dataclass
class ServerContext:
    """What the routes need; built once per server."""

    args: ServerArgs
    model: ModelFiles  # config.json as json (no transformers config: the frontend imports no torch)
    tm: TokenizerManager
    metrics: ServerMetrics
    roles: RoleSwitcher | None = None  # P/D servers: POST /pd_role_switch

    @property
    def model_name(self) -> str:
        return self.args.served_model_name or self.args.model_path


# ------------------------------------------------------------------ app
def create_app(ctx: ServerContext) -> FastAPI:
    app = FastAPI(title="pdserve", version=__version__, redoc_url=None)
    add_error_handlers(app, timeout_message="timed out waiting for the scheduler")
    app.add_exception_handler(RoleChanged, lambda _r, e: _role_changed(ctx, e))
    _add_generation_routes(app, ctx)
    _add_info_routes(app, ctx)
    _add_control_routes(app, ctx)
    guard_routes(app, ctx.args.api_key, ctx.args.admin_api_key,
                 OriginPolicy(ctx.args.host, ctx.args.allowed_hosts, ctx.args.allowed_origins),
                 worker_credential(ctx.args.cache_config().hash_key))
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]  # FastAPI's documented way to customise the schema
    return app


# ------------------------------------------------------------- OpenAPI
# The routes parse their bodies themselves (errors.read_body, errors.parse_body); these declare
# the same models in the schema without letting FastAPI validate (its 422 is not OpenAI's shape).
_ERRORS = {400: "a field is wrong (the message names it)", 401: "missing or wrong API key (--api-key)",
           403: "needs the admin key (--admin-api-key), or the rid is another client's",
           413: "body larger than --max-request-bytes", 503: "the scheduler is gone, busy or stopping"}
_EMPTY_200: dict[int | str, dict[str, Any]] = {200: {"description": "OK (no body)", "content": {}}}


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": ErrorResponse, "description": _ERRORS[status]} for status in statuses}


def _documented(path: str, streams: bool = False, also: tuple[int, ...] = ()) -> dict:
    """``app.post`` keyword arguments declaring ``path``'s request body and its responses."""
    model = OPENAPI_BODIES[path]
    body = {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    responses = _errors(400, 401, 413, 503, *also)
    if streams:
        event = {"type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}
        responses[200] = {"content": {"text/event-stream": {"schema": event}},
                          "description": "a JSON body, or with stream: true server-sent events ending in [DONE]"}
    return {"openapi_extra": {"requestBody": body}, "responses": responses}


def _openapi(app: FastAPI) -> dict:
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        models: list[type[BaseModel]] = [*OPENAPI_BODIES.values(), *OPENAPI_EXTRA_MODELS]
        _, defs = models_json_schema([(m, "validation") for m in models],
                                     ref_template="#/components/schemas/{model}")
        schema.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
        app.openapi_schema = schema
    return app.openapi_schema


def _add_generation_routes(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/generate", **_documented("/generate", streams=True))
    async def generate(request: Request):
        return await native_api.generate(ctx.tm, request)

    @app.post("/v1/completions", **_documented("/v1/completions", streams=True))
    async def completions(request: Request):
        return await openai_api.completions(ctx.tm, request, ctx.model_name)

    @app.post("/v1/chat/completions", **_documented("/v1/chat/completions", streams=True))
    async def chat_completions(request: Request):
        return await openai_api.chat_completions(ctx.tm, request, ctx.model_name)


def _add_info_routes(app: FastAPI, ctx: ServerContext) -> None:
    # A decode server whose transfers mostly fall back answers 200 with a JSON body; the schema
    # describes the colocated answer (an operator reads the body, a fuzzer should not expect one).
    @app.get("/health", response_class=Response, responses={**_EMPTY_200, **_errors(503)})
    async def health():
        if not (ctx.tm.healthy and ctx.tm.running_scheduler.is_alive()):
            raise ServerError(ctx.tm.fatal_error or "scheduler is not running")
        headers = _role_headers(ctx)
        if ctx.roles is not None and ctx.roles.draining is not None:
            return JSONResponse(error_body(f"draining: switching from {ctx.tm.role} to {ctx.roles.draining}", 503),
                                status_code=503, headers=headers)
        if ctx.tm.role == "decode":
            detail = await _transfer_health(ctx.tm)
            if detail is not None:
                return JSONResponse(detail, headers=headers)
        return Response(status_code=200, headers=headers)

    @app.get("/health_generate", response_class=Response, responses={**_EMPTY_200, **_errors(503)})
    async def health_generate():
        await asyncio.wait_for(_one_token(ctx.tm), HEALTH_GENERATE_TIMEOUT_S)
        return Response(status_code=200)

    @app.get("/v1/models", responses=_errors(401))
    async def models():
        return openai_api.list_models(ctx.model_name, ctx.args.model_path, ctx.tm.request_limits.context_len)

    async def server_info():
        return await _server_info(ctx)

    async def model_info():
        return _model_info(ctx)

    for path in ("/get_server_info", "/server_info"):
        app.get(path, responses=_errors(401, 503))(server_info)
    for path in ("/model_info", "/get_model_info"):
        app.get(path, responses=_errors(401))(model_info)

    @app.get("/kv_events/snapshot", responses=_errors(400, 401, 503))
    async def kv_events_snapshot():
        snapshot = await ctx.tm.kv_events_snapshot()
        if snapshot is None:
            raise RequestError("kv_events: this server publishes no KV events (start it with --kv-events-config)")
        return Response(orjson.dumps(snapshot), media_type="application/json")

    @app.get("/metrics", response_class=Response, responses={200: {
        "description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics():
        try:
            await ctx.tm.get_stats()  # refreshes the scheduler gauges
        except RequestError:
            pass  # still serve the frontend's counters
        return Response(ctx.metrics.render(), media_type=ctx.metrics.content_type)


def _role_headers(ctx: ServerContext) -> dict[str, str]:
    """What a router's health check learns about the role (it moves a switched server between its
    prefill and decode workers) and where the registry of a prefill server listens."""
    if ctx.tm.role == "null":
        return {}
    return {ROLE_HEADER: ctx.tm.role, BOOTSTRAP_PORT_HEADER: str(ctx.args.disaggregation_bootstrap_port),
            INSTANCE_HEADER: ctx.tm.bootstrap_gate.instance}


def _add_control_routes(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/pd_role_switch", include_in_schema=False)
    async def pd_role_switch(request: Request):
        req: RoleSwitchRequest = parse_body(RoleSwitchRequest, await read_body(request, ctx.args.max_request_bytes))
        if ctx.roles is None:
            raise RequestError("target_role: this server is not in P/D mode", param="target_role")
        return await ctx.roles.switch(req)

    @app.post("/disaggregation/prefill_lost", include_in_schema=False)
    async def prefill_lost(request: Request):
        req: PrefillLostRequest = parse_body(PrefillLostRequest, await read_body(request, ctx.args.max_request_bytes))
        ctx.tm.prefill_lost(req.refs, req.signature, request.client.host if request.client else None)
        return {"success": True}

    @app.post("/flush_cache", responses=_errors(400, 401, 403, 503))
    async def flush_cache():
        if await ctx.tm.flush_cache():
            return {"success": True, "message": "Cache flushed."}
        raise RequestError("flush_cache: requests are still running; retry when the server is idle")

    @app.post("/abort_request", **_documented("/abort_request", also=(403,)))
    async def abort_request(request: Request):
        req: AbortRequest = parse_body(AbortRequest, await read_body(request, ctx.args.max_request_bytes))
        if req.abort_all:
            if not may_administer(request.scope):
                raise admin_refusal("abort_all")
            ctx.tm.abort_all()
        elif req.rid:
            _abort_own(ctx.tm, req.rid, request.scope)
        else:
            raise RequestError("rid: give the rid to abort (or abort_all: true)", param="rid")
        return {"success": True}


def _abort_own(tm: TokenizerManager, rid: str, scope) -> None:
    """Aborts the caller's own ``rid`` (same key, same X-Client-Token; rids live in their owner's
    namespace), or with the admin key anyone's. Another client's rid answers as an unknown one, so
    an abort tells no one which rids are in flight (the router sends every abort to every worker)."""
    tm.abort(rid, owner_of_scope(scope), every_owner=holds_admin_key(scope))


async def _transfer_health(tm: TokenizerManager) -> dict | None:
    """A decode server still serves when its transfers fail (it prefills locally), so /health
    stays 200; but a high fallback rate means a broken deployment, and it says so."""
    try:
        stats = await asyncio.wait_for(tm.get_stats(), HEALTH_STATS_TIMEOUT_S)
    except (asyncio.TimeoutError, RequestError):
        return None  # busy scheduler: liveness is all this check can tell
    rate, window = stats.get("fallback_rate", 0.0), stats.get("fallback_window", 0)
    if window < FALLBACK_ALARM_MIN or rate < FALLBACK_ALARM_RATE:
        return None
    return {"status": "degraded", "fallback_rate": rate,
            "detail": f"{rate:.0%} of the last {window} disaggregated requests fell back to a local prefill: "
                      "check the prefill servers and the network (see the decode log)"}


async def _one_token(tm: TokenizerManager) -> None:
    sampling = SamplingParams(max_new_tokens=1, temperature=0.0)
    await collect(tm.generate([0], sampling, stream=False, rid=f"health-{tm.new_rid()}"))


async def _server_info(ctx: ServerContext) -> dict:
    stats = await ctx.tm.get_stats()
    args, limits = ctx.args.to_dict(), ctx.tm.request_limits
    return {**args, "args": args, **stats, "internal_states": [stats], "version": __version__,
            "context_length": limits.context_len, "max_total_num_tokens": limits.max_total_tokens,
            "scheduler_pids": ctx.tm.running_scheduler.pids, "num_inflight_requests": ctx.tm.num_inflight,
            "disaggregation_mode": ctx.tm.role,
            "role_switches": list(ctx.roles.history) if ctx.roles is not None else []}


def _model_info(ctx: ServerContext) -> dict:
    limits = ctx.tm.request_limits  # what the scheduler's ModelConfig says (its ready message)
    return {"model_path": ctx.args.model_path, "tokenizer_path": ctx.args.tokenizer_path or ctx.model.path,
            "served_model_name": ctx.model_name, "is_generation": True, "architecture": ctx.model.architecture,
            "context_length": limits.context_len, "vocab_size": limits.vocab_size}


def _role_changed(ctx: ServerContext, exc: RequestError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=_role_headers(ctx))


# --------------------------------------------------------------- launch
def launch_server(args: ServerArgs, startup_timeout: float = STARTUP_TIMEOUT_S,
                  model_files: ModelFiles | None = None) -> int:
    """Run a server until a signal (-> 0) or a failure (-> 1). Raises ValueError for bad args.
    ``model_files``: the caller's (config.json is then not read again)."""
    args.disagg_config().check_servable()
    configure_logging(args.log_level, "frontend")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the frontend must not compete for cores
    model_files = model_files or args.model_files()
    tokenizer = None if args.skip_tokenizer_init else load_tokenizer(args.tokenizer_path or model_files.path)
    _limit_torch_threads()
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        logger.error("port: cannot bind %s:%d (%s)", args.host, args.port, e.strerror or e)
        return 1
    try:
        bootstrap = start_bootstrap_server(args)
    except OSError as e:
        logger.error("disaggregation_bootstrap_port: cannot bind %s:%d (%s)", args.host,
                     args.disaggregation_bootstrap_port, e.strerror or e)
        sock.close()
        return 1
    warn_if_unauthenticated(args.host, args.api_key, args.admin_api_key, "the server")
    metrics = ServerMetrics(args.served_model_name or args.model_path)
    tm = TokenizerManager(args, tokenizer, metrics, stream_interval=args.stream_interval)
    tm.live_role.watch(metrics.set_role)  # the pd_role gauge follows every switch
    roles = None
    if args.disaggregation_mode != "null":
        roles = RoleSwitcher(args, tm, metrics, lambda: _open_registry(args).stop,
                             bootstrap.stop if bootstrap is not None else None)
    ctx = ServerContext(args, model_files, tm, metrics, roles)
    try:
        return run_event_loop(_serve(ctx, sock, startup_timeout))
    finally:
        if roles is not None:
            roles.close_registry()
        elif bootstrap is not None:
            bootstrap.stop()


def start_bootstrap_server(args: ServerArgs):
    """A prefill server's bootstrap registry (its scheduler ranks register there, decode servers
    read it), listening before the scheduler starts; None in other modes."""
    if args.disaggregation_mode != "prefill":
        return None
    return _open_registry(args)


def _open_registry(args: ServerArgs):
    from pdserve.disagg.bootstrap import open_registry

    return open_registry(args)


async def _serve(ctx: ServerContext, sock: socket.socket, startup_timeout: float) -> int:
    signals = _SignalCatcher(asyncio.get_running_loop(), ctx.tm)
    try:
        await ctx.tm.start(startup_timeout, should_stop=lambda: signals.caught)
    except (StartupError, StartupCancelled) as e:
        logger.log(logging.ERROR if isinstance(e, StartupError) else logging.INFO, "%s", e)
        await ctx.tm.close()
        sock.close()
        return 1 if isinstance(e, StartupError) else 0
    config = uvicorn.Config(create_app(ctx), log_level=ctx.args.log_level, access_log=False, lifespan="off",
                            # typed int; uvicorn hands it to asyncio.wait_for, so a float works
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)  # type: ignore[arg-type]
    server = _UvicornServer(config, signals)
    signals.server = server
    exit_code = 0

    def on_fatal(_message: str) -> None:
        nonlocal exit_code
        exit_code = 1
        server.should_exit = True

    ctx.tm.on_fatal = on_fatal
    # What the start built (fastapi, pydantic's schemas, the tokenizer, transformers' modules: hundreds of
    # thousands of objects that live as long as the process) leaves the cyclic collector's passes: a full
    # pass walked all of it, 40-90 ms of this loop at a time, stalling every request it landed among.
    gc.freeze()
    logger.info("pdserve %s serving %s on http://%s:%d", __version__, ctx.model_name, ctx.args.host, ctx.args.port)
    try:
        await server.serve(sockets=[sock])
    finally:
        await ctx.tm.close()
        sock.close()
    return exit_code


class _SignalCatcher:
    """SIGINT/SIGTERM handler that outlives uvicorn's.

    During startup it cancels the wait for the scheduler. While serving, uvicorn
    handles the signal (stops accepting, waits for responses); this handler also
    ends what is still running after DRAIN_S (``TokenizerManager.end_inflight``), so
    streams end with a final abort event and other requests with a 503, well
    before uvicorn's graceful timeout would cancel them. After serving, uvicorn re-raises the signal it caught;
    this handler absorbs it so the process exits through its normal cleanup.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, tm: TokenizerManager):
        self.loop = loop
        self.tm = tm
        self.caught = False
        self.server: _UvicornServer | None = None
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, _sig, _frame) -> None:
        self.on_signal()

    def on_signal(self) -> None:
        first = not self.caught
        self.caught = True
        self.tm.signalled = True
        if self.server is not None:
            self.server.should_exit = True
        if first and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._drain_later)

    def _drain_later(self) -> None:
        self.loop.call_later(DRAIN_S, self.tm.end_inflight)


class _UvicornServer(uvicorn.Server):
    """uvicorn's server, telling the signal catcher when uvicorn's own handler fires."""

    def __init__(self, config: uvicorn.Config, signals: _SignalCatcher):
        super().__init__(config)
        self.signals = signals

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        self.signals.on_signal()


def _limit_torch_threads() -> None:
    """The scheduler process does the compute; the frontend must not compete for cores. Where its start-up
    imported torch (transformers' AutoTokenizer for a model type whose tokenizer class it overrides; the
    device probe on a GPU host), torch runs on one thread. A frontend without torch has no torch threads
    (importing it here only to limit them cost seconds of CPU a start); one imported later (an in-process
    grammar compile's xgrammar) runs no torch op here, so its thread pool never starts."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)
