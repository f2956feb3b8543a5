"""The scheduler's side of the frontend link: the ZMQ loop around a ``Scheduler``.

``SchedulerLoop`` feeds the frontend's messages to one scheduler and sends its outputs back;
``rank_group.RankSchedulerLoop`` does the same for several ranks in lock step. Every message
goes through ``FRONTEND_CODEC`` (typed msgpack, never pickle); a frame that is not one of its
messages is counted and dropped. The processes that run these loops are started by
``entrypoints/scheduler_process.py``.

Loop contract (throughput depends on it):
- while the scheduler has work, incoming messages are drained without blocking
  and ``step()`` runs back to back;
- every step's outputs leave as ONE ``BatchTokenOutput`` message (a step that runs an extend
  first sends the decode tokens already sampled, so they do not wait out the prefill);
- requests that finish decoding in a step release their pages after its message is sent;
- when idle, the loop blocks on the socket with a poll timeout (never spins).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import zmq

from pdserve.config import ServerArgs, split_host_port
from pdserve.engine import io_struct, rank_io
from pdserve.engine.codec import Codec, CodecError, DropCounter
from pdserve.engine.modes import RoleSwitchRefused, SwitchableRoles

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 200  # how long an idle loop sleeps on the socket before re-checking its parent
# What travels between the frontend (or the offline Engine's RankClient) and the scheduler.
FRONTEND_CODEC = Codec((*io_struct.MESSAGES, *rank_io.MESSAGES))


@dataclass(frozen=True)
class SchedulerEndpoints:
    """ZMQ addresses: frontend -> scheduler requests, scheduler -> frontend outputs."""

    to_scheduler: str
    to_frontend: str

    @classmethod
    def in_dir(cls, directory: str) -> SchedulerEndpoints:
        return cls(f"ipc://{directory}/to_scheduler", f"ipc://{directory}/to_frontend")

    @classmethod
    def over_tcp(cls, host: str, port: int) -> SchedulerEndpoints:
        """Ranks on other nodes reach the frontend on node 0 at ``host``: ports port+1, port+2
        (``port`` is the torch.distributed rendezvous of ``--dist-init-addr``)."""
        return cls(f"tcp://{host}:{port + 1}", f"tcp://{host}:{port + 2}")

    @classmethod
    def for_args(cls, args: ServerArgs, directory: str) -> SchedulerEndpoints:
        if args.nnodes > 1:
            return cls.over_tcp(*split_host_port(args.dist_init_addr, "dist_init_addr"))
        return cls.in_dir(directory)


def send_message(sock: zmq.Socket, msg, flags: int = 0) -> None:
    """``msg`` (one of ``FRONTEND_CODEC``'s types) on ``sock``."""
    sock.send(FRONTEND_CODEC.encode(msg), flags, copy=False)


def recv_message(sock: zmq.Socket, drops: DropCounter, flags: int = 0):
    """The next message on ``sock``, or None for a frame that is none of ours (counted in ``drops``);
    zmq.Again as ``sock.recv``."""
    return decode_frame(sock.recv(flags, copy=False), drops)


def decode_frame(frame: zmq.Frame, drops: DropCounter):
    try:
        return FRONTEND_CODEC.decode(frame.buffer)
    except CodecError as e:
        drops.record(e)
        return None


# --------------------------------------------------------------------- loop
class SchedulerLoop:
    """Feeds ZMQ messages to a scheduler and sends its outputs back.

    ``scheduler`` needs ``add_request``, ``abort``, ``has_work``, ``step``,
    ``flush_cache``, ``stats`` and a ``reqs`` dict (``Scheduler`` has them).
    ``run`` returns after a ``ShutdownReq`` or once ``parent_pid`` is gone;
    an exception from the scheduler propagates (the process then exits non-zero).
    """

    def __init__(self, scheduler, recv: zmq.Socket, send: zmq.Socket,
                 parent_pid: int | None = None, idle_poll_ms: int = IDLE_POLL_MS, roles: SwitchableRoles | None = None):
        self.scheduler = scheduler
        self.roles = roles  # a single-rank P/D server's modes: it can switch roles
        self.recv = recv
        self.send = send
        self.parent_pid = parent_pid
        self.idle_poll_ms = idle_poll_ms
        self.stopped = False
        self.idle_polls = 0  # blocking polls that timed out (observable in tests)
        self.drops = DropCounter("scheduler")

    def run(self) -> None:
        while not self.stopped:
            woke = self.drain(block=not self.scheduler.runnable())
            if self.stopped:
                break
            if self.scheduler.has_work() or woke:
                self.run_step()
            elif self._parent_gone():
                logger.warning("parent process is gone; scheduler exiting")
                break

    def run_step(self) -> None:
        early = hasattr(self.scheduler, "emit")  # Scheduler's: outputs due before an extend leave at once
        # Scheduler's too: requests that finish decoding in the step release their pages once the
        # step's outputs are sent (a release elsewhere, an abort between steps, stays immediate)
        deferred = hasattr(self.scheduler, "release_finished")
        if early:
            self.scheduler.emit = self.send_outputs
        if deferred:
            self.scheduler.defer_release = True
        try:
            outputs = self.scheduler.step()
        finally:
            if early:
                self.scheduler.emit = None
            if deferred:
                self.scheduler.defer_release = False
        self.send_outputs(outputs, getattr(self.scheduler, "outputs_sampled_at", 0.0))
        if deferred:
            self.scheduler.release_finished()

    def send_outputs(self, outputs: list[io_struct.TokenOutput], sampled_at: float = 0.0) -> None:
        """One message for ``outputs`` (also the scheduler's ``emit``: outputs due before a long forward)."""
        if outputs:
            send_message(self.send, io_struct.BatchTokenOutput(outputs, time.monotonic(), sampled_at))

    def drain(self, block: bool) -> bool:
        """Handle every queued frontend message; if ``block``, first wait up to the idle poll
        timeout (shorter while the scheduler's mode waits on transfers) for a message from the
        frontend or the mode's peers. True if anything arrived."""
        if block and not self._wait():
            self.idle_polls += 1
            return False
        while not self.stopped:
            try:
                msg = recv_message(self.recv, self.drops, zmq.NOBLOCK)
            except zmq.Again:
                return True
            if msg is not None:
                self.handle(msg)
        return True

    def _wait(self) -> bool:
        mode = getattr(self.scheduler, "mode", None)
        sockets = mode.sockets() if mode is not None else []
        interval = mode.poll_interval_ms() if mode is not None else None
        timeout = self.idle_poll_ms if interval is None else min(interval, self.idle_poll_ms)
        if not sockets:
            return bool(self.recv.poll(timeout))
        poller = zmq.Poller()
        for sock in (self.recv, *sockets):
            poller.register(sock, zmq.POLLIN)
        return bool(poller.poll(timeout)) or interval is not None

    def handle(self, msg) -> None:
        if isinstance(msg, io_struct.TokenizedGenerateReq):
            self._add(msg)
        elif isinstance(msg, io_struct.AbortReq):
            self._abort(msg)
        elif isinstance(msg, io_struct.GetStatsReq):
            send_message(self.send, io_struct.StatsResp(self.scheduler.stats()))
        elif isinstance(msg, io_struct.FlushCacheReq):
            send_message(self.send, io_struct.FlushCacheResp(bool(self.scheduler.flush_cache())))
        elif isinstance(msg, io_struct.KVEventsSnapshotReq):
            send_message(self.send, io_struct.KVEventsSnapshotResp(self.scheduler.kv_events_snapshot()))
        elif isinstance(msg, io_struct.RoleSwitchReq):
            send_message(self.send, self._switch(msg.target_role))
        elif isinstance(msg, io_struct.PrefillLostReq):
            for room in msg.rooms:
                self.scheduler.mode.prefill_lost(room, msg.reason)
        elif isinstance(msg, io_struct.ShutdownReq):
            self.stopped = True
        else:
            logger.error("scheduler: ignoring unknown message %r", type(msg).__name__)

    def _add(self, msg: io_struct.TokenizedGenerateReq) -> None:
        try:
            self.scheduler.add_request(msg.rid, msg.input_ids, msg.sampling, msg.return_logprob,
                                       msg.logprob_start_len, msg.top_logprobs_num, bootstrap=msg.bootstrap,
                                       group=msg.group, cache_salt=msg.cache_salt)
        except ValueError as e:
            send_message(self.send, io_struct.RejectedReq(msg.rid, str(e)))

    def _abort(self, msg: io_struct.AbortReq) -> None:
        if msg.refused is not None:
            self.scheduler.mode.refused(msg.refused, msg.message)
            return
        rids = list(self.scheduler.reqs) if msg.abort_all else [msg.rid]
        for rid in rids:
            self.scheduler.abort(rid)

    def _switch(self, target: str) -> io_struct.RoleSwitchResp:
        if self.roles is None:
            return io_struct.RoleSwitchResp(False, self.scheduler.mode.name, "this scheduler cannot switch roles")
        try:
            self.roles.switch(self.scheduler, target)
        except RoleSwitchRefused as e:
            return io_struct.RoleSwitchResp(False, self.roles.role, str(e), busy=e.busy)
        return io_struct.RoleSwitchResp(True, self.roles.role)

    def _parent_gone(self) -> bool:
        return self.parent_pid is not None and os.getppid() != self.parent_pid


