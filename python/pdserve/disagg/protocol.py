"""Typed, versioned messages between a prefill server and a decode server (over ZMQ).

Wire form: UTF-8 JSON ``{"v": PROTOCOL_VERSION, "type": <class name>, "body": {<fields>}}``.
``decode`` refuses another version, an unknown type, a missing, extra or mistyped field, and
anything a message's own checks reject, with a ProtocolError naming the field.

Who sends what (DESIGN §5):
- decode -> prefill: ``KVRequest`` (one per destination rank), ``KVAbort``, ``DropRoom``,
  ``Heartbeat``.
- prefill -> decode: ``KVCompletion`` (one per source rank and destination rank), ``KVAbort``,
  ``KVAbortAck``, ``HeartbeatAck``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from dataclasses import dataclass

from pdserve.disagg.layout import KVLayout

PROTOCOL_VERSION = 1
SIDES = ("prefill", "decode")
STATUSES = ("ok", "failed")
MAX_ROOM = 2**64 - 1


class ProtocolError(ValueError):
    """A message that cannot be accepted; the text names the field."""


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ProtocolError(msg)


def _check_room(room: int) -> None:
    _require(0 <= room <= MAX_ROOM, f"room: {room} is not an unsigned 64-bit value")


@dataclass(frozen=True)
class KVRequest:
    """Decode asks prefill for one request's KV on one destination rank.

    Pages ``dst_pages`` receive token positions ``start_pos ..`` (``start_pos`` = decode's own
    cached prefix, page-aligned) for ``num_tokens`` tokens (prompt length - 1 - start_pos): the
    last prompt token is held back because decode's first step feeds it.
    """

    room: int
    decode_id: str  # the decode server, for aborts and heartbeats
    decode_rank: int  # attention rank on decode: dp_rank * tp_size + tp_rank
    session: str  # that rank's transfer session, "host:rpc_port"
    buffers: list[int]  # base address of each KV buffer of that rank, in layout.buffers order
    layout: KVLayout  # decode's KV layout (prefill plans its writes from it)
    dst_pages: list[int]
    start_pos: int
    num_tokens: int
    aux_addr: int  # where prefill writes the aux data (hidden state); 0 with aux_bytes 0: none
    aux_bytes: int
    reply_to: str  # decode's ZMQ endpoint for completions, aborts and acks

    def __post_init__(self):
        _check_room(self.room)
        ps = self.layout.page_size
        _require(0 <= self.decode_rank < self.layout.num_ranks,
                 f"decode_rank: {self.decode_rank} outside [0, {self.layout.num_ranks})")
        _require(len(self.buffers) == len(self.layout.buffers),
                 f"buffers: {len(self.buffers)} addresses for buffers {self.layout.buffers}")
        _require(self.start_pos >= 0 and self.start_pos % ps == 0,
                 f"start_pos: {self.start_pos} is not a non-negative multiple of page_size {ps}")
        _require(self.num_tokens >= 1, f"num_tokens: must be >= 1, got {self.num_tokens}")
        _require(len(self.dst_pages) == math.ceil(self.num_tokens / ps),
                 f"dst_pages: {len(self.dst_pages)} pages for {self.num_tokens} tokens of page_size {ps}")
        _require(all(0 <= p < self.layout.num_pages for p in self.dst_pages),
                 f"dst_pages: a page outside [0, {self.layout.num_pages})")
        _require(self.aux_bytes >= 0 and (self.aux_addr == 0) == (self.aux_bytes == 0),
                 f"aux_addr, aux_bytes: both zero or both set, got {self.aux_addr}, {self.aux_bytes}")
        _require(bool(self.session), "session: empty")
        _require(bool(self.reply_to), "reply_to: empty")

    @property
    def dst_dp_rank(self) -> int:
        """The decode DP group holding the request (``layout.plan_writes``'s ``dst_dp_rank``)."""
        return self.decode_rank // self.layout.tp_size


@dataclass(frozen=True)
class KVCompletion:
    """Prefill rank ``src_rank`` has finished writing ``room`` to ``dst_rank``: with status "ok",
    every one of its ``writes`` page-writes (``layout.count_writes``) had polled DONE before this
    was sent, so the bytes are in decode's memory; with "failed", ``error`` says why."""

    room: int
    src_rank: int
    dst_rank: int
    writes: int
    status: str
    error: str = ""
    # Where prefill's time went (seconds), for decode's TTFT breakdown: from pairing to the
    # first forward of the room, and from there to the end of its last forward.
    queue_s: float = 0.0
    prefill_s: float = 0.0

    def __post_init__(self):
        _check_room(self.room)
        _require(self.queue_s >= 0 and self.prefill_s >= 0, "queue_s, prefill_s: must be >= 0")
        _require(self.status in STATUSES, f"status: {self.status!r} is not one of {STATUSES}")
        _require(self.writes >= 0, f"writes: must be >= 0, got {self.writes}")
        _require(self.status == "ok" or bool(self.error), "error: a failed completion must say why")


@dataclass(frozen=True)
class KVAbort:
    """Either side gives up on ``room`` (client left, timeout, failure); ``side`` is the sender."""

    room: int
    reason: str
    side: str

    def __post_init__(self):
        _check_room(self.room)
        _require(self.side in SIDES, f"side: {self.side!r} is not one of {SIDES}")


@dataclass(frozen=True)
class KVAbortAck:
    """Prefill rank ``src_rank`` will post no more writes for ``room`` and none it posted is still
    in flight: decode may reuse the room's pages once every source rank acknowledged."""

    room: int
    src_rank: int

    def __post_init__(self):
        _check_room(self.room)


@dataclass(frozen=True)
class Heartbeat:
    """Liveness probe from ``server_id``; ``time`` is its wall clock, echoed by the ack."""

    server_id: str
    time: float


@dataclass(frozen=True)
class HeartbeatAck:
    """Answer from ``server_id`` to a Heartbeat sent at ``time``."""

    server_id: str
    time: float


@dataclass(frozen=True)
class DropRoom:
    """Conditional disaggregation: decode prefills ``room`` itself; prefill must do no work for it."""

    room: int

    def __post_init__(self):
        _check_room(self.room)


Message = KVRequest | KVCompletion | KVAbort | KVAbortAck | Heartbeat | HeartbeatAck | DropRoom
MESSAGES: dict[str, type] = {c.__name__: c for c in typing.get_args(Message)}


def encode(msg: Message) -> bytes:
    name = type(msg).__name__
    if name not in MESSAGES:
        raise ProtocolError(f"type: {name} is not a protocol message")
    return json.dumps({"v": PROTOCOL_VERSION, "type": name, "body": dataclasses.asdict(msg)},
                      separators=(",", ":")).encode()


def decode(data: bytes) -> Message:
    try:
        env = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"malformed message: not JSON ({e})") from None
    _require(isinstance(env, dict) and set(env) == {"v", "type", "body"},
             "malformed message: expected an object with keys v, type, body")
    _require(env["v"] == PROTOCOL_VERSION,
             f"v: unsupported protocol version {env['v']!r} (this build speaks {PROTOCOL_VERSION})")
    cls = MESSAGES.get(env["type"]) if isinstance(env["type"], str) else None
    _require(cls is not None, f"type: unknown message type {env['type']!r}")
    return from_dict(cls, env["body"], env["type"])


def from_dict(cls: type, body, path: str):
    """Dataclass ``cls`` from a JSON object, every field checked against its annotation
    (int, float, str, bool, list of those, nested dataclasses); ProtocolError names the field."""
    _require(isinstance(body, dict), f"{path}: expected an object, got {type(body).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name in body:
        _require(name in fields, f"{path}.{name}: unknown field")
    kwargs = {}
    for name, f in fields.items():
        if name not in body:
            _require(f.default is not dataclasses.MISSING, f"{path}.{name}: missing field")
            continue
        kwargs[name] = _value(body[name], hints[name], f"{path}.{name}")
    try:
        return cls(**kwargs)
    except (ProtocolError, ValueError) as e:
        raise ProtocolError(f"{path}: {e}") from None


def _value(v, hint, path: str):
    if hint is bool:
        _require(isinstance(v, bool), f"{path}: expected bool, got {type(v).__name__}")
    elif hint is int:
        _require(isinstance(v, int) and not isinstance(v, bool), f"{path}: expected int, got {type(v).__name__}")
    elif hint is float:
        _require(isinstance(v, (int, float)) and not isinstance(v, bool),
                 f"{path}: expected float, got {type(v).__name__}")
        v = float(v)
    elif hint is str:
        _require(isinstance(v, str), f"{path}: expected str, got {type(v).__name__}")
    elif typing.get_origin(hint) is list:
        _require(isinstance(v, list), f"{path}: expected a list, got {type(v).__name__}")
        (item,) = typing.get_args(hint)
        v = [_value(x, item, f"{path}[{i}]") for i, x in enumerate(v)]
    elif dataclasses.is_dataclass(hint):
        v = from_dict(hint, v, path)
    else:  # pragma: no cover - a field type this codec was not taught
        raise TypeError(f"{path}: unsupported field type {hint}")
    return v
