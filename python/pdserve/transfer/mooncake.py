"""The Mooncake Transfer Engine behind the TransferBackend contract (``base.py``).

Why Mooncake keeps the contract's guarantees (mooncake-transfer-engine 0.3.13, from its source
and measured on TCP, 127.0.0.1):

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

import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.transfer import base, mooncake_log
from pdserve.transfer.base import TransferBackend, TransferError, WriteHandle, WriteState

logger = logging.getLogger(__name__)

PROTOCOLS = ("tcp", "rdma")
MOONCAKE_INSTALL_HINT = (
    "install the extra that matches the host: pip install 'pdserve[cpu]' "
    "(mooncake-transfer-engine-non-cuda) on CPU-only hosts or 'pdserve[cuda]' "
    "(mooncake-transfer-engine) on GPU hosts; both need Debian's libibverbs1 and libnuma1 "
    "(apt-get install -y libibverbs1 libnuma1)"
)
_SUBMIT_FAILED = (0, 2**64 - 1)  # transfer_submit_write's "could not start" sentinels


def import_mooncake():
    """The ``mooncake.engine`` module, or a TransferError saying what to install."""
    mooncake_log.set_level()  # read when the library loads
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
        with mooncake_log.quiet_start(protocol):
            self._te = self._mc.TransferEngine()
            rc = self._te.initialize(hostname, metadata_server, protocol, device_name)
        if rc != 0:
            raise TransferError(f"Mooncake initialize({hostname!r}, {metadata_server!r}, {protocol!r}, "
                                f"{device_name!r}) returned {rc}")
        self._session = f"{hostname}:{self._te.get_rpc_port()}"
        self._regions = base.Regions()
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
        base.check_regions(regions)
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
        base.check_writes(srcs, dsts, lens)
        self._regions.check_sources(srcs, lens)
        s, d, n = base.merge_contiguous(srcs, dsts, lens)
        handle = WriteHandle(peer, len(n), sum(n))
        self._pump.add(_Batch(handle, deque(zip(s, d, n))))
        return handle

    def poll(self, handle: WriteHandle) -> WriteState:
        return self._pump.state(handle)

    def write_sync(self, peer, srcs, dsts, lens, notify=None) -> None:
        self._check_open()
        base.check_writes(srcs, dsts, lens)
        self._regions.check_sources(srcs, lens)
        s, d, n = base.merge_contiguous(srcs, dsts, lens)
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

    def notifies(self) -> list[base.Notify]:
        self._check_open()
        return [(x.name, x.msg) for x in self._te.get_notifies()]

    def probe(self, peer: str, timeout_s: float = 2.0) -> bool:
        self._check_open()
        return self._prober.probe(peer, timeout_s)

    def outstanding(self) -> base.Outstanding:
        return base.Outstanding(self._pump.pending(), len(self._regions))

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
        self._regions = base.Regions()
        self._te = None

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"transfer engine {self._session} is closed")


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

    def pending(self) -> int:
        """Batches not yet terminal."""
        with self._cond:
            return len(self._batches)

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
