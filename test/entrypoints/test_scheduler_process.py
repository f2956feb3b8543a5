"""SchedulerLoop over real ZMQ sockets with a fake scheduler: batching, idling, draining, replies."""

from __future__ import annotations

import threading

import pytest
import zmq

from pdserve.engine.io_struct import (
    AbortReq,
    BatchTokenOutput,
    FlushCacheReq,
    FlushCacheResp,
    GetStatsReq,
    RejectedReq,
    ShutdownReq,
    StatsResp,
    TokenizedGenerateReq,
    TokenOutput,
)
from pdserve.engine.request import SamplingParams
from pdserve.engine.scheduler_process import SchedulerLoop


class FakeScheduler:
    """Each step emits one token for every live request; a request finishes after ``n`` tokens."""

    def __init__(self, n: int = 3):
        self.n = n
        self.reqs: dict[str, int] = {}
        self.steps = 0
        self.added_before_step: list[int] = []

    def add_request(self, rid, input_ids, sampling, return_logprob=False, logprob_start_len=-1, top_logprobs_num=0):
        if not input_ids:
            raise ValueError("input_ids: the prompt is empty")
        self.reqs[rid] = 0

    def abort(self, rid, message="aborted"):
        return self.reqs.pop(rid, None) is not None

    def has_work(self):
        return bool(self.reqs)

    def step(self):
        self.steps += 1
        self.added_before_step.append(len(self.reqs))
        outs = []
        for rid in list(self.reqs):
            self.reqs[rid] += 1
            done = self.reqs[rid] >= self.n
            outs.append(TokenOutput(rid, [self.reqs[rid]], None, done, {"type": "length"} if done else None,
                                    1, self.reqs[rid], 0))
            if done:
                del self.reqs[rid]
        return outs

    def stats(self):
        return {"num_running_reqs": len(self.reqs)}

    def flush_cache(self):
        return not self.reqs


@pytest.fixture
def sockets():
    ctx = zmq.Context()
    to_sched_push, to_sched_pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    to_front_push, to_front_pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    to_sched_pull.bind("inproc://to_scheduler")
    to_sched_push.connect("inproc://to_scheduler")
    to_front_pull.bind("inproc://to_frontend")
    to_front_push.connect("inproc://to_frontend")
    yield to_sched_push, to_sched_pull, to_front_push, to_front_pull
    for s in (to_sched_push, to_sched_pull, to_front_push, to_front_pull):
        s.close(linger=0)
    ctx.term()


def _req(rid, ids=(1, 2)):
    return TokenizedGenerateReq(rid, list(ids), SamplingParams(max_new_tokens=3))


def _recv_all(sock, timeout_ms=200):
    out = []
    while sock.poll(timeout_ms):
        out.append(sock.recv_pyobj())
    return out


def test_one_message_per_step_and_all_queued_requests_join_the_first_step(sockets):
    push, pull, out_push, out_pull = sockets
    sched = FakeScheduler(n=3)
    for i in range(4):
        push.send_pyobj(_req(f"r{i}"))
    push.send_pyobj(ShutdownReq())  # handled in the same drain, after the requests
    loop = SchedulerLoop(sched, pull, out_push)
    loop.drain(block=True)
    while sched.has_work():
        loop.run_step()
    msgs = _recv_all(out_pull)
    assert sched.added_before_step[0] == 4  # drained everything before stepping
    assert len(msgs) == sched.steps == 3
    assert all(isinstance(m, BatchTokenOutput) and len(m.outputs) == 4 for m in msgs)
    assert loop.stopped


def test_idle_loop_blocks_on_the_socket_instead_of_spinning(sockets):
    push, pull, out_push, out_pull = sockets
    sched = FakeScheduler()
    loop = SchedulerLoop(sched, pull, out_push, idle_poll_ms=50)
    thread = threading.Thread(target=loop.run)
    thread.start()
    threading.Event().wait(0.3)
    push.send_pyobj(ShutdownReq())
    thread.join(5)
    assert not thread.is_alive()
    assert sched.steps == 0
    assert 2 <= loop.idle_polls <= 10  # ~0.3 s / 50 ms, not thousands of spins


def test_rejection_control_messages_and_abort(sockets):
    push, pull, out_push, out_pull = sockets
    sched = FakeScheduler(n=100)
    loop = SchedulerLoop(sched, pull, out_push)
    for msg in (_req("bad", ids=()), _req("a"), _req("b"), GetStatsReq(), FlushCacheReq(), AbortReq("a"),
                AbortReq("", abort_all=True)):
        push.send_pyobj(msg)
    loop.drain(block=True)
    msgs = _recv_all(out_pull)
    assert isinstance(msgs[0], RejectedReq) and msgs[0].rid == "bad" and "input_ids" in msgs[0].message
    assert isinstance(msgs[1], StatsResp) and msgs[1].stats == {"num_running_reqs": 2}
    assert isinstance(msgs[2], FlushCacheResp) and msgs[2].success is False
    assert not sched.reqs  # both aborted


def test_parent_exit_ends_the_loop(sockets):
    push, pull, out_push, out_pull = sockets
    loop = SchedulerLoop(FakeScheduler(), pull, out_push, parent_pid=-1, idle_poll_ms=10)
    loop.run()  # returns because getppid() != -1
