"""Requests a browser may have been tricked into sending: bodies that are not JSON, foreign ``Origin``
and ``Host`` headers (issue 33). Shared by the server and the router.

A page on another site can make a visitor's browser POST to ``http://127.0.0.1:30000`` without
asking first, as long as the body is ``text/plain``, a form or a Blob; the browser then labels the
request with the page's ``Origin``. DNS rebinding goes further: the attacker's own name resolves to
the loopback address, so the request is same-origin to the browser and only its ``Host`` header
(the attacker's name) gives it away. On a keyless server either one could flush the cache or
switch its role. So (``OriginPolicy``):

* a request body must be declared ``application/json`` (415 otherwise); a body with no
  Content-Type at all passes (curl, scripts; a browser always adds ``Origin`` to such a request);
* ``Host`` must name the bound address, or a loopback name when the server is bound to loopback,
  or one of ``--allowed-hosts`` (403 otherwise). Bound to a wildcard or another address with no
  ``--allowed-hosts`` given, the server cannot know the names it is reached by (Kubernetes Service
  names) and does not check;
* a POST/PUT/PATCH/DELETE with an ``Origin`` must come from the server's own origin (same scheme,
  host and port as its ``Host``, that host allowed) or one of ``--allowed-origins`` (403
  otherwise). Clients that are not browsers send no Origin.

``*`` in either list allows any. Requests that carry an API key are checked the same way.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from functools import cached_property, lru_cache
from urllib.parse import urlsplit

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.obs.kv_event_publisher import WILDCARD_HOSTS
from pdserve.web.api_key import is_loopback
from pdserve.web.errors import error_body

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
UNSAFE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
DEFAULT_PORTS = {"http": 80, "https": 443}


@lru_cache(maxsize=256)  # every request's Host is parsed; a server is reached by a handful of names
def split_host(value: str, scheme: str = "http") -> tuple[str, int]:
    """``Host`` header (``name``, ``name:port``, ``[v6]:port``) -> (lower-case name, port)."""
    parts = urlsplit(f"//{value}")
    try:
        port = parts.port
    except ValueError:
        port = None
    return (parts.hostname or "").lower(), port or DEFAULT_PORTS.get(scheme, 80)


@dataclass(frozen=True)
class OriginPolicy:
    bind_host: str
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()

    # Both depend on the flags alone: worked out once, not per request (an IP parse each, on the path
    # every request takes before its route).
    @cached_property
    def checks_host(self) -> bool:
        """Loopback binds always (the names are known); others only when ``--allowed-hosts`` names them."""
        if "*" in self.allowed_hosts:
            return False
        return bool(self.allowed_hosts) or (self.bind_host not in WILDCARD_HOSTS and is_loopback(
            self.bind_host.strip("[]")))

    @cached_property
    def host_names(self) -> frozenset[str]:
        """The lower-case names a checked ``Host`` may carry."""
        names = {self.bind_host.strip("[]").lower(), *(h.lower() for h in self.allowed_hosts)}
        if is_loopback(self.bind_host.strip("[]")):
            names |= LOOPBACK_NAMES
        return frozenset(names)

    def host_allowed(self, name: str) -> bool:
        return not self.checks_host or name in self.host_names

    def origin_allowed(self, origin: str, host_header: str, scheme: str) -> bool:
        if "*" in self.allowed_origins or origin.rstrip("/") in {o.rstrip("/") for o in self.allowed_origins}:
            return True
        parts = urlsplit(origin)
        if parts.scheme not in DEFAULT_PORTS or not parts.hostname:
            return False  # "null" (a sandboxed frame, a file), or not an origin at all
        try:
            origin_port = parts.port or DEFAULT_PORTS[parts.scheme]
        except ValueError:
            return False
        host, port = split_host(host_header, scheme)
        return (parts.hostname.lower(), origin_port) == (host, port) and self.host_allowed(host)

    def refusal(self, scope: Scope) -> tuple[int, str, str | None] | None:
        """(status, message, param) when the request must be refused, else None."""
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        host_header = headers.get("host", "")
        if host_header and not self.host_allowed(split_host(host_header)[0]):
            return 403, (f"Host: {host_header[:100]!r} is not a name this server answers to (it is bound to "
                         f"{self.bind_host}; add names with --allowed-hosts)"), "Host"
        method = scope.get("method", "GET")
        origin = headers.get("origin")
        if origin is not None and method in UNSAFE_METHODS and \
                not self.origin_allowed(origin, host_header, scope.get("scheme", "http")):
            return 403, (f"Origin: {origin[:100]!r} may not send requests here (cross-site; allow it with "
                         f"--allowed-origins)"), "Origin"
        ctype = headers.get("content-type")
        if ctype is not None and _has_body(headers) and not _is_json(ctype):
            return 415, f"Content-Type: request bodies must be application/json, got {ctype[:100]!r}", "Content-Type"
        return None


def _has_body(headers: dict[str, str]) -> bool:
    length = headers.get("content-length", "")
    return "transfer-encoding" in headers or (length.isdigit() and int(length) > 0)


def _is_json(content_type: str) -> bool:
    main = content_type.split(";", 1)[0].strip().lower()
    return main == "application/json" or (main.startswith("application/") and main.endswith("+json"))


_PEER: contextvars.ContextVar[str] = contextvars.ContextVar("pdserve_request_peer", default="")


def request_peer() -> str:
    """The address the HTTP request being served came from (set by ``OriginMiddleware``); "" outside one."""
    return _PEER.get()


class OriginMiddleware:
    """Refuses what ``OriginPolicy.refusal`` names, in OpenAI's error shape, before any route runs;
    notes the request's peer address for ``request_peer``."""

    def __init__(self, app: ASGIApp, policy: OriginPolicy):
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refused = self.policy.refusal(scope)
            if refused is not None:
                await _send_error(send, *refused)
                return
            client = scope.get("client")
            token = _PEER.set(client[0] if client else "")
            try:
                await self.app(scope, receive, send)
            finally:
                _PEER.reset(token)
            return
        await self.app(scope, receive, send)


async def _send_error(send: Send, status: int, message: str, param: str | None) -> None:
    body = orjson.dumps(error_body(message, status, param, "forbidden" if status == 403 else "unsupported_media_type"))
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
