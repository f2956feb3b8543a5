"""Decode side of the KV messenger: which prefill serves a room, what decode expects from it,
when the KV has landed, and where abandoned pages wait until no late write can reach them.

- ``PeerDirectory``: prefill servers' bootstrap records, fetched once per server on a helper
  thread (the scheduler loop never waits on HTTP), checked against decode's compatibility record.
- ``PeerMonitor``: decode's heartbeat. It probes each prefill transfer engine it waits on from a
  helper thread (Mooncake answers probes from its own threads, so a long prefill forward is not
  mistaken for death); two misses in a row mark the peer dead.
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
import time
from dataclasses import dataclass, field

from pdserve.disagg.bootstrap import BootstrapClient, BootstrapInfo, CompatRecord
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


class PeerDirectory:
    """Bootstrap records by prefill (host, port), fetched in the background."""

    def __init__(self, compat: CompatRecord, fetch_timeout_s: float):
        self.compat = compat
        self.fetch_timeout_s = fetch_timeout_s
        self._client = BootstrapClient()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="pdserve-bootstrap")
        self._peers: dict[tuple[str, int], Peer] = {}
        self._fetching: dict[tuple[str, int], concurrent.futures.Future] = {}
        self._lock = threading.Lock()

    def get(self, host: str, port: int) -> Peer | None:
        """The peer once its records are known (or its fetch failed); None while fetching."""
        key = (host, port)
        with self._lock:
            peer = self._peers.get(key)
            if peer is not None:
                return peer
            if key not in self._fetching:
                self._fetching[key] = self._pool.submit(self._fetch, key)
        return None

    def _fetch(self, key: tuple[str, int]) -> None:
        peer = Peer(key)
        try:
            peer.info = self._client.fetch(key[0], key[1], timeout_s=self.fetch_timeout_s)
            self.compat.check(peer.info.compat, mine="decode", theirs=f"prefill {peer.name}")
        except Exception as e:  # noqa: BLE001 - any failure is this peer's error, reported per request
            peer.incompatible = peer.info is not None
            peer.error = f"prefill {peer.name}: {e}"
            logger.warning("disaggregation: %s", peer.error)
        with self._lock:
            self._peers[key] = peer
            self._fetching.pop(key, None)

    def forget(self, key: tuple[str, int]) -> None:
        """A dead peer: fetch it again when a request names it (it may have restarted)."""
        with self._lock:
            self._peers.pop(key, None)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class PeerMonitor:
    """Probes transfer sessions from a helper thread; ``dead()`` lists those that stopped answering."""

    def __init__(self, backend: TransferBackend, interval_s: float):
        self.backend = backend
        self.interval_s = interval_s
        self._watched: set[str] = set()
        self._misses: dict[str, int] = {}
        self._dead: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdserve-heartbeat", daemon=True)
        self._thread.start()

    def watch(self, sessions: set[str]) -> None:
        """The sessions decode currently waits on (replaces the previous set)."""
        with self._lock:
            self._watched = set(sessions)

    def dead(self) -> set[str]:
        with self._lock:
            return set(self._dead)

    def revive(self, session: str) -> None:
        with self._lock:
            self._dead.discard(session)
            self._misses.pop(session, None)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            with self._lock:
                sessions = self._watched - self._dead
            for s in sessions:
                alive = self.backend.probe(s, timeout_s=max(0.5, self.interval_s))
                with self._lock:
                    self._misses[s] = 0 if alive else self._misses.get(s, 0) + 1
                    if self._misses[s] >= PROBE_MISSES:
                        self._dead.add(s)
                        logger.warning("disaggregation: prefill transfer engine %s stopped answering", s)

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
    sessions: set[str]  # prefill transfer sessions that may still write
    pending_sources: set[int]  # prefill ranks yet to acknowledge or complete
    until: float  # lease: released then whatever happened
    dead_since: float | None = None


class Quarantine:
    """Pages no one may reuse while a late write could still land on them."""

    def __init__(self, lease_s: float):
        self.lease_s = lease_s
        self.entries: dict[int, QuarantineEntry] = {}

    def add(self, room: int, pages: list[int], aux_slot: int | None, sessions: set[str],
            sources: set[int], now: float) -> None:
        if not pages and aux_slot is None:
            return
        self.entries[room] = QuarantineEntry(room, list(pages), aux_slot, set(sessions), set(sources),
                                             now + self.lease_s)

    @property
    def num_pages(self) -> int:
        return sum(len(e.pages) for e in self.entries.values())

    def settled(self, room: int, src_rank: int) -> None:
        """Prefill rank ``src_rank`` acknowledged the abort or completed the room."""
        e = self.entries.get(room)
        if e is not None:
            e.pending_sources.discard(src_rank)

    def peers_dead(self, sessions: set[str], now: float) -> None:
        for e in self.entries.values():
            if e.dead_since is None and e.sessions & sessions:
                e.dead_since = now

    def release(self, now: float) -> list[QuarantineEntry]:
        """Entries that are safe now; removed from the quarantine."""
        out = [e for e in self.entries.values()
               if not e.pending_sources or now >= e.until
               or (e.dead_since is not None and now - e.dead_since >= DEAD_PEER_GRACE_S)]
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


def monotonic() -> float:
    return time.monotonic()
