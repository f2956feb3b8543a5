"""An in-memory TransferBackend: memcpy between buffers registered in one process.

For tests and hosts without Mooncake: a prefill and a decode scheduler built in the same process
(``test/disagg/pd_pair.py``) move their KV through it under the same contract as Mooncake's
(``base.py``). Servers never use it: each server's scheduler runs in its own process, and this
fabric does not cross processes (``config.SERVER_TRANSFER_BACKENDS``).

How it keeps the contract:

* Endpoints meet in a ``MemoryFabric``, the in-process stand-in for the network. Schedulers are
  built independently (``build_scheduler``), with nothing to hand one another, so by default
  they share the process's fabric; a test may pass its own.
* ``post_writes`` queues the batch for this endpoint's copier thread and returns at once;
  ``poll`` sees PENDING until the copier ran it. A batch is copied under the destination
  endpoint's lock after checking every destination lies in a region it registered, so an
  ``unregister`` or ``close`` of the peer never races a copy, and DONE means the bytes are there.
* A destination outside the peer's regions, or an unknown or closed peer, fails the batch (the
  writes before the bad one landed; none is in flight afterwards), naming the peer.
* ``write_sync`` copies on the caller's thread, then appends the notify to the peer's list:
  it can never overtake its data.
* ``freeze`` stands for a stopped process (SIGSTOP, a long GC pause): its probes go unanswered,
  its own copier stops, and writes to it wait; they land on ``thaw``, or fail once they waited
  ``stall_timeout_s`` (Mooncake fails a write that makes no progress for 30 s), or when either
  end closes. A failed write never lands later.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.transfer import base
from pdserve.transfer.base import TransferBackend, TransferError, WriteHandle, WriteState

_RETRY_S = 0.002  # how often the copier looks again at batches waiting on a frozen peer


class MemoryFabric:
    """Live in-memory endpoints of one process, by session id."""

    def __init__(self):
        self._lock = threading.Lock()
        self._endpoints: dict[str, MemoryTransferBackend] = {}
        self._ports = itertools.count(1)

    def join(self, backend: MemoryTransferBackend, hostname: str) -> str:
        with self._lock:
            session = f"{hostname}:{next(self._ports)}"
            self._endpoints[session] = backend
        return session

    def leave(self, session: str) -> None:
        with self._lock:
            self._endpoints.pop(session, None)

    def lookup(self, session: str) -> MemoryTransferBackend | None:
        with self._lock:
            return self._endpoints.get(session)


PROCESS_FABRIC = MemoryFabric()


class _Unreachable(Exception):
    """The peer is frozen: the batch waits (not a failure)."""


@dataclass(eq=False)
class _Batch:
    handle: WriteHandle
    writes: list[tuple[int, int, int]]  # (src, dst, nbytes), merged
    give_up_at: float  # fails if its peer stays frozen until then


class MemoryTransferBackend(TransferBackend):
    """One in-process endpoint. ``protocol`` and ``device_name`` are accepted (the server's
    set-up passes them to every backend) and ignored: there is no wire."""

    def __init__(self, hostname: str = "127.0.0.1", protocol: str = "tcp", device_name: str = "",
                 fabric: MemoryFabric | None = None, stall_timeout_s: float = 30.0):
        del protocol, device_name
        if not stall_timeout_s > 0:
            raise ValueError(f"stall_timeout_s: must be > 0, got {stall_timeout_s}")
        self._stall_timeout_s = stall_timeout_s
        self._fabric = fabric or PROCESS_FABRIC
        self._lock = threading.Lock()  # regions, notifies, frozen, closed: what peers touch
        self._regions = base.Regions()
        self._notifies: list[base.Notify] = []
        self._awake = threading.Event()
        self._awake.set()
        self._closed = False
        self._cond = threading.Condition()  # the copier's queue and every handle's state
        self._queue: deque[_Batch] = deque()
        self._stopping = False
        self._session = self._fabric.join(self, hostname)
        self._thread = threading.Thread(target=self._run, name="memory-transfer", daemon=True)
        self._thread.start()

    @property
    def session_id(self) -> str:
        return self._session

    # -- this endpoint's memory ---------------------------------------------------------------

    def register(self, regions: Sequence[tuple[int, int]]) -> None:
        self._check_open()
        base.check_regions(regions)
        with self._lock:
            taken = base.Regions()
            for i, (addr, n) in enumerate(regions):
                if self._regions.overlaps(addr, n) or taken.overlaps(addr, n):
                    raise TransferError(f"regions[{i}]: [{addr:#x}, +{n}) overlaps a registered region")
                taken.add(addr, n)
            for addr, n in regions:
                self._regions.add(addr, n)

    def unregister(self, addrs: Sequence[int]) -> None:
        self._check_open()
        with self._lock:
            for a in addrs:
                self._regions.remove(a)

    # -- writes -------------------------------------------------------------------------------

    def post_writes(self, peer, srcs, dsts, lens) -> WriteHandle:
        s, d, n = self._checked(srcs, dsts, lens)
        handle = WriteHandle(peer, len(n), sum(n))
        with self._cond:
            if self._stopping:
                raise TransferError(f"transfer engine {self._session} is closed")
            self._queue.append(_Batch(handle, list(zip(s, d, n)), time.monotonic() + self._stall_timeout_s))
            self._cond.notify()
        return handle

    def poll(self, handle: WriteHandle) -> WriteState:
        with self._cond:
            return handle.state

    def write_sync(self, peer, srcs, dsts, lens, notify=None) -> None:
        s, d, n = self._checked(srcs, dsts, lens)
        target = self._fabric.lookup(peer)
        if target is None:
            raise TransferError(f"write to {peer} failed: no transfer engine {peer} in this process")
        try:
            target._land(peer, list(zip(s, d, n)), notify)
        except _Unreachable:
            raise TransferError(f"write to {peer} failed: it did not answer") from None

    def notifies(self) -> list[base.Notify]:
        self._check_open()
        with self._lock:
            got, self._notifies = self._notifies, []
        return got

    def probe(self, peer: str, timeout_s: float = 2.0) -> bool:
        self._check_open()
        target = self._fabric.lookup(peer)
        return target is not None and target._answers(timeout_s)

    def outstanding(self) -> base.Outstanding:
        with self._cond:
            batches = len(self._queue)
        with self._lock:
            return base.Outstanding(batches, len(self._regions))

    def close(self, timeout_s: float = 40.0) -> None:
        """Copies the batches already posted (failing those to a frozen peer), then leaves the fabric."""
        with self._cond:
            if self._stopping:
                return
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout_s)
        self._fabric.leave(self._session)
        with self._lock:
            self._closed = True
            self._regions = base.Regions()
            self._awake.set()  # wakes probes of this endpoint: it is gone

    # -- fault hooks: a stopped process ------------------------------------------------------

    def freeze(self) -> None:
        """Act as a stopped process: probes unanswered, writes to it held in flight."""
        with self._lock:
            self._awake.clear()

    def thaw(self) -> None:
        with self._lock:
            self._awake.set()

    # -- internals ----------------------------------------------------------------------------

    def _checked(self, srcs, dsts, lens) -> tuple[list[int], list[int], list[int]]:
        self._check_open()
        base.check_writes(srcs, dsts, lens)
        with self._lock:
            self._regions.check_sources(srcs, lens)
        return base.merge_contiguous(srcs, dsts, lens)

    def _check_open(self) -> None:
        if self._closed or self._stopping:
            raise TransferError(f"transfer engine {self._session} is closed")

    def _answers(self, timeout_s: float) -> bool:
        """Whether this endpoint answers a probe within ``timeout_s`` (a frozen one may thaw)."""
        return self._awake.wait(timeout_s) and not self._closed

    def _land(self, session: str, writes: list[tuple[int, int, int]], notify: base.Notify | None) -> None:
        """Copy ``writes`` into this endpoint's memory (called by the writer), then queue the
        notify. Raises _Unreachable when frozen, TransferError when closed or a destination is
        not registered here (after copying the writes before it)."""
        with self._lock:
            if self._closed:
                raise TransferError(f"write to {session} failed: its transfer engine is closed")
            if not self._awake.is_set():
                raise _Unreachable
            for i, (src, dst, n) in enumerate(writes):
                if not self._regions.contains(dst, n):
                    raise TransferError(f"write {i} to {session} failed: [{dst:#x}, +{n}) is not inside a "
                                        "region it registered")
                ctypes.memmove(dst, src, n)
            if notify is not None:
                self._notifies.append(notify)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue:
                    return
                work = list(self._queue)
            waiting = [b for b in work if not self._copy(b)]
            with self._cond:
                if self._stopping:
                    for b in waiting:
                        self._settle(b, f"write to {b.handle.peer} failed: it did not answer before this engine closed")
                elif waiting and len(self._queue) == len(waiting):
                    self._cond.wait(_RETRY_S)

    def _copy(self, b: _Batch) -> bool:
        """Run one batch; False when its peer or this endpoint is frozen (it stays queued)."""
        if not self._awake.is_set():
            return False
        target = self._fabric.lookup(b.handle.peer)
        error = None
        try:
            if target is None:
                raise TransferError(f"write to {b.handle.peer} failed: no transfer engine {b.handle.peer} "
                                    "in this process")
            target._land(b.handle.peer, b.writes, None)
        except _Unreachable:
            if time.monotonic() < b.give_up_at:
                return False
            error = f"write to {b.handle.peer} failed: it did not answer for {self._stall_timeout_s}s"
        except TransferError as e:
            error = str(e)
        with self._cond:
            self._settle(b, error)
        return True

    def _settle(self, b: _Batch, error: str | None) -> None:
        """Publish a terminal state and forget the batch, in one step for ``poll`` and
        ``outstanding`` (caller holds ``_cond``)."""
        b.handle.error = error
        b.handle.state = WriteState.FAILED if error else WriteState.DONE
        self._queue.remove(b)
