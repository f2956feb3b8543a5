"""Decode side of the KV messenger: which prefill serves a room, what decode expects from it,
when the KV has landed, and where abandoned pages wait until no late write can reach them.

- ``PeerDirectory``: prefill servers' bootstrap records, the same on every scheduler rank. The
  fetching rank (rank 0; the only one in a single-rank server) fetches a server's records on a
  helper thread (the scheduler loop never waits on HTTP), checks them against decode's
  compatibility record and KV layout, and posts the outcome as a ``PeerFetched`` message that
  every rank applies at the same loop iteration.
- ``PeerMonitor``: decode's heartbeat (on rank 0 alone). It probes the transfer engines of the
  known prefill servers from a helper thread (Mooncake answers probes from its own threads, so a
  long prefill forward is not mistaken for death); two misses in a row make it post a
  ``PeersDead`` verdict. A dead verdict fails rooms over, but it is a suspicion, not a proof: a
  paused prefill (GC, VM stall, SIGSTOP, partition) resumes and finishes the writes it started.
  So the monitor goes on checking dead sessions until their exit is confirmed (the transfer port
  refuses connections, which a paused process's kernel does not, and the bootstrap registry
  refuses too or no longer lists the session) and posts ``PeersGone``.
- ``IncomingRoom``: one request's expected page-writes per (prefill rank, decode rank), from
  ``layout.expected_writes``, and the completions that arrived.
- ``Quarantine``: destination pages (and the aux slot, and the table row whose record prefill
  writes in a layout with records) of a room decode gave up on. They are
  reused only once every prefill rank acknowledged the abort or completed the room, once the
  exit of the ranks that may still write is confirmed (after a grace period for bytes already
  on the wire), or once the lease runs out; never on a dead verdict alone.
"""

from __future__ import annotations

import concurrent.futures
import errno
import logging
import socket
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from pdserve.disagg.auth import PeerAuth
from pdserve.disagg.bootstrap import BootstrapClient, BootstrapError, BootstrapInfo, CompatRecord, Unreachable
from pdserve.disagg.layout import KVLayout, LayoutError, check_compatible
from pdserve.disagg.protocol import KVCompletion
from pdserve.transfer import TransferBackend

logger = logging.getLogger(__name__)

GONE_PEER_GRACE_S = 0.5  # after a peer's exit is confirmed, bytes it already sent may still be applied
PROBE_MISSES = 2  # consecutive failed probes before a peer is declared dead
UNREACHABLE_BACKOFF_S = 2.0  # a prefill whose registry did not answer is not asked again this soon


# ------------------------------------------------------------------- peers
@dataclass
class Peer:
    """One prefill server as decode knows it."""

    key: tuple[str, int]  # its bootstrap (host, port)
    info: BootstrapInfo | None = None
    error: str | None = None  # fetch failed, or incompatible (then every request to it fails)
    incompatible: bool = False
    retry_at: float = 0.0  # with an error: requests naming it fall back at once until then

    @property
    def name(self) -> str:
        return f"{self.key[0]}:{self.key[1]}"

    def retry_due(self, now: float) -> bool:
        """A peer whose fetch failed is asked again from ``retry_at`` on (incompatible ones never)."""
        return self.error is not None and not self.incompatible and now >= self.retry_at

    @property
    def fetched_info(self) -> BootstrapInfo:
        """Its records; only a peer whose fetch succeeded is used to send or receive KV."""
        if self.info is None:
            raise RuntimeError(f"prefill {self.name}: records not fetched ({self.error or 'fetch pending'})")
        return self.info

    @property
    def sessions(self) -> list[str]:
        return [r.session for r in self.info.ranks] if self.info else []

    def controls(self, ranks: Iterable[int]) -> list[str]:
        """The control endpoints of prefill ``ranks``, each once (a multi-rank prefill reads all
        its ranks' messages on one endpoint)."""
        return sorted({self.fetched_info.ranks[r].control for r in ranks})


@dataclass(frozen=True)
class PeerFetched:
    """The fetch of a prefill server's records ended (mailbox message: every rank applies it)."""

    peer: Peer


@dataclass(frozen=True)
class PeersDead:
    """The heartbeat's verdict (mailbox message): these prefill transfer sessions stopped answering."""

    sessions: frozenset[str]


@dataclass(frozen=True)
class PeersGone:
    """The monitor confirmed that the processes behind these dead sessions exited (mailbox message)."""

    sessions: frozenset[str]


def check_peer_layout(prefill: KVLayout, decode: KVLayout) -> None:
    """Raise LayoutError naming what makes ``prefill``'s KV unreceivable by ``decode``."""
    if prefill.dp_size != 1:
        raise LayoutError(f"dp_size: prefill has {prefill.dp_size} attention DP groups; decode receives from a "
                          f"prefill with one (its requests' KV sits on one group decode cannot name)")
    check_compatible(prefill, decode)


class PeerDirectory:
    """Bootstrap records by prefill (host, port).

    ``get`` and every change run on the scheduler thread; records change only through ``apply``
    (a PeerFetched message) and ``forget``, so ranks that apply the same messages agree. ``fetch``
    is for the fetching rank: it starts one background fetch per unknown server and ``post``s
    its PeerFetched when done (any thread).
    """

    def __init__(self, compat: CompatRecord, layout: KVLayout, fetch_timeout_s: float, post: Callable,
                 auth: PeerAuth | None = None):
        self.compat = compat
        self.layout = layout
        self.fetch_timeout_s = fetch_timeout_s
        self.post = post
        self.auth = auth
        self._client = BootstrapClient(auth=auth)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # the fetching rank's
        self._peers: dict[tuple[str, int], Peer] = {}
        self._fetching: set[tuple[str, int]] = set()
        self._retired: dict[str, tuple[str, int]] = {}  # sessions of forgotten peers -> their bootstrap

    def get(self, host: str, port: int) -> Peer | None:
        """The peer once its records are known (or its fetch failed); None until then."""
        return self._peers.get((host, port))

    def fetch(self, key: tuple[str, int]) -> None:
        """Start fetching ``key``'s records unless they are known or on their way."""
        if key in self._peers or key in self._fetching:
            return
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="pdserve-bootstrap")
        self._fetching.add(key)
        self._pool.submit(self._fetch, key)

    def _fetch(self, key: tuple[str, int]) -> None:
        peer = Peer(key)
        try:
            peer.info = self._client.fetch(key[0], key[1], timeout_s=self.fetch_timeout_s)
            self.compat.check(peer.info.compat, mine="decode", theirs=f"prefill {peer.name}")
            check_peer_layout(peer.info.layout, self.layout)
        except Exception as e:  # noqa: BLE001 - any failure is this peer's error, reported per request
            peer.incompatible = peer.info is not None
            peer.error = f"prefill {peer.name}: {e}"
            logger.warning("disaggregation: %s", peer.error)
        self.post(PeerFetched(peer))

    def apply(self, msg: PeerFetched, now: float) -> None:
        if msg.peer.error is not None:
            msg.peer.retry_at = now + UNREACHABLE_BACKOFF_S
        self._peers[msg.peer.key] = msg.peer
        self._fetching.discard(msg.peer.key)

    def forget(self, key: tuple[str, int]) -> None:
        """A dead or unreachable peer: fetch it again when a request names it (it may have restarted).
        Its sessions stay watched until their exit is confirmed: pages in quarantine may wait on them."""
        peer = self._peers.pop(key, None)
        if peer is not None:
            self._retired.update({s: key for s in peer.sessions})

    def buried(self, sessions: frozenset[str]) -> None:
        """``sessions``' processes are gone: nothing needs them watched any more."""
        for s in sessions:
            self._retired.pop(s, None)

    def peers(self) -> list[Peer]:
        return list(self._peers.values())

    def sessions(self) -> dict[str, tuple[str, int]]:
        """Transfer sessions of every known prefill rank, and of forgotten ones whose exit is not
        confirmed yet (what the heartbeat watches), with their bootstrap (host, port)."""
        out = dict(self._retired)
        out.update({s: p.key for p in self._peers.values() for s in p.sessions})
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


class PeerMonitor:
    """Probes transfer sessions from a helper thread and ``post``s ``PeersDead`` for those that
    stopped answering, then ``PeersGone`` once their exit is confirmed (``exited``). A dead
    session is still probed: one that answers again (it was paused) is alive again, so its next
    death gets a verdict of its own; one no longer watched is forgotten, so a restarted prefill
    reusing the address is judged afresh."""

    def __init__(self, backend: TransferBackend, interval_s: float, post: Callable, auth: PeerAuth | None = None):
        self.backend = backend
        self.interval_s = interval_s
        self.post = post
        self._client = BootstrapClient(request_timeout_s=max(0.5, interval_s), auth=auth)
        self._client.refused_grace_s = 0.0  # asked again at the next heartbeat anyway
        self._watched: dict[str, tuple[str, int]] = {}
        self._misses: dict[str, int] = {}
        self._dead: set[str] = set()
        self._gone: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdserve-heartbeat", daemon=True)
        self._thread.start()

    def watch(self, sessions: dict[str, tuple[str, int]]) -> None:
        """The sessions to probe, with their bootstrap (host, port) (replaces the previous set)."""
        with self._lock:
            self._watched = dict(sessions)
            self._dead &= set(self._watched)
            self._gone &= set(self._watched)
            self._misses = {s: n for s, n in self._misses.items() if s in self._watched}

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            with self._lock:
                alive = set(self._watched) - self._dead
                suspects = {s: self._watched[s] for s in self._dead - self._gone}
            timeout = max(0.5, self.interval_s)
            dead = {s for s in alive if not self._answered(s, self.backend.probe(s, timeout_s=timeout))}
            if dead:
                self.post(PeersDead(frozenset(dead)))
            revived = {s for s in suspects if self.backend.probe(s, timeout_s=timeout)}
            if revived:  # it was paused, not dead: its next death must get a verdict of its own
                with self._lock:
                    self._dead -= revived
                logger.info("disaggregation: prefill transfer engine(s) %s answer again", sorted(revived))
            gone = {s for s, key in suspects.items() if s not in revived and self.exited(s, key)}
            if gone:
                with self._lock:
                    self._gone |= gone
                self.post(PeersGone(frozenset(gone)))

    def exited(self, session: str, bootstrap: tuple[str, int]) -> bool:
        """The process behind ``session`` is gone: its transfer port refuses connections (a paused
        process's kernel still accepts them) and its registry refuses too or no longer lists it."""
        if not _refuses(session):
            return False
        try:
            info = self._client.fetch(*bootstrap, timeout_s=self._client.request_timeout_s)
        except Unreachable:
            return True
        except BootstrapError:  # no answer (paused too?), refused, incomplete: not a proof
            return False
        return session not in {r.session for r in info.ranks}

    def _answered(self, session: str, alive: bool) -> bool:
        """Record a probe's outcome; False when it makes the session dead (newly)."""
        with self._lock:
            if alive or session not in self._watched:
                self._misses.pop(session, None)
                return True
            self._misses[session] = self._misses.get(session, 0) + 1
            if self._misses[session] < PROBE_MISSES:
                return True
            self._dead.add(session)
        logger.warning("disaggregation: prefill transfer engine %s stopped answering", session)
        return False

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _refuses(session: str, timeout_s: float = 1.0) -> bool:
    """A TCP connection to ``session`` ("host:port") is refused (nothing listens any more)."""
    host, _, port = session.rpartition(":")
    if not port.isdigit():
        return False
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return False
    except ConnectionRefusedError:
        return True
    except OSError as e:
        return e.errno == errno.ECONNREFUSED


# ------------------------------------------------------------------- rooms
@dataclass
class IncomingRoom:
    """What decode waits for in one room."""

    room: int
    nonce: int  # this life of the room: a completion must echo it
    peer: Peer
    expected: dict[tuple[int, int], int]  # page-writes by (prefill rank, decode rank)
    deadline: float
    sent_at: float
    got: dict[tuple[int, int], KVCompletion] = field(default_factory=dict)

    @property
    def sources(self) -> set[int]:
        return {s for s, _ in self.expected}

    def overdue(self, now: float) -> bool:
        """More than ``--disaggregation-timeout-s`` without progress: since the KV request went
        out, prefill's last progress notice or the last counted completion."""
        return now > self.deadline

    def progress(self, now: float, timeout_s: float) -> None:
        """The room made progress at ``now``: it may wait ``timeout_s`` more (never less than before)."""
        self.deadline = max(self.deadline, now + timeout_s)

    def add(self, c: KVCompletion) -> str | None:
        """Record a completion; returns an error when it breaks the room."""
        key = (c.src_rank, c.dst_rank)
        if key not in self.expected:
            return f"room {self.room}: completion from prefill rank {c.src_rank} to {c.dst_rank} was not expected"
        if c.status != "ok":
            return c.error or "prefill reported a failed transfer"
        if c.writes != self.expected[key]:
            return (f"room {self.room}: prefill rank {c.src_rank} reports {c.writes} page-writes to rank "
                    f"{c.dst_rank}, decode expects {self.expected[key]}")
        self.got[key] = c
        return None

    @property
    def complete(self) -> bool:
        return set(self.got) == set(self.expected)

    def remote_timings(self) -> tuple[float, float]:
        """Prefill's (queue, prefill) seconds, the slowest source rank's."""
        if not self.got:
            return 0.0, 0.0
        return max(c.queue_s for c in self.got.values()), max(c.prefill_s for c in self.got.values())

    def remote_cached_tokens(self) -> int:
        """Prompt tokens prefill served from its prefix cache (every source rank shares one cache)."""
        return min((c.cached_tokens for c in self.got.values()), default=0)

    def remote_cached_by_tier(self) -> dict[str, int]:
        """``remote_cached_tokens`` split by the tier prefill found them in (device, host, storage)."""
        total = self.remote_cached_tokens()
        host = min((c.cached_host_tokens for c in self.got.values()), default=0)
        storage = min((c.cached_storage_tokens for c in self.got.values()), default=0)
        host, storage = min(host, total), min(storage, total - min(host, total))
        return {"device": total - host - storage, "host": host, "storage": storage}


# -------------------------------------------------------------- quarantine
@dataclass
class QuarantineEntry:
    room: int
    nonce: int
    pages: list[int]
    aux_slot: int | None
    pending: dict[int, str]  # prefill rank yet to acknowledge or complete -> its transfer session
    until: float  # lease: released then whatever happened
    staging: int | None = None  # the room's staging range (a packed transfer), freed with the pages
    row: int | None = None  # the request-table row whose record prefill writes (a layout with records)
    gone_at: dict[int, float] = field(default_factory=dict)  # pending rank -> when its exit was confirmed

    def safe(self, now: float) -> bool:
        """No late write can land: every pending rank's exit is confirmed (and its grace is over),
        none is left, or the lease ran out. A dead verdict alone is not enough (module docstring)."""
        gone = all(r in self.gone_at and now - self.gone_at[r] >= GONE_PEER_GRACE_S for r in self.pending)
        return now >= self.until or gone


class Quarantine:
    """Pages no one may reuse while a late write could still land on them, by (room, nonce)."""

    def __init__(self, lease_s: float):
        self.lease_s = lease_s
        self.entries: dict[tuple[int, int], QuarantineEntry] = {}

    def add(self, room: int, nonce: int, pages: list[int], aux_slot: int | None, pending: dict[int, str],
            now: float, staging: int | None = None, row: int | None = None) -> None:
        """``pending``: the prefill ranks that may still write (rank -> transfer session)."""
        if not pages and aux_slot is None and staging is None and row is None:
            return
        self.entries[(room, nonce)] = QuarantineEntry(room, nonce, list(pages), aux_slot, dict(pending),
                                                      now + self.lease_s, staging, row)

    @property
    def num_pages(self) -> int:
        return sum(len(e.pages) for e in self.entries.values())

    def settled(self, room: int, nonce: int, src_rank: int) -> bool:
        """Prefill rank ``src_rank`` acknowledged the abort or completed the room; False when no
        entry has that room and nonce."""
        e = self.entries.get((room, nonce))
        if e is None:
            return False
        e.pending.pop(src_rank, None)
        return True

    def peers_gone(self, sessions: set[str], now: float) -> None:
        for e in self.entries.values():
            for rank, session in e.pending.items():
                if session in sessions:
                    e.gone_at.setdefault(rank, now)

    def release(self, now: float) -> list[QuarantineEntry]:
        """Entries that are safe now; removed from the quarantine."""
        out = [e for e in self.entries.values() if e.safe(now)]
        for e in out:
            del self.entries[(e.room, e.nonce)]
        return out


class AuxSlots:
    """Rows of decode's registered aux buffer, one per request waiting for KV."""

    def __init__(self, n: int):
        self._free = list(range(n - 1, -1, -1))

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, slot: int | None) -> None:
        if slot is not None:
            self._free.append(slot)

    @property
    def num_free(self) -> int:
        return len(self._free)

