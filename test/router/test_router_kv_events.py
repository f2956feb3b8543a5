"""The router's follower of one worker's KV events, fed messages by hand (no socket, a fake clock):
resync on first contact, a gap or a restart; stale after a silence; malformed messages dropped."""

from __future__ import annotations

import logging

import orjson

from pdserve.router.kv_events import KVEventSubscriber


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def msg(seq: int, events: list[dict], epoch: int = 1) -> list[bytes]:
    return [b"", seq.to_bytes(8, "big"), orjson.dumps({"seq": seq, "epoch": epoch, "events": events})]


def stored(*hashes: int) -> dict:
    return {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": None, "token_ids": [],
            "block_size": 1, "medium": "GPU"}


def follower(snapshots: list[dict]) -> tuple[KVEventSubscriber, Clock]:
    clock = Clock()
    return KVEventSubscriber("w", "tcp://127.0.0.1:1", lambda: snapshots.pop(0), stale_s=5.0, clock=clock), clock


def test_first_contact_gap_and_restart_resync_from_the_snapshot():
    snaps = [{"seq": 3, "blocks": [{"block_hash": 10}]}, {"seq": 6, "blocks": [{"block_hash": 10},
                                                                              {"block_hash": 11}]},
             {"seq": 0, "epoch": 2, "blocks": []}]
    sub, _ = follower(snaps)
    assert sub.matched_blocks([10]) == 0  # nothing known yet
    sub.handle(msg(3, []))  # a heartbeat: the worker is at batch 3
    assert sub.resyncs == 1 and sub.matched_blocks([10, 11]) == 1
    sub.handle(msg(4, [stored(11)]))
    assert sub.matched_blocks([10, 11]) == 2 and sub.gaps == 1
    sub.handle(msg(6, [stored(12)]))  # batch 5 lost: resync, the snapshot covers up to 6
    assert sub.gaps == 2 and sub.resyncs == 2 and sub.matched_blocks([10, 11, 12]) == 2
    sub.handle(msg(1, [stored(20)], epoch=2))  # restarted: numbers from 1 again under a new epoch
    assert sub.resyncs == 3 and sub.matched_blocks([10]) == 0 and sub.index.seq == 0


def test_a_silent_worker_is_routed_as_holding_nothing():
    sub, clock = follower([{"seq": 1, "blocks": [{"block_hash": 10}]}])
    sub.handle(msg(1, []))
    assert sub.matched_blocks([10]) == 1 and sub.num_blocks == 1
    clock.now += 6.0  # no event, no heartbeat for longer than stale_s
    assert sub.matched_blocks([10]) == 0 and sub.num_blocks == 0 and not sub.status()["fresh"]
    sub.handle(msg(1, []))  # a heartbeat again: trusted again
    assert sub.matched_blocks([10]) == 1


def test_malformed_messages_and_failed_snapshots_leave_it_empty_not_broken():
    def fail() -> dict:
        raise OSError("connection refused")

    sub = KVEventSubscriber("w", "tcp://127.0.0.1:1", fail, stale_s=5.0, clock=Clock())
    sub.handle([b"", b"\x00"])  # no payload
    sub.handle([b"", (1).to_bytes(8, "big"), b"not json"])
    assert sub.batches == 0 and sub.gaps == 0
    sub.handle(msg(1, [stored(5)]))
    assert sub.resync_failures == 1 and sub.matched_blocks([5]) == 0


def test_first_contact_is_quiet_a_real_gap_says_what_was_missed(caplog):
    caplog.set_level(logging.DEBUG, logger="pdserve.router.kv_events")
    snaps = [{"seq": 4, "blocks": []}, {"seq": 9, "blocks": []}]
    sub, _ = follower(snaps)
    sub.handle(msg(4, []))  # first contact: the worker is at batch 4
    assert sub.resyncs == 1 and not [r for r in caplog.records if r.levelno >= logging.INFO]
    sub.handle(msg(9, [stored(1)]))  # 5..8 lost
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert said == ["KV events of w: missed batches after 4 (the worker is at 9); reloading the worker's cache "
                    "from the snapshot"]


def test_a_failing_snapshot_is_warned_once_per_run_of_failures(caplog):
    answers: list = [OSError("refused"), OSError("refused"), {"seq": 2, "blocks": []}]

    def fetch() -> dict:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    clock = Clock()
    sub = KVEventSubscriber("w", "tcp://127.0.0.1:1", fetch, stale_s=5.0, clock=clock)
    caplog.set_level(logging.INFO, logger="pdserve.router.kv_events")
    for seq in (1, 2, 2):  # heartbeats, a second apart: each one retries the snapshot
        sub.handle(msg(seq, []))
        clock.now += 1.0
    assert sub.resync_failures == 2 and sub.resyncs == 1
    levels = [(r.levelno, r.getMessage().split(":")[1].strip()) for r in caplog.records]
    assert [lv for lv, _ in levels] == [logging.WARNING, logging.INFO], levels
