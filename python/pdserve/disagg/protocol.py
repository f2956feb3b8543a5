"""Typed, versioned messages between a prefill server and a decode server (over ZMQ).

Wire form: UTF-8 JSON ``{"v": PROTOCOL_VERSION, "type": <class name>, "body": {<fields>}}``.
``decode`` refuses another version, an unknown type, a missing, extra or mistyped field, and
anything a message's own checks reject, with a ProtocolError naming the field. A frame is input
from whoever can reach the port (docs/disaggregation.md, "The trust boundary"): ``decode`` raises nothing but
ProtocolError, whatever the bytes, and bounds what it parses (frame size, nesting depth, digits
of a number) before Python's json would spend time or memory on it.

Who sends what (docs/disaggregation.md, "One request"):
- decode -> prefill: ``DecodeRecord`` (once per decode rank and prefill server, before its first
  KV request: what prefill checks every KV request against), ``KVRequest`` (one per destination
  rank), ``KVAbort``, ``DropRoom``.
- prefill -> decode: ``KVCompletion`` (one per source rank and destination rank), ``KVAbort``,
  ``KVAbortAck``, ``KVProgress`` (while a room is queued or being computed).
- decode -> prefill: ``KVProgressAck`` (one per ``KVProgress`` that extended a room's wait).

Every room carries decode's random ``nonce``: a completion, abort or acknowledgement counts only
for the room instance whose nonce it echoes, so a late message of an earlier life of a room (or
a guessed room number) never lands on the current one.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import typing
from dataclasses import dataclass, field

from pdserve.disagg.layout import KVLayout, staging_bytes

PROTOCOL_VERSION = 4  # 3: packed transfers (DecodeRecord.staging, KVRequest.staging_*); 4: KVProgress(Ack)
SIDES = ("prefill", "decode")
STATUSES = ("ok", "failed")
MAX_ROOM = 2**64 - 1
MAX_NONCE = 2**63 - 1
# Bounds on what a frame may make the decoder do. A KV request for a 1M-token prompt at page
# size 1 is about 8 MiB of page ids; no message nests deeper than a bootstrap snapshot's
# object/ranks/rank/layout/regions/region/layers (a regions layout's layers keeping each region).
MAX_FRAME_BYTES = 32 * 2**20
MAX_DEPTH = 7
MAX_TRANSFER_INFO_CHARS = 1 << 20  # NIXL's metadata: about 600 characters plus some per registered region
MAX_NUMBER_CHARS = 32  # a u64 has 20 digits; a float's repr fits in 24 characters
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_BRACKET = re.compile(rb"[\[\]{}]")


class ProtocolError(ValueError):
    """A message that cannot be accepted; the text names the field."""


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ProtocolError(msg)


def _check_room(room: int) -> None:
    _require(0 <= room <= MAX_ROOM, f"room: {room} is not an unsigned 64-bit value")


def _check_nonce(nonce: int) -> None:
    _require(1 <= nonce <= MAX_NONCE, f"nonce: {nonce} is not in [1, 2**63)")


@dataclass(frozen=True)
class BufferRange:
    """A registered memory range of a decode rank: ``[addr, addr + nbytes)``."""

    addr: int
    nbytes: int

    def __post_init__(self):
        _require(self.addr > 0 and self.nbytes > 0, f"addr, nbytes: must be > 0, got {self.addr}, {self.nbytes}")

    def holds(self, addr: int, nbytes: int) -> bool:
        return self.addr <= addr and addr + nbytes <= self.addr + self.nbytes


@dataclass(frozen=True)
class DecodeRecord:
    """What one decode rank publishes to a prefill server before asking it for KV: the only
    destinations that prefill will ever write for this rank. Prefill checks every KVRequest of
    ``(decode_id, decode_rank)`` against it (``check_request``) before a single write."""

    decode_id: str  # the decode server ("host:http_port")
    decode_rank: int  # attention rank on decode: dp_rank * tp_size + tp_rank
    session: str  # that rank's transfer session, "host:rpc_port"
    buffers: list[BufferRange]  # the rank's KV buffers, in layout.buffers order
    layout: KVLayout
    aux: BufferRange  # the rank's aux buffer: rows of aux_row_bytes
    aux_row_bytes: int
    reply_to: str  # decode's control endpoint: where prefill sends completions, aborts and acks
    # The rank's staging buffer for packed transfers (``disagg/staging.py``); empty: it has none
    staging: list[BufferRange] = field(default_factory=list)
    transfer_info: str = ""  # the transfer backend's peer_info (NIXL: its agent metadata); "": none needed

    def __post_init__(self):
        _require(bool(self.decode_id), "decode_id: empty")
        _require(len(self.transfer_info) <= MAX_TRANSFER_INFO_CHARS,
                 f"transfer_info: {len(self.transfer_info)} characters (at most {MAX_TRANSFER_INFO_CHARS})")
        _require(len(self.staging) <= 1, f"staging: {len(self.staging)} ranges (at most one)")
        _require(0 <= self.decode_rank < self.layout.num_ranks,
                 f"decode_rank: {self.decode_rank} outside [0, {self.layout.num_ranks})")
        _require(len(self.buffers) == len(self.layout.buffers),
                 f"buffers: {len(self.buffers)} ranges for buffers {self.layout.buffers}")
        for name, b in zip(self.layout.buffers, self.buffers):
            need = self.layout.geometry(name)[1] * self.layout.rows(name)
            _require(b.nbytes >= need, f"buffers: a range shorter than the layout's {need} bytes ({name})")
        _require(0 < self.aux_row_bytes <= self.aux.nbytes and self.aux.nbytes % self.aux_row_bytes == 0,
                 f"aux_row_bytes: {self.aux_row_bytes} does not divide the aux buffer of {self.aux.nbytes} bytes")
        _require(bool(self.session), "session: empty")
        check_endpoint(self.reply_to, "reply_to")

    def check_request(self, kv: KVRequest) -> None:
        """Raise ProtocolError naming the first field of ``kv`` that this record does not allow."""
        _require(kv.session == self.session, f"session: {kv.session} is not the published {self.session}")
        _require(kv.layout == self.layout, "layout: differs from the layout decode published")
        _require(kv.buffers == [b.addr for b in self.buffers], "buffers: differ from the buffers decode published")
        _require(kv.reply_to == self.reply_to, f"reply_to: {kv.reply_to} is not the published {self.reply_to}")
        if kv.aux_bytes:
            offset = kv.aux_addr - self.aux.addr
            _require(kv.aux_bytes == self.aux_row_bytes and self.aux.holds(kv.aux_addr, kv.aux_bytes)
                     and offset % self.aux_row_bytes == 0,
                     f"aux_addr: {kv.aux_addr:#x} (+{kv.aux_bytes}) is not a row of the published aux buffer")
        if kv.staging_bytes:
            _require(any(r.holds(kv.staging_addr, kv.staging_bytes) for r in self.staging),
                     f"staging_addr: {kv.staging_addr:#x} (+{kv.staging_bytes}) is not inside the published "
                     f"staging buffer")


def check_endpoint(endpoint: str, name: str) -> None:
    """A ZMQ TCP endpoint ``tcp://host:port`` (what a channel may connect to)."""
    host, sep, port = endpoint.removeprefix("tcp://").rpartition(":")
    _require(endpoint.startswith("tcp://") and bool(sep) and bool(host) and port.isdigit()
             and 0 < int(port) < 65536 and len(endpoint) <= 300 and not any(c in host for c in "*;/ "),
             f"{name}: {endpoint[:80]!r} is not an endpoint tcp://host:port")


@dataclass(frozen=True)
class KVRequest:
    """Decode asks prefill for one request's KV on one destination rank.

    Pages ``dst_pages`` receive token positions ``start_pos ..`` (``start_pos`` = decode's own
    cached prefix, page-aligned) for ``num_tokens`` tokens (prompt length - 1 - start_pos): the
    last prompt token is held back because decode's first step feeds it.
    """

    room: int
    nonce: int  # decode's random id of this room's life; every answer echoes it
    decode_id: str  # the decode server, for aborts
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
    # Packed transfer (``layout.plan_packed_writes``): where the room's staging region is; 0, 0:
    # the writes go to the pages themselves
    staging_addr: int = 0
    staging_bytes: int = 0
    # The record slot (decode's request-table row) receiving the request's per-request records
    # (``layout.records``: DeepSeek-V4's bounded layout); -1 for a layout without records
    record_slot: int = -1

    def __post_init__(self):
        _check_room(self.room)
        _check_nonce(self.nonce)
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
        _require(len(set(self.dst_pages)) == len(self.dst_pages), "dst_pages: a page named twice")
        _require(self.aux_bytes >= 0 and (self.aux_addr == 0) == (self.aux_bytes == 0),
                 f"aux_addr, aux_bytes: both zero or both set, got {self.aux_addr}, {self.aux_bytes}")
        _require(bool(self.session), "session: empty")
        check_endpoint(self.reply_to, "reply_to")
        _require((self.staging_addr == 0) == (self.staging_bytes == 0),
                 f"staging_addr, staging_bytes: both zero or both set, got {self.staging_addr}, {self.staging_bytes}")
        slots = self.layout.record_slots
        _require(0 <= self.record_slot < slots if self.layout.records else self.record_slot == -1,
                 f"record_slot: {self.record_slot} is not one of the layout's {slots} record slots"
                 if self.layout.records else f"record_slot: {self.record_slot} for a layout without records (-1)")
        if self.staging_bytes:
            need = staging_bytes(self.layout, len(self.dst_pages))
            _require(self.layout.kind == "gqa", "staging_bytes: packed transfers are for GQA (HND) pages")
            _require(self.staging_addr > 0 and self.staging_bytes == need,
                     f"staging_bytes: {self.staging_bytes} for {len(self.dst_pages)} pages, the layout needs {need}")

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
    nonce: int
    src_rank: int
    dst_rank: int
    writes: int
    status: str
    error: str = ""
    # Where prefill's time went (seconds), for decode's TTFT breakdown: from pairing to the
    # first forward of the room, and from there to the end of its last forward.
    queue_s: float = 0.0
    prefill_s: float = 0.0
    # Prompt tokens prefill took from its prefix cache (not computed): what the client's
    # cached_tokens reports, since prefill is where a cache hit saves compute.
    cached_tokens: int = 0
    # Of cached_tokens, those loaded from host memory and from the storage tier (the rest were on
    # the device): decode reports them as meta_info.cached_tokens_by_tier.
    cached_host_tokens: int = 0
    cached_storage_tokens: int = 0

    def __post_init__(self):
        _check_room(self.room)
        _check_nonce(self.nonce)
        _require(0 <= self.queue_s < math.inf and 0 <= self.prefill_s < math.inf,
                 "queue_s, prefill_s: must be finite and >= 0")
        _require(self.cached_tokens >= 0, f"cached_tokens: must be >= 0, got {self.cached_tokens}")
        _require(0 <= self.cached_host_tokens and 0 <= self.cached_storage_tokens
                 and self.cached_host_tokens + self.cached_storage_tokens <= self.cached_tokens,
                 f"cached_host_tokens, cached_storage_tokens: must be >= 0 and sum to at most cached_tokens "
                 f"({self.cached_tokens}), got {self.cached_host_tokens} and {self.cached_storage_tokens}")
        _require(self.status in STATUSES, f"status: {self.status!r} is not one of {STATUSES}")
        _require(self.writes >= 0, f"writes: must be >= 0, got {self.writes}")
        _require(self.status == "ok" or bool(self.error), "error: a failed completion must say why")


@dataclass(frozen=True)
class KVAbort:
    """Either side gives up on ``room`` (client left, timeout, failure); ``side`` is the sender,
    ``sender`` its server id (prefill answers a decode's abort at the endpoint of that decode's
    record, never at an address the message names). ``nonce`` 0: the sender never learned it
    (prefill gave up on a room before decode's KV request arrived)."""

    room: int
    reason: str
    side: str
    sender: str
    nonce: int = 0

    def __post_init__(self):
        _check_room(self.room)
        _require(self.nonce == 0 or 1 <= self.nonce <= MAX_NONCE, f"nonce: {self.nonce} is not in [0, 2**63)")
        _require(self.side in SIDES, f"side: {self.side!r} is not one of {SIDES}")


@dataclass(frozen=True)
class KVAbortAck:
    """Prefill rank ``src_rank`` will post no more writes for ``room`` and none it posted is still
    in flight: decode may reuse the room's pages once every source rank acknowledged."""

    room: int
    nonce: int
    src_rank: int

    def __post_init__(self):
        _check_room(self.room)
        _check_nonce(self.nonce)


@dataclass(frozen=True)
class DropRoom:
    """Conditional disaggregation: decode prefills ``room`` itself; prefill must do no work for it."""

    room: int

    def __post_init__(self):
        _check_room(self.room)


@dataclass(frozen=True)
class KVProgress:
    """Prefill still works on ``room`` (queued or computing it): decode's wait for the room's KV
    restarts (docs/disaggregation.md, "Timeouts are about progress"). ``session``: the transfer
    session of prefill rank ``src_rank``, which decode checks against the records it fetched;
    ``seq``: this notice, echoed by the ``KVProgressAck`` that lets prefill extend its own deadline."""

    room: int
    nonce: int
    src_rank: int
    session: str
    seq: int

    def __post_init__(self):
        _check_room(self.room)
        _check_nonce(self.nonce)
        _require(self.src_rank >= 0, f"src_rank: must be >= 0, got {self.src_rank}")
        _require(0 < len(self.session) <= 300, f"session: {len(self.session)} characters (1 to 300)")
        _require(1 <= self.seq <= MAX_NONCE, f"seq: {self.seq} is not in [1, 2**63)")


@dataclass(frozen=True)
class KVProgressAck:
    """Decode extended ``room``'s wait on prefill's notice ``seq`` to ``wait_s`` (its
    ``--disaggregation-timeout-s``) after receiving it; ``sender``: decode's server id. Prefill
    extends its write deadline only on this echo, to the notice's send time plus the shorter of
    ``wait_s`` and its own timeout, so its deadline never passes decode's (a notice lost or refused
    extends nothing; two servers configured with different timeouts stay safe)."""

    room: int
    nonce: int
    seq: int
    sender: str
    wait_s: float

    def __post_init__(self):
        _check_room(self.room)
        _check_nonce(self.nonce)
        _require(1 <= self.seq <= MAX_NONCE, f"seq: {self.seq} is not in [1, 2**63)")
        _require(bool(self.sender), "sender: empty")
        _require(0 < self.wait_s < math.inf, f"wait_s: must be finite and > 0, got {self.wait_s}")


Message = DecodeRecord | KVRequest | KVCompletion | KVAbort | KVAbortAck | DropRoom | KVProgress | KVProgressAck
MESSAGES: dict[str, type] = {c.__name__: c for c in typing.get_args(Message)}


def encode(msg: Message) -> bytes:
    name = type(msg).__name__
    if name not in MESSAGES:
        raise ProtocolError(f"type: {name} is not a protocol message")
    return json.dumps({"v": PROTOCOL_VERSION, "type": name, "body": dataclasses.asdict(msg)},
                      separators=(",", ":")).encode()


def decode(data: bytes) -> Message:
    """The message in ``data``; ProtocolError (naming the field) for anything else, never
    another exception."""
    env = parse_json(data)
    _require(isinstance(env, dict) and set(env) == {"v", "type", "body"},
             "malformed message: expected an object with keys v, type, body")
    _require(env["v"] == PROTOCOL_VERSION,
             f"v: unsupported protocol version {env['v']!r} (this build speaks {PROTOCOL_VERSION})")
    cls = MESSAGES.get(env["type"]) if isinstance(env["type"], str) else None
    if cls is None:
        raise ProtocolError(f"type: unknown message type {env['type']!r:.60}")
    try:
        return from_dict(cls, env["body"], env["type"])
    except ProtocolError:
        raise
    except Exception as e:  # noqa: BLE001 - a value no check foresaw is still the peer's error
        raise ProtocolError(f"{env['type']}: malformed ({type(e).__name__}: {str(e)[:200]})") from None


def parse_json(data: bytes, max_bytes: int = MAX_FRAME_BYTES):
    """JSON from an untrusted peer, bounded before parsing: size, nesting depth, digits of a
    number; NaN and infinities refused. ProtocolError for anything that is not such JSON."""
    _require(isinstance(data, bytes | bytearray | memoryview), "malformed message: not bytes")
    _require(len(data) <= max_bytes, f"malformed message: {len(data)} bytes (at most {max_bytes})")
    data = bytes(data)
    depth = deepest = 0
    for b in _BRACKET.findall(_STRING.sub(b'""', data)):
        depth += 1 if b in b"[{" else -1
        deepest = max(deepest, depth)
    _require(deepest <= MAX_DEPTH, f"malformed message: nested {deepest} deep (at most {MAX_DEPTH})")
    try:
        return json.loads(data, parse_int=_bounded_int, parse_float=_bounded_float, parse_constant=_no_constant)
    except ProtocolError:
        raise
    except Exception as e:  # noqa: BLE001 - UnicodeDecodeError, JSONDecodeError, RecursionError, ...
        raise ProtocolError(f"malformed message: not JSON ({type(e).__name__}: {str(e)[:200]})") from None


def _bounded_int(text: str) -> int:
    _require(len(text) <= MAX_NUMBER_CHARS, f"malformed message: a number of {len(text)} digits")
    return int(text)


def _bounded_float(text: str) -> float:
    _require(len(text) <= MAX_NUMBER_CHARS, f"malformed message: a number of {len(text)} characters")
    v = float(text)
    _require(math.isfinite(v), f"malformed message: {text} is not a finite number")
    return v


def _no_constant(text: str):
    raise ProtocolError(f"malformed message: {text} is not a JSON number")


def from_dict(cls: type, body, path: str):
    """Dataclass ``cls`` from a JSON object, every field checked against its annotation
    (int, float, str, bool, lists and tuples of those, nested dataclasses); ProtocolError names the field."""
    _require(isinstance(body, dict), f"{path}: expected an object, got {type(body).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name in body:
        _require(name in fields, f"{path}.{str(name)[:40]}: unknown field")
    kwargs = {}
    for name, f in fields.items():
        if name not in body:
            _require(f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING,
                     f"{path}.{name}: missing field")
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
        _require(-(2**64) < v < 2**64, f"{path}: {v} is out of range")
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
    elif typing.get_origin(hint) is tuple and typing.get_args(hint)[1:] == (Ellipsis,):
        _require(isinstance(v, list), f"{path}: expected a list, got {type(v).__name__}")
        item = typing.get_args(hint)[0]
        v = tuple(_value(x, item, f"{path}[{i}]") for i, x in enumerate(v))
    elif isinstance(hint, type) and dataclasses.is_dataclass(hint):
        v = from_dict(hint, v, path)
    else:  # pragma: no cover - a field type this codec was not taught
        raise TypeError(f"{path}: unsupported field type {hint}")
    return v
