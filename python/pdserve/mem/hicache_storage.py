"""The storage leg of the hierarchical cache: chunks of host pages to and from a ``PageStore``.

A chunk is ``chunk_tokens`` tokens (``chunk_pages`` pages) starting at a multiple of itself,
keyed by ``storage.keys.chunk_keys`` (chained SHA-256 from the namespace, so a key names the
whole prefix). Its payload is its pages in host memory as page_first bytes.

Puts run on a background thread (a failed put only costs a later recompute; the pages are
still on host). A thread that raises is replaced and counted in ``thread_restarts`` so the
tier never goes quietly dark. Gets run where the scheduler asks (the prefetch of a waiting
request): a miss anywhere ends the hit there.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence

from pdserve.mem.storage import PageStore, chunk_keys

logger = logging.getLogger(__name__)

PUT_QUEUE_CHUNKS = 256  # puts beyond this many waiting are dropped (and counted), never block the loop


class StorageLeg:
    """Puts (asynchronous) and gets (synchronous) of whole chunks against ``store``."""

    def __init__(self, store: PageStore, namespace: bytes, chunk_tokens: int, page_size: int):
        if chunk_tokens % page_size:
            raise ValueError(f"hicache_storage_chunk_tokens: must be a multiple of the page size ({page_size}), "
                             f"got {chunk_tokens}")
        self.store = store
        self.namespace = namespace
        self.chunk_tokens = chunk_tokens
        self.chunk_pages = chunk_tokens // page_size
        self.counters = {"storage_get_bytes": 0, "storage_put_bytes": 0,
                         "storage_puts_dropped": 0, "storage_thread_restarts": 0}
        self._queue: queue.Queue[tuple[bytes, bytes] | None] = queue.Queue(PUT_QUEUE_CHUNKS)
        self._lock = threading.Lock()
        self._closed = False
        self._thread = self._start_thread()

    def keys(self, tokens: Sequence[int]) -> list[bytes]:
        """Keys of the full chunks of ``tokens`` (from the start of the sequence)."""
        return chunk_keys(self.namespace, list(tokens), self.chunk_tokens)

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
    def fetch(self, keys: Sequence[bytes], page_bytes: int) -> list[bytes]:
        """Payloads of the longest run of leading ``keys`` the store returns intact (each
        ``chunk_pages * page_bytes`` long); stops at the first miss."""
        present = self.store.exists(list(keys))
        out = []
        for key in keys[:present]:
            payload = self.store.get(key)
            if payload is None or len(payload) != self.chunk_pages * page_bytes:
                break
            out.append(payload)
            self._count("storage_get_bytes", len(payload))
        return out

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def stats(self) -> dict[str, int]:
        with self._lock:
            out = dict(self.counters)
        out.update({f"storage_{k}": v for k, v in self.store.stats().items()})
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout=10)
        self.store.close()
