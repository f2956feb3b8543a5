"""The decode server's scheduler mode (docs/disaggregation.md): pre-allocate pages, ask prefill for the KV,
wait until every write has landed, then decode; fall back to a local prefill when it fails. A
request asking for no new token (the shared prompt of ``n`` samples) ends once its KV landed,
leaving it in the radix cache.

A request's life here: it waits (``pending``) until its prefill's bootstrap records are known
and pages are free -> decode pins pages for ``prompt[:-1]`` minus what its own radix cache
holds, sends the KV request and parks it in WAITING_FOR_KV -> prefill's completion arrives
with a write count equal to the one decode computed from the layouts -> it joins the running
batch, and its first decode step feeds the prompt's last token.

Decode prefills locally instead (the colocated path, so output is identical) when there is
nothing to receive (a one-token prompt, or ``prompt[:-1]`` already cached), when what it would
receive is shorter than ``--disaggregation-min-prefill-tokens``, or when the request wants
prompt logprobs (only a local prefill computes them); prefill is told to drop the room. On a
failed transfer (prefill dead, write error, timeout) it falls back the same way on fresh pages,
and the abandoned pages (and, in a layout with per-request records, the table row whose record
prefill writes) stay in quarantine until no late write can land; with
``--disaggregation-fallback error`` the request fails instead.

With several ranks (TP, DP attention) every rank of the request's attention group pins the same
pages (lock step) and sends prefill its own KV request (its transfer session, its buffers); the
completions, bootstrap records and heartbeat verdicts reach every rank as messages rank 0 shares
(``disagg/mode_io.py``), so the group lands, fails over or quarantines a room at the same step.

Packed transfers (``--disaggregation-transfer-pack``; ``layout.packing_pays``): a rank lends a room
a range of its registered staging buffer (published in its record) for the room's whole KV;
prefill writes each forward's head blocks there in one write apiece, and once the room's writes
completed the rank scatters the range into the room's pages before the request runs. A room
given up on keeps its range in quarantine with its pages. With no range free the room is asked
for unpacked: the staging buffer bounds memory, never a request.

Timeouts are about progress, not total time (docs/disaggregation.md): a room fails over once
``--disaggregation-timeout-s`` (T) passed with no sign of progress: since its KV request, since
prefill's last ``KVProgress`` for it (prefill sends one when it pairs the room and then at least
every T/4 while the room is queued or being computed), or since its last counted completion. A
prefill that is slow but working never trips it; one that is stuck (a forward longer than T, a
pause) or dead does. Prefill still never writes a room after decode gave up on it without saying
so, and the quarantine lease still covers the rest:

- prefill extends its own write deadline only when decode acknowledges a notice
  (``KVProgressAck``), and only to that notice's *send* time + T, while decode extended its
  deadline to the notice's *receipt* time + T (read after it arrived); receipt >= send, so the
  extension never puts prefill's deadline past decode's. A notice lost, refused or arriving for
  a room decode already gave up on (counted stale, never acknowledged) extends neither side;
- before any notice, prefill's deadline is T after the KV request *arrived* there, decode's T
  after it was *sent*: prefill may post until decode's give-up time plus that one-way delay, as
  before progress existed, which the lease (``LEASE_TIMEOUTS`` x T after the give-up) covers.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter, deque
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

import torch

from pdserve.config import DisaggConfig
from pdserve.disagg.layout import KVLayout, LayoutError, expected_writes, packing_pays, staging_blocks, staging_bytes
from pdserve.disagg.mode_io import ModeIO
from pdserve.disagg.protocol import (
    MAX_NONCE,
    DecodeRecord,
    DropRoom,
    KVAbort,
    KVAbortAck,
    KVCompletion,
    KVProgress,
    KVProgressAck,
    KVRequest,
)
from pdserve.disagg.receiver import (
    AuxSlots,
    IncomingRoom,
    Peer,
    PeerDirectory,
    PeerFetched,
    PeerMonitor,
    PeersDead,
    PeersGone,
    Quarantine,
)
from pdserve.disagg.staging import StagingPool, unpack_room
from pdserve.engine.modes import SchedulerMode
from pdserve.engine.modes import balance as _balance
from pdserve.engine.request import Req, ReqState, finish_abort, finish_length
from pdserve.transfer import TransferBackend, TransferError

logger = logging.getLogger(__name__)

FALLBACK_WINDOW = 100  # the fallback rate is over this many recent disaggregated requests
LEASE_TIMEOUTS = 2  # quarantine lease in --disaggregation-timeout-s: past prefill's own bound on writing a room
# Rooms the router said broke before their request reached this scheduler (its call to decode and its
# notice race), remembered for --disaggregation-timeout-s, at most this many (the oldest go first)
LOST_EARLY_MAX = 4096


@dataclass(frozen=True)
class OwedAbort:
    """A request decode gave up on before its prefill's records arrived: prefill is told once they
    do, or its HTTP half would wait there until the disaggregation timeout."""

    peer: tuple[str, int]
    room: int
    reason: str
    since: float


@dataclass
class WaitingRoom:
    """A request of this rank waiting for its KV: what it expects and the aux row it lent prefill."""

    req: Req
    incoming: IncomingRoom
    aux_slot: int
    staging: int | None = None  # offset of the room's staging range (a packed transfer)
    blocks: tuple = ()  # ``layout.staging_blocks`` of that range
    pages: tuple[int, ...] = ()  # the pages the KV request named (where the range unpacks to)


class DecodeMode(SchedulerMode):
    name = "decode"
    rank_counters = ("kv_bytes_received",)  # each rank receives its own heads' share

    def __init__(self, config: DisaggConfig, io: ModeIO, backend: TransferBackend, layout: KVLayout,
                 bases: list[int], aux: torch.Tensor, directory: PeerDirectory, server_id: str, rank: int = 0,
                 record: DecodeRecord | None = None, nonce_salt: bytes = b"", staging: StagingPool | None = None,
                 pools: dict[str, torch.Tensor] | None = None):
        """``rank``: this rank's attention rank in ``layout``; ``bases``: its KV buffer addresses in
        ``layout.buffers`` order; ``aux`` [slots, hidden] float32, registered: where prefill
        writes each request's aux data; ``record``: what this rank publishes to each prefill before
        its first KV request (the only destinations prefill will write); ``nonce_salt``: random,
        the same on every rank (rooms' nonces derive from it, so the ranks agree on them);
        ``staging``, registered and published in ``record``, and ``pools`` (the KV tensors behind
        ``bases``): for packed transfers (``config.transfer_pack``)."""
        self.config = config
        self.io = io
        self.backend = backend
        self.layout = layout
        self.bases = bases
        self.aux = aux
        self.directory = directory
        self.server_id = server_id
        self.rank = rank
        self.dp_rank = rank // layout.tp_size
        self.monitor = (PeerMonitor(backend, config.heartbeat_s, io.post, directory.auth)
                        if io.is_fetcher else None)
        self.asked: set[tuple[str, int]] = set()  # prefill servers this rank asked to be fetched
        self.record = record
        self.introduced: set[tuple[str, int]] = set()  # prefill servers that have this rank's record
        self.nonce_salt = nonce_salt
        self.staging = staging
        self.pools = pools or {}
        self._seq = 0
        self.quarantine = Quarantine(lease_s=LEASE_TIMEOUTS * config.timeout_s)
        self.aux_slots = AuxSlots(aux.shape[0])
        self.pending: list[Req] = []  # waiting for their prefill's records or for free pages
        self.owed_aborts: list[OwedAbort] = []
        self.rooms: dict[int, WaitingRoom] = {}
        # room -> (when, why): the router's notice came first; the request falls back as it arrives
        self.lost_early: dict[int, tuple[float, str]] = {}
        self.outcomes: deque[bool] = deque(maxlen=FALLBACK_WINDOW)  # recent transfers: True = fell back
        self.counters = {"requests_disaggregated": 0, "kv_received": 0, "local_prefills": 0,
                         "fallbacks": 0, "transfer_failures": 0, "kv_pages_received": 0, "stale_messages": 0,
                         "duplicate_rooms": 0, "kv_rooms_packed": 0, "kv_pages_requested": 0, "kv_bytes_received": 0,
                         "decode_cached_tokens": 0}

    # ------------------------------------------------------------- intake
    def take(self, req: Req, bootstrap) -> bool:
        if bootstrap is None:
            return False  # not routed: a colocated request
        if self._live(bootstrap.room):  # the frontend refuses these; a second frontend or a bug must not either
            self.counters["duplicate_rooms"] += 1
            self.scheduler.finish_request(req, finish_abort(f"bootstrap_room: {bootstrap.room} is already used by "
                                                            f"a request in flight (rooms must be unique)"))
            return True
        req.room, req.bootstrap = bootstrap.room, bootstrap
        lost = self._lost_early_notice(bootstrap.room)
        if lost is not None:  # the router already saw this room's prefill half break: prefill here now
            self._lost(req, lost)
            return True
        self.pending.append(req)
        return True

    def _lost_early_notice(self, room: int) -> str | None:
        """Why the router said ``room``'s prefill broke before its request arrived (taken), if it did
        within the disaggregation timeout."""
        now = self.io.now()
        for r in [r for r, (t, _) in self.lost_early.items() if now - t > self.config.timeout_s]:
            del self.lost_early[r]
        notice = self.lost_early.pop(room, None)
        return None if notice is None else notice[1]

    def _live(self, room: int) -> bool:
        return room in self.rooms or any(r.room == room for r in self.pending)

    def connect(self, loop) -> None:
        self.io.connect(loop)

    def detach(self) -> None:
        if self.monitor is not None:
            self.monitor.watch({})  # no heartbeats to prefill servers while this server prefills

    def poll(self) -> None:
        now = self.io.now()
        for msg in self.io.recv_all():
            self._on_message(msg, now)
        self._fetch(self.io.agree(sorted(self._unknown_peers())))
        self._pay_owed_aborts(now)
        for req in list(self.pending):
            if not self._try_prepare(req, now):
                break  # FCFS: a request that cannot get pages holds back the ones behind it
        for room, w in list(self.rooms.items()):
            if w.incoming.overdue(now):
                self._fail(room, f"no progress from prefill {w.incoming.peer.name} for {self.config.timeout_s:g} s "
                                 f"(--disaggregation-timeout-s: the longest wait for a room's KV without progress)")
        self._release_quarantine(now)
        if self.monitor is not None:
            self.monitor.watch(self.directory.sessions())

    def wants_agreement(self) -> bool:
        return bool(self._unknown_peers())

    def _unknown_peers(self) -> set[tuple[str, int]]:
        """Prefill servers pending requests name whose records this rank has not asked for yet."""
        keys = {(r.bootstrap_ref.host, r.bootstrap_ref.port) for r in self.pending}
        keys |= {o.peer for o in self.owed_aborts}
        return {k for k in keys if self.directory.get(*k) is None} - self.asked

    def _fetch(self, wanted: list[list] | None) -> None:
        """Every rank's unknown prefill servers (None: not agreed this step): the fetching rank
        fetches them; their records come back to every rank as a PeerFetched message."""
        if wanted is None:
            return
        self.asked |= self._unknown_peers()
        if self.io.is_fetcher:
            for keys in wanted:
                for key in keys:
                    self.directory.fetch(tuple(key))

    # ------------------------------------------------------------- preparing
    def _try_prepare(self, req: Req, now: float) -> bool:
        """False when the request must keep waiting for pages (nothing taken)."""
        b = req.bootstrap_ref
        peer = self.directory.get(b.host, b.port)
        if peer is None:
            return True  # records on their way; later requests may go ahead
        if peer.error is not None:
            if peer.retry_due(now):
                self._forget(peer.key)  # ask again: it may have restarted (the request waits for the answer)
                return True
            self.pending.remove(req)
            self._unreachable(req, peer)
            return True
        if self._serve_locally(req, peer):
            return True
        return self._request_kv(req, peer, now)

    def _unreachable(self, req: Req, peer: Peer) -> None:
        """Within the back-off after a failed fetch, requests naming the peer fall back at once."""
        if peer.incompatible:  # a deployment error: never hidden behind a fallback
            self.scheduler.finish_request(req, finish_abort(f"disaggregation handshake refused: {peer.error}"))
            return
        self._fall_back(req, peer.error or f"prefill {peer.name} unreachable")

    def _forget(self, key: tuple[str, int]) -> None:
        self.directory.forget(key)
        self.asked.discard(key)
        self.introduced.discard(key)

    def _serve_locally(self, req: Req, peer: Peer) -> bool:
        """Prefill here instead (and tell prefill to drop the room) when a transfer cannot pay."""
        receive = len(req.fill_ids) - 1 - self.scheduler.kv_manager.match_len(req.fill_ids[:-1], req.cache_salt)
        if receive > 0 and receive >= self.config.min_prefill_tokens and req.logprob is None:
            return False
        self.pending.remove(req)
        self.io.send_once(peer.fetched_info.ranks[0].control, DropRoom(req.bootstrap_room))
        self.counters["local_prefills"] += 1
        self.scheduler.enqueue(req)
        return True

    def _request_kv(self, req: Req, peer: Peer, now: float) -> bool:
        """Pin pages for ``prompt[:-1]`` (its cached prefix locked, the rest this request's own)
        and ask prefill for the rest; False (nothing taken) when they do not fit yet."""
        kv = self.scheduler.kv_manager
        n = len(req.fill_ids) - 1  # positions decode receives or has: all but the last prompt token
        aux_slot = self.aux_slots.alloc()
        if aux_slot is None:
            return False
        if not kv.admit(req, req.fill_ids[:-1]):
            self.aux_slots.free(aux_slot)
            return False
        # A page per running request stays free or evictable: its next decode step may need one.
        if not kv.grow(req, n, headroom=len(self.scheduler.running)):
            kv.unadmit(req)
            self.aux_slots.free(aux_slot)
            return False
        self.pending.remove(req)
        req.cached_tokens_reported = req.cached_len
        # Decode's own hit: the pages it holds are not asked for (only req.pages[num_cached_pages:] are).
        req.decode_cached_tokens = req.cached_len
        self.counters["decode_cached_tokens"] += req.cached_len
        try:
            self._send_kv_request(req, peer, req.pages[req.num_cached_pages:], aux_slot, now)
        except LayoutError as e:  # refused at handshake: name what differs, keep serving
            kv.drop(req)
            self.aux_slots.free(aux_slot)
            self.scheduler.finish_request(req, finish_abort(f"disaggregation handshake refused: {e}"))
        return True

    def _send_kv_request(self, req: Req, peer: Peer, pages: list[int], aux_slot: int, now: float) -> None:
        """This rank's KV request (its session, buffers, aux row); the room expects the page-writes
        of every (prefill rank, decode rank) pair of the attention group."""
        info, room = peer.fetched_info, req.bootstrap_room
        src = info.layout
        seed = info.ranks[0].seed
        expected = expected_writes(src, self.layout, len(pages), room=room, seed=seed, dst_dp_rank=self.dp_rank)
        row = self.aux[aux_slot]
        nonce = self._nonce(room)
        at = self._lend_staging(src, len(pages))
        need = staging_bytes(self.layout, len(pages)) if at is not None else 0
        addr = self.staging.addr + at if self.staging is not None and at is not None else 0
        kv = KVRequest(room, nonce, self.server_id, self.rank, self.backend.session_id, self.bases, self.layout,
                       pages, req.kv_len, len(req.fill_ids) - 1 - req.kv_len, row.data_ptr(),
                       row.numel() * row.element_size(), self.io.endpoint, addr, need,
                       record_slot=req.table_row if self.layout.records else -1)
        controls = peer.controls({s for s, _ in expected})
        if peer.key not in self.introduced and self.record is not None:
            for control in peer.controls(range(len(info.ranks))):  # before the KV request, on the same pipe
                self.io.send(control, self.record)
            self.introduced.add(peer.key)
        for control in controls:
            self.io.send(control, kv)
        req.state = ReqState.WAITING_FOR_KV
        req.stage_clock.start_prefill(now)
        inc = IncomingRoom(room, nonce, peer, expected, now + self.config.timeout_s, now)
        blocks = tuple(staging_blocks(src, self.layout, self.rank, len(pages), room=room, seed=seed,
                                      dst_dp_rank=self.dp_rank)) if at is not None else ()
        self.rooms[room] = WaitingRoom(req, inc, aux_slot, at, blocks, tuple(pages))
        self.counters["requests_disaggregated"] += 1
        self.counters["kv_pages_requested"] += len(pages)
        self.counters["kv_rooms_packed"] += at is not None

    def _lend_staging(self, src: KVLayout, num_pages: int) -> int | None:
        """A staging range for a room of ``num_pages`` pages from ``src``, when packing pays and
        one is free (else the room goes unpacked)."""
        if self.staging is None or not self.pools or not packing_pays(src, self.layout, num_pages,
                                                                      self.config.transfer_pack):
            return None
        return self.staging.alloc(staging_bytes(self.layout, num_pages))

    def _nonce(self, room: int) -> int:
        """This life of ``room``: unguessable without the salt, the same on every rank (lock step
        makes ``_seq`` agree)."""
        self._seq += 1
        digest = hashlib.blake2b(f"{room}:{self._seq}".encode(), key=self.nonce_salt[:64], digest_size=8).digest()
        return int.from_bytes(digest, "little") % MAX_NONCE + 1

    def _connect(self, peer: Peer) -> None:
        """The backend learns the prefill ranks from their records (NIXL must answer their writes);
        records it cannot use make the peer unusable, as an incompatible one is."""
        if peer.error is not None:
            return
        try:
            for r in peer.fetched_info.ranks:
                self.backend.connect(r.session, r.transfer_info)
        except TransferError as e:
            peer.incompatible, peer.error = True, f"prefill {peer.name}: {e}"
            logger.warning("disaggregation: %s", peer.error)

    # ------------------------------------------------------------- arrivals
    def _on_message(self, msg, now: float) -> None:
        if isinstance(msg, PeerFetched):
            self._connect(msg.peer)
            self.directory.apply(msg, now)
            self.asked.discard(msg.peer.key)
        elif isinstance(msg, PeersDead):
            self._on_dead(msg.sessions)
        elif isinstance(msg, PeersGone):
            self.quarantine.peers_gone(set(msg.sessions), now)
            for peer in self.directory.peers():  # records naming an exited process are stale
                if set(peer.sessions) & msg.sessions:
                    self._forget(peer.key)
            self.directory.buried(msg.sessions)
        elif isinstance(msg, KVCompletion):
            self._on_completion(msg, now)
        elif isinstance(msg, KVProgress):
            self._on_progress(msg)
        elif isinstance(msg, KVAbort):
            if self._current(msg.room, msg.nonce):
                self._fail(msg.room, f"prefill gave up: {msg.reason}", notify=False)
        elif isinstance(msg, KVAbortAck):
            if not self.quarantine.settled(msg.room, msg.nonce, msg.src_rank):
                self.counters["stale_messages"] += 1
        else:
            logger.debug("decode: ignoring %s", type(msg).__name__)

    def _current(self, room: int, nonce: int) -> bool:
        """``room``'s current life has ``nonce``; anything else is stale (an earlier life, a room
        decode failed over) or forged, and counted."""
        w = self.rooms.get(room)
        if w is not None and w.incoming.nonce == nonce:
            return True
        self.counters["stale_messages"] += 1
        return False

    def _on_progress(self, p: KVProgress) -> None:
        """Prefill still works on the room: its wait restarts now (read after the notice arrived,
        so no earlier than prefill sent it) and prefill hears which notice did it (module
        docstring). Another life of the room, or a rank or session the room's prefill does not
        have: stale or forged, counted, extends nothing."""
        if not self._current(p.room, p.nonce):
            return
        inc = self.rooms[p.room].incoming
        ranks = inc.peer.fetched_info.ranks
        if p.src_rank >= len(ranks) or ranks[p.src_rank].session != p.session:
            self.counters["stale_messages"] += 1
            return
        inc.progress(self.io.now(), self.config.timeout_s)
        for control in inc.peer.controls(range(len(ranks))):
            self.io.send_once(control, KVProgressAck(p.room, p.nonce, p.seq, self.server_id, self.config.timeout_s))

    def _on_completion(self, c: KVCompletion, now: float) -> None:
        if self.quarantine.settled(c.room, c.nonce, c.src_rank):  # a room decode already gave up on
            return
        if not self._current(c.room, c.nonce):
            return
        inc = self.rooms[c.room].incoming
        err = inc.add(c)
        if err is not None:
            self._fail(c.room, err, notify=False, settled={c.src_rank})
        elif inc.complete:
            self._land(c.room, now)
        else:  # a source rank's writes landed: progress (decode waiting longer is always safe)
            inc.progress(now, self.config.timeout_s)

    def _land(self, room: int, now: float) -> None:
        """Every byte is in place: the request joins the running batch."""
        w = self.rooms.pop(room)
        req, inc = w.req, w.incoming
        self.aux_slots.free(w.aux_slot)
        if w.staging is not None and self.staging is not None:  # every write completed: nothing lands there now
            unpack_room(self.staging, w.staging, w.blocks, self.pools, w.pages)
            self.staging.free(w.staging)
        req.kv_len = len(req.fill_ids) - 1
        if self.layout.records:  # the record prefill wrote holds the state before kv_len (module docstring)
            self.scheduler.kv_manager.record_received(req)
        clock = req.stage_clock
        clock.end_prefill(now)
        clock.remote_queue, clock.remote_prefill = inc.remote_timings()
        req.cached_tokens_reported = inc.remote_cached_tokens()  # prefill's hit: the compute it saved
        req.cached_by_tier_reported = inc.remote_cached_by_tier()
        clock.transferred = True
        self.scheduler.activate(req)
        if req.sampling.max_new_tokens == 0:  # a shared prompt (n > 1): its KV goes to the radix cache for the samples
            self.scheduler.finish_request(req, finish_length(0))
        self.counters["kv_received"] += 1
        self.outcomes.append(False)
        self.counters["kv_pages_received"] += len(req.pages) - req.num_cached_pages
        # every layer and page buffer, and the request's records
        self.counters["kv_bytes_received"] += staging_bytes(self.layout, len(w.pages)) + self.layout.record_bytes

    # ------------------------------------------------------------- failures
    def _fail(self, room: int, reason: str, notify: bool = True, settled: AbstractSet[int] = frozenset()) -> None:
        """Give up on the room's transfer; its pages go to quarantine, the request falls back.
        ``notify`` False: prefill itself ended the room (it acknowledges once its writes settled)."""
        w = self.rooms.pop(room)
        req, inc = w.req, w.incoming
        self._abandon(req, inc, w, settled, self.io.now())
        if notify:
            self._send_abort(inc.peer, room, reason, inc.nonce)
        self.counters["transfer_failures"] += 1
        self.outcomes.append(True)
        self._fall_back(req, reason)

    def _abandon(self, req: Req, inc: IncomingRoom, w: WaitingRoom, settled: AbstractSet[int], now: float) -> None:
        """The request lets go of its memory; its own pages (and the aux row, and the staging
        range) wait in quarantine, kept allocated, until no late write can land."""
        pending = inc.sources - set(settled)  # the prefill ranks that may still write these pages
        sessions = {s: inc.peer.fetched_info.ranks[s].session for s in pending}
        records = bool(self.layout.records)  # prefill may still write the row's record
        row = req.table_row if records else None
        own = self.scheduler.kv_manager.quarantine(req, keep_row=records)
        self.quarantine.add(req.bootstrap_room, inc.nonce, own, w.aux_slot, sessions, now, staging=w.staging,
                            row=row)

    def _fall_back(self, req: Req, reason: str) -> None:
        if self.config.fallback == "error":
            self.scheduler.finish_request(req, finish_abort(f"KV transfer failed: {reason}"))
            return
        logger.warning("disaggregation: falling back to a local prefill for %s: %s", req.rid, reason)
        self.counters["fallbacks"] += 1
        req.stage_clock.restart()
        self.scheduler.enqueue(req, front=True)

    def prefill_lost(self, room: int, reason: str) -> bool:
        """Waiting for records or KV that prefill will never send: fall back now, not at the timeout."""
        if room in self.rooms:
            self._fail(room, reason)
            return True
        req = next((r for r in self.pending if r.bootstrap_room == room), None)
        if req is None:
            # Its request has not reached this scheduler yet (the router's call to decode and this
            # notice travel apart): remembered, so the request falls back as it arrives instead of
            # waiting out the timeout for KV that will never come.
            if len(self.lost_early) >= LOST_EARLY_MAX:
                del self.lost_early[next(iter(self.lost_early))]
            self.lost_early[room] = (self.io.now(), reason)
            return False
        self.pending.remove(req)
        self._lost(req, reason)
        return True

    def _lost(self, req: Req, reason: str) -> None:
        self.counters["transfer_failures"] += 1
        self.outcomes.append(True)
        self._fall_back(req, reason)

    def _send_abort(self, peer: Peer, room: int, reason: str, nonce: int = 0) -> None:
        if peer.info is not None:
            for control in peer.controls(range(len(peer.info.ranks))):
                self.io.send_once(control, KVAbort(room, reason, "decode", self.server_id, nonce))

    def _pay_owed_aborts(self, now: float) -> None:
        """Aborts owed to prefill servers whose records arrived are sent; those owed to one that
        cannot be reached, or older than prefill's own wait for the KV half, are dropped."""
        owed = []
        for o in self.owed_aborts:
            peer = self.directory.get(*o.peer)
            if peer is not None and peer.info is not None:
                self._send_abort(peer, o.room, o.reason)
            elif now - o.since <= self.config.timeout_s and (peer is None or peer.error is None):
                owed.append(o)
        self.owed_aborts = owed

    def _on_dead(self, sessions: frozenset[str]) -> None:
        """The heartbeat's verdict: rooms waiting on a dead prefill rank fall back and the prefill
        is forgotten (a request naming it again fetches its records afresh). The verdict may be
        wrong (a paused prefill resumes): every rank is still told to drop the room, and its
        pages stay in quarantine until acknowledged, confirmed gone (``PeersGone``) or leased out."""
        for room, w in list(self.rooms.items()):
            if set(w.incoming.peer.sessions) & sessions:
                self._fail(room, f"prefill {w.incoming.peer.name} stopped answering")
        for peer in self.directory.peers():
            if set(peer.sessions) & sessions:
                self._forget(peer.key)

    def _release_quarantine(self, now: float) -> None:
        for e in self.quarantine.release(now):
            self.scheduler.kv_manager.free_quarantined(e.pages, row=e.row)
            self.aux_slots.free(e.aux_slot)
            if e.staging is not None and self.staging is not None:
                self.staging.free(e.staging)

    # ------------------------------------------------------------- release
    def abort(self, req: Req, message: str) -> bool:
        if req in self.pending:
            self.pending.remove(req)
            key, now = (req.bootstrap_ref.host, req.bootstrap_ref.port), self.io.now()
            self.owed_aborts.append(OwedAbort(key, req.bootstrap_room, message, now))
            self._pay_owed_aborts(now)  # sent now, or once the prefill's records are here
            self.scheduler.finish_request(req, finish_abort(message))
            return True
        room = req.room
        w = self.rooms.get(room) if room is not None else None
        if room is None or w is None or w.req is not req:
            return False
        del self.rooms[room]
        self._abandon(req, w.incoming, w, set(), self.io.now())
        self._send_abort(w.incoming.peer, room, message, w.incoming.nonce)
        self.scheduler.finish_request(req, finish_abort(message))
        return True

    def refused(self, bootstrap, message: str) -> None:
        """Refused at the frontend (a grammar it cannot compile): prefill's half is told as an
        aborted pending request's is, or it would wait for decode until the disaggregation timeout."""
        now = self.io.now()
        self.owed_aborts.append(OwedAbort((bootstrap.host, bootstrap.port), bootstrap.room, message, now))
        self._pay_owed_aborts(now)

    # ------------------------------------------------------------- inspection
    def before_extend(self, reqs: list[Req], lens: list[int]) -> None:
        for r in reqs:  # prefilled here (by choice): decode's own hit is what its admission found
            if r.decode_cached_tokens is None:
                r.decode_cached_tokens = r.cached_tokens_reported

    def has_work(self) -> bool:
        return bool(self.pending or self.rooms or self.quarantine.entries or self.owed_aborts)

    def poll_interval_ms(self) -> int | None:
        if self.pending or self.owed_aborts:
            return 2
        return 20 if (self.rooms or self.quarantine.entries) else None

    def held_reqs(self) -> list[Req]:
        return [w.req for w in self.rooms.values()]

    def quarantined_pages(self) -> int:
        return self.quarantine.num_pages

    def check_resources(self, idle: bool) -> None:
        """Aux rows: one per waiting room or quarantine entry holding one; with ``idle``, no room,
        pending request, quarantine entry or transfer batch left (``SchedulerMode``)."""
        lent = len(self.rooms) + sum(e.aux_slot is not None for e in self.quarantine.entries.values())
        _balance("decode aux slots", self.aux_slots.num_free + lent, self.aux.shape[0])
        if self.staging is not None:
            lent_ranges = sum(w.staging is not None for w in self.rooms.values()) + sum(
                e.staging is not None for e in self.quarantine.entries.values())
            _balance("decode staging ranges", self.staging.ranges_in_use, lent_ranges)
        if idle:
            _balance("decode rooms waiting for KV", len(self.rooms), 0)
            _balance("decode pending requests", len(self.pending), 0)
            _balance("decode aborts owed to prefill", len(self.owed_aborts), 0)
            _balance("decode quarantine entries", len(self.quarantine.entries), 0)
            _balance("decode transfer batches in flight", self.backend.outstanding().batches, 0)

    def sockets(self) -> list:
        return self.io.sockets()

    def stats(self) -> dict:
        rate = sum(self.outcomes) / len(self.outcomes) if self.outcomes else 0.0
        # control_endpoint: where prefill's completions and acks arrive (for drills and operators;
        # frames there are authenticated, so publishing it gives nothing away)
        return {"disaggregation_mode": self.name, "control_endpoint": self.io.endpoint,
                "num_waiting_for_kv": len(self.rooms),
                "num_pending_kv": len(self.pending), "quarantined_pages": self.quarantine.num_pages,
                "fallback_rate": rate, "fallback_window": len(self.outcomes),
                "control_refused": self.io.refused(), "quarantine_entries": len(self.quarantine.entries),
                "control_refused_by_reason": dict(self.io.channel.gate.refused),
                "aux_rows_in_use": self.aux.shape[0] - self.aux_slots.num_free,
                "staging_ranges_in_use": self.staging.ranges_in_use if self.staging is not None else 0,
                "transfer_batches_in_flight": self.backend.outstanding().batches, **self.counters}

    @classmethod
    def merge_stats(cls, per_dp: list[dict]) -> dict:
        counters = ("num_waiting_for_kv", "num_pending_kv", "quarantined_pages", "fallback_window",
                    "requests_disaggregated", "kv_received", "local_prefills", "fallbacks", "transfer_failures",
                    "kv_pages_received", "stale_messages", "duplicate_rooms", "control_refused", "quarantine_entries",
                    "aux_rows_in_use", "transfer_batches_in_flight", "kv_rooms_packed", "staging_ranges_in_use",
                    "kv_pages_requested", "kv_bytes_received", "decode_cached_tokens")
        out = {"disaggregation_mode": cls.name, **{k: sum(s[k] for s in per_dp) for k in counters}}
        out["control_endpoints"] = [s["control_endpoint"] for s in per_dp]
        by_reason: Counter[str] = Counter()
        for s in per_dp:
            by_reason.update(s.get("control_refused_by_reason", {}))
        out["control_refused_by_reason"] = dict(by_reason)
        fell_back = sum(s["fallback_rate"] * s["fallback_window"] for s in per_dp)
        out["fallback_rate"] = fell_back / out["fallback_window"] if out["fallback_window"] else 0.0
        return out

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close()
        self.directory.close()
        self.io.close()
