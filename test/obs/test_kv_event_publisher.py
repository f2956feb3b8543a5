"""KV events end to end in one process: a real scheduler (tiny-llama) publishing on real ZMQ, the
router's subscriber following it. Batches are numbered without holes; a batch dropped on purpose
(the publisher's test hook) is seen as a gap and repaired from the snapshot."""

from __future__ import annotations

import json
import time

import orjson
import pytest
import zmq

from pdserve.config import KVEventsConfig, ServerArgs
from pdserve.engine.request import SamplingParams
from pdserve.entrypoints.scheduler_process import build_scheduler, close_kv_events
from pdserve.obs.kv_event_publisher import EventCurveKeys, KVEventPublisher
from pdserve.router.kv_events import KVEventSubscriber
from pdserve.router.kv_index import prompt_block_hashes

PAGE = 4
HASH_KEY = bytes(range(32))  # the deployment's block hash key (resolve_kv_hash_key's output)
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


# ------------------------------------------------- who may read the events
def test_the_default_endpoint_is_the_servers_host_not_every_interface():
    default = KVEventsConfig("zmq")
    assert default.endpoint_for("127.0.0.1") == "tcp://127.0.0.1:5557"
    assert default.endpoint_for("10.1.2.3") == "tcp://10.1.2.3:5557"
    assert default.endpoint_for("::1") == "tcp://[::1]:5557"
    assert KVEventsConfig("zmq", "tcp://127.0.0.1:*").endpoint_for("10.1.2.3") == "tcp://127.0.0.1:*"  # as given
    assert ServerArgs(model_path="tiny-llama", host="10.1.2.3",
                      kv_events_config='{"publisher": "zmq"}').kv_events().endpoint_for("10.1.2.3").startswith(
                          "tcp://10.1.2.3:")


def _published_stored(pub: KVEventPublisher, port: int) -> dict:
    """The first BlockStored event a subscriber on 127.0.0.1:``port`` receives from ``pub`` (a CURVE
    client under the hash key's keys where ``pub`` is a CURVE server)."""
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        if pub.curve is not None:
            EventCurveKeys.from_hash_key(HASH_KEY).secure_subscriber(sub)
        sub.connect(f"tcp://127.0.0.1:{port}")
        wait_for(lambda: sub.poll(100), "a heartbeat (the subscription is live)")
        pub.stored(None, [11, 12], [1, 2, 3, 4, 5, 6, 7, 8], 4, "GPU")
        pub.flush()
        while not (events := orjson.loads(sub.recv_multipart()[2])["events"]):
            pass
        return events[0]
    finally:
        sub.close(linger=0)
        ctx.term()


@pytest.mark.parametrize("bind, token_ids", [("tcp://127.0.0.1:*", True), ("tcp://0.0.0.0:*", False)])
def test_token_ids_are_published_only_to_this_machine(bind, token_ids):
    # A wildcard bind is reachable from other machines, with no authentication: the events go out
    # with their (keyed) block hashes (what routing needs) and without the prompts' tokens. The
    # subscriber itself connects over loopback only.
    pub = KVEventPublisher(KVEventsConfig("zmq", bind), advertise_host="127.0.0.1", hash_key=HASH_KEY)
    try:
        port = int(pub.endpoint.rsplit(":", 1)[1])
        stored = _published_stored(pub, port)
        assert stored["block_hashes"] == [11, 12] and stored["type"] == "BlockStored"
        assert ("token_ids" in stored) is token_ids and pub.stats()["kv_events_token_ids"] is token_ids
        if token_ids:
            assert stored["token_ids"] == [1, 2, 3, 4, 5, 6, 7, 8]
    finally:
        pub.close()


def test_unkeyed_hashes_are_not_published_beyond_this_machine():
    """Unkeyed block hashes give the prompts away (test/obs/test_kv_events.py: the dictionary attack),
    and a PUB socket authenticates no subscriber: an unkeyed server publishes on loopback or not at all."""
    with pytest.raises(ValueError, match=r"kv_events_config: endpoint .* --kv-hash-key-file"):
        KVEventPublisher(KVEventsConfig("zmq", "tcp://0.0.0.0:*"), advertise_host="127.0.0.1")
    KVEventPublisher(KVEventsConfig("zmq", "tcp://127.0.0.1:*"), advertise_host="127.0.0.1").close()  # loopback: fine


def _subscriber(ctx: zmq.Context, port: int, keys: EventCurveKeys | None) -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        keys.secure_subscriber(sub)
    sub.connect(f"tcp://127.0.0.1:{port}")
    return sub


def test_events_reachable_from_other_machines_are_curve_for_holders_of_the_hash_key_only():
    """Round 2's open item: keyed hashes still tell which blocks are equal, so a publisher bound beyond
    the loopback is a CURVE server whose keys derive from the hash key. A subscriber without them, or
    with another deployment's, gets nothing (not even a heartbeat) while the router's gets every batch."""
    pub = KVEventPublisher(KVEventsConfig("zmq", "tcp://0.0.0.0:*"), advertise_host="127.0.0.1", hash_key=HASH_KEY)
    ctx = zmq.Context()
    try:
        assert pub.stats()["kv_events_curve"] is True
        port = int(pub.endpoint.rsplit(":", 1)[1])
        strangers = [_subscriber(ctx, port, None), _subscriber(ctx, port, EventCurveKeys.from_hash_key(bytes(32)))]
        router = _subscriber(ctx, port, EventCurveKeys.from_hash_key(HASH_KEY))
        wait_for(lambda: router.poll(100), "a heartbeat to the key holder")
        router.recv_multipart()
        pub.stored(None, [11, 12], [1, 2, 3, 4, 5, 6, 7, 8], 4, "GPU")
        pub.flush()
        while not (events := orjson.loads(router.recv_multipart()[2])["events"]):
            pass
        assert events[0]["block_hashes"] == [11, 12] and "token_ids" not in events[0]
        router.recv_multipart()  # and a heartbeat after it: the strangers, connected first, had as long
        assert [s.poll(0) for s in strangers] == [0, 0]
        for s in (*strangers, router):
            s.close()
    finally:
        ctx.term()
        pub.close()


def test_the_routers_subscriber_follows_a_curve_publisher_with_the_keys():
    pub = KVEventPublisher(KVEventsConfig("zmq", "tcp://0.0.0.0:*"), advertise_host="127.0.0.1", hash_key=HASH_KEY)
    endpoint = "tcp://127.0.0.1:" + pub.endpoint.rsplit(":", 1)[1]
    sub = KVEventSubscriber("curve", endpoint, lambda: pub.snapshot([], PAGE), stale_s=30.0,
                            curve=EventCurveKeys.from_hash_key(HASH_KEY)).start()
    try:
        wait_for(lambda: sub.fresh, "the first heartbeat and resync over CURVE")
        pub.stored(None, [11, 12], [1, 2, 3, 4, 5, 6, 7, 8], PAGE, "GPU")
        pub.flush()
        wait_for(lambda: sub.num_blocks == 2, "the stored blocks")
    finally:
        sub.stop()
        pub.close()


def test_loopback_events_stay_plain_for_local_readers():
    pub = KVEventPublisher(KVEventsConfig("zmq", "tcp://127.0.0.1:*"), advertise_host="127.0.0.1", hash_key=HASH_KEY)
    try:
        assert pub.curve is None and pub.stats()["kv_events_curve"] is False
    finally:
        pub.close()


def test_hash_only_events_still_drive_the_routers_index():
    from pdserve.router.kv_index import KVIndex

    index = KVIndex()
    index.load_snapshot({"seq": 0, "blocks": []})
    hashes = prompt_block_hashes(list(range(1, 14)), PAGE)
    assert index.apply(1, [{"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
                            "block_size": PAGE, "medium": "GPU"}])
    assert index.matched_blocks(prompt_block_hashes(list(range(1, 14)), PAGE)) == 3
