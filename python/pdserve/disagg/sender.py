"""Prefill side of the KV messenger: one ``OutgoingRoom`` per request whose KV goes to decode.

The scheduler tells the sender which pages a forward is about to fill (``stage``); the model
runner's per-layer hook (``on_layer``) posts that layer's writes as soon as the layer has
written its KV, without waiting for the forward to end: the transfer overlaps the rest. After the last
chunk the sender writes the aux data, and ``poll`` reports the room done once every write has
polled DONE: only then may decode be told, because DONE means the bytes have landed
(``pdserve.transfer``).

With several prefill ranks, each rank has its own sender over its own pool and transfer engine:
it posts only the writes whose source is its rank (``layout.plan_writes`` names one source per
destination head), reports completions for its own (source, destination) pairs, and posts a
destination rank's aux row only if it is that destination's first source. A rank with no writes
for a room settles at once and reports nothing.

A room has a deadline (``open``'s ``budget_s``: what is left of ``--disaggregation-timeout-s``
since its KV request arrived; ``extend`` moves it when decode acknowledged progress): past it the
sender posts nothing more for the room, whatever the scheduler asks, because decode may have
failed the room over and, once its lease ends, reused the pages. A prefill that was paused (GC,
VM stall, SIGSTOP) checks this before every post.

Packed transfers: when decode lent a room a staging region (``KVRequest.staging_bytes``), each
forward's head block of a layer moves in one write (``layout.plan_packed_writes``): the sender
gathers it into a range of its own staging buffer (``disagg/staging.py``), posts the write, and
takes the range back once that write settled. With no range free it writes the block page by page
from the pool into the same staging range, never waiting.

A layout with per-request records (DeepSeek-V4's bounded layout) moves the request's record too:
the last chunk's forward stages, beside its pages, one write per layer and record from the request's
table row to the slot decode's KV request names, posted by the same layer hook once that layer (the
draft's included) has written the record for the last time; they are counted like page writes.

Legend: S page_size, n prompt tokens; the sender moves positions [start_pos, n - 1).
"""

from __future__ import annotations

import enum
import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from pdserve.disagg.layout import (
    KVLayout,
    LayoutError,
    PackedWrite,
    WriteOp,
    check_compatible,
    count_writes,
    op_addresses,
    plan_packed_writes,
    plan_record_writes,
    plan_writes,
    segments,
    unpacked_writes,
)
from pdserve.disagg.protocol import KVRequest
from pdserve.disagg.staging import StagingPool, pack_block
from pdserve.transfer import TransferBackend, WriteHandle, WriteState

logger = logging.getLogger(__name__)


class RoomState(enum.Enum):
    SENDING = "sending"  # writes are posted as the forward passes run
    DRAINING = "draining"  # every write is posted; waiting for them to land
    DONE = "done"
    FAILED = "failed"


@dataclass
class OutgoingRoom:
    """One request's transfer from this prefill rank to the decode ranks of its KV requests."""

    room: int
    kvs: dict[int, KVRequest]  # by decode rank
    sources: dict[int, list[int]]  # decode rank -> the prefill ranks writing to it (sorted)
    num_tokens: int  # prompt length - 1: positions this prefill fills
    next_page: int  # first prompt page (index) not yet staged
    paired_at: float
    deadline: float = float("inf")  # time.monotonic() past which nothing more is posted
    acked_at: float = float("-inf")  # send time of the last progress notice decode acknowledged
    state: RoomState = RoomState.SENDING
    handles: list[WriteHandle] = field(default_factory=list)
    writes: dict[int, int] = field(default_factory=lambda: defaultdict(int))  # page-writes by decode rank
    staged: dict[int, list] = field(default_factory=dict)  # layer -> this forward's ops
    ranges: list[tuple[WriteHandle, list[int]]] = field(default_factory=list)  # staging ranges a write reads
    error: str | None = None
    aborted: bool = False
    first_forward: float | None = None
    last_forward: float | None = None
    nbytes: int = 0

    @property
    def start_page(self) -> int:
        kv = next(iter(self.kvs.values()))
        return kv.start_pos // kv.layout.page_size

    def settled(self, backend: TransferBackend) -> bool:
        return all(backend.poll(h) is not WriteState.PENDING for h in self.handles)

    @property
    def progress_at(self) -> float:
        """The room's latest sign of life decode knows of: pairing, or an acknowledged notice."""
        return max(self.paired_at, self.acked_at)

    def timings(self) -> tuple[float, float]:
        """(queue, prefill) seconds: pairing to first forward, first forward to last."""
        first = self.first_forward if self.first_forward is not None else self.paired_at
        last = self.last_forward if self.last_forward is not None else first
        return max(0.0, first - self.paired_at), max(0.0, last - first)


class KVSender:
    """All outgoing rooms of one prefill rank. Used from the scheduler thread only (the layer
    hook runs on it too, inside the forward)."""

    def __init__(self, backend: TransferBackend, layout: KVLayout, rank: int, bases: dict[str, int],
                 aux: torch.Tensor, seed: int = 0, pools: dict[str, torch.Tensor] | None = None,
                 staging: StagingPool | None = None):
        """``rank``: this prefill rank's attention rank (``layout``'s numbering); ``bases``: its KV
        buffer base addresses by name; ``aux`` [slots, hidden] float32 registered staging rows for
        the aux data, one per room in flight; ``seed``: of the MLA source draw (published);
        ``pools``: the KV tensors behind ``bases`` (GQA [N, P, H, S, D]) and ``staging`` a
        registered buffer, to pack blocks for packed transfers (without them such a transfer goes
        page by page)."""
        self.backend = backend
        self.pools = pools or {}
        self.staging = staging
        self.layout = layout
        self.rank = rank
        self.dp_rank = rank // layout.tp_size
        self.bases = bases
        self.aux = aux
        self.seed = seed
        self.rooms: dict[int, OutgoingRoom] = {}
        self._aux_free = list(range(aux.shape[0]))
        self._aux_slot: dict[int, int] = {}
        self._active: list[OutgoingRoom] = []  # rooms staged for the forward now running
        self.bytes_posted = 0
        self.writes_posted = 0
        self.packed_writes = 0  # of writes_posted: blocks packed into staging

    @property
    def aux_rows_free(self) -> int:
        return len(self._aux_free)

    # ------------------------------------------------------------- rooms
    def check(self, kv: KVRequest, num_tokens: int) -> None:
        """Raise LayoutError naming what makes ``kv`` unservable for a prompt of n - 1 = num_tokens."""
        check_compatible(self.layout, kv.layout)
        if kv.start_pos + kv.num_tokens != num_tokens:
            raise LayoutError(f"num_tokens: decode asks for positions {kv.start_pos}..{kv.start_pos + kv.num_tokens}"
                              f" but this prompt has {num_tokens} before its last token")
        if kv.aux_bytes not in (0, self.aux.shape[1] * self.aux.element_size()):
            raise LayoutError(f"aux_bytes: decode expects {kv.aux_bytes}, prefill sends "
                              f"{self.aux.shape[1] * self.aux.element_size()}")
        if kv.staging_bytes and self.layout.kind != "gqa":
            raise LayoutError("staging_bytes: packed transfers are for GQA (HND) pages")
        if self.layout.records and not 0 <= kv.record_slot < kv.layout.record_slots:
            raise LayoutError(f"record_slot: {kv.record_slot} is not one of decode's {kv.layout.record_slots} "
                              f"record slots")

    def open(self, room: int, kvs: dict[int, KVRequest], num_tokens: int, now: float,
             budget_s: float = float("inf")) -> OutgoingRoom:
        """``budget_s``: how long from now the room may still be written (module docstring)."""
        for kv in kvs.values():
            self.check(kv, num_tokens)
        if budget_s <= 0:
            raise LayoutError("room: its KV request waited past --disaggregation-timeout-s before pairing")
        r = OutgoingRoom(room, kvs, {d: self._sources(room, kv, d) for d, kv in kvs.items()}, num_tokens, 0, now,
                         deadline=time.monotonic() + budget_s)
        r.next_page = r.start_page
        self.rooms[room] = r
        return r

    def _sources(self, room: int, kv: KVRequest, dst_rank: int) -> list[int]:
        segs = segments(self.layout, kv.layout, room=room, seed=self.seed, src_dp_rank=self.dp_rank,
                        dst_dp_rank=kv.dst_dp_rank)
        return sorted({g.src_rank for g in segs if g.dst_rank == dst_rank})

    def own_pairs(self, room: int) -> list[int]:
        """The decode ranks this rank writes ``room`` to (it reports a completion for each)."""
        r = self.rooms[room]
        return [d for d in r.kvs if self.rank in r.sources[d]]

    def stage(self, room: int, pages: list[int], end_pos: int, row: int | None = None) -> None:
        """The coming forward fills positions up to ``end_pos`` of the room's prompt (``pages``:
        the request's page list, ``row``: its table row, where its record is); plan the writes of the
        pages it completes, and with the last chunk those of the record. Chunks end on page
        boundaries except the last, so every page is sent once per layer."""
        r = self.rooms[room]
        if r.state is not RoomState.SENDING or r.aborted:
            return
        S = self.layout.page_size
        last = end_pos >= r.num_tokens
        end_page = -(-end_pos // S) if last else end_pos // S
        if r.first_forward is None:
            r.first_forward = time.monotonic()
        if end_page <= r.next_page and not (last and self.layout.records):
            return
        src = pages[r.next_page:end_page]
        first_dst = r.next_page - r.start_page
        r.staged = defaultdict(list)
        for d, kv in r.kvs.items():
            if self.rank not in r.sources[d]:
                continue
            ops = self._plan(room, kv, src, first_dst) if src else []
            if last and self.layout.records:
                if row is None:
                    raise LayoutError("records: the last chunk of a room with records needs the request's table row")
                ops = [*ops, *plan_record_writes(self.layout, kv.layout, row, kv.record_slot, room=room,
                                                 seed=self.seed, src_dp_rank=self.dp_rank,
                                                 dst_dp_rank=kv.dst_dp_rank)]
            for op in ops:
                if op.src_rank == self.rank and op.dst_rank == d:
                    r.staged[op.layer].append(op)
        r.next_page = max(r.next_page, end_page)
        self._active.append(r)

    def _plan(self, room: int, kv: KVRequest, src: list[int], first_dst: int) -> list[WriteOp] | list[PackedWrite]:
        if kv.staging_bytes:
            return plan_packed_writes(self.layout, kv.layout, src, first_dst, len(kv.dst_pages), room=room,
                                      seed=self.seed, src_dp_rank=self.dp_rank, dst_dp_rank=kv.dst_dp_rank)
        return plan_writes(self.layout, kv.layout, src, kv.dst_pages[first_dst:first_dst + len(src)], room=room,
                           seed=self.seed, src_dp_rank=self.dp_rank, dst_dp_rank=kv.dst_dp_rank)

    def on_layer(self, layer: int) -> None:
        """The model runner's hook: ``layer``'s KV for this forward is in the pool; post its writes."""
        for r in self._active:
            ops = r.staged.pop(layer, None)
            if not ops or r.aborted or self._past_deadline(r):
                continue
            for d, kv in r.kvs.items():
                mine = [op for op in ops if op.dst_rank == d]
                if mine and kv.staging_bytes:
                    self._post_packed(r, kv, mine)
                elif mine:
                    self._post(r, kv, mine)

    def _post(self, r: OutgoingRoom, kv: KVRequest, ops: list) -> None:
        dst_bases = dict(zip(kv.layout.buffers, kv.buffers))
        srcs, dsts, lens = op_addresses(ops, self.bases, dst_bases)
        self._record(r, self.backend.post_writes(kv.session, srcs, dsts, lens), ops, lens)

    def _record(self, r: OutgoingRoom, handle: WriteHandle, ops: list, lens: list[int]) -> None:
        r.handles.append(handle)
        for key, n in count_writes(ops).items():
            r.writes[key[1]] += n
        nbytes = sum(lens)
        r.nbytes += nbytes
        self.bytes_posted += nbytes
        self.writes_posted += len(lens)

    def _post_packed(self, r: OutgoingRoom, kv: KVRequest, ops: list[PackedWrite]) -> None:
        """One batch for the layer's blocks to ``kv``'s rank: each packed into a staging range
        when one is free, else page by page from the pool; every write lands inside the room's
        staging region (checked here too, not only by construction)."""
        self._reclaim()
        srcs: list[int] = []
        dsts: list[int] = []
        lens: list[int] = []
        taken: list[int] = []
        staging = self.staging
        for w in ops:
            if w.dst_offset < 0 or w.dst_offset + w.nbytes > kv.staging_bytes:
                r.error, r.aborted = f"staging_bytes: a write past the room's {kv.staging_bytes} bytes", True
                self._give_back(taken)  # packed, never posted
                return
            packed = self._pack(w)
            if packed is None or staging is None:
                for op in unpacked_writes(self.layout, w):
                    srcs.append(self.bases[op.buffer] + op.src_offset)
                    dsts.append(kv.staging_addr + op.dst_offset)
                    lens.append(op.nbytes)
                continue
            taken.append(packed)
            srcs.append(staging.addr + packed)
            dsts.append(kv.staging_addr + w.dst_offset)
            lens.append(w.nbytes)
        if taken and staging is not None and staging.buffer.is_cuda:
            torch.cuda.current_stream(staging.buffer.device).synchronize()  # packed before the NIC reads
        handle = self.backend.post_writes(kv.session, srcs, dsts, lens)
        r.ranges.append((handle, taken))
        self.packed_writes += len(taken)
        self._record(r, handle, ops, lens)

    def _pack(self, w: PackedWrite) -> int | None:
        """The staging offset ``w``'s block was packed at; None when it cannot be packed now."""
        pool = self.pools.get(w.buffer)
        if self.staging is None or pool is None:
            return None
        at = self.staging.alloc(w.nbytes)
        if at is not None:
            pack_block(pool, w.layer, w.src_pages, w.src_head, w.nheads, self.staging, at)
        return at

    def _give_back(self, taken: list[int]) -> None:
        if self.staging is not None:
            for at in taken:
                self.staging.free(at)

    def _reclaim(self, room: OutgoingRoom | None = None) -> None:
        """Staging ranges whose write settled go back (of ``room``, or of every room)."""
        if self.staging is None:
            return
        for r in [room] if room is not None else self.rooms.values():
            keep = []
            for handle, taken in r.ranges:
                if self.backend.poll(handle) is WriteState.PENDING:
                    keep.append((handle, taken))
                else:
                    self._give_back(taken)
            r.ranges = keep

    def forward_done(self) -> None:
        """The forward ended: staged rooms stamp their last forward."""
        now = time.monotonic()
        for r in self._active:
            r.last_forward = now
            r.staged = {}
        self._active = []

    def finish(self, room: int, hidden: torch.Tensor) -> None:
        """The prompt is prefilled: post the aux data (the last prefilled position's hidden state);
        the room now drains."""
        r = self.rooms[room]
        if r.state is not RoomState.SENDING:
            return
        r.state = RoomState.DRAINING
        for d, kv in r.kvs.items():
            if kv.aux_bytes and not r.aborted and not self._past_deadline(r) and r.sources[d][0] == self.rank:
                self._post_aux(r, kv, hidden)

    def _post_aux(self, r: OutgoingRoom, kv: KVRequest, hidden: torch.Tensor) -> None:
        if r.room not in self._aux_slot:
            if not self._aux_free:
                r.error = "aux: no staging slot free"
                return
            self._aux_slot[r.room] = self._aux_free.pop()
        row = self.aux[self._aux_slot[r.room]]
        row.copy_(hidden.to(row.dtype))
        r.handles.append(self.backend.post_writes(kv.session, [row.data_ptr()], [kv.aux_addr], [kv.aux_bytes]))

    @staticmethod
    def _past_deadline(r: OutgoingRoom) -> bool:
        """Checked before every post: a room past its deadline gets nothing more and fails."""
        if time.monotonic() <= r.deadline:
            return False
        if not r.aborted:
            logger.warning("prefill: room %d is past its deadline: no more writes for it", r.room)
            r.aborted, r.error = True, ("the room passed its deadline (--disaggregation-timeout-s after decode's KV "
                                        "request or its last acknowledged progress) before its KV was sent")
        return True

    # ------------------------------------------------------------- progress
    def poll(self, room: int) -> RoomState:
        """DRAINING -> DONE once every write landed, FAILED if one failed (once all settled)."""
        r = self.rooms[room]
        if r.state is not RoomState.DRAINING or not r.settled(self.backend):
            return r.state
        failed = [h for h in r.handles if self.backend.poll(h) is WriteState.FAILED]
        if failed or r.error:
            r.error = r.error or failed[0].error or "a KV write failed"
            r.state = RoomState.FAILED
        else:
            r.state = RoomState.DONE
        return r.state

    def abort(self, room: int) -> None:
        """Post nothing more for ``room``; it closes once its posted writes have settled."""
        r = self.rooms.get(room)
        if r is not None:
            r.aborted = True
            r.staged = {}

    def close_room(self, room: int) -> OutgoingRoom | None:
        """Forget a room whose writes have all settled; frees its aux slot and staging ranges."""
        r = self.rooms.get(room)
        if r is not None:
            self._reclaim(r)
            assert not r.ranges, f"room {room} closed with a write from staging in flight"
        slot = self._aux_slot.pop(room, None)
        if slot is not None:
            self._aux_free.append(slot)
        return self.rooms.pop(room, None)

    def extend(self, room: int, sent_at: float, timeout_s: float) -> None:
        """Decode acknowledged a progress notice sent at ``sent_at`` (``time.monotonic``'s clock:
        rank 0's, the same on one host): the room may be written until ``sent_at + timeout_s``,
        never earlier than before; a room given up on or past its deadline stays so."""
        r = self.rooms.get(room)
        if r is not None and not r.aborted and not self._past_deadline(r):
            r.acked_at = max(r.acked_at, sent_at)
            r.deadline = max(r.deadline, sent_at + timeout_s)

    def expired(self, room: int) -> bool:
        """``room`` is past its deadline (then it is given up on: nothing more is posted for it)."""
        return self._past_deadline(self.rooms[room])

    def fail_unsettled(self, room: int, why: str) -> None:
        r = self.rooms[room]
        r.error = why
        r.aborted = True
