"""KV events end to end in one process: a real scheduler (tiny-llama) publishing on real ZMQ, the
router's subscriber following it. Batches are numbered without holes; a batch dropped on purpose
(the publisher's test hook) is seen as a gap and repaired from the snapshot."""

from __future__ import annotations

import json
import time

import orjson
import pytest
import zmq

from pdserve.config import ServerArgs
from pdserve.engine.request import SamplingParams
from pdserve.engine.scheduler_process import build_scheduler, close_kv_events
from pdserve.router.kv_events import KVEventSubscriber
from pdserve.router.kv_index import prompt_block_hashes

PAGE = 4
CONFIG = json.dumps({"publisher": "zmq", "endpoint": "tcp://127.0.0.1:*"})


@pytest.fixture(scope="module")
def scheduler():
    s = build_scheduler(ServerArgs(model_path="tiny-llama", max_total_tokens=512, page_size=PAGE,
                                   kv_events_config=CONFIG))
    yield s
    close_kv_events(s)


def run(scheduler, rid: str, ids: list[int]) -> None:
    scheduler.add_request(rid, ids, SamplingParams(max_new_tokens=2, temperature=0.0))
    while scheduler.has_work():
        scheduler.step()


def wait_for(condition, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def cached(scheduler) -> set[int]:
    return {h for h, _ in scheduler.kv_manager.cached_blocks()}


def test_batches_are_numbered_and_carry_vllm_fields(scheduler):
    endpoint = scheduler.stats()["kv_events_endpoint"]
    assert endpoint.startswith("tcp://127.0.0.1:") and not endpoint.endswith(":*")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(endpoint)
        wait_for(lambda: sub.poll(100), "a heartbeat (the subscription is live)")
        sub.recv_multipart()
        first = scheduler.kv_events.seq
        run(scheduler, "a", list(range(1, 14)))
        frames = sub.recv_multipart()
        while not orjson.loads(frames[2])["events"]:  # skip heartbeats
            frames = sub.recv_multipart()
        topic, seq, payload = frames[0], int.from_bytes(frames[1], "big"), orjson.loads(frames[2])
        assert topic == b"" and seq == payload["seq"] == first + 1
        (stored,) = payload["events"]
        assert stored["type"] == "BlockStored" and stored["medium"] == "GPU" and stored["block_size"] == PAGE
        assert stored["parent_block_hash"] is None
        # the router's hashes of the prompt are the server's: 12 of 13 tokens cacheable, 3 pages
        assert stored["block_hashes"] == prompt_block_hashes(list(range(1, 14)), PAGE)
    finally:
        sub.close(linger=0)
        ctx.term()


def test_a_dropped_batch_is_a_gap_repaired_from_the_snapshot(scheduler):
    pub = scheduler.kv_events
    sub = KVEventSubscriber("in-process", pub.endpoint, scheduler.kv_events_snapshot, stale_s=30.0).start()
    try:
        wait_for(lambda: sub.fresh, "the first resync (heartbeat -> snapshot)")
        resyncs = sub.resyncs
        run(scheduler, "b", [7] * 9)
        wait_for(lambda: sub.index.seq == pub.seq, "batch b")
        assert sub.index.blocks["GPU"] == cached(scheduler) and sub.resyncs == resyncs  # followed, no resync
        pub.drop_next = 1
        run(scheduler, "c", [5] * 21)  # its BlockStored batch is numbered, never sent
        run(scheduler, "d", [8] * 17)
        wait_for(lambda: sub.index.seq == pub.seq and sub.resyncs > resyncs, "the gap's resync")
        assert sub.gaps >= 1 and pub.dropped_batches == 1
        assert sub.index.blocks["GPU"] == cached(scheduler)
        assert sub.matched_blocks(prompt_block_hashes([5] * 21 + [1], PAGE)) == 5  # c's blocks: from the snapshot
        assert scheduler.flush_cache()
        wait_for(lambda: sub.index.seq == pub.seq, "the flush's batch")
        assert sub.num_blocks == 0
    finally:
        sub.stop()
