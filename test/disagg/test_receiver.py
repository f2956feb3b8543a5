"""receiver.py's pieces that make decode ranks agree: the peer directory (fetched by one rank,
applied by every rank from the PeerFetched message), the heartbeat (a PeersDead verdict once per
session, over a real Mooncake engine), the handshake refusal of a layout decode cannot receive,
and the quarantine with several prefill ranks (released only when every rank that may still
write settled or is dead)."""

from __future__ import annotations

import socket
import time

import pytest
from test_bootstrap import COMPAT, LAYOUT, rank_record

from pdserve.disagg.bootstrap import BootstrapClient, BootstrapServer
from pdserve.disagg.channel import Mailbox
from pdserve.disagg.layout import KVLayout, LayoutError
from pdserve.disagg.receiver import (
    DEAD_PEER_GRACE_S,
    PeerDirectory,
    PeerFetched,
    PeerMonitor,
    PeersDead,
    Quarantine,
    check_peer_layout,
)
from pdserve.disagg.transfer import MooncakeTransferBackend, mooncake_available

# Decode TP1 of LAYOUT's model: all 8 heads of 2048 bytes per page on one rank.
DECODE = KVLayout("gqa", 1, 8, 16, "bfloat16", 4, 50, 8 * 2048, 50 * 8 * 2048)
CLIENT = BootstrapClient(request_timeout_s=2.0, interval_s=0.05)


def _wait_messages(mailbox: Mailbox, timeout_s: float = 30.0) -> list:
    deadline = time.monotonic() + timeout_s
    while not (got := mailbox.recv_all()):
        assert time.monotonic() < deadline, "no message posted"
        mailbox.socket.poll(50)
    return got


def _registry(server: BootstrapServer, layout: KVLayout) -> None:
    CLIENT.register_compat("127.0.0.1", server.port, COMPAT)
    for r in range(layout.num_ranks):
        CLIENT.register_rank("127.0.0.1", server.port, rank_record(r, layout))


def test_one_rank_fetches_and_every_rank_applies_the_records():
    mailbox = Mailbox()
    fetcher, follower = (PeerDirectory(COMPAT, DECODE, 5.0, mailbox.post) for _ in range(2))
    try:
        with BootstrapServer("127.0.0.1", 0) as server:
            _registry(server, LAYOUT)
            key = ("127.0.0.1", server.port)
            assert fetcher.get(*key) is None
            fetcher.fetch(key)
            fetcher.fetch(key)  # already on its way: one fetch
            (msg,) = _wait_messages(mailbox)
        assert isinstance(msg, PeerFetched) and msg.peer.error is None
        for d in (fetcher, follower):
            d.apply(msg)
            assert d.get(*key).info.ranks == [rank_record(0), rank_record(1)]
            assert d.sessions() == {"127.0.0.1:15000", "127.0.0.1:15001"}
        assert follower._pool is None  # the follower never ran a fetch
        follower.forget(key)  # forgotten, its sessions stay watched until declared dead
        assert follower.get(*key) is None and follower.sessions() == {"127.0.0.1:15000", "127.0.0.1:15001"}
        follower.buried(frozenset({"127.0.0.1:15001"}))
        assert follower.sessions() == {"127.0.0.1:15000"}
    finally:
        for d in (fetcher, follower):
            d.close()
        mailbox.close()


def test_a_prefill_with_several_attention_groups_is_refused_at_handshake():
    mailbox = Mailbox()
    directory = PeerDirectory(COMPAT, DECODE, 5.0, mailbox.post)
    dp2 = KVLayout("gqa", 2, 8, 16, "bfloat16", 4, 100, 4 * 16 * 128, 100 * 4 * 16 * 128, dp_size=2)
    try:
        with BootstrapServer("127.0.0.1", 0) as server:
            _registry(server, dp2)
            directory.fetch(("127.0.0.1", server.port))
            (msg,) = _wait_messages(mailbox)
        assert msg.peer.incompatible and "dp_size: prefill has 2 attention DP groups" in msg.peer.error
    finally:
        directory.close()
        mailbox.close()


def test_layout_check_names_what_differs():
    check_peer_layout(LAYOUT, DECODE)  # TP2 -> TP1: fine
    other = KVLayout("gqa", 1, 8, 16, "bfloat16", 3, 50, 8 * 2048, 50 * 8 * 2048)
    with pytest.raises(LayoutError, match="^num_layers: prefill has 4, decode has 3$"):
        check_peer_layout(LAYOUT, other)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not mooncake_available(), reason="needs mooncake")
def test_the_heartbeat_posts_one_verdict_per_dead_session():
    engine, peer, mailbox = MooncakeTransferBackend(), MooncakeTransferBackend(), Mailbox()
    monitor = PeerMonitor(engine, 0.05, mailbox.post)
    gone = f"127.0.0.1:{_free_port()}"  # nothing answers there
    try:
        monitor.watch({peer.session_id, gone})
        assert _wait_messages(mailbox) == [PeersDead(frozenset({gone}))]
        deadline = time.monotonic() + 0.5  # ten more heartbeats: the verdict is not repeated
        while time.monotonic() < deadline:
            assert mailbox.recv_all() == []
            time.sleep(0.05)
        monitor.watch({peer.session_id})  # forgotten...
        monitor.watch({peer.session_id, gone})  # ...so watched again, it is judged afresh
        assert _wait_messages(mailbox) == [PeersDead(frozenset({gone}))]
    finally:
        monitor.close()
        mailbox.close()
        peer.close()
        engine.close()


def test_quarantine_waits_for_every_prefill_rank_that_may_still_write():
    q = Quarantine(lease_s=100.0)
    q.add(1, [4, 5], 0, {0: "s0", 1: "s1"}, now=0.0)
    q.add(2, [6], None, {0: "s0", 1: "s1"}, now=0.0)
    q.peers_dead({"s1"}, now=1.0)  # rank 1 died; rank 0 may still write both rooms
    assert q.release(now=5.0) == [] and q.num_pages == 3
    q.settled(1, 0)  # rank 0 acknowledged room 1: only the dead rank was pending there
    assert [e.room for e in q.release(now=5.0)] == [1]
    q.peers_dead({"s0"}, now=6.0)  # now room 2's ranks are all dead: a grace for bytes on the wire
    assert q.release(now=6.0 + DEAD_PEER_GRACE_S / 2) == []
    assert [e.room for e in q.release(now=6.0 + DEAD_PEER_GRACE_S)] == [2]
    q.add(3, [7], None, {0: "s0"}, now=10.0)
    assert q.release(now=109.0) == [] and [e.room for e in q.release(now=110.0)] == [3]  # the lease
    assert q.num_pages == 0
