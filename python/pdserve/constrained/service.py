"""Compiling grammars off the caller's thread, with a bounded LRU of results.

``submit(kind, text)`` returns a Future of the backend's compiled grammar: the cached one (done,
or still compiling for an earlier request: compiles are shared), or a new compile on one of
``config.compile_threads`` threads. Failures are cached too (the same bad schema sent again gets
its error at once). At most ``config.cache_size`` entries are kept, least recently used dropped.
The backend itself is built on a compile thread at the first submit (a large vocabulary takes
a second), so no caller ever waits for it on its own thread.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from pdserve.config import GrammarConfig
from pdserve.constrained.base import GrammarBackend, GrammarError, GrammarTimeout, short_error
from pdserve.constrained.stats import GrammarStats


class CompileService:
    def __init__(self, make_backend: Callable[[], GrammarBackend], config: GrammarConfig,
                 stats: GrammarStats | None = None):
        self.config = config
        self.stats = stats or GrammarStats()
        self._make_backend = make_backend
        self._backend: GrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._pool = ThreadPoolExecutor(config.compile_threads, thread_name_prefix="pdserve-grammar")

    def backend(self) -> GrammarBackend:
        """The backend (built on the first call; later calls return it at once)."""
        with self._backend_lock:
            if self._backend is None:
                self._backend = self._make_backend()
            return self._backend

    @property
    def backend_ready(self) -> GrammarBackend | None:
        return self._backend

    def submit(self, kind: str, text: str) -> Future:
        key = (kind, text)
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                self.stats.count("cache_hits")
                return fut
            self.stats.count("cache_misses")
            fut = self._pool.submit(self._compile, kind, text)
            self._cache[key] = fut
            while len(self._cache) > self.config.cache_size:
                self._cache.popitem(last=False)
        return fut

    def compile(self, kind: str, text: str, timeout: float | None = None) -> Any:
        """Block until compiled (at most ``timeout``, default the configured one); raises
        GrammarError (GrammarTimeout past the time)."""
        fut = self.submit(kind, text)
        try:
            return fut.result(self.config.compile_timeout_s if timeout is None else timeout)
        except FutureTimeout:
            self.stats.count("timeouts")
            raise timeout_error(kind, self.config.compile_timeout_s if timeout is None else timeout) from None

    def _compile(self, kind: str, text: str) -> Any:
        try:
            backend = self.backend()  # built once, not counted as a compile
        except Exception as e:  # noqa: BLE001 - e.g. the backend's package missing: every request's error
            self.stats.count("compile_failures")
            raise GrammarError(kind, f"cannot be compiled: {short_error(e)}") from None
        t0 = time.perf_counter()
        try:
            return backend.compile(kind, text)
        except GrammarError:
            self.stats.count("compile_failures")
            raise
        except Exception as e:  # noqa: BLE001 - a backend's own failure becomes the request's error
            self.stats.count("compile_failures")
            raise GrammarError(kind, f"could not be compiled: {short_error(e)}") from None
        finally:
            self.stats.observe_compile(time.perf_counter() - t0)

    def __len__(self) -> int:
        return len(self._cache)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def timeout_error(kind: str, seconds: float) -> GrammarTimeout:
    return GrammarTimeout(kind, f"compiling the grammar took longer than {seconds:g} s "
                                f"(--grammar-compile-timeout); simplify it or raise the limit")
