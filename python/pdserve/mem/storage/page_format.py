"""The on-store object: a fixed header that lets a reader prove the payload is the page it asked for.

Layout (little-endian), ``HEADER_BYTES`` = 120::

    magic      4  b"PDKV"
    version    2  FORMAT_VERSION
    flags      2  FLAG_MAC when the page is signed, else 0
    namespace 32  compatibility-record digest the writer used
    key       32  the full chunk key
    length     8  payload bytes that follow
    crc        4  CRC32C of the payload
    mac       32  HMAC-SHA256 of the 84 bytes before it and the payload (zeros when unsigned)
    hcrc       4  CRC32C of the 116 bytes before it (a flipped header bit is caught by itself)

Every load checks all of them; the store turns a mismatch into a counted miss. The full key is
kept (not just a file name or a store key) so that a renamed, copied or hash-colliding object
cannot be served for the wrong prefix; the namespace so that another model's page of the same
shape is refused with its own counter.

A CRC only catches accidents: anyone who can write the store (another client of a shared
Mooncake master, another local user) can plant a well-formed page under any key, and the
reader would serve its bytes as KV. So under a deployment token (``--disaggregation-auth-token``)
writers sign pages with a key derived from it (``mac_key``) and readers refuse an unsigned or
wrongly signed page as ``bad_mac``. Without a token pages are unsigned and only the CRC is
checked, as before.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

import google_crc32c

from pdserve.mem.storage.base import KEY_BYTES, check_key

MAGIC = b"PDKV"
FORMAT_VERSION = 2  # 1: no MAC field
FLAG_MAC = 1
MAC_BYTES = 32
_PREFIX = struct.Struct(f"<4sHH{KEY_BYTES}s{KEY_BYTES}sQI")
_HCRC = struct.Struct("<I")
HEADER_BYTES = _PREFIX.size + MAC_BYTES + _HCRC.size
_NO_MAC = bytes(MAC_BYTES)
# Domain of the key derivation: a page MAC key is useless for any other HMAC the token keys.
_MAC_KEY_LABEL = b"pdserve-kv-page-mac-v1"


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


def mac_key(token: str) -> bytes:
    """The page-signing key of a deployment token (an HMAC of a fixed label under the token, so
    the token itself never keys page MACs)."""
    if not token:
        raise ValueError("auth_token: a page MAC key needs a non-empty token")
    return hmac.new(token.encode(), _MAC_KEY_LABEL, hashlib.sha256).digest()


def _mac(key: bytes, prefix: bytes, payload: bytes | memoryview) -> bytes:
    h = hmac.new(key, prefix, hashlib.sha256)
    h.update(payload)
    return h.digest()


def header(namespace: bytes, key: bytes, payload: bytes | memoryview, mac_key: bytes | None = None) -> bytes:
    """The header of ``payload`` alone, for writers that send header and payload without joining
    them; signed when ``mac_key`` is given."""
    check_key(namespace, "namespace")
    check_key(key)
    flags = FLAG_MAC if mac_key is not None else 0
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, flags, namespace, key, len(payload), crc32c(payload))
    signed = prefix + (_mac(mac_key, prefix, payload) if mac_key is not None else _NO_MAC)
    return signed + _HCRC.pack(crc32c(signed))


def pack(namespace: bytes, key: bytes, payload: bytes | memoryview, mac_key: bytes | None = None) -> bytes:
    """Header + payload, ready to be written as one object."""
    return header(namespace, key, payload, mac_key) + bytes(payload)


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
    (hcrc,) = _HCRC.unpack_from(blob, HEADER_BYTES - _HCRC.size)
    if hcrc != crc32c(bytes(blob[: HEADER_BYTES - _HCRC.size])):
        raise PageFormatError("corrupt", "header checksum mismatch")
    return ns, key, length


def unpack(blob: bytes | memoryview, namespace: bytes, key: bytes, mac_key: bytes | None = None) -> bytes:
    """The payload of ``blob`` if it is exactly the page ``key`` of ``namespace`` (and, with
    ``mac_key``, signed under it); PageFormatError if not."""
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
    if mac_key is not None:
        _check_mac(blob, mac_key, payload)
    return payload


def _check_mac(blob: bytes | memoryview, mac_key: bytes, payload: bytes) -> None:
    (_magic, _version, flags) = struct.unpack_from("<4sHH", blob)
    if not flags & FLAG_MAC:
        raise PageFormatError("bad_mac", "page is not signed, and this server has a token")
    stored = bytes(blob[_PREFIX.size : _PREFIX.size + MAC_BYTES])
    if not hmac.compare_digest(stored, _mac(mac_key, bytes(blob[: _PREFIX.size]), payload)):
        raise PageFormatError("bad_mac", "page MAC does not match this server's token")
