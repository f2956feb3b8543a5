"""Storage keys: SHA-256 chained over full chunks of little-endian uint32 token ids, per namespace.

Keys must be equal across processes, hosts and restarts (a file written yesterday, a page
another prefill server stored), so they never involve Python's salted ``hash()``. Chaining
(``key_i = SHA256(key_{i-1} || tokens_i)``, ``key_{-1} = namespace``) makes a key name the whole
prefix, not just its own chunk: the same chunk after a different history is a different page.
The namespace is the digest of the compatibility record, so two models whose KV has the same
shape still never share a key.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping, Sequence

from pdserve.mem.storage.base import check_key

_NAMESPACE_DOMAIN = b"pdserve-kv-namespace-v1\0"
_MAX_TOKEN_ID = 2**32 - 1


def namespace(compat: Mapping[str, object], salt: str | None = None) -> bytes:
    """SHA-256 of the canonical JSON of the compatibility record and the optional salt.

    ``compat`` names what makes KV bytes interchangeable (model fingerprint, dtype, page size,
    memory layout, TP shard ...); values must be JSON scalars or lists of them.
    """
    if not compat:
        raise ValueError("compat: the compatibility record must not be empty")
    for field, value in compat.items():
        if not isinstance(field, str):
            raise ValueError(f"compat: field names must be strings, got {field!r}")
        _check_json_value(field, value)
    if salt is not None and not isinstance(salt, str):
        raise ValueError(f"salt: must be a string or None, got {type(salt).__name__}")
    record = {"compat": dict(compat), "salt": salt}
    canonical = json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(_NAMESPACE_DOMAIN + canonical.encode()).digest()


def _check_json_value(field: str, value: object) -> None:
    if isinstance(value, list | tuple):
        for item in value:
            _check_json_value(field, item)
    elif not (value is None or isinstance(value, str | int | float | bool)):
        raise ValueError(f"compat.{field}: {type(value).__name__} is not a JSON scalar")


def chunk_keys(
    namespace: bytes, token_ids: Sequence[int], chunk_tokens: int, *, parent: bytes | None = None
) -> list[bytes]:
    """One key per full chunk of ``token_ids`` (a trailing partial chunk gets none).

    ``parent``: the key of the chunk before ``token_ids[0]`` when continuing a chain (default:
    ``token_ids`` starts the sequence, so the chain starts at ``namespace``).
    """
    check_key(namespace, "namespace")
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens: must be a positive integer, got {chunk_tokens!r}")
    prev = check_key(parent, "parent") if parent is not None else namespace
    keys: list[bytes] = []
    for start in range(0, len(token_ids) - chunk_tokens + 1, chunk_tokens):
        prev = hashlib.sha256(prev + _pack_tokens(token_ids[start : start + chunk_tokens])).digest()
        keys.append(prev)
    return keys


def _pack_tokens(tokens: Sequence[int]) -> bytes:
    try:
        return struct.pack(f"<{len(tokens)}I", *tokens)
    except struct.error:
        bad = next((t for t in tokens if not isinstance(t, int) or not 0 <= t <= _MAX_TOKEN_ID), None)
        raise ValueError(f"token_ids: {bad!r} is not a token id in [0, 2**32)") from None
