"""Who may call which route: ``--api-key`` for inference, ``--admin-api-key`` for admin routes.

Every route of the server and of the router is classified in ``ROUTE_ACCESS``; ``check_classified``
refuses to build an app with a route missing there, so a new route is classified when it is added.

- ``OPEN``: ``/health`` and metrics, never a key (probes and Prometheus carry no secrets).
  ``/health_generate`` runs the model, so it is ``INFERENCE`` (open only where no key is set).
- ``INFERENCE``: ``Authorization: Bearer <--api-key>`` when that key is set, else open. The admin key
  is not taken here, as in SGLang: an operator's key is not also a client's.
- ``ADMIN`` (cache flush, role switch): the admin key when ``--admin-api-key`` is set (the inference
  key is refused with a 403 that says so); without it, what ``INFERENCE`` needs (SGLang's
  ``ADMIN_OPTIONAL``, so deployments without an admin key keep working).
- ``OWNED`` (``/abort_request``): what ``INFERENCE`` needs; the route itself then lets a caller abort
  only requests it started (``owner_of_scope``) unless it holds the admin key, and ``abort_all``
  needs what ``ADMIN`` needs.
- ``WORKER`` (``/kv_events/snapshot``: every cached block's hash, whoever's prompt it holds): for the
  deployment's own router, never a client. The admin key, or the worker credential (``X-PD-Worker``,
  ``worker_credential`` of the deployment's KV hash key, which the router holds); the inference key
  is refused (403). Only a server with no key of any kind leaves it open, as every other route.

A request's owner is a hash of the Authorization header it came with and of the optional
``X-Client-Token`` header: a secret a client picks so that other holders of the same shared
inference key cannot abort its requests. Through the router a request reaches the workers with the
router's worker key and the client's token, so the owner is the same wherever it is aborted.
"""

from __future__ import annotations

import contextvars
import enum
import hashlib
import hmac
import ipaddress
import logging

from pdserve.web.errors import RequestError, error_response

logger = logging.getLogger(__name__)

ADMIN_KEY_ENV = "PDSERVE_ADMIN_API_KEY"  # --admin-api-key's default: pdserve up passes it so, not on argv
CLIENT_TOKEN_HEADER = "X-Client-Token"


class Access(enum.Enum):
    OPEN = "open"
    INFERENCE = "inference"
    ADMIN = "admin"
    OWNED = "owned"
    WORKER = "worker"


WORKER_HEADER = "X-PD-Worker"
_WORKER_DOMAIN = b"pdserve-worker-credential-v1\0"


def worker_credential(hash_key: bytes) -> str | None:
    """What the router sends in ``X-PD-Worker`` for ``WORKER`` routes: derived from the deployment's KV
    block hash key (config.resolve_kv_hash_key), which its servers and router share; None unkeyed."""
    return hashlib.sha256(_WORKER_DOMAIN + hash_key).hexdigest() if hash_key else None


# Every route of the server (entrypoints/http_server.py) and the router (router/app.py).
ROUTE_ACCESS: dict[str, Access] = {
    "/health": Access.OPEN,
    "/health_generate": Access.INFERENCE,  # it generates (and on the router, on every worker): a client's call
    "/metrics": Access.OPEN,
    "/generate": Access.INFERENCE,
    "/v1/completions": Access.INFERENCE,
    "/v1/chat/completions": Access.INFERENCE,
    "/v1/models": Access.INFERENCE,
    "/model_info": Access.INFERENCE,
    "/get_model_info": Access.INFERENCE,
    "/server_info": Access.INFERENCE,  # secrets in the args are masked (ServerArgs.to_dict)
    "/get_server_info": Access.INFERENCE,
    "/kv_events/snapshot": Access.WORKER,  # the router's cache view, with the admin key or the worker credential
    "/openapi.json": Access.INFERENCE,
    "/docs": Access.INFERENCE,
    "/docs/oauth2-redirect": Access.INFERENCE,
    "/redoc": Access.INFERENCE,
    "/abort_request": Access.OWNED,
    "/flush_cache": Access.ADMIN,
    "/pd_role_switch": Access.ADMIN,
    "/disaggregation/prefill_lost": Access.INFERENCE,  # the router's, signed under the P/D token
}

_OWNER: contextvars.ContextVar[str] = contextvars.ContextVar("pdserve_request_owner", default="")


def request_owner() -> str:
    """The owner of the HTTP request being served (set by ``AccessMiddleware``); "" outside one."""
    return _OWNER.get()


def check_classified(paths: list[str]) -> None:
    """Raises if a route is in no access class: a new route must say who may call it."""
    missing = sorted(p for p in paths if p not in ROUTE_ACCESS)
    if missing:
        raise RuntimeError(f"routes {missing} have no access class: add them to web.api_key.ROUTE_ACCESS")


def owner_of_scope(scope) -> str:
    headers = dict(scope["headers"])
    seen = headers.get(b"authorization", b"") + b"\0" + headers.get(CLIENT_TOKEN_HEADER.lower().encode(), b"")
    return hashlib.sha256(seen).hexdigest()


def holds_admin_key(scope) -> bool:
    """Whether the request came with the admin key (always False when none is set)."""
    return bool(scope.get("state", {}).get("pdserve_admin", False))


def may_administer(scope) -> bool:
    """Whether the request may do what an ``ADMIN`` route does (see the module's docstring)."""
    return bool(scope.get("state", {}).get("pdserve_may_administer", False))


def admin_refusal(what: str) -> RequestError:
    return RequestError(f"{what}: needs the admin key ('Authorization: Bearer <--admin-api-key>'); the "
                        "inference key is not enough", param="Authorization", status=403, code="admin_key_required")


class AccessMiddleware:
    """Plain ASGI (no per-chunk overhead on streams, unlike BaseHTTPMiddleware). Marks each request
    with its owner (``request_owner``) and whether it may administer, and refuses what its key
    does not open."""

    def __init__(self, app, api_key: str | None = None, admin_api_key: str | None = None,
                 worker_credential: str | None = None):
        self.app = app
        self.inference = f"Bearer {api_key}".encode() if api_key else None
        self.admin = f"Bearer {admin_api_key}".encode() if admin_api_key else None
        self.worker = worker_credential.encode() if worker_credential else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        access = ROUTE_ACCESS.get(scope["path"], Access.INFERENCE)  # unknown paths: 404 after the key check
        if access is Access.OPEN:
            return await self.app(scope, receive, send)
        if access is Access.WORKER:
            return await self._worker_route(scope, receive, send)
        got = dict(scope["headers"]).get(b"authorization", b"")
        is_admin = self.admin is not None and hmac.compare_digest(got, self.admin)
        inference_ok = self.inference is None or hmac.compare_digest(got, self.inference)
        administer = is_admin if self.admin is not None else inference_ok
        err = self._refusal(scope["path"], access, inference_ok, administer, is_admin)
        if err is not None:
            return await error_response(err)(scope, receive, send)
        scope.setdefault("state", {}).update(pdserve_admin=is_admin, pdserve_may_administer=administer)
        token = _OWNER.set(owner_of_scope(scope))
        try:
            await self.app(scope, receive, send)
        finally:
            _OWNER.reset(token)

    async def _worker_route(self, scope, receive, send):
        headers = dict(scope["headers"])
        got = headers.get(b"authorization", b"")
        sent = headers.get(WORKER_HEADER.lower().encode(), b"")
        ok = ((self.admin is not None and hmac.compare_digest(got, self.admin))
              or (self.worker is not None and hmac.compare_digest(sent, self.worker))
              or (self.admin is None and self.inference is None and self.worker is None))
        if ok:
            return await self.app(scope, receive, send)
        err = RequestError(f"{scope['path'].lstrip('/')}: a worker-only route, for the deployment's router: needs "
                           f"the admin key ('Authorization: Bearer <--admin-api-key>') or the {WORKER_HEADER} "
                           "credential of the deployment's --kv-hash-key-file; the inference key is not enough",
                           param="Authorization", status=403 if got or sent else 401, code="worker_key_required")
        return await error_response(err)(scope, receive, send)

    def _refusal(self, path: str, access: Access, inference_ok: bool, administer: bool,
                 is_admin: bool) -> RequestError | None:
        if access is Access.ADMIN and not administer:
            if self.admin is not None and inference_ok and self.inference is not None:
                return admin_refusal(path.lstrip("/"))
            return _missing_key("the admin key (--admin-api-key)" if self.admin is not None else "the API key")
        admin_abort = access is Access.OWNED and is_admin  # the admin may abort without the inference key
        if access in (Access.INFERENCE, Access.OWNED) and not inference_ok and not admin_abort:
            return _missing_key("the API key")
        return None


def _missing_key(which: str) -> RequestError:
    return RequestError(f"Authorization: missing or wrong API key (send 'Authorization: Bearer <key>' with {which})",
                        param="Authorization", status=401, code="invalid_api_key")


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback address (a bracketed IPv6 literal too, as a Host header writes it)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name other than localhost may resolve to any interface


ALLOW_NO_KEY_FLAG = "--allow-no-api-key"


def unauthenticated_refusal(host: str, api_key: str | None, allowed: bool, what: str) -> str | None:
    """Why ``what`` must not listen on ``host``: beyond the loopback it needs an API key unless the
    operator says ``--allow-no-api-key`` (a network they trust); None when it may."""
    if api_key or allowed or is_loopback(host):
        return None
    return (f"api_key: {what} would listen on {host} with no --api-key (anyone who reaches it could generate, "
            f"abort and flush): give --api-key (or $PDSERVE_API_KEY), bind --host 127.0.0.1, or pass "
            f"{ALLOW_NO_KEY_FLAG}")


def warn_if_unauthenticated(host: str, api_key: str | None, admin_api_key: str | None, what: str) -> bool:
    """One warning line when ``what`` listens beyond loopback with no key at all; whether it warned."""
    if api_key or admin_api_key or is_loopback(host):
        return False
    logger.warning("%s listens on %s with no --api-key and no --admin-api-key: anyone who can reach it may "
                   "generate, abort every request, flush the cache and switch roles; set both keys, or bind "
                   "--host 127.0.0.1", what, host)
    return True
