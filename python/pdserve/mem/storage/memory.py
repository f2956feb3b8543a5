"""In-process tiers for tests: a bounded dict store, and a wrapper that makes any tier misbehave.

``MemoryStore`` keeps ``page_format`` blobs in an LRU dict bounded by bytes, so it verifies
loads exactly like the real tiers (its ``corrupt`` can flip a stored byte to prove it).
``FaultyStore`` wraps any ``PageStore`` to reproduce the field failures the engine must survive:
a key evicted between ``exists`` and ``get``, a slow loader, failing puts. Neither touches the
disk or the network, so engine tests with a storage tier stay in one process.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pdserve.mem.storage import page_format
from pdserve.mem.storage.base import Counters, PageStore, check_key

GB = 10**9


class MemoryStore:
    """``PageStore`` over a dict of packed objects, least recently used evicted past ``capacity_bytes``."""

    name = "memory"

    def __init__(self, capacity_bytes: int, namespace: bytes, mac_key: bytes | None = None) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"hicache_storage_size_gb: must be > 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.namespace = check_key(namespace, "namespace")
        self._mac_key = mac_key
        self._lock = threading.Lock()
        self._objects: OrderedDict[bytes, bytes] = OrderedDict()
        self._used = 0
        self._closed = False
        self._counters = Counters()

    def exists(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            if self._closed:
                return 0
            for n, key in enumerate(keys):
                if key not in self._objects:
                    return n
                self._objects.move_to_end(key)
            return len(keys)

    def get(self, key: bytes) -> bytes | None:
        check_key(key)
        with self._lock:
            blob = None if self._closed else self._objects.get(key)
        if blob is None:
            self._counters.miss("closed" if self._closed else "miss_absent")
            return None
        try:
            payload = page_format.unpack(blob, self.namespace, key, self._mac_key)
        except page_format.PageFormatError as err:
            self._counters.miss(err.reason)
            self.remove(key)
            return None
        self._counters.hit(len(payload))
        return payload

    def put(self, key: bytes, payload: bytes) -> bool:
        check_key(key)
        blob = page_format.pack(self.namespace, key, payload, self._mac_key)
        with self._lock:
            if self._closed or len(blob) > self.capacity_bytes:
                self._counters.add("put_failures")
                return False
            if key in self._objects:
                self._counters.add("put_duplicates")
                return True
            while self._used + len(blob) > self.capacity_bytes:
                _, victim = self._objects.popitem(last=False)
                self._used -= len(victim)
                self._counters.add("evictions")
            self._objects[key] = blob
            self._used += len(blob)
        self._counters.add("puts")
        self._counters.add("bytes_written", len(blob))
        return True

    def stats(self) -> dict[str, int]:
        out = self._counters.snapshot()
        with self._lock:
            out["objects"] = len(self._objects)
            out["bytes_used"] = self._used
        return out

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._objects.clear()
            self._used = 0

    # -- test hooks -----------------------------------------------------------------------------

    def remove(self, key: bytes) -> bool:
        """Drop ``key`` as an eviction elsewhere would; True if it was there."""
        with self._lock:
            blob = self._objects.pop(key, None)
            if blob is not None:
                self._used -= len(blob)
            return blob is not None

    def corrupt(self, key: bytes, offset: int = -1) -> None:
        """Flip one stored byte of ``key`` (default: the payload's last), as a bad disk or DIMM would."""
        with self._lock:
            blob = bytearray(self._objects[key])
            blob[offset] ^= 0xFF
            self._objects[key] = bytes(blob)

    def replace_raw(self, key: bytes, blob: bytes) -> None:
        """Store ``blob`` as is under ``key`` (another model's page, a truncated object ...)."""
        with self._lock:
            old = self._objects.pop(key, None)
            self._used += len(blob) - (len(old) if old is not None else 0)
            self._objects[key] = blob


@dataclass
class Faults:
    """What ``FaultyStore`` does wrong; tests change the fields while it runs."""

    get_delay_s: float = 0.0  # every get sleeps this long first (a slow loader)
    fail_puts: bool = False  # every put returns False without storing
    evict_after_exists: bool = False  # keys ``exists`` reports are removed before any get can load them


class FaultyStore:
    """Any ``PageStore`` with injected faults; ``evict_after_exists`` needs an inner ``MemoryStore``."""

    def __init__(self, inner: PageStore, faults: Faults | None = None) -> None:
        self.inner = inner
        self.name = inner.name
        self.faults = faults or Faults()
        self._counters = Counters()

    def exists(self, keys: Sequence[bytes]) -> int:
        n = self.inner.exists(keys)
        if self.faults.evict_after_exists and isinstance(self.inner, MemoryStore):
            for key in keys[:n]:
                if self.inner.remove(key):
                    self._counters.add("injected_evictions")
        return n

    def get(self, key: bytes) -> bytes | None:
        if self.faults.get_delay_s > 0:
            self._counters.add("injected_delays")
            time.sleep(self.faults.get_delay_s)
        return self.inner.get(key)

    def put(self, key: bytes, payload: bytes) -> bool:
        if self.faults.fail_puts:
            self._counters.add("injected_put_failures")
            return False
        return self.inner.put(key, payload)

    def stats(self) -> dict[str, int]:
        out = self.inner.stats()
        injected = {k: v for k, v in self._counters.snapshot().items() if k.startswith("injected_")}
        out.update(injected)
        out["put_failures"] += injected.get("injected_put_failures", 0)
        return out

    def close(self) -> None:
        self.inner.close()


def create_memory_store(
    *,
    directory: str | None,
    size_gb: float,
    namespace: bytes,
    extra_config: Mapping[str, object],
    mac_key: bytes | None = None,
    host: str = "127.0.0.1",
) -> MemoryStore:
    """``create_page_store("memory", ...)``: tests only; ``directory`` and extra config are refused."""
    if extra_config:
        raise ValueError(
            f"hicache_storage_backend_extra_config: the memory backend takes none, got {sorted(extra_config)}"
        )
    del directory, host
    return MemoryStore(int(size_gb * GB), namespace, mac_key)
