"""The storage leg of the hierarchical cache: chunks of host pages to and from a ``PageStore``.

A chunk is ``chunk_tokens`` tokens (``chunk_pages`` pages) starting at a multiple of itself,
keyed by ``storage.keys.chunk_keys`` (chained SHA-256 from the namespace, so a key names the
whole prefix). Its payload is its pages in host memory as page_first bytes.

Puts run on a background thread (a failed put only costs a later recompute; the pages are
still on host). A thread that raises is replaced and counted in ``thread_restarts`` so the
tier never goes quietly dark. Gets (``prefetch``) run on a second thread while the request
waits in the queue: a ``Prefetch`` collects whole, checked chunks in order as they land, and
a miss anywhere ends the hit there. The scheduler decides when to stop waiting
(``prefetch_can_stop``, the ``--hicache-storage-prefetch-policy``) and takes what has landed;
nothing of a prefetch enters the cache before that, so a cancelled one leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.config import PrefetchPolicy
from pdserve.mem.storage import PageStore, chunk_keys

logger = logging.getLogger(__name__)

PUT_QUEUE_CHUNKS = 256  # puts beyond this many waiting are dropped (and counted), never block the loop
GET_QUEUE_PREFETCHES = 256  # prefetches beyond this many waiting finish empty (counted), never block the loop


@dataclass
class Prefetch:
    """A read of chunks ``first, first + 1, ...`` (``keys``) for one waiting request. The storage
    thread appends to ``payloads`` (under ``lock``) and sets ``done`` when it stops; ``cancel``
    makes it stop at the next chunk. ``min_chunks``: a shorter hit is not worth reading."""

    first: int
    keys: list[bytes]
    page_bytes: int
    min_chunks: int = 1
    started: float = field(default_factory=time.monotonic)
    payloads: list[bytes] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False

    def landed(self) -> list[bytes]:
        with self.lock:
            return list(self.payloads)

    def cancel(self) -> None:
        self.cancelled = True


def prefetch_can_stop(policy: PrefetchPolicy, done: bool, elapsed_s: float, tokens: int) -> bool:
    """Whether a waiting request stops waiting for its prefetch now (pure: the policy table)."""
    if done or policy.name == "best_effort":
        return True
    if policy.name == "timeout":
        return elapsed_s >= policy.bound_s(tokens)
    return False  # wait_complete


class StorageLeg:
    """Puts (asynchronous) and gets (synchronous) of whole chunks against ``store``."""

    def __init__(self, store: PageStore, namespace: bytes, chunk_tokens: int, page_size: int,
                 policy: PrefetchPolicy | None = None):
        if chunk_tokens % page_size:
            raise ValueError(f"hicache_storage_chunk_tokens: must be a multiple of the page size ({page_size}), "
                             f"got {chunk_tokens}")
        self.store = store
        self.namespace = namespace
        self.chunk_tokens = chunk_tokens
        self.chunk_pages = chunk_tokens // page_size
        self.policy = policy or PrefetchPolicy()
        self.counters = {"storage_get_bytes": 0, "storage_put_bytes": 0,
                         "storage_puts_dropped": 0, "storage_thread_restarts": 0,
                         "storage_prefetches": 0, "storage_prefetches_dropped": 0,
                         "storage_prefetch_stopped_early": 0, "storage_prefetch_skipped_short": 0}
        self._queue: queue.Queue[tuple[bytes, bytes] | None] = queue.Queue(PUT_QUEUE_CHUNKS)
        self._lock = threading.Lock()
        self._closed = False
        self._probe_hits = 0
        self._thread = self._start_thread()
        self._gets: queue.Queue[Prefetch | None] = queue.Queue(GET_QUEUE_PREFETCHES)
        self._get_thread = self._start_get_thread()

    def keys(self, tokens: Sequence[int], salt: str = "") -> list[bytes]:
        """Keys of the full chunks of ``tokens`` (from the start of the sequence) in ``salt``'s chain:
        a salted chain starts from a key of the salt (mem/radix_cache.py, cache isolation), so requests
        with different salts share no stored page either."""
        parent = hashlib.sha256(self.namespace + b"pdserve cache salt\0" + salt.encode()).digest() if salt else None
        return chunk_keys(self.namespace, list(tokens), self.chunk_tokens, parent=parent)

    # ------------------------------------------------------------------- puts
    def put_async(self, key: bytes, payload: bytes) -> None:
        if self._closed:
            return
        try:
            self._queue.put_nowait((key, payload))
        except queue.Full:
            self._count("storage_puts_dropped")

    def flush(self) -> None:
        """Wait until every queued put has run (tests, shutdown)."""
        self._queue.join()

    def _start_thread(self) -> threading.Thread:
        t = threading.Thread(target=self._put_loop, name="hicache-storage-put", daemon=True)
        t.start()
        return t

    def _put_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                key, payload = item
                if self.store.put(key, payload):  # a False is counted by the store (put_failures)
                    self._count("storage_put_bytes", len(payload))
            except Exception:
                # The put is lost (its pages are still on host); the tier must not stop with it.
                logger.exception("hicache storage thread failed; restarting it")
                self._count("storage_thread_restarts")
                if not self._closed:
                    self._thread = self._start_thread()
                return
            finally:
                self._queue.task_done()

    # ------------------------------------------------------------------- gets
    def prefetch(self, first: int, keys: Sequence[bytes], page_bytes: int, min_chunks: int = 1) -> Prefetch:
        """Start reading ``keys`` (chunks ``first, ...``) on the storage thread."""
        pf = Prefetch(first, list(keys), page_bytes, max(1, min_chunks))
        if self._closed:
            pf.done.set()
            return pf
        try:
            self._gets.put_nowait(pf)
            self._count("storage_prefetches")
        except queue.Full:
            self._count("storage_prefetches_dropped")
            pf.done.set()
        return pf

    def fetch(self, keys: Sequence[bytes], page_bytes: int) -> list[bytes]:
        """Payloads of the longest run of leading ``keys`` the store returns intact, read on the
        storage thread while the caller waits (tests, tools)."""
        pf = self.prefetch(0, keys, page_bytes)
        pf.done.wait()
        return pf.landed()

    def _start_get_thread(self) -> threading.Thread:
        t = threading.Thread(target=self._get_loop, name="hicache-storage-get", daemon=True)
        t.start()
        return t

    def _get_loop(self) -> None:
        while True:
            pf = self._gets.get()
            if pf is None:
                return
            try:
                self._read(pf)
            except Exception:
                logger.exception("hicache storage get thread failed; restarting it")
                self._count("storage_thread_restarts")
                if not self._closed:
                    self._get_thread = self._start_get_thread()
                return
            finally:
                pf.done.set()  # a waiting request must never wait on a dead thread

    def _read(self, pf: Prefetch) -> None:
        if pf.cancelled:
            return
        present = self.store.exists(pf.keys)
        if present < pf.min_chunks:
            if present:
                self._count("storage_prefetch_skipped_short")
            return
        for key in pf.keys[:present]:
            if pf.cancelled:
                return
            payload = self.store.get(key)
            if payload is None or len(payload) != self.chunk_pages * pf.page_bytes:
                return
            with pf.lock:
                pf.payloads.append(payload)
            self._count("storage_get_bytes", len(payload))

    def probe_get(self, key: bytes, n: int) -> None:
        """``n`` timed reads of the start-up probe object (not counted as hits)."""
        for _ in range(n):
            if self.store.get(key) is not None:
                self._probe_hits += 1

    def count_stopped_early(self) -> None:
        self._count("storage_prefetch_stopped_early")

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def stats(self) -> dict[str, int]:
        with self._lock:
            out = dict(self.counters)
        out.update({f"storage_{k}": v for k, v in self.store.stats().items()})
        if "storage_hits" in out:
            out["storage_hits"] -= self._probe_hits
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._gets.put(None)
        self._thread.join(timeout=10)
        self._get_thread.join(timeout=10)
        self.store.close()
