"""What both HTTP programs (the server and the router) put around their routes: the error handlers
(OpenAI's error shape for a ``RequestError`` and for the framework's own 404 and 405, a 400 for a
value nested past Python's stack, a 500 naming the exception for anything else) and,
once every route is added, the check that each has an access class and the API-key middleware."""

from __future__ import annotations

import asyncio
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from pdserve.web.api_key import AccessMiddleware, check_classified
from pdserve.web.errors import RequestError, error_body, error_response
from pdserve.web.origin import OriginMiddleware, OriginPolicy

logger = logging.getLogger(__name__)


def add_error_handlers(app: FastAPI, timeout_message: str | None = None) -> None:
    """``timeout_message``: an ``asyncio.TimeoutError`` is a 503 saying so (the server waiting on its
    scheduler); None: it is an internal error like any other."""

    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        if timeout_message is not None and isinstance(exc, asyncio.TimeoutError):
            return JSONResponse(error_body(timeout_message, 503), status_code=503)
        logger.exception("unhandled error on %s", request.url.path, exc_info=exc)
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", 500), status_code=500)

    # Starlette types every handler as taking Exception; this one is registered for RequestError only.
    app.add_exception_handler(RequestError, _request_error)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(RecursionError, _too_deep)
    app.add_exception_handler(Exception, internal_error)


def guard_routes(app: FastAPI, api_key: str | None, admin_api_key: str | None,
                 origin: OriginPolicy | None = None, worker_credential: str | None = None) -> None:
    """After the last route: every route has an access class (``web/api_key.py``), and the keys are checked;
    before them (outermost), foreign Host / Origin headers and bodies that are not JSON are refused
    (``web/origin.py``)."""
    check_classified([route.path for route in app.routes])  # type: ignore[attr-defined]
    app.add_middleware(AccessMiddleware, api_key=api_key, admin_api_key=admin_api_key,
                       worker_credential=worker_credential)
    if origin is not None:
        app.add_middleware(OriginMiddleware, policy=origin)


async def _request_error(_request: Request, exc: RequestError) -> JSONResponse:
    return error_response(exc)


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """The framework's answers (no such route, a method the route does not take) in OpenAI's shape,
    not FastAPI's ``{"detail": ...}``; a 405 keeps its Allow header."""
    path, method = request.url.path, request.method
    if exc.status_code == 404:
        message, code = f"path: {path} is not a route of this server", "not_found"
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        message, code = f"method: {method} is not allowed on {path} (allowed: {allowed})", "method_not_allowed"
    else:
        message, code = f"{path}: {exc.detail}", None
    param = {404: "path", 405: "method"}.get(exc.status_code)
    return JSONResponse(error_body(message, exc.status_code, param, code), status_code=exc.status_code,
                        headers=exc.headers)


async def _too_deep(request: Request, exc: Exception) -> JSONResponse:
    """The net under the per-field limits: a value nested past Python's stack is the request's doing
    (a 400, never a 500 a router's breaker would count against the worker, issue 33)."""
    logger.warning("a request to %s nested too deeply for a parser (%s)", request.url.path, exc)
    return error_response(RequestError("request body: a value is nested too deeply to parse", param=None))
