"""Compiling grammars off the caller's thread, fairly between clients, with a bounded LRU of results.

``submit(kind, text, owner)`` returns a Future of the backend's compiled grammar: the cached one
(done, or still compiling for an earlier request: compiles are shared), or a new compile queued
for one of ``config.compile_threads`` threads. Failures are cached too (the same bad schema sent
again gets its error at once). At most ``config.cache_size`` entries are kept, least recently
used dropped. The backend itself is built on a compile thread at the first compile (a large
vocabulary takes a second), so no caller ever waits for it on its own thread.

One client must not starve the others (issue 33: ten clients that sent a 10 s schema each and hung
up made a later trivial schema time out behind them). So:

* each ``owner`` (the frontend's client: API key, X-Client-Token, peer) has its own queue of at
  most ``config.max_compiles_per_client`` new compiles, queued or running; one more is refused at
  once (``CompileBusy``, a 429) instead of waiting behind its own;
* the threads take the queues in turn (round robin over owners), not in arrival order;
* a caller that stops waiting (timed out, disconnected, its request aborted) says so with
  ``release``; a compile nobody waits for any more is dropped before it starts. One that is
  already running finishes on its thread (a thread cannot be stopped; see
  docs/structured-outputs.md, "Limits", for what bounds it) and is cached for the next asker,
  unless it runs in a child process (below);
* the compile threads run at a lower CPU priority (nice +10) than the threads that serve requests.

``owner=None`` (the scheduler, which compiles only what its frontend already accepted) is never
refused and shares one queue.

With ``make_worker`` (the frontend's check, ``--grammar-compile-isolation``) each thread compiles in
its own child process with CPU and memory limits (constrained/isolation.py), and a Future's result is
the compile's seconds, not a grammar: the check only learns whether the constraint compiles. A
running compile nobody waits for any more is then killed once it has run ``KILL_GRACE_S`` (nothing
cached; a new asker before then keeps it alive), not left to finish.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from pdserve.config import GrammarConfig
from pdserve.constrained.base import GrammarBackend, GrammarError, GrammarTimeout, short_error
from pdserve.constrained.isolation import CompileDropped, CompileKilled, IsolatedCompiler
from pdserve.constrained.stats import GrammarStats

Key = tuple[str, str]  # (kind, text)
SCHEDULER = "\0scheduler"  # the owner of compiles submitted with owner=None


class CompileBusy(GrammarError):
    """This client already has ``max_compiles_per_client`` compiles queued or running (a 429)."""


@dataclass
class _Job:
    """A compile not finished yet. Invariant: counted in ``_owned[owner]`` until it leaves ``_jobs``."""

    key: Key
    future: Future
    owner: str
    waiters: int = 1
    started: bool = False


class CompileService:
    def __init__(self, make_backend: Callable[[], GrammarBackend], config: GrammarConfig,
                 stats: GrammarStats | None = None,
                 make_worker: Callable[[], IsolatedCompiler] | None = None):
        self.config = config
        self.stats = stats or GrammarStats()
        self._make_backend = make_backend
        self._backend: GrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self._lock = threading.Condition()
        self._cache: OrderedDict[Key, Future] = OrderedDict()
        self._jobs: dict[Key, _Job] = {}  # compiles not finished (queued or running)
        self._queues: OrderedDict[str, deque[_Job]] = OrderedDict()  # owner -> its queued jobs, in turn order
        self._owned: dict[str, int] = {}  # owner -> its jobs queued or running
        self._closed = False
        self._workers = [make_worker() for _ in range(config.compile_threads)] if make_worker else []
        self._threads = [threading.Thread(target=self._work, args=(i,), name=f"pdserve-grammar-{i}", daemon=True)
                         for i in range(config.compile_threads)]
        for t in self._threads:
            t.start()

    def backend(self) -> GrammarBackend:
        """The backend (built on the first call; later calls return it at once)."""
        with self._backend_lock:
            if self._backend is None:
                self._backend = self._make_backend()
            return self._backend

    @property
    def backend_ready(self) -> GrammarBackend | None:
        return self._backend

    def submit(self, kind: str, text: str, owner: str | None = None) -> Future:
        """The Future of ``(kind, text)`` compiled; the caller waits on it and calls ``release`` when it
        stops waiting. Raises CompileBusy when ``owner`` has too many compiles of its own in the queue."""
        key = (kind, text)
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                self.stats.count("cache_hits")
                job = self._jobs.get(key)
                if job is not None:
                    job.waiters += 1
                return fut
            who = SCHEDULER if owner is None else owner
            limit = self.config.max_compiles_per_client
            if owner is not None and self._owned.get(who, 0) >= limit:
                self.stats.count("busy")
                raise CompileBusy(kind, f"this client already has {limit} grammars compiling or queued "
                                        f"(--grammar-max-compiles-per-client); retry when they are done")
            self.stats.count("cache_misses")
            fut = Future()
            job = _Job(key, fut, who)
            self._jobs[key] = job
            self._owned[who] = self._owned.get(who, 0) + 1
            if who not in self._queues:  # a client new to the queue goes first: it has had no turn yet
                self._queues[who] = deque()
                self._queues.move_to_end(who, last=False)
            self._queues[who].append(job)
            self._cache[key] = fut
            while len(self._cache) > self.config.cache_size:
                self._cache.popitem(last=False)
            self._lock.notify()
        return fut

    def release(self, kind: str, text: str) -> None:
        """One caller of ``submit(kind, text)`` stopped waiting; with none left, a compile that has not
        started is dropped (its Future cancelled, nothing cached); one running in a child process is
        killed by its thread once it has run KILL_GRACE_S with nobody waiting (``_check_isolated``)."""
        key = (kind, text)
        with self._lock:
            job = self._jobs.get(key)
            if job is None:
                return
            job.waiters -= 1
            if job.waiters > 0 or job.started:
                return
            self._queues[job.owner].remove(job)
            self._forget(job)
            if self._cache.get(key) is job.future:
                del self._cache[key]
            self.stats.count("abandoned")
        job.future.cancel()

    def compile(self, kind: str, text: str, timeout: float | None = None) -> Any:
        """Block until compiled (at most ``timeout``, default the configured one); raises
        GrammarError (GrammarTimeout past the time)."""
        fut = self.submit(kind, text)
        seconds = self.config.compile_timeout_s if timeout is None else timeout
        try:
            return fut.result(seconds)
        except FutureTimeout:
            self.stats.count("timeouts")
            raise timeout_error(kind, seconds) from None
        finally:
            self.release(kind, text)

    # ---------------------------------------------------------- the threads
    def _next(self) -> _Job | None:
        """The next job, taking the owners in turn (under the lock; None once closed)."""
        while not self._closed:
            for owner, queue in self._queues.items():
                if queue:
                    job = queue.popleft()
                    self._queues.move_to_end(owner)
                    job.started = True
                    return job
            self._lock.wait()
        return None

    def _work(self, index: int) -> None:
        _lower_priority()
        worker = self._workers[index] if self._workers else None
        while True:
            with self._lock:
                job = self._next()
            if job is None:
                return
            if job.future.set_running_or_notify_cancel():
                try:
                    job.future.set_result(self._check_isolated(job, worker) if worker else self._compile(*job.key))
                except GrammarError as e:
                    job.future.set_exception(e)
            with self._lock:
                self._forget(job)

    def _forget(self, job: _Job) -> None:
        """``job`` left the queue for good (finished or dropped); under the lock."""
        if self._jobs.get(job.key) is job:
            del self._jobs[job.key]
        self._owned[job.owner] -= 1
        if not self._owned[job.owner]:
            del self._owned[job.owner]
            if not self._queues.get(job.owner, True):
                del self._queues[job.owner]

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

    def _check_isolated(self, job: _Job, worker: IsolatedCompiler) -> float:
        try:
            seconds = worker.compile(*job.key, abandoned=lambda: job.waiters <= 0)
        except (CompileKilled, CompileDropped) as e:
            with self._lock:
                if self._cache.get(job.key) is job.future:  # nothing cached: the next asker compiles anew
                    del self._cache[job.key]
                self.stats.count("killed" if isinstance(e, CompileKilled) else "abandoned")
            raise
        except GrammarError:
            self.stats.count("compile_failures")
            raise
        except Exception as e:  # noqa: BLE001 - e.g. a child that cannot start: the request's error, not the thread's end
            self.stats.count("compile_failures")
            raise GrammarError(job.key[0], f"could not be checked: {short_error(e)}") from None
        self.stats.observe_compile(seconds)
        return seconds

    def queued(self, owner: str | None = None) -> int:
        """Compiles queued or running for ``owner`` (None: the scheduler's)."""
        with self._lock:
            return self._owned.get(SCHEDULER if owner is None else owner, 0)

    def __len__(self) -> int:
        return len(self._cache)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            dropped = [job for queue in self._queues.values() for job in queue]
            self._queues.clear()
            self._lock.notify_all()
        for job in dropped:
            job.future.cancel()
        for worker in self._workers:
            worker.close()


COMPILE_NICE = 10  # compile threads yield the CPU to the event loop and the scheduler


def _lower_priority() -> None:
    """Run this thread at ``COMPILE_NICE`` (Linux sets nice per thread): a compile uses what CPU the
    serving threads leave, so large schemas cannot slow other clients' requests. The backends release
    the GIL while they compile, so the CPU is what they would take. Best effort elsewhere."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICE)
    except (AttributeError, OSError):
        pass


def timeout_error(kind: str, seconds: float) -> GrammarTimeout:
    return GrammarTimeout(kind, f"compiling the grammar took longer than {seconds:g} s "
                                f"(--grammar-compile-timeout); simplify it or raise the limit")
