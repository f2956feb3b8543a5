"""Client-facing errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every message starts with the field it is about (``temperature: must be ...``),
so a client can tell what to fix without reading server logs.
"""

from __future__ import annotations

from typing import TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

ModelT = TypeVar("ModelT", bound=BaseModel)

MAX_ECHOED_CHARS = 200  # of a bad value quoted back in an error message

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          408: "timeout_error", 413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable",
          500: "server_error"}


class RequestError(Exception):
    """A request the server will not serve; ``param`` is the offending field (or None)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code or ("invalid_value" if status == 400 else None)

    @classmethod
    def from_value_error(cls, err: ValueError, rename: dict[str, str] | None = None,
                         strip_prefix: str = "") -> RequestError:
        """Wrap a ``"field: why"`` ValueError, renaming the field for the API that was called."""
        field, sep, why = str(err).partition(":")
        if not sep:
            return cls(str(err))
        if strip_prefix and field.startswith(strip_prefix):
            field = field[len(strip_prefix):]
        field = (rename or {}).get(field, field)
        return cls(f"{field}:{why}", param=field)

    def body(self) -> dict:
        return error_body(self.message, self.status, self.param, self.code)


class ServerError(RequestError):
    """The server cannot serve right now (scheduler gone, shutting down)."""

    def __init__(self, message: str, status: int = 503):
        super().__init__(message, None, status, None)


class RoleChanged(ServerError):
    """A request admitted for the role this server had just before a role switch (it arrived while
    the switch committed): 503, with the new role in the X-PD-Role header so a router sends it
    elsewhere."""


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """What ``error_body`` returns, for the OpenAPI schema."""

    error: ErrorDetail


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(err: RequestError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with a 413 as soon as it is known to exceed ``limit`` bytes:
    from Content-Length before reading anything, else while the chunks arrive."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise _too_large(size, limit)
        parts.append(part)
    return b"".join(parts)


def _too_large(size: int, limit: int) -> RequestError:
    return RequestError(f"request body: larger than the server's limit of {limit} bytes (--max-request-bytes)",
                        param=None, status=413, code="request_too_large")


def parse_body(model: type[ModelT], raw: bytes) -> ModelT:
    """Validate a JSON body against ``model``; malformed JSON or a bad field -> RequestError(400)."""
    try:
        return model.model_validate_json(raw or b"")
    except ValidationError as e:
        raise _from_validation_error(e) from None


def _from_validation_error(e: ValidationError) -> RequestError:
    first = _most_relevant(e.errors(include_url=False))
    if first["type"] == "json_invalid":
        return RequestError(f"request body: invalid JSON ({first['msg']})", param=None, code="invalid_json")
    if first["type"] in ("model_type", "model_attributes_type") and not first["loc"]:
        return RequestError("request body: must be a JSON object", param=None)
    field = _loc_to_field(first["loc"])
    got = repr(first.get("input"))
    if len(got) > MAX_ECHOED_CHARS:
        got = got[:MAX_ECHOED_CHARS] + "..."
    detail = first["msg"] if first["type"] == "missing" else f"{first['msg']}, got {got}"
    return RequestError(f"{field}: {detail}", param=field)


def _most_relevant(errors: list[ErrorDetails]) -> ErrorDetails:
    """The complaint of the union member that got furthest: each member's first error, and of
    those the deepest, then the latest element (``prompt: [1, [2]]`` -> ``prompt[1]``, where
    list[int] failed, not ``prompt[0]``, where list[list[int]] and list[str] did)."""
    firsts: dict[tuple, ErrorDetails] = {}
    for err in errors:
        firsts.setdefault(_member(err["loc"]), err)
    return max(firsts.values(), key=lambda err: (len(_clean(err["loc"])), _indices(err["loc"])))


def _member(loc: tuple) -> tuple:
    """The loc up to its first union tag: which union member an error belongs to."""
    for i, part in enumerate(loc):
        if isinstance(part, str) and _is_type_tag(part):
            return loc[:i + 1]
    return loc


def _clean(loc: tuple) -> tuple:
    return tuple(p for p in loc if not (isinstance(p, str) and _is_type_tag(p)))


def _indices(loc: tuple) -> tuple:
    return tuple(p for p in loc if isinstance(p, int))


def _loc_to_field(loc: tuple) -> str:
    """('messages', 0, 'content', 'list[TextPart]', 0) -> 'messages[0].content[0]' (union tags dropped)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _is_type_tag(part):
            continue
        else:
            out += ("." if out else "") + part
    return out or "request body"


def _is_type_tag(part: str) -> bool:
    # pydantic names union members by type ("str", "list[int]", "function-after[...]") or, for a
    # model, by its class name ("NamedToolChoice"); field names are lower case
    return part in ("str", "int", "float", "bool", "dict", "list", "none") or "[" in part or part[:1].isupper()
