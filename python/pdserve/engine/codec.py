"""Typed, bounded bytes for every message between a server's processes and ranks (never pickle).

A frame is the msgpack of ``[type name, fields]``. ``Codec`` knows a fixed set of message
dataclasses by name; ``decode`` checks the frame's size first, looks the name up among those
types only, and decodes the fields strictly into that type (msgspec checks every field's type,
nested dataclasses, optionals, lists of tuples, and runs ``__post_init__``). Anything else is a
``CodecError``: bytes from a socket are data, so a stranger's frame can at worst be refused,
never run (a pickle runs whatever its author chose). Encoders and decoders are built once per
``Codec``, not per message: the frontend's hot path sends many small messages.

``Values`` is the untyped twin for the ranks' collectives (a stats dict, a rank's fact in an
agreement round): plain msgpack values, decoded into a type the caller names, or into builtins.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import msgspec

logger = logging.getLogger(__name__)

# A frame larger than this is refused before decoding. The largest real one is a step's outputs
# with prompt logprobs (a long prompt x top-k pairs): tens of MiB at most.
MAX_FRAME_BYTES = 256 << 20


class CodecError(ValueError):
    """A frame that is not one of the codec's messages; the text says why (type, field, size)."""


class Codec:
    """Encode and decode the messages of ``types`` (dataclasses, each name once); ``max_bytes``
    bounds a frame."""

    def __init__(self, types: Iterable[type], max_bytes: int = MAX_FRAME_BYTES):
        self.types: dict[str, type] = {}
        for t in types:
            other = self.types.setdefault(t.__name__, t)
            if other is not t:
                raise ValueError(f"types: two message types named {t.__name__} ({other.__module__}, {t.__module__})")
        self.max_bytes = max_bytes
        self._encoder = msgspec.msgpack.Encoder()
        self._envelope = msgspec.msgpack.Decoder(tuple[str, msgspec.Raw])
        self._decoders: dict[str, msgspec.msgpack.Decoder] = {
            name: msgspec.msgpack.Decoder(t) for name, t in self.types.items()}

    def with_types(self, more: Iterable[type]) -> Codec:
        """A codec that also knows ``more`` (the same bound)."""
        return Codec([*self.types.values(), *more], self.max_bytes)

    def encode(self, msg) -> bytes:
        name = type(msg).__name__
        if self.types.get(name) is not type(msg):
            raise CodecError(f"type: {name} is not a message this codec carries")
        return self._encoder.encode((name, msg))

    def decode(self, frame: bytes | memoryview) -> Any:
        """The message in ``frame``; CodecError for anything else, never another exception."""
        if len(frame) > self.max_bytes:
            raise CodecError(f"frame: {len(frame)} bytes (at most {self.max_bytes})")
        try:
            name, raw = self._envelope.decode(frame)
        except Exception as e:  # noqa: BLE001 - DecodeError, ValidationError, RecursionError: all the peer's
            raise CodecError(f"frame: not a [type, fields] message ({_short(e)})") from None
        decoder = self._decoders.get(name)
        if decoder is None:
            raise CodecError(f"type: unknown message type {name!r:.60}")
        try:
            return decoder.decode(raw)
        except msgspec.ValidationError as e:  # a field of the wrong type, or refused by __post_init__
            raise CodecError(f"{name}: {str(e)[:300]}") from None
        except Exception as e:  # noqa: BLE001 - malformed msgpack inside the envelope
            raise CodecError(f"{name}: {_short(e)}") from None


class Values:
    """Plain values (numbers, strings, bytes, lists, dicts, dataclasses) for collectives between
    ranks; ``decode(data, as_type)`` checks the result against ``as_type`` (Any: builtins only)."""

    def __init__(self, max_bytes: int = MAX_FRAME_BYTES):
        self.max_bytes = max_bytes
        self._encoder = msgspec.msgpack.Encoder()
        self._decoders: dict[Any, msgspec.msgpack.Decoder] = {}  # one per type asked for

    def encode(self, value) -> bytes:
        try:
            return self._encoder.encode(value)
        except TypeError as e:
            raise CodecError(f"value: {type(value).__name__} cannot be sent ({_short(e)})") from None

    def decode(self, data: bytes | memoryview, as_type: Any = Any) -> Any:
        if len(data) > self.max_bytes:
            raise CodecError(f"value: {len(data)} bytes (at most {self.max_bytes})")
        decoder = self._decoders.get(as_type)
        if decoder is None:
            decoder = self._decoders[as_type] = msgspec.msgpack.Decoder(as_type)
        try:
            return decoder.decode(data)
        except Exception as e:  # noqa: BLE001 - as in Codec.decode
            raise CodecError(f"value: not a {getattr(as_type, '__name__', as_type)} ({_short(e)})") from None


class DropCounter:
    """A receiver's refused frames: counted, and logged at the first and each power of two after
    (a stranger's flood of junk must not flood the log)."""

    def __init__(self, where: str):
        self.where = where
        self.count = 0

    def record(self, error: CodecError) -> None:
        self.count += 1
        if self.count & (self.count - 1) == 0:
            logger.warning("%s: dropped a frame that is not one of our messages (%d so far): %s",
                           self.where, self.count, error)


def _short(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e)[:200]}"
