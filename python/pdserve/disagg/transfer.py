"""The narrow interface pdserve keeps in front of a KV transfer engine, and its Mooncake implementation.

Peers are named by their transfer session id (``"host:rpc_port"``). Addresses are raw ints
(``tensor.data_ptr()``); sources must lie in memory this backend registered, destinations in
memory the peer registered.

What "done" means (measured on Mooncake's TCP transport, 127.0.0.1; the tests in
``test/disagg/test_transfer.py`` reproduce it):

* **DONE means landed.** When ``poll(handle)`` reports ``DONE`` on the sender, every byte of
  the batch is already in the receiver's memory: a sender that polls DONE and at once tells the
  receiver over another channel (a pipe) never lets the receiver see stale bytes (hundreds of
  rounds, 1 B to 6 MiB, split over 1-4 writes). The reason, from Mooncake's source: since its
  TCP protocol v2 (``tcp_proto_version`` 2 in the segment descriptor; mooncake 0.3.12+) the
  receiver sends an 8-byte status frame only after the final chunk of a WRITE has been copied
  into destination memory, and the sender marks the slice COMPLETED only on that frame. The
  legacy framing (``MC_TCP_PROTO=1``) completes when the last chunk enters the sender's socket
  buffer; with it the same check saw torn bytes (16 of 300 rounds in one run) and both ordering
  tests fail, so they do detect the failure they guard against. On RDMA (RC queue pairs)
  completion comes with the remote NIC's acknowledgement: not measured here.
* **A notify cannot overtake its data on TCP.** Mooncake sends the notify attached to a sync
  batch write only after it has observed that batch COMPLETED (above), as a request/response
  RPC on the handshake socket that appends it to the peer's notify list before the sender's
  call returns. Checked: a receiver that reads the region named by each notify as soon as
  ``notifies()`` returns it saw no stale byte (200 rounds, 1 B to 6 MiB; with the legacy
  framing it does). But a notify can be **lost silently** (from the source): when the notify
  RPC fails, Mooncake logs an error and the write still reports success.
* **Consequence for decode's completion:** prefill waits until every posted write of a room
  polls DONE, then sends the completion message (with its write count) over its control
  channel; decode may trust the bytes when that message arrives. Counting notifies alone
  could wait forever on a lost notify, so they are never the only signal.

Mooncake quirks this module hides (mooncake-transfer-engine 0.3.13):

* ``get_batch_transfer_status([bid])`` is not a poll: it busy-waits, GIL released, until the
  batch ends or its timeout. The only non-blocking status call is ``transfer_check_status``,
  which looks at the first task of a batch, so each write is submitted as its own one-entry
  batch (``transfer_submit_write``; measured no slower than one multi-entry batch).
* Batch ids are raw pointers freed by the status call that reports a terminal state, and the
  allocator hands the same value out again: never query an id after it reported done/failed.
  Terminal codes of ``transfer_check_status``: 1 completed, -1 failed, -2 timed out, 0 pending.
  A submit that cannot even start returns 0 (older wheels: 2**64-1).
* About 1,000 writes queued to one peer is the limit; past it writes fail after 1 s
  (3,000 writes at once: 2,568 failed). The backend keeps at most ``max_inflight_per_peer``.
* The first write to a peer opens its segment with a blocking handshake RPC (about 60 s to a
  hung peer) made while holding the wrapper's lock that every submit takes: one hung peer
  would stall every write to every peer. So writes are submitted from a pump thread
  (``post_writes`` never waits on the network), and first contact runs on a helper thread,
  starting with a probe bounded by ``connect_timeout_s``; a peer that does not answer fails
  its writes instead of taking the lock.
* A dead peer (port closed) fails at once: submit returns 0, in-flight writes fail within
  milliseconds, ``send_probe`` returns -102. A hung peer (SIGSTOP) fails writes after 30 s
  without progress or status frame (``MC_TCP_STATUS_TIMEOUT_SEC``), but ``send_probe`` blocks
  about 60 s, so ``probe`` runs it on a helper thread with its own timeout.
* The sync calls (``write_sync``) busy-wait, GIL released, for at most ``MC_TRANSFER_TIMEOUT``
  (default 30 s) plus 1 ns per byte; keep them for small writes off the scheduler's hot path.
* ``initialize`` returns 0 even for an unknown protocol; the protocol is checked here.
* Registering a region that overlaps a registered one fails (rc -7): unregister a buffer
  before its memory is freed and possibly handed out again.
* TCP does not need the source registered, RDMA does; this backend checks sources on every
  transport so a missing registration fails the same way in tests and in clusters.
* Destroying an engine takes about a second and must not race in-flight writes (they point at
  caller memory): ``close`` waits for them to settle first.
* Thread-safety: one engine is used from the pump thread (submit, status), helper threads
  (probe, first contact) and the caller's thread (``write_sync``, ``notifies``) at once;
  Mooncake's wrapper guards its segment map with one mutex, batch state is per batch, and the
  tests exercise this concurrency.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import enum
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

PROTOCOLS = ("tcp", "rdma")
MOONCAKE_INSTALL_HINT = (
    "install the extra that matches the host: pip install 'pdserve[cpu]' "
    "(mooncake-transfer-engine-non-cuda) on CPU-only hosts or 'pdserve[cuda]' "
    "(mooncake-transfer-engine) on GPU hosts; both need Debian's libibverbs1 and libnuma1 "
    "(apt-get install -y libibverbs1 libnuma1)"
)
_SUBMIT_FAILED = (0, 2**64 - 1)  # transfer_submit_write's "could not start" sentinels


class TransferError(RuntimeError):
    """A transfer failed, or the engine could not be set up; the message names the peer."""


class WriteState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@dataclass(eq=False)
class WriteHandle:
    """Ticket for one ``post_writes`` batch; only the backend that issued it may poll it.

    ``num_writes`` counts writes after merging; ``error`` says why, once FAILED.
    """

    peer: str
    num_writes: int
    nbytes: int
    state: WriteState = WriteState.PENDING
    error: str | None = None


Notify = tuple[str, str]  # (name, msg)


def merge_contiguous(srcs: Sequence[int], dsts: Sequence[int],
                     lens: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
    """Merge each write into the previous one when both its source and its destination
    continue the previous write's exactly (order kept): one network write per contiguous run."""
    out_s: list[int] = []
    out_d: list[int] = []
    out_n: list[int] = []
    for s, d, n in zip(srcs, dsts, lens):
        if out_n and out_s[-1] + out_n[-1] == s and out_d[-1] + out_n[-1] == d:
            out_n[-1] += n
        else:
            out_s.append(s)
            out_d.append(d)
            out_n.append(n)
    return out_s, out_d, out_n


def check_writes(srcs: Sequence[int], dsts: Sequence[int], lens: Sequence[int]) -> None:
    """Reject malformed batches before they reach the engine (lengths must match, bytes >= 1)."""
    if not (len(srcs) == len(dsts) == len(lens)):
        raise ValueError(f"srcs, dsts, lens: lengths differ ({len(srcs)}, {len(dsts)}, {len(lens)})")
    if not srcs:
        raise ValueError("srcs: a batch needs at least one write")
    for i, n in enumerate(lens):
        if n < 1:
            raise ValueError(f"lens[{i}]: must be >= 1 byte, got {n}")


class TransferBackend(ABC):
    """One process's endpoint of the KV transfer fabric.

    Contracts every implementation keeps:
    - ``register`` before any write reads from (or a peer writes into) a region; a source
      outside the registered regions is a ``ValueError`` at post time, on every transport.
    - ``post_writes`` never blocks on the network; it merges contiguous runs (see
      ``merge_contiguous``) and returns a handle. The caller keeps sources unchanged and
      alive until the handle is terminal.
    - ``poll`` is non-blocking. A handle turns DONE once every byte is in the peer's memory
      (see the module docstring for the evidence), FAILED once any write failed and *no write
      of the batch is still in flight* (so no byte of it can land later). It never goes back.
    - ``write_sync`` blocks until the batch is done or failed (raising ``TransferError``); the
      optional notify reaches the peer's ``notifies()`` after the data, or is lost (never early).
    - ``notifies`` drains what arrived since the last call, oldest first.
    - ``probe`` answers within ``timeout_s``; False means "did not answer", not "dead".
    - ``close`` is idempotent; it waits (bounded) for in-flight writes, then frees the engine.
    """

    @property
    @abstractmethod
    def session_id(self) -> str:
        """This endpoint's peer name, ``"host:rpc_port"``."""

    @abstractmethod
    def register(self, regions: Sequence[tuple[int, int]]) -> None:
        """Register ``(addr, nbytes)`` regions (one batch call). Raises TransferError."""

    @abstractmethod
    def unregister(self, addrs: Sequence[int]) -> None:
        """Forget regions registered at ``addrs`` (before their memory is freed or reused: a new
        region overlapping a registered one is refused)."""

    @abstractmethod
    def post_writes(self, peer: str, srcs: Sequence[int], dsts: Sequence[int],
                    lens: Sequence[int]) -> WriteHandle:
        """Queue writes ``srcs[i] -> peer:dsts[i]`` of ``lens[i]`` bytes."""

    @abstractmethod
    def poll(self, handle: WriteHandle) -> WriteState:
        """Current state of a posted batch."""

    @abstractmethod
    def write_sync(self, peer: str, srcs: Sequence[int], dsts: Sequence[int], lens: Sequence[int],
                   notify: Notify | None = None) -> None:
        """Write and wait; then, if given, deliver ``notify`` to the peer."""

    @abstractmethod
    def notifies(self) -> list[Notify]:
        """Notifies received since the last call."""

    @abstractmethod
    def probe(self, peer: str, timeout_s: float = 2.0) -> bool:
        """Whether the peer's transfer engine answered within ``timeout_s``."""

    @abstractmethod
    def close(self) -> None:
        """Stop, wait for in-flight writes (bounded), unregister and free the engine."""

    def wait(self, handle: WriteHandle, timeout_s: float, interval_s: float = 0.0005) -> WriteState:
        """Poll until terminal or ``timeout_s`` passed; returns the last state (maybe PENDING)."""
        deadline = time.monotonic() + timeout_s
        while (state := self.poll(handle)) is WriteState.PENDING and time.monotonic() < deadline:
            time.sleep(interval_s)
        return state


# ---------------------------------------------------------------------------------------------
# Mooncake


def import_mooncake():
    """The ``mooncake.engine`` module, or a TransferError saying what to install."""
    try:
        from mooncake import engine
    except ImportError as e:
        raise TransferError(f"the Mooncake transfer backend is unavailable ({e}): {MOONCAKE_INSTALL_HINT}") from e
    return engine


def mooncake_available() -> bool:
    try:
        import_mooncake()
    except TransferError:
        return False
    return True


@dataclass(eq=False)
class _Batch:
    """Pump-side state of one handle. Only the pump thread changes it (other threads hand
    results over through ``_WritePump._handoff``), so it needs no lock of its own."""

    handle: WriteHandle
    writes: deque  # of (src, dst, nbytes) not yet submitted
    inflight: list = field(default_factory=list)  # Mooncake batch ids
    connecting: bool = False  # its first write is opening the peer's segment on a helper thread
    error: str | None = None  # published to handle.error when it settles

    @property
    def settled(self) -> bool:
        return not self.inflight and not self.connecting and (not self.writes or self.error is not None)


class _Regions:
    """Registered ``[addr, addr + n)`` regions, for the source check."""

    def __init__(self):
        self._starts: list[int] = []
        self._ends: list[int] = []

    def add(self, addr: int, n: int) -> None:
        i = bisect.bisect(self._starts, addr)
        self._starts.insert(i, addr)
        self._ends.insert(i, addr + n)

    def contains(self, addr: int, n: int) -> bool:
        i = bisect.bisect(self._starts, addr) - 1
        return i >= 0 and addr + n <= self._ends[i]

    def remove(self, addr: int) -> None:
        i = bisect.bisect_left(self._starts, addr)
        if i == len(self._starts) or self._starts[i] != addr:
            raise ValueError(f"addrs: {addr:#x} is not the start of a registered region")
        del self._starts[i], self._ends[i]

    def all(self) -> list[int]:
        return list(self._starts)


class MooncakeTransferBackend(TransferBackend):
    """``mooncake.engine.TransferEngine`` behind the TransferBackend contract.

    Here: ``protocol="tcp"``, ``hostname="127.0.0.1"`` and the ``P2PHANDSHAKE`` metadata mode
    (no metadata server). In clusters: ``protocol="rdma"`` with ``device_name`` the NIC(s),
    comma separated (see ``topology.nic_for_gpus``).
    """

    def __init__(self, hostname: str = "127.0.0.1", protocol: str = "tcp", device_name: str = "",
                 metadata_server: str = "P2PHANDSHAKE", max_inflight_per_peer: int = 256,
                 poll_interval_s: float = 0.0005, connect_timeout_s: float = 5.0):
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol: {protocol!r} is not one of {PROTOCOLS}")
        if max_inflight_per_peer < 1:
            raise ValueError(f"max_inflight_per_peer: must be >= 1, got {max_inflight_per_peer}")
        self._mc = import_mooncake()
        self._te = self._mc.TransferEngine()
        rc = self._te.initialize(hostname, metadata_server, protocol, device_name)
        if rc != 0:
            raise TransferError(f"Mooncake initialize({hostname!r}, {metadata_server!r}, {protocol!r}, "
                                f"{device_name!r}) returned {rc}")
        self._session = f"{hostname}:{self._te.get_rpc_port()}"
        self._regions = _Regions()
        self._prober = _Prober(self._te)
        self._connect_timeout_s = connect_timeout_s
        self._pump = _WritePump(self._te, self._prober, max_inflight_per_peer, poll_interval_s, connect_timeout_s)
        self._closed = False

    @property
    def session_id(self) -> str:
        return self._session

    def register(self, regions: Sequence[tuple[int, int]]) -> None:
        self._check_open()
        if not regions:
            return
        for i, (addr, n) in enumerate(regions):
            if addr <= 0 or n < 1:
                raise ValueError(f"regions[{i}]: need addr > 0 and nbytes >= 1, got ({addr}, {n})")
        rc = self._te.batch_register_memory([a for a, _ in regions], [n for _, n in regions])
        if rc != 0:
            raise TransferError(f"Mooncake batch_register_memory of {len(regions)} regions returned {rc}")
        for addr, n in regions:
            self._regions.add(addr, n)

    def unregister(self, addrs: Sequence[int]) -> None:
        self._check_open()
        for a in addrs:
            self._regions.remove(a)
        if addrs and (rc := self._te.batch_unregister_memory(list(addrs))) != 0:
            raise TransferError(f"Mooncake batch_unregister_memory of {len(addrs)} regions returned {rc}")

    def post_writes(self, peer, srcs, dsts, lens) -> WriteHandle:
        self._check_open()
        check_writes(srcs, dsts, lens)
        self._check_sources(srcs, lens)
        s, d, n = merge_contiguous(srcs, dsts, lens)
        handle = WriteHandle(peer, len(n), sum(n))
        self._pump.add(_Batch(handle, deque(zip(s, d, n))))
        return handle

    def poll(self, handle: WriteHandle) -> WriteState:
        return self._pump.state(handle)

    def write_sync(self, peer, srcs, dsts, lens, notify=None) -> None:
        self._check_open()
        check_writes(srcs, dsts, lens)
        self._check_sources(srcs, lens)
        s, d, n = merge_contiguous(srcs, dsts, lens)
        # First contact opens the segment under a lock every other submit needs: only for a
        # peer that answers (see _WritePump).
        if not self._pump.known(peer) and not self._prober.probe(peer, self._connect_timeout_s):
            raise TransferError(f"write to {peer} failed: it did not answer within {self._connect_timeout_s}s")
        if notify is None:
            rc = self._te.batch_transfer_sync_write(peer, s, d, n)
        else:
            note = self._mc.TransferNotify()
            note.name, note.msg = notify
            rc = self._te.batch_transfer_sync(peer, s, d, n, self._mc.TransferOpcode.Write, note)
        if rc != 0:
            raise TransferError(f"write of {sum(n)} bytes in {len(n)} writes to {peer} failed (Mooncake rc={rc})")

    def notifies(self) -> list[Notify]:
        self._check_open()
        return [(x.name, x.msg) for x in self._te.get_notifies()]

    def probe(self, peer: str, timeout_s: float = 2.0) -> bool:
        self._check_open()
        return self._prober.probe(peer, timeout_s)

    def close(self, timeout_s: float = 40.0) -> None:
        """Writes or probes still inside Mooncake after ``timeout_s`` (a hung peer fails writes
        after 30 s, probes after about 60 s) keep the engine alive, leaked on purpose: freeing
        it under them would be a use-after-free."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + timeout_s
        if not (self._pump.stop(timeout_s) and self._prober.stop(max(0.0, deadline - time.monotonic()))):
            logger.warning("transfer engine %s: calls still inside Mooncake after %.0fs; not freeing the engine",
                           self._session, timeout_s)
            return
        if self._regions.all():
            self._te.batch_unregister_memory(self._regions.all())
        self._te = None

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"transfer engine {self._session} is closed")

    def _check_sources(self, srcs, lens) -> None:
        for i, (s, n) in enumerate(zip(srcs, lens)):
            if not self._regions.contains(s, n):
                raise ValueError(f"srcs[{i}]: [{s:#x}, +{n}) is not inside a region registered with this backend")


class _Prober:
    """``send_probe`` on helper threads (it blocks about 60 s on a hung peer): one probe per
    peer at a time, each caller waiting at most its own timeout."""

    def __init__(self, te):
        self._te = te
        self._lock = threading.Lock()
        self._running: dict[str, concurrent.futures.Future] = {}

    def probe(self, peer: str, timeout_s: float) -> bool:
        with self._lock:
            fut = self._running.get(peer)
            if fut is None or fut.done():
                fut = self._running[peer] = concurrent.futures.Future()
                threading.Thread(target=self._run, args=(peer, fut), name="mooncake-probe", daemon=True).start()
        try:
            return fut.result(timeout=timeout_s) == 0
        except concurrent.futures.TimeoutError:
            return False

    def _run(self, peer: str, fut: concurrent.futures.Future) -> None:
        fut.set_result(self._te.send_probe(peer))

    def stop(self, timeout_s: float) -> bool:
        """Wait for probes still inside Mooncake; True when none is."""
        with self._lock:
            running = list(self._running.values())
        done, pending = concurrent.futures.wait(running, timeout=timeout_s)
        return not pending


class _WritePump:
    """Thread that submits queued writes (at most ``cap`` in flight per peer) and polls them.

    The first write to a peer opens its Mooncake segment with a blocking RPC made while holding
    a lock that every other submit takes too (Mooncake's Python wrapper), so a hung peer would
    stall all traffic for about 60 s. First contact therefore runs on a helper thread and
    starts with a bounded probe; only a peer that answered gets the segment-opening write. The
    helper's batch id (or failure) comes back through ``_handoff``. ``_cond`` guards
    ``_batches``, ``_handoff``, ``_peers`` and every handle's state; Mooncake is called with
    it released.
    """

    def __init__(self, te, prober: _Prober, cap: int, interval_s: float, connect_timeout_s: float):
        self._te = te
        self._prober = prober
        self._cap = cap
        self._interval = interval_s
        self._connect_timeout_s = connect_timeout_s
        self._cond = threading.Condition()
        self._batches: list[_Batch] = []
        self._handoff: list[tuple[_Batch, int | None, str]] = []  # (batch, first bid or None, why)
        self._peers: dict[str, str] = {}  # peer -> "connecting" | "ready"
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="mooncake-pump", daemon=True)
        self._thread.start()

    def add(self, batch: _Batch) -> None:
        with self._cond:
            if self._stopping:
                raise TransferError("transfer engine is closing")
            self._batches.append(batch)
            self._cond.notify()

    def state(self, handle: WriteHandle) -> WriteState:
        with self._cond:
            return handle.state

    def known(self, peer: str) -> bool:
        """Whether the peer's segment is open (first contact done)."""
        with self._cond:
            return self._peers.get(peer) == "ready"

    def stop(self, timeout_s: float) -> bool:
        """Fail what was never submitted and wait for the rest. True when no thread can touch
        the engine any more; the pump then drops its reference."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            return False
        self._te = None
        return True

    def _run(self) -> None:
        while True:
            with self._cond:
                self._take_handoff()
                if self._stopping:
                    for b in self._batches:
                        if b.writes and b.error is None:
                            b.error = "transfer engine closed before the write was submitted"
                    if all(b.settled for b in self._batches):
                        self._finish_settled()
                        return
                if not self._batches:
                    self._cond.wait()
                    continue
                work = list(self._batches)
            progressed = self._submit(work) | self._check(work)
            with self._cond:
                self._finish_settled()
                if not progressed and not self._handoff:
                    self._cond.wait(self._interval)

    def _submit(self, work: list[_Batch]) -> bool:
        progressed = False
        inflight: dict[str, int] = {}
        for b in work:
            inflight[b.handle.peer] = inflight.get(b.handle.peer, 0) + len(b.inflight) + b.connecting
        for b in work:
            peer = b.handle.peer
            if b.error is not None or not b.writes or b.connecting or not self._peer_ready(b):
                continue
            while b.writes and inflight[peer] < self._cap:
                src, dst, n = b.writes.popleft()
                bid = self._te.transfer_submit_write(peer, src, dst, n)
                progressed = True
                if bid in _SUBMIT_FAILED:
                    b.error = f"could not start a {n}-byte write to {peer}"
                    break
                b.inflight.append(bid)
                inflight[peer] += 1
        return progressed

    def _check(self, work: list[_Batch]) -> bool:
        progressed = False
        for b in work:
            still = []
            for bid in b.inflight:
                rc = self._te.transfer_check_status(bid)  # frees bid when rc != 0
                if rc == 0:
                    still.append(bid)
                    continue
                progressed = True
                if rc != 1 and b.error is None:
                    b.error = f"write to {b.handle.peer} {'timed out' if rc == -2 else 'failed'}"
            b.inflight = still
        return progressed

    def _peer_ready(self, b: _Batch) -> bool:
        """Whether the batch's peer is known; if nobody is contacting it yet, this batch's first
        write does, on a helper thread."""
        with self._cond:
            status = self._peers.get(b.handle.peer)
            if status is None:
                self._peers[b.handle.peer] = "connecting"
                b.connecting = True
                write = b.writes.popleft()
                threading.Thread(target=self._connect, args=(b, write), name="mooncake-connect",
                                 daemon=True).start()
            return status == "ready"

    def _connect(self, b: _Batch, write: tuple[int, int, int]) -> None:
        peer = b.handle.peer
        bid, why = None, f"could not reach {peer}"
        if not self._prober.probe(peer, self._connect_timeout_s):
            why = f"{peer} did not answer a probe within {self._connect_timeout_s}s"
        elif (bid := self._te.transfer_submit_write(peer, *write)) in _SUBMIT_FAILED:  # opens the segment
            bid = None
        with self._cond:
            self._handoff.append((b, bid, why))
            self._cond.notify()

    def _take_handoff(self) -> None:
        """Results of first contacts (caller holds the lock). A failed one fails every batch
        still waiting for that peer; the next batch to it tries again."""
        for b, bid, why in self._handoff:
            b.connecting = False
            peer = b.handle.peer
            if bid is not None:
                b.inflight.append(bid)
                self._peers[peer] = "ready"
                continue
            del self._peers[peer]
            for other in self._batches:
                if other.handle.peer == peer and not other.inflight and not other.connecting:
                    other.error = other.error or why
        self._handoff.clear()

    def _finish_settled(self) -> None:
        """Publish terminal states (caller holds the lock)."""
        keep = []
        for b in self._batches:
            if b.settled:
                b.handle.error = b.error
                b.handle.state = WriteState.FAILED if b.error else WriteState.DONE
            else:
                keep.append(b)
        self._batches = keep


class FaultInjectingBackend(TransferBackend):
    """A real backend that breaks on request, for failure tests (no fake engine underneath).

    Knobs, thread-safe and changeable at any time:
    - ``fail_writes_to(peer)``: later writes to ``peer`` fail without reaching the network.
    - ``fail_after(n)``: the next ``n`` writes (counted after merging) go through, later ones
      fail; a batch straddling the limit sends its first writes, so some of its bytes land.
    - ``hold()``: batches report PENDING until ``release()``, whatever their bytes did;
      ``hold(seconds=s)``: each batch posted from now on reports PENDING for ``s`` seconds more.
    - ``drop_notifies()``: ``write_sync`` writes the data but the notify never leaves, as when
      Mooncake's notify RPC fails (it only logs).
    - ``delay_posts(s)``: batches posted from now on reach the real engine only ``s`` seconds
      later (a slow network): their bytes land late, after anything the caller did meanwhile.
    ``reset()`` clears them all. A failed batch still reports FAILED only after its real writes
    settled, as the contract requires.
    """

    def __init__(self, inner: TransferBackend, clock: Callable[[], float] = time.monotonic):
        self.inner = inner
        self._clock = clock
        self._lock = threading.Lock()
        # handle -> (the real engine's handle or None, injected error, time it may complete)
        self._batches: dict[WriteHandle, tuple[WriteHandle | None, str | None, float]] = {}
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._failing_peers: set[str] = set()
            self._budget: int | None = None
            self._held = False
            self._delay_s = 0.0
            self._drop_notifies = False
            self._post_delay_s = 0.0

    def fail_writes_to(self, peer: str) -> None:
        with self._lock:
            self._failing_peers.add(peer)

    def fail_after(self, n: int | None) -> None:
        with self._lock:
            self._budget = n

    def hold(self, seconds: float | None = None) -> None:
        with self._lock:
            if seconds is None:
                self._held = True
            else:
                self._delay_s = seconds

    def delay_posts(self, seconds: float) -> None:
        with self._lock:
            self._post_delay_s = seconds

    def release(self) -> None:
        with self._lock:
            self._held = False
            self._delay_s = 0.0

    def inner_handle(self, handle: WriteHandle) -> WriteHandle | None:
        """The real engine's handle behind ``handle`` (None when nothing was sent), so a test
        can tell "bytes landed" from "reported done"; only until ``handle`` turned terminal."""
        with self._lock:
            return self._batches[handle][0]

    def drop_notifies(self, drop: bool = True) -> None:
        with self._lock:
            self._drop_notifies = drop

    @property
    def session_id(self) -> str:
        return self.inner.session_id

    def register(self, regions) -> None:
        self.inner.register(regions)

    def unregister(self, addrs) -> None:
        self.inner.unregister(addrs)

    def post_writes(self, peer, srcs, dsts, lens) -> WriteHandle:
        check_writes(srcs, dsts, lens)
        s, d, n = merge_contiguous(srcs, dsts, lens)
        with self._lock:
            keep, error = self._allowed(peer, len(n))
            posted_at = self._clock() + self._delay_s
            post_delay = self._post_delay_s
        handle = WriteHandle(peer, len(n), sum(n))
        if keep and post_delay > 0:
            with self._lock:
                self._batches[handle] = (_LATE, error, posted_at)
            timer = threading.Timer(post_delay, self._post_late, (handle, peer, s[:keep], d[:keep], n[:keep]))
            timer.daemon = True
            timer.start()
            return handle
        inner = self.inner.post_writes(peer, s[:keep], d[:keep], n[:keep]) if keep else None
        with self._lock:
            self._batches[handle] = (inner, error, posted_at)
        return handle

    def _post_late(self, handle: WriteHandle, peer, srcs, dsts, lens) -> None:
        inner = self.inner.post_writes(peer, srcs, dsts, lens)
        with self._lock:
            _, error, posted_at = self._batches[handle]
            self._batches[handle] = (inner, error, posted_at)

    def poll(self, handle: WriteHandle) -> WriteState:
        with self._lock:
            if handle.state is not WriteState.PENDING:
                return handle.state
            inner, error, release_at = self._batches[handle]
            held = self._held or self._clock() < release_at
        if inner is _LATE:
            return WriteState.PENDING
        state = self.inner.poll(inner) if inner is not None else WriteState.DONE
        if state is WriteState.PENDING or held:
            return WriteState.PENDING
        with self._lock:
            handle.error = error or (inner.error if state is WriteState.FAILED else None)
            handle.state = WriteState.FAILED if handle.error else WriteState.DONE
            del self._batches[handle]
            return handle.state

    def write_sync(self, peer, srcs, dsts, lens, notify=None) -> None:
        check_writes(srcs, dsts, lens)
        s, d, n = merge_contiguous(srcs, dsts, lens)
        with self._lock:
            keep, error = self._allowed(peer, len(n))
            if self._drop_notifies:
                notify = None
        if keep:
            self.inner.write_sync(peer, s[:keep], d[:keep], n[:keep], None if error else notify)
        if error:
            raise TransferError(error)

    def notifies(self) -> list[Notify]:
        return self.inner.notifies()

    def probe(self, peer: str, timeout_s: float = 2.0) -> bool:
        return self.inner.probe(peer, timeout_s)

    def close(self) -> None:
        self.inner.close()

    def _allowed(self, peer: str, count: int) -> tuple[int, str | None]:
        """How many of ``count`` writes really go, and the injected error (caller holds the lock)."""
        if peer in self._failing_peers:
            return 0, f"injected failure: writes to {peer} fail"
        if self._budget is None:
            return count, None
        keep = min(count, self._budget)
        self._budget -= keep
        return keep, None if keep == count else f"injected failure: write budget exhausted ({peer})"


_LATE = WriteHandle("", 0, 0)  # stands for a delayed batch's real handle until it is posted


def create_transfer_backend(name: str, **kwargs) -> TransferBackend:
    """Backend by its ``--disaggregation-transfer-backend`` name (imported only when chosen)."""
    factories: dict[str, Callable[..., TransferBackend]] = {"mooncake": MooncakeTransferBackend}
    if name not in factories:
        raise ValueError(f"disaggregation_transfer_backend: {name!r} is not one of {sorted(factories)}")
    return factories[name](**kwargs)
