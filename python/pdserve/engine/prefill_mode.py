"""The prefill server's scheduler mode (DESIGN §5): pair rooms, prefill ``prompt[:-1]``, never
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
"""

from __future__ import annotations

import dataclasses
import logging

from pdserve.config import DisaggConfig
from pdserve.disagg.bootstrap import Dropped, Expired, Paired, RoomError, RoomTable
from pdserve.disagg.layout import LayoutError
from pdserve.disagg.protocol import DropRoom, Heartbeat, HeartbeatAck, KVAbort, KVAbortAck, KVCompletion, KVRequest
from pdserve.disagg.sender import KVSender, RoomState
from pdserve.engine.mode_io import ModeIO
from pdserve.engine.modes import SchedulerMode
from pdserve.engine.request import Req, ReqState, finish_abort, finish_length

logger = logging.getLogger(__name__)


class PrefillMode(SchedulerMode):
    name = "prefill"
    rank_counters = ("kv_bytes_sent", "kv_writes_sent")

    def __init__(self, config: DisaggConfig, io: ModeIO, sender: KVSender, server_id: str):
        self.config = config
        self.io = io
        self.sender = sender
        self.server_id = server_id
        self.rooms = RoomTable(config.timeout_s)
        self.reqs: dict[int, Req] = {}  # room -> its request, from pairing until it finishes
        self.reply_to: dict[int, str] = {}  # room -> decode's endpoint, while the room is open
        self.transferring: dict[int, Req] = {}
        self.closing: dict[int, str | None] = {}  # aborted room -> decode endpoint awaiting the ack
        self.counters = {"rooms_completed": 0, "rooms_failed": 0, "rooms_dropped": 0, "rooms_aborted": 0,
                         "rooms_expired": 0}

    def attach(self, scheduler) -> None:
        super().attach(scheduler)
        scheduler.runner.layer_hook = lambda layer_id, _fb: self.sender.on_layer(layer_id)

    def connect(self, loop) -> None:
        self.io.connect(loop)

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

    def _on_pairing(self, result) -> None:
        if isinstance(result, Paired):
            self._start(result.http, result.kv)
        elif isinstance(result, Dropped) and result.http is not None:
            self.counters["rooms_dropped"] += 1
            self._finish(result.http, finish_length(0))

    def _start(self, req: Req, kvs: dict[int, KVRequest]) -> None:
        """Both halves are here: queue the prefill of ``prompt[:-1]``."""
        room = req.room
        kv_by_rank = {kv.decode_rank: kv for kv in kvs.values()}
        reply = next(iter(kv_by_rank.values())).reply_to
        try:
            self.sender.open(room, kv_by_rank, req.prompt_len - 1, self.io.now())
        except LayoutError as e:
            self.io.send_once(reply, KVAbort(room, f"prefill refuses the KV request: {e}", "prefill"))
            self._finish(req, finish_abort(f"KV request refused: {e}"))
            return
        self.reply_to[room] = reply
        self.reqs[room] = req
        req.hold_back_last_token()
        req.sampling = dataclasses.replace(req.sampling, max_new_tokens=0)
        self.scheduler.waiting.append(req)

    # ------------------------------------------------------------- forward
    def before_extend(self, reqs: list[Req], lens: list[int]) -> None:
        for req, n in zip(reqs, lens):
            room = req.room
            if room in self.sender.rooms:
                self.sender.stage(room, req.pages, req.kv_len + n)

    def after_prefill(self, reqs: list[Req], done: list[int]) -> list[int]:
        self.sender.forward_done()
        hidden = self.scheduler.runner.last_hidden
        rest = []
        for i in done:
            room = reqs[i].room
            if room not in self.sender.rooms:
                rest.append(i)
                continue
            self.sender.finish(room, hidden[i])
            reqs[i].state = ReqState.TRANSFERRING
            self.transferring[room] = reqs[i]
        return rest

    # ------------------------------------------------------------- progress
    def poll(self) -> None:
        now = self.io.now()
        for msg in self.io.recv_all():
            self._on_message(msg, now)
        self._settle(self.io.agree(self._drained_here()))
        for room in list(self.closing):
            self._close_if_settled(room)
        self._expire(now)

    def wants_agreement(self) -> bool:
        return bool(self.transferring)

    def _on_message(self, msg, now: float) -> None:
        if isinstance(msg, KVRequest):
            tp = msg.layout.tp_size  # one KV request per rank of decode's attention group
            try:
                self._on_pairing(self.rooms.add_kv(msg.room, msg.decode_rank % tp, msg, now, parts=tp))
            except RoomError as e:
                self.io.send_once(msg.reply_to, KVAbort(msg.room, str(e), "prefill"))
        elif isinstance(msg, DropRoom):
            self._on_drop(msg.room, now)
        elif isinstance(msg, KVAbort):
            self._on_decode_abort(msg, now)
        elif isinstance(msg, Heartbeat):
            self.io.send_once(msg.server_id, HeartbeatAck(self.server_id, msg.time))
        else:
            logger.warning("prefill: unexpected %s", type(msg).__name__)

    def _on_drop(self, room: int, now: float) -> None:
        try:
            self._on_pairing(self.rooms.drop(room, now))
        except RoomError as e:
            logger.warning("prefill: %s", e)

    def _on_decode_abort(self, msg: KVAbort, now: float) -> None:
        cancelled = self.rooms.cancel(msg.room, now)
        if cancelled is not None:  # never paired: nothing was posted
            if cancelled.http is not None:
                self._finish(cancelled.http, finish_abort(f"decode gave up on the room: {msg.reason}"))
            for reply in _endpoints(cancelled.kv):
                self.io.send(reply, KVAbortAck(msg.room, self.sender.rank))  # each rank for itself
            return
        req = self.reqs.get(msg.room)
        if req is None:
            logger.info("prefill: abort for unknown room %d (%s)", msg.room, msg.reason)
            return
        self.counters["rooms_aborted"] += 1
        self.closing[msg.room] = self.reply_to.get(msg.room)
        self.scheduler.abort(req.rid, f"decode gave up on the room: {msg.reason}")

    def _drained_here(self) -> dict[int, str | None]:
        """This rank's writes of each transferring room: None while some are in flight, "" once
        all landed, else why one failed."""
        out = {}
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
        r = self.sender.rooms[room]
        queue_s, prefill_s = r.timings()
        status = "failed" if r.state is RoomState.FAILED else "ok"
        for d in self.sender.own_pairs(room):
            self.io.send(r.kvs[d].reply_to, KVCompletion(room, self.sender.rank, d, r.writes.get(d, 0), status,
                                                         r.error or "", queue_s, prefill_s))
        if error is None:
            self.counters["rooms_completed"] += 1
            self._finish(req, finish_length(0))
        else:
            self.counters["rooms_failed"] += 1
            logger.warning("prefill: room %d failed: %s", room, error)
            self._finish(req, finish_abort(f"KV transfer to decode failed: {error}"))
        self.sender.close_room(room)

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
            self.io.send(reply, KVAbortAck(room, self.sender.rank))

    def _expire(self, now: float) -> None:
        for e in self.rooms.expire(now):
            self.counters["rooms_expired"] += 1
            self._fail_expired(e)
        for room, req in list(self.transferring.items()):
            if now - self.sender.rooms[room].paired_at > self.config.timeout_s:
                self.sender.fail_unsettled(room, f"writes not landed after {self.config.timeout_s:.0f} s")
                self.transferring.pop(room)
                self.closing[room] = self.reply_to.get(room)
                self.counters["rooms_failed"] += 1
                self._finish(req, finish_abort("KV transfer to decode timed out"))

    def _fail_expired(self, e: Expired) -> None:
        t = self.config.timeout_s
        if e.http is not None:
            self._finish(e.http, finish_abort(f"no KV request from decode for room {e.room} within {t:.0f} s"))
        for reply in _endpoints(e.kv):
            self.io.send_once(reply, KVAbort(e.room, f"the request never reached prefill within {t:.0f} s", "prefill"))

    # ------------------------------------------------------------- release
    def abort(self, req: Req, message: str) -> bool:
        room = req.room
        if room is None:
            return False
        cancelled = self.rooms.cancel(room, self.io.now())
        if cancelled is not None:  # the client left before pairing
            for reply in _endpoints(cancelled.kv):
                self.io.send_once(reply, KVAbort(room, message, "prefill"))
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
        self.reqs.pop(room, None)
        reply = self.reply_to.pop(room, None)
        r = self.sender.rooms.get(room)
        if r is None or r.state in (RoomState.DONE, RoomState.FAILED):
            return
        # Ended before its KV was complete (client or decode abort, error): stop sending, tell
        # decode (unless decode asked), and acknowledge once nothing posted can still land.
        self.sender.abort(room)
        if room not in self.closing:
            if reply is not None:
                self.io.send_once(reply, KVAbort(room, "prefill ended the request before its KV was sent", "prefill"))
            self.closing[room] = reply

    def _finish(self, req: Req, reason: dict) -> None:
        self.scheduler.finish_request(req, reason)

    # ------------------------------------------------------------- inspection
    def has_work(self) -> bool:
        return bool(len(self.rooms) or self.transferring or self.closing)

    def poll_interval_ms(self) -> int | None:
        if self.transferring or self.closing:
            return 1
        return 50 if len(self.rooms) else None

    def held_reqs(self) -> list[Req]:
        return list(self.transferring.values())

    def sockets(self) -> list:
        return self.io.sockets()

    def stats(self) -> dict:
        return {"disaggregation_mode": self.name, "rooms_waiting": len(self.rooms),
                "rooms_transferring": len(self.transferring), "kv_bytes_sent": self.sender.bytes_posted,
                "kv_writes_sent": self.sender.writes_posted, **self.counters}

    def close(self) -> None:
        self.io.close()


def _endpoints(kvs: dict[int, KVRequest]) -> list[str]:
    """Where decode reads a room's replies, each once (every decode rank of a room names the same)."""
    return sorted({kv.reply_to for kv in kvs.values()})
