"""The contract every KV storage tier keeps (file, Mooncake Store, a fake): content-addressed pages.

A key (``keys.chunk_keys``) names one full chunk of tokens inside one namespace (model, dtype,
page size, layout, TP shard, salt); the payload is that chunk's KV bytes in whatever layout the
caller chose. Tiers store ``page_format.pack``-ed objects and check them on every load, so:

* **A lookup is a hint.** ``exists`` may say a key is there and a later ``get`` miss: another
  client, eviction or a lease expiry can remove it in between. Callers must treat ``get``'s
  answer as the truth and recompute what it misses.
* **A miss is never an exception and never wrong bytes.** ``get`` returns the payload only when
  the object's magic, version, namespace, full key, length and CRC32C all match (and, under a
  token, its MAC); anything else (absent, evicted, truncated, corrupted, another model's page, a
  page planted without the token, an I/O error, a dead server) is ``None`` and one counter in
  ``stats()`` says which.
* **A failed put is ``False``**, never an exception (store full, disk full, server gone): the
  data is still in the tier above, so losing a write-back only costs a later recompute.
* Programming errors (a key of the wrong length) do raise. After ``close`` every ``get`` misses
  (``closed``) and every ``put`` fails, so a storage thread racing shutdown needs no special case.

Implementations are thread-safe: a storage thread may put while another gets.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

KEY_BYTES = 32  # SHA-256 digests: keys and namespaces alike

# Counters every tier reports (tiers may add their own). ``misses`` is the sum of the miss_* ones.
STAT_NAMES = (
    "hits",
    "misses",
    "miss_absent",  # no such object (never stored, evicted, expired)
    "corrupt",  # bad magic/version/length/CRC, truncated or a different key inside
    "wrong_namespace",  # a well-formed page of another compatibility record
    "bad_mac",  # under a token: a well-formed page not signed with it (planted, or another deployment's)
    "read_errors",  # I/O or server errors while reading
    "closed",  # asked after close()
    "puts",
    "put_failures",
    "evictions",
    "bytes_read",
    "bytes_written",
)


@runtime_checkable
class PageStore(Protocol):
    """One storage tier. ``name`` is its backend name (``file``, ``mooncake``)."""

    name: str

    def exists(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are present now (stops at the first absent one). A hint only."""
        ...

    def get(self, key: bytes) -> bytes | None:
        """The verified payload stored under ``key``, or None (a miss, counted by reason)."""
        ...

    def put(self, key: bytes, payload: bytes) -> bool:
        """Store ``payload`` under ``key``; False when it was not stored (full, failed). Idempotent."""
        ...

    def stats(self) -> dict[str, int]:
        """A snapshot of the counters in ``STAT_NAMES`` plus tier-specific ones."""
        ...

    def close(self) -> None:
        """Release files, connections and memory this store owns. Safe to call twice."""
        ...


def check_key(key: bytes, what: str = "key") -> bytes:
    """A key or namespace must be a 32-byte digest: anything else is a caller's bug."""
    if not isinstance(key, bytes | bytearray) or len(key) != KEY_BYTES:
        raise ValueError(f"{what} must be {KEY_BYTES} bytes (a SHA-256 digest), got {key!r:.80}")
    return bytes(key)


class Counters:
    """Thread-safe counters shared by the tiers, so every tier reports the same names."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(STAT_NAMES, 0)

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._values[name] = self._values.get(name, 0) + amount

    def miss(self, reason: str) -> None:
        """One miss, and the counter saying why (a name from STAT_NAMES or a tier's own)."""
        with self._lock:
            self._values["misses"] += 1
            self._values[reason] = self._values.get(reason, 0) + 1

    def hit(self, nbytes: int) -> None:
        with self._lock:
            self._values["hits"] += 1
            self._values["bytes_read"] += nbytes

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)


# backend name -> (module, factory); imported on first use so Mooncake loads only when chosen.
_BACKENDS = {
    "file": ("pdserve.mem.storage.file", "create_file_store"),
    "mooncake": ("pdserve.mem.storage.mooncake_store", "create_mooncake_store"),
    "memory": ("pdserve.mem.storage.memory", "create_memory_store"),  # in-process, for tests
}
BACKEND_NAMES = tuple(_BACKENDS)


def create_page_store(
    backend: str,
    *,
    directory: str | None,
    size_gb: float,
    namespace: bytes,
    extra_config: Mapping[str, object] | None,
    auth_token: str | None = None,
    host: str = "127.0.0.1",
) -> PageStore:
    """The tier named by ``--hicache-storage-backend``.

    ``directory``: ``--hicache-storage-dir`` (the file tier needs it); ``size_gb``:
    ``--hicache-storage-size-gb`` (the file tier's bound; Mooncake's segment size unless the
    extra config names ``global_segment_size``); ``extra_config``:
    ``--hicache-storage-backend-extra-config``, checked by the backend, unknown keys refused;
    ``auth_token``: the deployment's token (``config.resolve_token``), under which pages are
    signed and unsigned ones refused (``page_format``); None: CRC checks only; ``host``: the
    address this process is reached at (the server's ``--host``), where a shared tier's other
    clients find the memory it lends (Mooncake's ``local_hostname``).
    """
    if backend not in _BACKENDS:
        raise ValueError(f"hicache_storage_backend: {backend!r} is not one of {sorted(_BACKENDS)}")
    if not size_gb > 0:
        raise ValueError(f"hicache_storage_size_gb: must be > 0, got {size_gb!r}")
    check_key(namespace, "namespace")
    module, factory = _BACKENDS[backend]
    from pdserve.mem.storage import page_format

    store: PageStore = getattr(importlib.import_module(module), factory)(
        directory=directory, size_gb=size_gb, namespace=namespace, extra_config=dict(extra_config or {}),
        mac_key=page_format.mac_key(auth_token) if auth_token else None, host=host,
    )
    return store
