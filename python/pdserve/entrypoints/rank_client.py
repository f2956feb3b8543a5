"""The offline Engine's stand-in for an in-process Scheduler when the engine has several ranks.

Every rank runs as a subprocess (``RankProcesses``), exactly as under ``pdserve serve``:
one code path for the lock step, and ranks that never wait on the caller's thread (an
Engine left idle between ``generate`` calls keeps its ranks polling, not blocked in a
collective). This client speaks to them over ZMQ like the HTTP frontend does, but
synchronously, and offers the part of the Scheduler interface ``Engine`` uses.
"""

from __future__ import annotations

import shutil
import tempfile
import time
import weakref

import zmq

from pdserve.config import ModelConfig, ServerArgs
from pdserve.engine.codec import DropCounter
from pdserve.engine.io_struct import (
    AbortReq,
    BatchTokenOutput,
    FlushCacheReq,
    FlushCacheResp,
    GetStatsReq,
    RejectedReq,
    SchedulerFailed,
    SchedulerReady,
    ShutdownReq,
    StatsResp,
    TokenizedGenerateReq,
    TokenOutput,
)
from pdserve.engine.node_sockets import frontend_sockets
from pdserve.engine.rank_io import CheckMemoryReq, CheckMemoryResp
from pdserve.engine.request import RequestLimits, SamplingParams, check_scheduler_request
from pdserve.engine.scheduler_loop import SchedulerEndpoints, recv_message, send_message
from pdserve.entrypoints.scheduler_process import RankProcesses

STARTUP_TIMEOUT_S = 600.0
STEP_POLL_MS = 50
CONTROL_TIMEOUT_S = 60.0


class RankClient:
    """``add_request`` / ``abort`` / ``step`` / ``has_work`` / ``stats`` / ``flush_cache`` /
    ``check_memory`` over the ranks; ``close()`` stops them and removes the socket directory.

    ``step()`` returns the outputs that arrived within a short poll (possibly none) and
    raises RuntimeError once a rank has died, ValueError when a request was rejected.
    """

    def __init__(self, args: ServerArgs, model_config: ModelConfig, startup_timeout: float = STARTUP_TIMEOUT_S):
        self.model_config = model_config
        self.reqs: dict[str, None] = {}  # rids submitted and not finished (the Scheduler's ``reqs`` keys)
        self._tmpdir = tempfile.mkdtemp(prefix="pdserve-engine-")
        endpoints = SchedulerEndpoints.for_args(args, self._tmpdir)
        self._ctx = zmq.Context()
        self._binder = frontend_sockets(args)  # several nodes: the node's address, CURVE under the token
        self._send = self._binder.bind(self._ctx, zmq.PUSH, endpoints.to_scheduler)
        self._recv = self._binder.bind(self._ctx, zmq.PULL, endpoints.to_frontend)
        self.drops = DropCounter("engine")
        self._replies: list = []  # control replies not yet taken
        self._outputs: list[TokenOutput] = []  # outputs not yet returned by step()
        self._rejected: list[tuple[str, str]] = []
        self.ranks = RankProcesses(args, endpoints, self._tmpdir)
        self._closed = False
        weakref.finalize(self, self.close)  # at interpreter exit at the latest (close is idempotent)
        try:
            self.ranks.start()
            ready = self._wait_ready(startup_timeout)
        except BaseException:
            self.close()
            raise
        self.limits = RequestLimits(ready.context_len, ready.vocab_size, ready.max_total_tokens)

    # -------------------------------------------------------------- Scheduler API
    def validate(self, input_ids: list[int], sampling: SamplingParams) -> None:
        """What Scheduler.validate checks, against the limits the ranks reported."""
        check_scheduler_request(input_ids, sampling, self.limits)

    def add_request(self, rid: str, input_ids: list[int], sampling: SamplingParams, return_logprob: bool = False,
                    logprob_start_len: int = -1, top_logprobs_num: int = 0) -> None:
        if rid in self.reqs:
            raise ValueError(f"rid: {rid!r} is already in use")
        self.validate(input_ids, sampling)
        send_message(self._send, TokenizedGenerateReq(rid, input_ids, sampling, return_logprob, logprob_start_len,
                                                      top_logprobs_num))
        self.reqs[rid] = None

    def abort(self, rid: str, message: str = "aborted by client") -> bool:
        if rid not in self.reqs:
            return False
        send_message(self._send, AbortReq(rid))
        return True

    def has_work(self) -> bool:
        return bool(self.reqs)

    def step(self) -> list[TokenOutput]:
        self._pump(STEP_POLL_MS)
        outputs, self._outputs = self._outputs, []
        for o in outputs:
            if o.finished:
                self.reqs.pop(o.rid, None)
        if self._rejected:
            rid, message = self._rejected.pop(0)
            self.reqs.pop(rid, None)
            raise ValueError(message)
        if not outputs:
            self._check_alive()
        return outputs

    def stats(self) -> dict:
        return self._control(GetStatsReq(), StatsResp).stats

    def flush_cache(self) -> bool:
        return self._control(FlushCacheReq(), FlushCacheResp).success

    def check_memory(self) -> CheckMemoryResp:
        """Every rank's page accounting; raises RuntimeError naming the ranks whose check failed."""
        resp = self._control(CheckMemoryReq(), CheckMemoryResp)
        bad = [f"rank {m.rank}: {m.error}" for m in resp.ranks if m.error]
        if bad:
            raise RuntimeError("; ".join(bad))
        return resp

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Stop every rank (politely first), close the sockets, remove the socket directory."""
        if self._closed:
            return
        self._closed = True
        self.ranks.stop(send_shutdown=lambda: send_message(self._send, ShutdownReq(), zmq.NOBLOCK))
        for sock in (self._send, self._recv):
            sock.close(linger=0)
        self._binder.close()
        self._ctx.term()
        shutil.rmtree(self._tmpdir, ignore_errors=True)

    # -------------------------------------------------------------------- helpers
    def _wait_ready(self, timeout: float) -> SchedulerReady:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._recv.poll(250):
                msg = recv_message(self._recv, self.drops)
                if isinstance(msg, SchedulerReady):
                    return msg
                if isinstance(msg, SchedulerFailed):
                    raise RuntimeError(f"scheduler failed to start: {msg.message}")
            elif not self.ranks.is_alive():
                raise RuntimeError(f"{self.ranks.describe_exit()} during startup")
        raise RuntimeError(f"scheduler ranks not ready after {timeout:.0f} s")

    def _pump(self, wait_ms: int) -> None:
        """Take every message that arrives within ``wait_ms`` (or is already queued)."""
        if not self._recv.poll(wait_ms):
            return
        while True:
            try:
                msg = recv_message(self._recv, self.drops, zmq.NOBLOCK)
            except zmq.Again:
                return
            if msg is None:
                continue
            if isinstance(msg, BatchTokenOutput):
                self._outputs += msg.outputs
            elif isinstance(msg, RejectedReq):
                self._rejected.append((msg.rid, msg.message))
            elif isinstance(msg, SchedulerFailed):
                raise RuntimeError(f"scheduler failed: {msg.message}")
            else:
                self._replies.append(msg)

    def _control(self, msg, reply_type: type):
        """Send a control request and wait for its reply (outputs arriving meanwhile are kept)."""
        send_message(self._send, msg)
        deadline = time.monotonic() + CONTROL_TIMEOUT_S
        while time.monotonic() < deadline:
            for i, got in enumerate(self._replies):
                if isinstance(got, reply_type):
                    return self._replies.pop(i)
            self._pump(STEP_POLL_MS)
            self._check_alive()
        raise RuntimeError(f"scheduler ranks did not answer {type(msg).__name__} within {CONTROL_TIMEOUT_S:.0f} s")

    def _check_alive(self) -> None:
        if not self.ranks.is_alive():
            raise RuntimeError(self.ranks.describe_exit())
