"""NVIDIA's NIXL (UCX underneath) behind the TransferBackend contract (``base.py``).

How NIXL keeps the contract (nixl-cu12 1.5.1, UCX over TCP on 127.0.0.1, measured):

* **A peer is learned from its record, not from a side channel.** NIXL writes only to agents
  whose metadata (UCX worker address, registered regions and their keys) it was given.
  ``peer_info`` is that metadata (base64) and travels in the side's bootstrap record
  (``RankRecord`` on prefill, ``DecodeRecord`` on decode), signed like the rest; ``connect``
  loads it and checks it names the session the record claims. NIXL's own listener (which would
  serve and accept metadata unauthenticated on a port of its own) stays off.
* **DONE means landed, by acknowledgement.** NIXL does not document whether its DONE
  (``check_xfer_state``) means the bytes are in the receiver's memory or only that they left.
  Measured over UCX's TCP transport it waits for the receiver (writes of 4 KiB to 4 MiB to a
  SIGSTOPped peer stayed in progress for 20 s, until resumed) and DONE-then-pipe never showed a
  stale byte (300 rounds) even without what follows; an earlier reading of DONE within 8 ms
  for a stopped peer was a SIGSTOP not yet delivered. So that the guarantee does not hang on
  how a transport completes (RDMA, shared memory), every batch also carries a NIXL
  notification (``W`` + sequence number), which UCX delivers after the batch's data on the
  same endpoint; the receiver's pump answers it with an ``A`` notification, and the batch turns
  DONE only when NIXL reports DONE and the answer came back (one round trip later). Both sides
  must therefore have connected each other (P/D does: each side's record reaches the other
  before the first write); a receiver that does not know the sender cannot answer, and the
  write fails as "did not answer".
* **A notify cannot overtake its data**: ``write_sync``'s notify rides in the same ``W``
  notification, which the receiver sees only after the data (the ordering tests check it).
* **Failures.** A peer whose process died fails at once (NIXL raises
  ``nixlRemoteDisconnectError``, or the handle reports ERR); a peer that does not answer (stopped,
  partitioned) fails after ``stall_timeout_s`` plus 1 ns per byte, as Mooncake's TCP transport
  does. A batch still inside UCX when that happens is cancelled (its handle released) before it
  reports FAILED, so no source byte is read afterwards; bytes that already left this host may
  still land if the peer resumes, which decode's quarantine of abandoned pages allows for.
* **Liveness.** ``session_id`` is ``"host:port"`` of a small listener this backend owns (bound
  to ``hostname``, never a wildcard) that answers a fixed banner and reads nothing: ``probe``
  connects and waits for the banner (a stopped process's kernel accepts, but nobody answers),
  and once the process exits the port refuses, which decode's heartbeat uses to confirm a death.
* **UCX environment** (read once, when UCX loads; an operator's setting wins, see
  ``ucx_defaults`` and docs/disaggregation.md): over TCP, ``UCX_TLS=tcp`` and, when the
  advertised host is a loopback address, ``UCX_NET_DEVICES=lo``. ``UCX_MODULES=^ib`` keeps UCX's
  InfiniBand modules unloaded on TCP: with them loaded, every process that created an agent
  died with SIGSEGV at interpreter exit, inside ``rtnl_tc_unregister`` of the libnl-route that
  libibverbs pulls in, run by ``_dl_fini`` after UCX had torn itself down (gdb backtrace; no
  order of releasing handles, agents or memory avoided it, and ``UCX_MODULES=^ib`` does). An
  agent still open when the interpreter tears down aborts the process instead ("terminate called
  without an active exception"), so every backend closes itself at exit (``atexit``) unless
  closed before; P/D modes leave their backend to the process's end.
* **No NIXL progress thread.** NIXL's own (on by default) busy-spins: an idle agent took a
  whole core (0.998 CPU-seconds per second), on servers a core per rank, and with it 1P1D TTFT
  on a 2-core host was 13-20% above Mooncake's. Without it UCX progresses inside the calls the
  pump makes anyway (``check_xfer_state``, ``get_new_notifs``): every 0.5 ms while a batch is in
  flight or notifications arrive, backing off to ``IDLE_POLL_S`` when idle (two idle agents:
  0.14 CPU-seconds per second at a fixed 0.5 ms).
* Thread-safety: one lock around every agent call (the agent runs in NIXL's ``NONE`` sync mode
  without its listener); a pump thread polls handles and notifications, answers ``W``s.
"""

from __future__ import annotations

import atexit
import base64
import itertools
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.transfer import base
from pdserve.transfer.base import TransferBackend, TransferError, WriteHandle, WriteState

logger = logging.getLogger(__name__)

PROTOCOLS = ("tcp", "rdma")
NIXL_INSTALL_HINT = ("install the NIXL extra: pip install 'pdserve[nixl]' (nixl-cu12, UCX included; it installs "
                     "and moves DRAM on CPU-only hosts too), or 'pdserve[cpu]' / 'pdserve[cuda]', which include it")
BANNER = b"pdserve-nixl\n"  # what the liveness listener answers
_WRITE, _ACK = b"W", b"A"  # notification kinds: a batch's marker (with an optional notify), its answer
_SEQ_BYTES = 8
MAX_NOTIFY_BYTES = 64 << 10  # a notify longer than this is dropped by the receiver
IDLE_POLL_S = 0.002  # the pump's poll interval when nothing is in flight (0.5 ms while anything is)
_LOOPBACK = ("127.", "::1", "localhost")


def ucx_defaults(protocol: str, hostname: str, device_name: str = "") -> dict[str, str]:
    """UCX variables this backend sets unless the operator did (see the module docstring)."""
    if protocol == "rdma":
        return {"UCX_NET_DEVICES": ",".join(f"{d}:1" for d in device_name.split(","))} if device_name else {}
    env = {"UCX_TLS": "tcp", "UCX_MODULES": "^ib"}
    if hostname.startswith(_LOOPBACK):
        env["UCX_NET_DEVICES"] = "lo"
    return env


def import_nixl(env: dict[str, str] | None = None):
    """The ``nixl_cu12._api`` module, or a TransferError saying what to install. ``env``: UCX
    defaults to apply first (UCX reads them once, when its first agent starts)."""
    for key, value in (env or {}).items():
        os.environ.setdefault(key, value)
    try:
        from nixl_cu12 import _api
    except ImportError as e:
        raise TransferError(f"the NIXL transfer backend is unavailable ({e}): {NIXL_INSTALL_HINT}") from e
    # NIXL logs every agent start at INFO to stdout; ours says what matters.
    logging.getLogger("nixl").setLevel(logging.INFO if logger.isEnabledFor(logging.DEBUG) else logging.WARNING)
    return _api


def nixl_available() -> bool:
    try:
        import_nixl()
    except TransferError:
        return False
    return True


@dataclass(eq=False)
class _Batch:
    """One posted batch: NIXL's handle until it is released, and what decides DONE."""

    handle: WriteHandle
    seq: int
    xfer: object | None  # NIXL's handle; None once released
    deadline: float
    sent: bool = False  # NIXL reported DONE: every byte left this host
    acked: bool = False  # the peer answered the batch's notification: every byte landed
    error: str | None = None


class NixlTransferBackend(TransferBackend):
    """A NIXL agent (UCX backend) named by its session, with DRAM or device regions registered.

    Here: ``protocol="tcp"`` over loopback. In clusters: ``protocol="rdma"`` with ``device_name``
    the NIC(s) (``topology.nic_for_gpus``), which become ``UCX_NET_DEVICES``.
    """

    def __init__(self, hostname: str = "127.0.0.1", protocol: str = "tcp", device_name: str = "",
                 stall_timeout_s: float = 30.0, poll_interval_s: float = 0.0005):
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol: {protocol!r} is not one of {PROTOCOLS}")
        if not stall_timeout_s > 0:
            raise ValueError(f"stall_timeout_s: must be > 0, got {stall_timeout_s}")
        self._lib = import_nixl(ucx_defaults(protocol, hostname, device_name))
        self._beacon = _Beacon(hostname)
        self._session = f"{hostname}:{self._beacon.port}"
        self._memtype = "DRAM"
        try:
            config = self._lib.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
            self._agent = self._lib.nixl_agent(self._session, config)
        except Exception as e:
            self._beacon.close()
            raise TransferError(f"NIXL agent {self._session} could not start: {e}") from e
        self._lock = threading.Lock()  # every call into the agent
        self._regions = base.Regions()
        self._registered: dict[int, object] = {}  # region start -> NIXL's registration
        self._peers: dict[str, str] = {}  # session -> the peer_info loaded for it
        self._stall_s = stall_timeout_s
        self._seq = itertools.count(1)
        self._closed = False
        self._pump = _Pump(self, poll_interval_s)
        atexit.register(self.close)  # an agent left to the interpreter's teardown aborts the process

    @property
    def session_id(self) -> str:
        return self._session

    @property
    def peer_info(self) -> str:
        with self._lock:
            return base64.b64encode(self._agent.get_agent_metadata()).decode()

    def connect(self, peer: str, info: str) -> None:
        self._check_open()
        try:
            meta = base64.b64decode(info, validate=True)
        except ValueError as e:
            raise TransferError(f"transfer_info of {peer}: not base64 ({e})") from None
        with self._lock:
            if self._peers.get(peer) == info:
                return
            if peer in self._peers:
                self._agent.remove_remote_agent(peer)
                del self._peers[peer]
            try:
                name = self._agent.add_remote_agent(meta)
            except Exception as e:
                raise TransferError(f"transfer_info of {peer}: NIXL refused it ({e})") from e
            name = name.decode() if isinstance(name, bytes) else str(name)
            if name != peer:
                if name not in self._peers:  # never drop a peer another record connected
                    self._agent.remove_remote_agent(name)
                raise TransferError(f"transfer_info of {peer}: it describes agent {name[:80]!r}")
            self._peers[peer] = info

    def register(self, regions: Sequence[tuple[int, int]]) -> None:
        self._check_open()
        if not regions:
            return
        base.check_regions(regions)
        for addr, n in regions:
            if self._regions.overlaps(addr, n):
                raise TransferError(f"region [{addr:#x}, +{n}) overlaps one registered with {self._session}")
        with self._lock:
            for addr, n in regions:
                try:
                    self._registered[addr] = self._agent.register_memory([(addr, n, 0, "")], self._memtype)
                except Exception as e:
                    raise TransferError(f"NIXL register_memory of [{addr:#x}, +{n}) failed: {e}") from e
                self._regions.add(addr, n)

    def unregister(self, addrs: Sequence[int]) -> None:
        self._check_open()
        for a in addrs:
            self._regions.remove(a)
        with self._lock:
            for a in addrs:
                self._agent.deregister_memory(self._registered.pop(a))

    def post_writes(self, peer, srcs, dsts, lens) -> WriteHandle:
        self._check_open()
        base.check_writes(srcs, dsts, lens)
        self._regions.check_sources(srcs, lens)
        return self._post(peer, *base.merge_contiguous(srcs, dsts, lens), payload=b"")

    def poll(self, handle: WriteHandle) -> WriteState:
        return self._pump.state(handle)

    def write_sync(self, peer, srcs, dsts, lens, notify=None) -> None:
        self._check_open()
        base.check_writes(srcs, dsts, lens)
        self._regions.check_sources(srcs, lens)
        payload = json.dumps(list(notify)).encode() if notify is not None else b""
        handle = self._post(peer, *base.merge_contiguous(srcs, dsts, lens), payload=payload)
        state = self.wait(handle, self._stall_s + handle.nbytes * 1e-9 + 5.0)
        if state is not WriteState.DONE:
            raise TransferError(handle.error or f"write to {peer} did not finish")

    def notifies(self) -> list[base.Notify]:
        self._check_open()
        return self._pump.take_notifies()

    def probe(self, peer: str, timeout_s: float = 2.0) -> bool:
        self._check_open()
        return probe_banner(peer, timeout_s)

    def outstanding(self) -> base.Outstanding:
        return base.Outstanding(self._pump.pending(), len(self._regions))

    def close(self, timeout_s: float = 40.0) -> None:
        """Batches still inside UCX after ``timeout_s`` keep the agent alive, leaked on purpose:
        freeing it under them would be a use-after-free."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        if not self._pump.stop(timeout_s):
            logger.warning("transfer agent %s: writes still inside NIXL after %.0fs; not freeing it",
                           self._session, timeout_s)
            return
        with self._lock:
            for peer in list(self._peers):
                self._agent.remove_remote_agent(peer)
            for reg in self._registered.values():
                self._agent.deregister_memory(reg)
            self._peers.clear()
            self._registered.clear()
            self._regions = base.Regions()
            self._agent = None
        self._beacon.close()

    # --- internals ----------------------------------------------------------------------------

    def _post(self, peer: str, srcs: list[int], dsts: list[int], lens: list[int], payload: bytes) -> WriteHandle:
        handle = WriteHandle(peer, len(lens), sum(lens))
        seq = next(self._seq)
        batch = _Batch(handle, seq, None, time.monotonic() + self._stall_s + handle.nbytes * 1e-9)
        if peer not in self._peers:
            batch.error = f"write to {peer} failed: no transfer record of it was connected"
        else:
            batch.xfer, batch.error = self._start(peer, srcs, dsts, lens, _WRITE + seq.to_bytes(_SEQ_BYTES, "big")
                                                  + payload)
        self._pump.add(batch)
        return handle

    def _start(self, peer, srcs, dsts, lens, notif: bytes) -> tuple[object | None, str | None]:
        """Create and post NIXL's transfer; (handle, None) or (None, why)."""
        with self._lock:
            try:
                local = self._agent.get_xfer_descs([(s, n, 0) for s, n in zip(srcs, lens)], self._memtype)
                remote = self._agent.get_xfer_descs([(d, n, 0) for d, n in zip(dsts, lens)], self._memtype)
                xfer = self._agent.initialize_xfer("WRITE", local, remote, peer, notif)
            except Exception as e:  # a destination the peer never registered, a peer gone
                return None, f"write to {peer} failed: {type(e).__name__}: {e}"
            try:
                if self._agent.transfer(xfer) == "ERR":
                    raise TransferError("NIXL reported ERR at post")
            except Exception as e:
                self._agent.release_xfer_handle(xfer)
                return None, f"write to {peer} failed: {type(e).__name__}: {e}"
        return xfer, None

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"transfer agent {self._session} is closed")


class _Pump:
    """Thread that polls posted batches, drains NIXL's notifications (answering each ``W`` and
    keeping its notify, matching each ``A`` to its batch) and fails batches past their deadline.
    ``_cond`` guards ``_batches``, ``_acks``, ``_notifies`` and every handle's state; the agent is
    called under the backend's lock only."""

    def __init__(self, be: NixlTransferBackend, interval_s: float):
        self._be = be
        self._interval = interval_s
        self._cond = threading.Condition()
        self._batches: list[_Batch] = []
        self._acks: set[tuple[str, int]] = set()  # (peer, seq) answered before its batch settled
        self._notifies: list[base.Notify] = []
        self._unknown: set[str] = set()  # senders we could not answer (logged once each)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="nixl-pump", daemon=True)
        self._thread.start()

    def add(self, batch: _Batch) -> None:
        with self._cond:
            if self._stopping:
                batch.error = batch.error or "transfer agent closed before the write was posted"
            self._batches.append(batch)
            self._settle()

    def state(self, handle: WriteHandle) -> WriteState:
        with self._cond:
            return handle.state

    def pending(self) -> int:
        with self._cond:
            return len(self._batches)

    def take_notifies(self) -> list[base.Notify]:
        with self._cond:
            out, self._notifies = self._notifies, []
            return out

    def stop(self, timeout_s: float) -> bool:
        """Wait (bounded) for in-flight batches, cancel what is left; True when UCX holds none."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._batches and time.monotonic() < deadline:
                self._cond.wait(0.01)
            self._stopping = True
        self._thread.join(max(1.0, deadline - time.monotonic()))
        with self._cond:
            for b in self._batches:
                if b.xfer is not None and not self._cancel(b):
                    return False
                b.error = b.error or "transfer agent closed with the write in flight"
            self._settle()
        return not self._thread.is_alive()

    def _run(self) -> None:
        wait = self._interval
        while True:
            with self._cond:
                if self._stopping:
                    return
                work = [b for b in self._batches if b.xfer is not None]
            got = self._drain_notifs()
            self._poll(work)
            with self._cond:
                self._expire(time.monotonic())
                self._settle()
                # Every poll is also UCX's progress (no NIXL progress thread, see the module
                # docstring): fast while anything moves, backing off to IDLE_POLL_S when idle.
                wait = self._interval if (got or self._batches) else min(2 * wait, IDLE_POLL_S)
                self._cond.wait(wait)

    def _poll(self, work: list[_Batch]) -> None:
        be = self._be
        for b in work:
            with be._lock:
                state = be._agent.check_xfer_state(b.xfer)
                if state == "PROC":
                    continue
                be._agent.release_xfer_handle(b.xfer)
            with self._cond:
                b.xfer = None
                if state == "DONE":
                    b.sent = True
                else:
                    b.error = b.error or f"write to {b.handle.peer} failed (NIXL reported {state})"

    def _drain_notifs(self) -> bool:
        """Take NIXL's notifications (their call also progresses UCX); whether any came."""
        be = self._be
        with be._lock:
            got = be._agent.get_new_notifs()
        answers = []
        for sender, msgs in got.items():
            sender = sender.decode() if isinstance(sender, bytes) else str(sender)
            for m in msgs:
                kind, seq, payload = m[:1], int.from_bytes(m[1:1 + _SEQ_BYTES], "big"), m[1 + _SEQ_BYTES:]
                if kind == _ACK:
                    with self._cond:
                        self._acks.add((sender, seq))
                elif kind == _WRITE:
                    self._keep_notify(sender, payload)
                    answers.append((sender, _ACK + m[1:1 + _SEQ_BYTES]))
        for sender, ack in answers:
            self._answer(sender, ack)
        return bool(got) and any(got.values())

    def _answer(self, sender: str, ack: bytes) -> None:
        be = self._be
        with be._lock:
            known = sender in be._peers
            if known:
                try:
                    be._agent.send_notif(sender, ack)
                except Exception as e:  # the sender died meanwhile: its batch fails on its side
                    logger.debug("could not answer %s: %s", sender, e)
        if not known and sender not in self._unknown:
            self._unknown.add(sender)
            logger.warning("transfer agent %s: writes from %s, whose record was never connected, go "
                           "unanswered (they fail on its side)", be._session, sender[:80])

    def _keep_notify(self, sender: str, payload: bytes) -> None:
        if not payload:
            return
        try:
            name, msg = json.loads(payload) if len(payload) <= MAX_NOTIFY_BYTES else (None, None)
        except ValueError:
            name = msg = None
        if isinstance(name, str) and isinstance(msg, str):
            with self._cond:
                self._notifies.append((name, msg))
        else:
            logger.warning("transfer agent %s: dropped a malformed notify from %s", self._be._session, sender[:80])

    def _expire(self, now: float) -> None:
        """Fail batches past their deadline (caller holds ``_cond``); one still inside UCX is
        cancelled first, or waits for its handle to end."""
        for b in self._batches:
            if b.error is None and not b.acked and now > b.deadline:
                if b.xfer is not None and not self._cancel(b):
                    continue
                b.error = f"write to {b.handle.peer} failed: it did not answer within {self._be._stall_s:.0f}s"

    def _cancel(self, b: _Batch) -> bool:
        be = self._be
        with be._lock:
            try:
                be._agent.release_xfer_handle(b.xfer)
            except Exception as e:  # NIXL could not cancel it: try again later
                logger.debug("release of a write to %s failed: %s", b.handle.peer, e)
                return False
        b.xfer = None
        return True

    def _settle(self) -> None:
        """Publish terminal states (caller holds ``_cond``)."""
        keep = []
        for b in self._batches:
            key = (b.handle.peer, b.seq)
            if key in self._acks:
                self._acks.discard(key)
                b.acked = True
            if b.xfer is None and (b.error is not None or (b.sent and b.acked)):
                b.handle.error = b.error
                b.handle.state = WriteState.FAILED if b.error else WriteState.DONE
            else:
                keep.append(b)
        self._batches = keep
        self._cond.notify_all()


class _Beacon:
    """The listener behind ``session_id``: answers ``BANNER`` to whoever connects, reads nothing."""

    def __init__(self, hostname: str):
        family = socket.AF_INET6 if ":" in hostname else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.bind((hostname, 0))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self._run, name="nixl-beacon", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with conn:
                try:
                    conn.settimeout(1.0)
                    conn.sendall(BANNER)
                except OSError:
                    pass

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._thread.join(5)


def probe_banner(peer: str, timeout_s: float) -> bool:
    """Whether ``peer`` ("host:port") answered the banner within ``timeout_s``."""
    host, _, port = peer.rpartition(":")
    if not port.isdigit():
        return False
    deadline = time.monotonic() + timeout_s
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as s:
            got = b""
            while len(got) < len(BANNER):
                s.settimeout(max(0.001, deadline - time.monotonic()))
                chunk = s.recv(len(BANNER) - len(got))
                if not chunk:
                    break
                got += chunk
            return got == BANNER
    except OSError:
        return False
