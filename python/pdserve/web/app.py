"""What both HTTP programs (the server and the router) put around their routes: the error handlers
(OpenAI's error shape for a ``RequestError``, a 500 naming the exception for anything else) and,
once every route is added, the check that each has an access class and the API-key middleware."""

from __future__ import annotations

import asyncio
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from pdserve.web.api_key import AccessMiddleware, check_classified
from pdserve.web.errors import RequestError, error_body, error_response

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
    app.add_exception_handler(Exception, internal_error)


def guard_routes(app: FastAPI, api_key: str | None, admin_api_key: str | None,
                 worker_credential: str | None = None) -> None:
    """After the last route: every route has an access class (``web/api_key.py``), and the keys are checked."""
    check_classified([route.path for route in app.routes])  # type: ignore[attr-defined]
    app.add_middleware(AccessMiddleware, api_key=api_key, admin_api_key=admin_api_key,
                       worker_credential=worker_credential)


async def _request_error(_request: Request, exc: RequestError) -> JSONResponse:
    return error_response(exc)
