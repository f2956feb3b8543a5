"""SchedulerLoop over real ZMQ sockets around a real Scheduler on the tiny-llama preset (it
starts in about a second): batching, idling, draining, replies, leaving when the parent goes.
The offline Engine on the same preset is the oracle for tokens."""

from __future__ import annotations

import os
import threading
import time

import pytest
import zmq

import pdserve
from pdserve.config import ServerArgs
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
)
from pdserve.engine.request import SamplingParams
from pdserve.engine.scheduler_loop import FRONTEND_CODEC, SchedulerLoop
from pdserve.entrypoints.scheduler_process import build_scheduler

PRESET = "tiny-llama"


@pytest.fixture(scope="module")
def scheduler():
    """One real scheduler for the module; every test leaves it idle with its pages accounted for."""
    return build_scheduler(ServerArgs(model_path=PRESET, max_total_tokens=2048))


@pytest.fixture(autouse=True)
def idle_before_and_after(scheduler):
    assert not scheduler.has_work()
    yield
    assert not scheduler.has_work()
    scheduler.check_memory()
    st = scheduler.stats()
    assert st["free_pages"] + st["cached_pages"] == st["total_pages"], st


@pytest.fixture(scope="module")
def engine():
    return pdserve.Engine(model_path=PRESET, max_total_tokens=2048)


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


def _req(rid, ids=(5, 17, 99, 3), max_new_tokens=3):
    return TokenizedGenerateReq(rid, list(ids), SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                                                               ignore_eos=True))


def _recv_all(sock, timeout_ms=200):
    out = []
    while sock.poll(timeout_ms):
        out.append(FRONTEND_CODEC.decode(sock.recv()))
    return out


def test_one_message_per_step_and_all_queued_requests_join_the_first_step(sockets, scheduler, engine):
    push, pull, out_push, out_pull = sockets
    prompts = [[5 + i, 17, 99, 3] for i in range(4)]
    rids = [f"r{i}" for i in range(4)]
    for rid, p in zip(rids, prompts):
        push.send(FRONTEND_CODEC.encode(_req(rid, p)))
    push.send(FRONTEND_CODEC.encode(ShutdownReq()))  # handled in the same drain, after the requests
    loop = SchedulerLoop(scheduler, pull, out_push)
    steps_before = scheduler.stats()["forward_steps"]
    loop.drain(block=True)
    assert loop.stopped and scheduler.stats()["num_waiting_reqs"] == 4  # drained everything before stepping
    while scheduler.has_work():
        loop.run_step()
    msgs = _recv_all(out_pull)
    # one extend step holding all four prompts, then two decode steps: one message each
    assert len(msgs) == scheduler.stats()["forward_steps"] - steps_before == 3
    assert all(isinstance(m, BatchTokenOutput) and sorted(o.rid for o in m.outputs) == rids for m in msgs)
    got = {rid: [t for m in msgs for o in m.outputs if o.rid == rid for t in o.new_token_ids] for rid in rids}
    want = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 3, "temperature": 0.0,
                                                               "ignore_eos": True})
    assert [got[rid] for rid in rids] == [w["output_ids"] for w in want]
    assert all(o.finished and o.finish_reason == {"type": "length", "length": 3} for o in msgs[-1].outputs)


def test_a_finished_request_gives_its_pages_to_the_cache_after_its_last_token_is_sent(sockets, scheduler):
    """The radix insert of a finished request (a node and a hash per page) runs once the step's
    outputs are sent, not before: it would hold back that step's tokens for every stream. Nothing
    is left unreleased after the step, and a later step finds the pages where they belong."""
    push, pull, out_push, out_pull = sockets
    loop = SchedulerLoop(scheduler, pull, out_push)
    sent_outputs = loop.send_outputs
    at_send: dict[str, tuple[bool, int]] = {}  # rid -> (its pages still all held, cached pages) when its end left

    def send_outputs(outputs, sampled_at=0.0):
        for o in outputs:
            if o.finished:
                req = reqs[o.rid]
                held = bool(req.pages) and not any(scheduler.allocator.is_free(p) for p in req.pages)
                at_send[o.rid] = (held, scheduler.cache.num_cached_pages)
        sent_outputs(outputs, sampled_at)

    loop.send_outputs = send_outputs
    for i in range(3):
        push.send(FRONTEND_CODEC.encode(_req(f"f{i}", (11 + i, 23, 5, 8, 13), max_new_tokens=3 + 2 * i)))
    loop.drain(block=True)
    reqs = dict(scheduler.reqs)
    after: dict[str, int] = {}
    while scheduler.has_work():
        loop.run_step()
        scheduler.check_memory()  # between steps nothing is left unreleased
        after.update({rid: scheduler.cache.num_cached_pages for rid in at_send if rid not in after})
    assert sorted(at_send) == ["f0", "f1", "f2"]
    for rid, (held, cached) in at_send.items():
        assert held, rid  # its tokens left while it still held its pages
        assert after[rid] > cached, rid  # they reached the cache right after the send
    _recv_all(out_pull)


def test_decode_tokens_already_sampled_leave_before_an_extend_runs(sockets, scheduler, engine):
    """Overlap scheduling: the decode step in flight when a new prompt arrives lands before that
    prompt's extend; its tokens go out then, in their own message stamped with their sampling
    time, instead of waiting out the prefill in the extend's message."""
    push, pull, out_push, out_pull = sockets
    loop = SchedulerLoop(scheduler, pull, out_push)
    push.send(FRONTEND_CODEC.encode(_req("a", max_new_tokens=4)))
    loop.drain(block=True)
    loop.run_step()  # a's extend: its first token
    loop.run_step()  # a's first decode step, launched on the worker
    push.send(FRONTEND_CODEC.encode(_req("b", (7, 8, 9, 10), max_new_tokens=2)))
    loop.drain(block=True)
    while scheduler.has_work():
        loop.run_step()
    msgs = _recv_all(out_pull)
    first_b = next(i for i, m in enumerate(msgs) if any(o.rid == "b" for o in m.outputs))
    before_b = [t for m in msgs[:first_b] for o in m.outputs if o.rid == "a" for t in o.new_token_ids]
    assert len(before_b) == 2, [[(o.rid, o.new_token_ids) for o in m.outputs] for m in msgs]
    early = msgs[first_b - 1]
    assert [o.rid for o in early.outputs] == ["a"] and 0 < early.sampled_at <= early.sent_at
    got = {rid: [t for m in msgs for o in m.outputs if o.rid == rid for t in o.new_token_ids] for rid in "ab"}
    greedy = [{"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True} for n in (4, 2)]
    want = engine.generate(input_ids=[[5, 17, 99, 3], [7, 8, 9, 10]], sampling_params=greedy)
    assert [got["a"], got["b"]] == [w["output_ids"] for w in want]
    assert scheduler.emit is None  # only a step the loop runs sends early


def test_idle_loop_blocks_on_the_socket_instead_of_spinning(sockets, scheduler):
    push, pull, out_push, out_pull = sockets
    steps_before = scheduler.stats()["forward_steps"]
    loop = SchedulerLoop(scheduler, pull, out_push, idle_poll_ms=50)
    thread = threading.Thread(target=loop.run)
    thread.start()
    threading.Event().wait(0.3)
    push.send(FRONTEND_CODEC.encode(ShutdownReq()))
    thread.join(5)
    assert not thread.is_alive()
    assert scheduler.stats()["forward_steps"] == steps_before
    assert 2 <= loop.idle_polls <= 10  # ~0.3 s / 50 ms, not thousands of spins


def test_rejection_control_messages_and_abort(sockets, scheduler):
    push, pull, out_push, out_pull = sockets
    loop = SchedulerLoop(scheduler, pull, out_push)
    vocab = scheduler.model_config.vocab_size
    for msg in (_req("empty", ids=()), _req("oov", ids=(1, vocab)), _req("long", max_new_tokens=10 ** 6),
                _req("a"), _req("b"), GetStatsReq(), FlushCacheReq(), AbortReq("a"),
                AbortReq("", abort_all=True)):
        push.send(FRONTEND_CODEC.encode(msg))
    loop.drain(block=True)
    msgs = _recv_all(out_pull)
    assert [type(m) for m in msgs] == [RejectedReq] * 3 + [StatsResp, FlushCacheResp]
    assert [(m.rid, m.message.split(":")[0]) for m in msgs[:3]] == [
        ("empty", "input_ids"), ("oov", "input_ids"), ("long", "sampling_params.max_new_tokens")]
    assert msgs[3].stats["num_waiting_reqs"] == 2 and msgs[3].stats["num_running_reqs"] == 0
    assert msgs[4].success is False  # requests were queued: the cache is not flushed under them
    assert not scheduler.reqs  # both aborted
    loop.run_step()  # the aborts' final outputs leave in one message
    (final,) = _recv_all(out_pull)
    assert sorted((o.rid, o.finished, o.finish_reason["type"], o.new_token_ids) for o in final.outputs) == [
        ("a", True, "abort", []), ("b", True, "abort", [])]


def _run_in_thread(loop: SchedulerLoop) -> threading.Thread:
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    return thread


def test_parent_exit_ends_the_loop(sockets, scheduler):
    push, pull, out_push, out_pull = sockets
    loop = SchedulerLoop(scheduler, pull, out_push, parent_pid=-1, idle_poll_ms=10)  # never our parent
    thread = _run_in_thread(loop)
    thread.join(10)
    still_running = thread.is_alive()
    if still_running:
        push.send(FRONTEND_CODEC.encode(ShutdownReq()))
        thread.join(5)
    assert not still_running, "the loop kept running after its parent was gone"
    assert not loop.stopped  # it left because the parent was gone, not because it was told to


def test_loop_with_a_live_parent_runs_until_shutdown(sockets, scheduler):
    push, pull, out_push, out_pull = sockets
    loop = SchedulerLoop(scheduler, pull, out_push, parent_pid=os.getppid(), idle_poll_ms=10)
    thread = _run_in_thread(loop)
    deadline = time.monotonic() + 30
    while loop.idle_polls < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert thread.is_alive() and loop.idle_polls >= 5  # idled (and checked its parent) several times
    push.send(FRONTEND_CODEC.encode(ShutdownReq()))
    thread.join(5)
    assert not thread.is_alive() and loop.stopped
