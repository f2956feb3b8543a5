"""Every P/D threshold at, just below and just above its boundary, as docs/disaggregation.md
("Thresholds") states it: --disaggregation-min-prefill-tokens, the timeouts (unpaired halves,
decode's wait, prefill's drain and write deadline), heartbeat misses, the quarantine lease and
the confirmed-exit grace, and the unreachable-registry back-off."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from pd_pair import PDPair, greedy

from pdserve.disagg.bootstrap import RoomTable
from pdserve.disagg.layout import LayoutError
from pdserve.disagg.receiver import (
    GONE_PEER_GRACE_S,
    PROBE_MISSES,
    IncomingRoom,
    Peer,
    PeerMonitor,
    Quarantine,
)
from pdserve.disagg.sender import KVSender

EPS = 1e-6


def test_min_prefill_tokens_transfers_at_the_boundary_and_prefills_locally_below_it():
    """Decode receives len(prompt) - 1 tokens; it prefills locally when that is FEWER than the
    flag: equal transfers."""
    pair = PDPair("tiny-llama")
    try:
        prompts = [torch.randint(3, 1500, (n,), generator=torch.Generator().manual_seed(n)).tolist()
                   for n in (21, 22, 23)]  # receive 20, 21, 22 with the threshold at 21
        pair.decode.mode.config = dataclasses.replace(pair.decode.mode.config, min_prefill_tokens=21)
        for i, p in enumerate(prompts):
            pair.submit(f"r{i}", p, greedy(2))
            pair.run()
        st = pair.decode.stats()
        assert (st["local_prefills"], st["kv_received"]) == (1, 2)  # 20 < 21: local; 21 and 22: transferred
        pair.assert_idle_and_accounted()
    finally:
        pair.close()


def test_an_unpaired_half_expires_at_the_timeout_not_before():
    table = RoomTable(timeout_s=5.0)
    table.add_http(1, "req", now=10.0)
    assert table.expire(now=15.0 - EPS) == []
    (e,) = table.expire(now=15.0)
    assert e.room == 1 and e.http == "req"


def test_decode_waits_the_full_timeout_then_fails_over():
    inc = IncomingRoom(room=1, nonce=1, peer=Peer(("h", 1)), expected={(0, 0): 3}, deadline=40.0, sent_at=10.0)
    assert not inc.overdue(40.0)
    assert inc.overdue(40.0 + EPS)


def test_decode_waits_the_full_timeout_after_the_last_progress_never_less():
    inc = IncomingRoom(room=1, nonce=1, peer=Peer(("h", 1)), expected={(0, 0): 3}, deadline=40.0, sent_at=10.0)
    inc.progress(35.0, 30.0)  # a notice at 35 s: the wait restarts
    assert not inc.overdue(65.0) and inc.overdue(65.0 + EPS)
    inc.progress(20.0, 30.0)  # an older sign of progress never shortens it
    assert not inc.overdue(65.0)


class _Probe:
    def __init__(self):
        self.answers: list[bool] = []

    def probe(self, session, timeout_s):
        return self.answers.pop(0)


def test_a_peer_is_dead_after_exactly_probe_misses_consecutive_misses():
    verdicts = []
    monitor = PeerMonitor(_Probe(), 3600.0, verdicts.append)  # its thread never wakes: we drive it
    try:
        monitor.watch({"s": ("h", 1)})
        for _ in range(PROBE_MISSES - 1):
            assert monitor._answered("s", False)  # one short of the verdict
        assert monitor._answered("s", True)  # an answer resets the count
        for _ in range(PROBE_MISSES - 1):
            assert monitor._answered("s", False)
        assert not monitor._answered("s", False)  # the PROBE_MISSES-th miss in a row: dead
    finally:
        monitor.close()


def test_the_quarantine_lease_and_the_exit_grace_end_exactly_on_time():
    q = Quarantine(lease_s=60.0)
    q.add(1, 1, [3], None, {0: "s0"}, now=100.0)
    q.add(2, 2, [4], None, {0: "s1"}, now=100.0)
    q.peers_gone({"s1"}, now=110.0)
    assert q.release(now=110.0 + GONE_PEER_GRACE_S - EPS) == []
    assert [e.room for e in q.release(now=110.0 + GONE_PEER_GRACE_S)] == [2]
    assert q.release(now=160.0 - EPS) == []
    assert [e.room for e in q.release(now=160.0)] == [1]


def test_an_unreachable_registry_is_asked_again_exactly_at_retry_at():
    peer = Peer(("h", 1), error="prefill h:1: nothing listens there", retry_at=50.0)
    assert not peer.retry_due(50.0 - EPS)
    assert peer.retry_due(50.0)
    assert not Peer(("h", 1), error="weights differ", incompatible=True, retry_at=0.0).retry_due(100.0)


def test_a_room_is_opened_only_with_write_budget_left(monkeypatch):
    """The write deadline: a KV request that waited the whole timeout before pairing is refused;
    one with budget left gets a deadline that far ahead."""
    sender = KVSender.__new__(KVSender)
    sender.rooms = {}
    monkeypatch.setattr(KVSender, "check", lambda self, kv, n: None)
    monkeypatch.setattr(KVSender, "_sources", lambda self, room, kv, d: [0])

    class _KV:
        start_pos = 0

        class layout:  # noqa: N801 - a stand-in namespace for the request's layout
            page_size = 1

    for budget in (0.0, -EPS):
        with pytest.raises(LayoutError, match="waited past --disaggregation-timeout-s"):
            sender.open(1, {0: _KV()}, 5, now=0.0, budget_s=budget)
    before = time.monotonic()
    r = sender.open(1, {0: _KV()}, 5, now=0.0, budget_s=2.0)
    assert before + 2.0 <= r.deadline <= time.monotonic() + 2.0
