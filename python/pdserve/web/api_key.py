"""``--api-key``: ``Authorization: Bearer <key>`` required on every path but health checks and
metrics, refused with a 401 in OpenAI's error shape. Shared by the server and the router."""

from __future__ import annotations

import hmac

from pdserve.web.errors import RequestError, error_response

OPEN_PATHS = ("/health", "/health_generate", "/metrics")  # reachable without the API key


class ApiKeyMiddleware:
    """Plain ASGI (no per-chunk overhead on streams, unlike BaseHTTPMiddleware)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        got = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(got, self.expected):
            return await self.app(scope, receive, send)
        err = RequestError("Authorization: missing or wrong API key (send 'Authorization: Bearer <key>')",
                           param="Authorization", status=401, code="invalid_api_key")
        await error_response(err)(scope, receive, send)
