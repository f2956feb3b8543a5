"""The on-store object: a fixed header that lets a reader prove the payload is the page it asked for.

Layout (little-endian), ``HEADER_BYTES`` = 88::

    magic      4  b"PDKV"
    version    2  FORMAT_VERSION
    flags      2  0 (reserved)
    namespace 32  compatibility-record digest the writer used
    key       32  the full chunk key
    length     8  payload bytes that follow
    crc       4  CRC32C of the payload
    hcrc      4  CRC32C of the 84 bytes before it (a flipped header bit is caught by itself)

Every load checks all of them; the store turns a mismatch into a counted miss. The full key is
kept (not just a file name or a store key) so that a renamed, copied or hash-colliding object
cannot be served for the wrong prefix; the namespace so that another model's page of the same
shape is refused with its own counter.
"""

from __future__ import annotations

import struct

import google_crc32c

from pdserve.mem.storage.base import KEY_BYTES, check_key

MAGIC = b"PDKV"
FORMAT_VERSION = 1
_PREFIX = struct.Struct(f"<4sHH{KEY_BYTES}s{KEY_BYTES}sQI")
_HCRC = struct.Struct("<I")
HEADER_BYTES = _PREFIX.size + _HCRC.size


class PageFormatError(ValueError):
    """A stored object is not the page asked for; ``reason`` is the counter it goes to."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def crc32c(data: bytes | memoryview) -> int:
    """CRC32C (Castagnoli) with google-crc32c's C implementation (SSE4.2/ARMv8 where available).

    Its C entry point takes only ``bytes`` (it refuses releasable buffers such as memoryviews),
    so anything else is copied once.
    """
    return int(google_crc32c.value(data if isinstance(data, bytes) else bytes(data)))


def header(namespace: bytes, key: bytes, payload: bytes | memoryview) -> bytes:
    """The header of ``payload`` alone, for writers that send header and payload without joining them."""
    check_key(namespace, "namespace")
    check_key(key)
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, 0, namespace, key, len(payload), crc32c(payload))
    return prefix + _HCRC.pack(crc32c(prefix))


def pack(namespace: bytes, key: bytes, payload: bytes | memoryview) -> bytes:
    """Header + payload, ready to be written as one object."""
    return header(namespace, key, payload) + bytes(payload)


def header_view(blob: bytes | memoryview) -> tuple[bytes, bytes, int]:
    """(namespace, key, payload length) of a well-formed header; PageFormatError otherwise.

    Enough to index an object without reading its payload (the file tier's start-up scan).
    """
    if len(blob) < HEADER_BYTES:
        raise PageFormatError("corrupt", f"{len(blob)} bytes is shorter than the {HEADER_BYTES}-byte header")
    prefix = bytes(blob[: _PREFIX.size])
    magic, version, _flags, ns, key, length, _crc = _PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise PageFormatError("corrupt", f"bad magic {magic!r}")
    if version != FORMAT_VERSION:
        raise PageFormatError("corrupt", f"format version {version}, this reader knows {FORMAT_VERSION}")
    (hcrc,) = _HCRC.unpack_from(blob, _PREFIX.size)
    if hcrc != crc32c(prefix):
        raise PageFormatError("corrupt", "header checksum mismatch")
    return ns, key, length


def unpack(blob: bytes | memoryview, namespace: bytes, key: bytes) -> bytes:
    """The payload of ``blob`` if it is exactly the page ``key`` of ``namespace``; PageFormatError if not."""
    ns, stored_key, length = header_view(blob)
    if ns != namespace:
        raise PageFormatError("wrong_namespace", "page written under another compatibility record")
    if stored_key != key:
        raise PageFormatError("corrupt", "object holds another key")
    if len(blob) != HEADER_BYTES + length:
        raise PageFormatError("corrupt", f"payload is {len(blob) - HEADER_BYTES} bytes, header says {length}")
    payload = bytes(memoryview(blob)[HEADER_BYTES:])  # the one copy: the caller gets bytes
    (crc,) = struct.unpack_from("<I", blob, _PREFIX.size - 4)
    if crc32c(payload) != crc:
        raise PageFormatError("corrupt", "payload CRC32C mismatch")
    return payload
