"""The prefill server's scheduler mode (docs/disaggregation.md): pair rooms, prefill ``prompt[:-1]``, never
sample, stream the KV layer by layer, report completion with the write count.

A request's life here: its HTTP half (from the router) waits in the room table until decode's
KV request for the same room arrives (either order) -> it queues for prefill like any request,
but holding back its last prompt token (decode feeds that one) and asking for no new token ->
its chunks run; after each layer the sender posts that layer's writes -> when the last chunk is
done it drains (TRANSFERRING, pages held) until every write has landed -> completion to decode,
pages to the radix cache, the HTTP half answered.

With several ranks (TP, EP) every rank runs this mode on the messages rank 0 shares; each rank
posts its own writes from its own pool (``disagg/sender.py``), and a room ends (pages released,
completions sent) only once every rank's writes have settled, which the ranks agree on
(``ModeIO.agree``) before acting.

A KV request is input, not a command (docs/disaggregation.md, "The trust boundary"): it is served only for a decode
rank whose ``DecodeRecord`` arrived first, and only if its session, buffers, layout, aux row and
reply endpoint are the ones that record published; replies go to record endpoints, never to an
address an unrecorded message names. Every way a room ends without a completion (refused,
expired, timed out, aborted) sends decode a ``KVAbortAck`` once nothing posted can still land,
so decode's quarantine empties on acknowledgements, not leases.

Timeouts are about progress (``disagg/decode.py`` states the safety argument): from pairing until
its last chunk is computed, a room sends decode a ``KVProgress`` at once and then at least every
``--disaggregation-timeout-s`` / 4 (T/4; from ``poll``, which runs between forwards), so a
queued room and a long prefill keep decode waiting while a stuck one does not; a forward (one
chunk) must take well under T (a third leaves margin). The sender's deadline (nothing posted past
it) starts T after the KV request arrived and moves only when decode acknowledges a notice, to
that notice's send time + T; a transferring room fails once T passed since pairing or since the
last acknowledged notice.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict

from pdserve.config import DisaggConfig
from pdserve.disagg.bootstrap import Dropped, Expired, Paired, RoomError, RoomTable
from pdserve.disagg.layout import LayoutError
from pdserve.disagg.mode_io import ModeIO
from pdserve.disagg.protocol import (
    DecodeRecord,
    DropRoom,
    KVAbort,
    KVAbortAck,
    KVCompletion,
    KVProgress,
    KVProgressAck,
    KVRequest,
    ProtocolError,
)
from pdserve.disagg.sender import KVSender, RoomState
from pdserve.engine.modes import SchedulerMode
from pdserve.engine.modes import balance as _balance
from pdserve.engine.request import Req, ReqState, finish_abort, finish_length
from pdserve.transfer import TransferError

logger = logging.getLogger(__name__)

MAX_DECODE_RECORDS = 4096  # decode ranks remembered; the oldest is dropped past this
# After a prefill forward, the scheduler waits this long at most for the rooms it just finished to
# land (their last layer's and aux writes were posted moments before), and at most this share of
# the forward it just ran, so a completion does not wait out the whole next forward.
LANDING_WAIT_S = 0.01
LANDING_WAIT_SHARE = 0.05
LANDING_POLL_S = 0.0002  # a sleep, not a spin: the transfer engine's threads may need this core to send
NOTICES_PER_TIMEOUT = 4  # a queued or computing room tells decode at least this often per timeout


@dataclasses.dataclass
class Notices:
    """A room's progress notices: when the last went out, and the send time of each one decode may
    still acknowledge (older than the timeout: it could extend nothing)."""

    last: float = float("-inf")
    sent: dict[int, float] = dataclasses.field(default_factory=dict)  # seq -> send time


class PrefillMode(SchedulerMode):
    name = "prefill"
    samples = False  # decode samples every token: a request's grammar is decode's alone
    rank_counters = ("kv_bytes_sent", "kv_writes_sent", "kv_writes_packed")

    def __init__(self, config: DisaggConfig, io: ModeIO, sender: KVSender, server_id: str):
        self.config = config
        self.io = io
        self.sender = sender
        self.server_id = server_id
        self.rooms: RoomTable[Req, KVRequest] = RoomTable(config.timeout_s)
        self.reqs: dict[int, Req] = {}  # room -> its request, from pairing until it finishes
        self.reply_to: dict[int, tuple[str, int]] = {}  # room -> decode's (endpoint, nonce), while open
        self.transferring: dict[int, Req] = {}
        self.notified: set[int] = set()  # transferring rooms whose completions this rank already sent
        self._forward_started = 0.0  # time.monotonic() when the forward now running was launched
        self.closing: dict[int, tuple[str, int] | None] = {}  # aborted room -> (endpoint, nonce) awaiting the ack
        self.decodes: OrderedDict[tuple[str, int], DecodeRecord] = OrderedDict()  # (decode_id, rank) -> record
        self.kv_arrival: dict[int, float] = {}  # room -> when its first KV request arrived (unpaired rooms)
        self.notices: dict[int, Notices] = {}  # open room -> its progress notices
        self._notice_seq = 0  # the same on every rank (lock step)
        self.counters = {"rooms_completed": 0, "rooms_failed": 0, "rooms_dropped": 0, "rooms_aborted": 0,
                         "rooms_expired": 0, "kv_requests_refused": 0, "stale_messages": 0, "kv_pages_requested": 0}

    def attach(self, scheduler) -> None:
        super().attach(scheduler)
        scheduler.runner.layer_hook = self._on_layer

    def connect(self, loop) -> None:
        self.io.connect(loop)

    def detach(self) -> None:
        self.scheduler.runner.layer_hook = None  # a decode server's forwards must not stage KV writes

    # ------------------------------------------------------------- intake
    def take(self, req: Req, bootstrap) -> bool:
        if bootstrap is None:
            self._finish(req, finish_abort("bootstrap_room: a prefill server serves only requests "
                                           "routed with bootstrap_host/port/room (use a P/D router)"))
            return True
        req.room = bootstrap.room
        # Prefill never samples and never computes what decode's first step will feed.
        req.return_logprob, req.logprob, req.stop_matcher = False, None, None
        if req.prompt_len == 1:  # nothing to send: decode runs the whole prompt itself
            self._finish(req, finish_length(0))
            return True
        try:
            self._on_pairing(self.rooms.add_http(req.room, req, self.io.now()))
        except RoomError as e:
            self._finish(req, finish_abort(str(e)))
        return True

    def _on_pairing(self, result: Paired[Req, KVRequest] | Dropped[Req] | None) -> None:
        if isinstance(result, Paired):
            self._start(result.http, result.kv)
        elif isinstance(result, Dropped) and result.http is not None and result.reason is not None:
            self.counters["rooms_aborted"] += 1  # decode gave up on it before this half arrived
            self._finish(result.http, finish_abort(result.reason))
        elif isinstance(result, Dropped) and result.http is not None:
            self.counters["rooms_dropped"] += 1
            self._finish(result.http, finish_length(0))

    def _start(self, req: Req, kvs: dict[int, KVRequest]) -> None:
        """Both halves are here: queue the prefill of ``prompt[:-1]``."""
        room, now = req.bootstrap_room, self.io.now()
        kv_by_rank = {kv.decode_rank: kv for kv in kvs.values()}
        first = next(iter(kv_by_rank.values()))
        arrived = self.kv_arrival.pop(room, now)
        try:
            if any(kv.nonce != first.nonce or kv.reply_to != first.reply_to for kv in kv_by_rank.values()):
                raise LayoutError("nonce, reply_to: the KV requests of one room disagree")
            self.sender.open(room, kv_by_rank, req.prompt_len - 1, now,
                             budget_s=self.config.timeout_s - (now - arrived))
        except LayoutError as e:
            self._refuse_room(room, first.reply_to, first.nonce, f"prefill refuses the KV request: {e}")
            self._finish(req, finish_abort(f"KV request refused: {e}"))
            return
        self.reply_to[room] = (first.reply_to, first.nonce)
        self.reqs[room] = req
        req.hold_back_last_token()
        req.sampling = dataclasses.replace(req.sampling, max_new_tokens=0)
        self.scheduler.enqueue(req)

    # ------------------------------------------------------------- forward
    def _on_layer(self, layer_id: int, _fb) -> None:
        """The model runner's hook, after each layer of every forward: post that layer's writes, and
        tell decode about rooms that landed meanwhile (their completions need not wait for this
        forward to end)."""
        self.sender.on_layer(layer_id)
        if self.transferring:
            self._notify_landed()

    def before_extend(self, reqs: list[Req], lens: list[int]) -> None:
        self._forward_started = time.monotonic()
        for req, n in zip(reqs, lens):
            room = req.room
            if room in self.sender.rooms:
                self.sender.stage(room, req.pages, req.kv_len + n, req.row)

    def after_prefill(self, reqs: list[Req], done: list[int]) -> list[int]:
        self.sender.forward_done()
        hidden = self.scheduler.runner.last_hidden
        rest: list[int] = []
        for i in done:
            room = reqs[i].room
            if room not in self.sender.rooms:
                rest.append(i)
                continue
            if hidden is None:
                raise RuntimeError("prefill: the model runner kept no hidden states of the forward just run")
            self.sender.finish(room, hidden[i])
            reqs[i].state = ReqState.TRANSFERRING
            self.transferring[room] = reqs[i]
        self._await_landing(time.monotonic() - self._forward_started)
        return rest

    def _await_landing(self, forward_s: float) -> None:
        """Wait briefly (``LANDING_WAIT_*``) for the transferring rooms to land and tell decode of
        each as it does: over a fast link the last writes land within a millisecond or two, and
        the next forward (on a busy prefill server there always is one) would hold them up for its
        whole length."""
        deadline = time.monotonic() + min(LANDING_WAIT_S, LANDING_WAIT_SHARE * max(0.0, forward_s))
        while self._notify_landed() and time.monotonic() < deadline:
            time.sleep(LANDING_POLL_S)

    def _notify_landed(self) -> bool:
        """Send this rank's completions of each transferring room whose writes have all settled
        here (what ``_complete`` would send for it; a rank's own completions change nothing
        locally, so they need no agreement); the room ends at the agreed ``_complete``. True
        while some room's writes are still in flight here."""
        waiting = False
        for room in self.transferring:
            if room in self.notified:
                continue
            if self.sender.poll(room) in (RoomState.DONE, RoomState.FAILED):
                self._send_completions(room)
                self.notified.add(room)
            else:
                waiting = True
        return waiting

    # ------------------------------------------------------------- progress
    def poll(self) -> None:
        now = self.io.now()
        for msg in self.io.recv_all():
            self._on_message(msg, now)
        self._notify_landed()
        self._settle(self.io.agree(self._drained_here()))
        for room in list(self.closing):
            self._close_if_settled(room)
        self._expire(now)
        self._notify_progress(now)

    def wants_agreement(self) -> bool:
        return bool(self.transferring)

    def _on_message(self, msg, now: float) -> None:
        if isinstance(msg, DecodeRecord):
            self._on_record(msg)
        elif isinstance(msg, KVRequest):
            self._on_kv_request(msg, now)
        elif isinstance(msg, DropRoom):
            self._on_drop(msg.room, now)
        elif isinstance(msg, KVAbort):
            self._on_decode_abort(msg, now)
        elif isinstance(msg, KVProgressAck):
            self._on_progress_ack(msg)
        else:
            self.counters["stale_messages"] += 1
            logger.warning("prefill: unexpected %s", type(msg).__name__)

    def _on_record(self, rec: DecodeRecord) -> None:
        key = (rec.decode_id, rec.decode_rank)
        try:  # the backend learns the rank's endpoint from the record (NIXL: its agent metadata)
            self.sender.backend.connect(rec.session, rec.transfer_info)
        except TransferError as e:
            self.counters["kv_requests_refused"] += 1
            logger.warning("prefill: refused the record of decode %s rank %d: %s", rec.decode_id[:80],
                           rec.decode_rank, e)
            return
        self.decodes.pop(key, None)
        self.decodes[key] = rec  # newest last: a restarted decode replaces its record
        while len(self.decodes) > MAX_DECODE_RECORDS:
            self.decodes.popitem(last=False)

    def _on_kv_request(self, kv: KVRequest, now: float) -> None:
        """Checked against the decode rank's record before anything else (module docstring)."""
        rec = self.decodes.get((kv.decode_id, kv.decode_rank))
        try:
            if rec is None:
                raise ProtocolError(f"decode_id: no record of decode {kv.decode_id[:80]} rank {kv.decode_rank}")
            rec.check_request(kv)
        except ProtocolError as e:
            self.counters["kv_requests_refused"] += 1
            logger.warning("prefill: refused a KV request for room %d: %s", kv.room, e)
            if rec is not None:  # an endpoint we learned from the record, not from this request
                self._refuse_room(kv.room, rec.reply_to, kv.nonce, f"KV request refused: {e}")
            return
        tp = kv.layout.tp_size  # one KV request per rank of decode's attention group
        fresh = kv.room not in self.kv_arrival
        self.kv_arrival.setdefault(kv.room, now)  # the room's write deadline counts from here
        try:
            self._on_pairing(self.rooms.add_kv(kv.room, kv.decode_rank % tp, kv, now, parts=tp))
            self.counters["kv_pages_requested"] += len(kv.dst_pages)  # only what decode lacks
        except RoomError as e:
            if fresh:
                self.kv_arrival.pop(kv.room, None)
            self.counters["kv_requests_refused"] += 1
            self._refuse_room(kv.room, kv.reply_to, kv.nonce, str(e))

    def _refuse_room(self, room: int, reply: str, nonce: int, reason: str) -> None:
        """Decode's room will get nothing from here: say so, and acknowledge at once (nothing was
        posted for it), so its pages leave quarantine now."""
        self.io.send_once(reply, KVAbort(room, reason, "prefill", self.server_id, nonce))
        self.io.send(reply, KVAbortAck(room, nonce, self.sender.rank))

    def _endpoint_of(self, decode_id: str) -> str | None:
        return next((r.reply_to for (d, _), r in self.decodes.items() if d == decode_id), None)

    def _on_drop(self, room: int, now: float) -> None:
        try:
            self._on_pairing(self.rooms.drop(room, now))
        except RoomError as e:
            logger.warning("prefill: %s", e)

    def _on_decode_abort(self, msg: KVAbort, now: float) -> None:
        why = f"decode gave up on the room: {msg.reason}"
        cancelled = self.rooms.cancel(msg.room, now, why)
        if cancelled is not None:  # never paired: nothing was posted
            self.kv_arrival.pop(msg.room, None)
            if cancelled.http is not None:
                self.counters["rooms_aborted"] += 1
                self._finish(cancelled.http, finish_abort(why))
            for reply, nonce in _endpoints(cancelled.kv):
                self.io.send(reply, KVAbortAck(msg.room, nonce, self.sender.rank))  # each rank for itself
            return
        req, open_room = self.reqs.get(msg.room), self.reply_to.get(msg.room)
        if req is None or open_room is None:
            self._ack_unknown(msg)
            return
        if msg.nonce != open_room[1]:
            self.counters["stale_messages"] += 1
            logger.info("prefill: abort of room %d with a stale nonce ignored", msg.room)
            return
        self.counters["rooms_aborted"] += 1
        self.closing[msg.room] = open_room
        self.scheduler.abort(req.rid, why)

    def _ack_unknown(self, msg: KVAbort) -> None:
        """A room this server holds nothing of: nothing of it can be in flight, so say so at once
        (unless its ack is already due from ``closing``), at the endpoint of the decode's record."""
        reply = self._endpoint_of(msg.sender)
        if msg.room in self.closing or msg.room in self.sender.rooms or not msg.nonce or reply is None:
            return
        logger.info("prefill: abort for unknown room %d (%s): acknowledged", msg.room, msg.reason)
        self.io.send(reply, KVAbortAck(msg.room, msg.nonce, self.sender.rank))

    def _notify_progress(self, now: float) -> None:
        """Rooms queued or being computed tell decode so, at most every T/4 (module docstring)."""
        t = self.config.timeout_s
        for room in self.reqs:
            r, reply = self.sender.rooms.get(room), self.reply_to.get(room)
            n = self.notices.setdefault(room, Notices())
            if r is None or reply is None or r.state is not RoomState.SENDING or r.aborted or room in self.closing \
                    or now - n.last < t / NOTICES_PER_TIMEOUT or self.sender.expired(room):
                continue
            self._notice_seq += 1
            n.sent = {seq: at for seq, at in n.sent.items() if at + t > now}
            n.last = n.sent[self._notice_seq] = now
            self.io.send_once(reply[0], KVProgress(room, reply[1], self.sender.rank, self.sender.backend.session_id,
                                                   self._notice_seq))

    def _on_progress_ack(self, ack: KVProgressAck) -> None:
        """Decode extended the room's wait on one of its notices by ``wait_s``: the room may be
        written until that notice's send time + the shorter of T and ``wait_s``, no later than
        decode's new deadline (module docstring)."""
        reply, n, r = self.reply_to.get(ack.room), self.notices.get(ack.room), self.sender.rooms.get(ack.room)
        ok = reply is not None and reply[1] == ack.nonce and n is not None and r is not None \
            and any(kv.decode_id == ack.sender for kv in r.kvs.values())
        sent = n.sent.pop(ack.seq, None) if ok and n is not None else None
        if sent is None:  # another life of the room, a notice never sent or long expired, or forged
            self.counters["stale_messages"] += 1
            return
        self.sender.extend(ack.room, sent, min(self.config.timeout_s, ack.wait_s))

    def _drained_here(self) -> dict[int, str | None]:
        """This rank's writes of each transferring room: None while some are in flight, "" once
        all landed, else why one failed."""
        out: dict[int, str | None] = {}
        for room in self.transferring:
            state = self.sender.poll(room)
            if state in (RoomState.DONE, RoomState.FAILED):
                out[room] = self.sender.rooms[room].error or ("" if state is RoomState.DONE else "a KV write failed")
            else:
                out[room] = None
        return out

    def _settle(self, facts: list[dict] | None) -> None:
        """End the rooms whose writes have settled on every rank (``facts``: each rank's
        ``_drained_here``; None: not agreed this step)."""
        if facts is None:
            return
        for room in list(self.transferring):
            outcomes = [f.get(room) for f in facts]
            if all(o is not None for o in outcomes):
                self._complete(room, next((o for o in outcomes if o), None))

    def _complete(self, room: int, error: str | None) -> None:
        """Every rank's writes settled: each rank reports its own (source, destination) pairs; the
        request ends (its pages to the radix cache) or fails with ``error`` (some rank's)."""
        req = self.transferring.pop(room)
        if room not in self.notified:
            self._send_completions(room, req)
        self.notified.discard(room)
        if error is None:
            self.counters["rooms_completed"] += 1
            self._finish(req, finish_length(0))
        else:
            self.counters["rooms_failed"] += 1
            logger.warning("prefill: room %d failed: %s", room, error)
            self._finish(req, finish_abort(f"KV transfer to decode failed: {error}"))
        self.sender.close_room(room)

    def _send_completions(self, room: int, req: Req | None = None) -> None:
        """This rank's completion of ``room`` to each decode rank it wrote (its writes have settled)."""
        req = req if req is not None else self.transferring[room]
        r = self.sender.rooms[room]
        queue_s, prefill_s = r.timings()
        status = "failed" if r.state is RoomState.FAILED else "ok"
        by_tier = req.cached_by_tier_reported or {}
        for d in self.sender.own_pairs(room):
            kv = r.kvs[d]
            self.io.send(kv.reply_to, KVCompletion(room, kv.nonce, self.sender.rank, d, r.writes.get(d, 0), status,
                                                   r.error or "", queue_s, prefill_s, req.cached_tokens_reported,
                                                   by_tier.get("host", 0), by_tier.get("storage", 0)))

    def _close_if_settled(self, room: int) -> None:
        """An aborted room: once this rank's posted writes have settled, it acknowledges (for its
        rank alone; decode waits for every rank's). Rank-local: the request already ended."""
        r = self.sender.rooms.get(room)
        if r is not None and not r.settled(self.sender.backend):
            return
        reply = self.closing.pop(room)
        if r is not None:
            self.sender.close_room(room)
        if reply:
            self.io.send(reply[0], KVAbortAck(room, reply[1], self.sender.rank))

    def _expire(self, now: float) -> None:
        for e in self.rooms.expire(now):
            self.counters["rooms_expired"] += 1
            self._fail_expired(e)
        for room, req in list(self.transferring.items()):
            if now - self.sender.rooms[room].progress_at > self.config.timeout_s:
                why = f"writes not landed after {self.config.timeout_s:.0f} s"
                self.sender.fail_unsettled(room, why)
                self.transferring.pop(room)
                self.notified.discard(room)
                reply = self.closing[room] = self.reply_to.get(room)
                if reply is not None:  # decode fails over now; the ack follows once the writes settled
                    self.io.send_once(reply[0], KVAbort(room, why, "prefill", self.server_id, reply[1]))
                self.counters["rooms_failed"] += 1
                self._finish(req, finish_abort("KV transfer to decode timed out"))

    def _fail_expired(self, e: Expired) -> None:
        t = self.config.timeout_s
        self.kv_arrival.pop(e.room, None)
        if e.http is not None:
            self._finish(e.http, finish_abort(f"no KV request from decode for room {e.room} within {t:.0f} s"))
        for reply, nonce in _endpoints(e.kv):
            self._refuse_room(e.room, reply, nonce, f"the request never reached prefill within {t:.0f} s")

    # ------------------------------------------------------------- release
    def abort(self, req: Req, message: str) -> bool:
        room = req.room
        if room is None:
            return False
        cancelled = self.rooms.cancel(room, self.io.now())
        if cancelled is not None:  # the client left before pairing
            self.kv_arrival.pop(room, None)
            for reply, nonce in _endpoints(cancelled.kv):
                self._refuse_room(room, reply, nonce, message)
            self._finish(req, finish_abort(message))
            return True
        if room in self.transferring:
            self._finish(req, finish_abort(message))
            return True
        return False  # queued or prefilling: the scheduler finishes it, on_finish closes the room

    def on_finish(self, req: Req) -> None:
        room = req.room
        if room is None:
            return
        self.transferring.pop(room, None)
        self.notified.discard(room)
        self.reqs.pop(room, None)
        self.notices.pop(room, None)
        reply = self.reply_to.pop(room, None)
        r = self.sender.rooms.get(room)
        if r is None or r.state in (RoomState.DONE, RoomState.FAILED):
            return
        # Ended before its KV was complete (client or decode abort, error): stop sending, tell
        # decode (unless decode asked), and acknowledge once nothing posted can still land.
        self.sender.abort(room)
        if room not in self.closing:
            if reply is not None:
                self.io.send_once(reply[0], KVAbort(room, "prefill ended the request before its KV was sent",
                                                    "prefill", self.server_id, reply[1]))
            self.closing[room] = reply

    def _finish(self, req: Req, reason: dict) -> None:
        self.scheduler.finish_request(req, reason)

    # ------------------------------------------------------------- inspection
    def has_work(self) -> bool:
        return bool(len(self.rooms) or self.transferring or self.closing)

    def poll_interval_ms(self) -> int | None:
        if self.transferring or self.closing:
            return 1
        if self.reqs:  # their progress notices fall due even if nothing else wakes the loop
            return max(1, int(self.config.timeout_s * 1000 / (2 * NOTICES_PER_TIMEOUT)))
        return 50 if len(self.rooms) else None

    def held_reqs(self) -> list[Req]:
        return list(self.transferring.values())

    def check_resources(self, idle: bool) -> None:
        """Every open room is a request's (``reqs``), with a sender room once started; with
        ``idle``, no room, pairing half, sender room, aux row or transfer batch is left."""
        _balance("prefill rooms with a reply endpoint and no request", len(set(self.reply_to) - set(self.reqs)), 0)
        if idle:
            for what, n in (("rooms waiting to pair", len(self.rooms)), ("requests", len(self.reqs)),
                            ("transferring rooms", len(self.transferring)), ("rooms closing", len(self.closing)),
                            ("rooms notified", len(self.notified)),
                            ("KV arrival stamps", len(self.kv_arrival)), ("sender rooms", len(self.sender.rooms)),
                            ("rooms with progress notices", len(self.notices)),
                            ("transfer batches in flight", self.sender.backend.outstanding().batches)):
                _balance(f"prefill {what}", n, 0)
            _balance("prefill aux rows free", self.sender.aux_rows_free, self.sender.aux.shape[0])
            if self.sender.staging is not None:
                _balance("prefill staging ranges in use", self.sender.staging.ranges_in_use, 0)

    def sockets(self) -> list:
        return self.io.sockets()

    def stats(self) -> dict:
        return {"disaggregation_mode": self.name, "rooms_waiting": len(self.rooms),
                "rooms_transferring": len(self.transferring), "kv_bytes_sent": self.sender.bytes_posted,
                "kv_writes_sent": self.sender.writes_posted, "kv_writes_packed": self.sender.packed_writes,
                "control_refused": self.io.refused(),
                "control_refused_by_reason": dict(self.io.channel.gate.refused),
                "rooms_open": len(self.reqs) + len(self.closing),
                "aux_rows_in_use": self.sender.aux.shape[0] - self.sender.aux_rows_free,
                "transfer_batches_in_flight": self.sender.backend.outstanding().batches, **self.counters}

    def close(self) -> None:
        self.io.close()


def _endpoints(kvs: dict[int, KVRequest]) -> list[tuple[str, int]]:
    """Where decode reads a room's replies and the room's nonce, each once (every decode rank of a
    room names the same; every KV request was checked against its decode's record)."""
    return sorted({(kv.reply_to, kv.nonce) for kv in kvs.values()})
