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
  ``PeersDead`` verdict.
- ``IncomingRoom``: one request's expected page-writes per (prefill rank, decode rank), from
  ``layout.expected_writes``, and the completions that arrived.
- ``Quarantine``: destination pages (and the aux slot) of a room decode gave up on. They are
  reused only once every prefill rank acknowledged the abort or completed the room, once the
  peer is known dead (after a grace period for bytes already on the wire), or once the lease
  runs out.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.disagg.bootstrap import BootstrapClient, BootstrapInfo, CompatRecord
from pdserve.disagg.layout import KVLayout, LayoutError, check_compatible
from pdserve.disagg.protocol import KVCompletion
from pdserve.disagg.transfer import TransferBackend

logger = logging.getLogger(__name__)

DEAD_PEER_GRACE_S = 0.5  # after a peer is known dead, bytes it already sent may still be applied
PROBE_MISSES = 2  # consecutive failed probes before a peer is declared dead


# ------------------------------------------------------------------- peers
@dataclass
class Peer:
    """One prefill server as decode knows it."""

    key: tuple[str, int]  # its bootstrap (host, port)
    info: BootstrapInfo | None = None
    error: str | None = None  # fetch failed, or incompatible (then every request to it fails)
    incompatible: bool = False

    @property
    def name(self) -> str:
        return f"{self.key[0]}:{self.key[1]}"

    @property
    def sessions(self) -> list[str]:
        return [r.session for r in self.info.ranks] if self.info else []

    def controls(self, ranks) -> list[str]:
        """The control endpoints of prefill ``ranks``, each once (a multi-rank prefill reads all
        its ranks' messages on one endpoint)."""
        return sorted({self.info.ranks[r].control for r in ranks})


@dataclass(frozen=True)
class PeerFetched:
    """The fetch of a prefill server's records ended (mailbox message: every rank applies it)."""

    peer: Peer


@dataclass(frozen=True)
class PeersDead:
    """The heartbeat's verdict (mailbox message): these prefill transfer sessions stopped answering."""

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

    def __init__(self, compat: CompatRecord, layout: KVLayout, fetch_timeout_s: float, post: Callable):
        self.compat = compat
        self.layout = layout
        self.fetch_timeout_s = fetch_timeout_s
        self.post = post
        self._client = BootstrapClient()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # the fetching rank's
        self._peers: dict[tuple[str, int], Peer] = {}
        self._fetching: set[tuple[str, int]] = set()
        self._retired: set[str] = set()  # sessions of forgotten peers, watched until declared dead

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

    def apply(self, msg: PeerFetched) -> None:
        self._peers[msg.peer.key] = msg.peer
        self._fetching.discard(msg.peer.key)

    def forget(self, key: tuple[str, int]) -> None:
        """A dead or unreachable peer: fetch it again when a request names it (it may have restarted).
        Its sessions stay watched until declared dead: pages in quarantine may wait on them."""
        peer = self._peers.pop(key, None)
        if peer is not None:
            self._retired |= set(peer.sessions)

    def buried(self, sessions: frozenset[str]) -> None:
        """``sessions`` were declared dead: nothing needs them watched any more."""
        self._retired -= sessions

    def peers(self) -> list[Peer]:
        return list(self._peers.values())

    def sessions(self) -> set[str]:
        """Transfer sessions of every known prefill rank, and of forgotten ones not yet declared
        dead (what the heartbeat watches)."""
        return {s for p in self._peers.values() for s in p.sessions} | self._retired

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


class PeerMonitor:
    """Probes transfer sessions from a helper thread and ``post``s ``PeersDead`` for those that
    stopped answering. A session reported dead is not probed again while it stays watched; one
    no longer watched is forgotten, so a restarted prefill reusing the address is judged afresh."""

    def __init__(self, backend: TransferBackend, interval_s: float, post: Callable):
        self.backend = backend
        self.interval_s = interval_s
        self.post = post
        self._watched: set[str] = set()
        self._misses: dict[str, int] = {}
        self._dead: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdserve-heartbeat", daemon=True)
        self._thread.start()

    def watch(self, sessions: set[str]) -> None:
        """The sessions to probe (replaces the previous set)."""
        with self._lock:
            self._watched = set(sessions)
            self._dead &= self._watched
            self._misses = {s: n for s, n in self._misses.items() if s in self._watched}

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            with self._lock:
                sessions = self._watched - self._dead
            timeout = max(0.5, self.interval_s)
            dead = {s for s in sessions if not self._answered(s, self.backend.probe(s, timeout_s=timeout))}
            if dead:
                self.post(PeersDead(frozenset(dead)))

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


# ------------------------------------------------------------------- rooms
@dataclass
class IncomingRoom:
    """What decode waits for in one room."""

    room: int
    peer: Peer
    expected: dict[tuple[int, int], int]  # page-writes by (prefill rank, decode rank)
    deadline: float
    sent_at: float
    got: dict[tuple[int, int], KVCompletion] = field(default_factory=dict)

    @property
    def sources(self) -> set[int]:
        return {s for s, _ in self.expected}

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


# -------------------------------------------------------------- quarantine
@dataclass
class QuarantineEntry:
    room: int
    pages: list[int]
    aux_slot: int | None
    pending: dict[int, str]  # prefill rank yet to acknowledge or complete -> its transfer session
    until: float  # lease: released then whatever happened
    dead_at: dict[int, float] = field(default_factory=dict)  # pending rank -> when it was declared dead

    def safe(self, now: float) -> bool:
        """No late write can land: every pending rank is dead (and its grace is over), none is
        left, or the lease ran out."""
        gone = all(r in self.dead_at and now - self.dead_at[r] >= DEAD_PEER_GRACE_S for r in self.pending)
        return now >= self.until or gone


class Quarantine:
    """Pages no one may reuse while a late write could still land on them."""

    def __init__(self, lease_s: float):
        self.lease_s = lease_s
        self.entries: dict[int, QuarantineEntry] = {}

    def add(self, room: int, pages: list[int], aux_slot: int | None, pending: dict[int, str], now: float) -> None:
        """``pending``: the prefill ranks that may still write (rank -> transfer session)."""
        if not pages and aux_slot is None:
            return
        self.entries[room] = QuarantineEntry(room, list(pages), aux_slot, dict(pending), now + self.lease_s)

    @property
    def num_pages(self) -> int:
        return sum(len(e.pages) for e in self.entries.values())

    def settled(self, room: int, src_rank: int) -> None:
        """Prefill rank ``src_rank`` acknowledged the abort or completed the room."""
        e = self.entries.get(room)
        if e is not None:
            e.pending.pop(src_rank, None)

    def peers_dead(self, sessions: set[str], now: float) -> None:
        for e in self.entries.values():
            for rank, session in e.pending.items():
                if session in sessions:
                    e.dead_at.setdefault(rank, now)

    def release(self, now: float) -> list[QuarantineEntry]:
        """Entries that are safe now; removed from the quarantine."""
        out = [e for e in self.entries.values() if e.safe(now)]
        for e in out:
            del self.entries[e.room]
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

