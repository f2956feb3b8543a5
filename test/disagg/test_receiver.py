"""receiver.py's pieces that make decode ranks agree: the peer directory (fetched by one rank,
applied by every rank from the PeerFetched message), the heartbeat (a PeersDead verdict once per
session, over a real Mooncake engine, then a PeersGone once the exit is confirmed and never for
a paused peer), the handshake refusal of a layout decode cannot receive, and the quarantine with
several prefill ranks (released only when every rank that may still write settled or is
confirmed gone, never on a dead verdict alone)."""

from __future__ import annotations

import socket
import time

import pytest
from test_bootstrap import COMPAT, LAYOUT, rank_record

from pdserve.disagg.bootstrap import BootstrapClient, BootstrapServer
from pdserve.disagg.channel import Mailbox
from pdserve.disagg.layout import KVLayout, LayoutError
from pdserve.disagg.receiver import (
    GONE_PEER_GRACE_S,
    UNREACHABLE_BACKOFF_S,
    PeerDirectory,
    PeerFetched,
    PeerMonitor,
    PeersDead,
    PeersGone,
    Quarantine,
    check_peer_layout,
)
from pdserve.transfer import MooncakeTransferBackend, mooncake_available

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
            d.apply(msg, now=1.0)
            assert d.get(*key).info.ranks == [rank_record(0), rank_record(1)]
            assert d.sessions() == {"127.0.0.1:15000": key, "127.0.0.1:15001": key}
        assert follower._pool is None  # the follower never ran a fetch
        follower.forget(key)  # forgotten, its sessions stay watched until their exit is confirmed
        assert follower.get(*key) is None and set(follower.sessions()) == {"127.0.0.1:15000", "127.0.0.1:15001"}
        follower.buried(frozenset({"127.0.0.1:15001"}))
        assert follower.sessions() == {"127.0.0.1:15000": key}
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
        nowhere = ("127.0.0.1", _free_port())  # its registry is gone too
        monitor.watch({peer.session_id: nowhere, gone: nowhere})
        got = _wait_messages(mailbox)
        assert got[0] == PeersDead(frozenset({gone}))
        got += _wait_messages(mailbox) if len(got) == 1 else []
        assert got[1:] == [PeersGone(frozenset({gone}))]  # nothing listens: exit confirmed
        deadline = time.monotonic() + 0.5  # ten more heartbeats: the verdicts are not repeated
        while time.monotonic() < deadline:
            assert mailbox.recv_all() == []
            time.sleep(0.05)
        monitor.watch({peer.session_id: nowhere})  # forgotten...
        monitor.watch({peer.session_id: nowhere, gone: nowhere})  # ...so watched again, it is judged afresh
        assert _wait_messages(mailbox)[0] == PeersDead(frozenset({gone}))
    finally:
        monitor.close()
        mailbox.close()
        peer.close()
        engine.close()


def test_quarantine_waits_for_every_prefill_rank_that_may_still_write():
    q = Quarantine(lease_s=100.0)
    q.add(1, 11, [4, 5], 0, {0: "s0", 1: "s1"}, now=0.0)
    q.add(2, 22, [6], None, {0: "s0", 1: "s1"}, now=0.0)
    q.peers_gone({"s1"}, now=1.0)  # rank 1's process exited; rank 0 may still write both rooms
    assert q.release(now=5.0) == [] and q.num_pages == 3
    assert not q.settled(1, 99, 0)  # another life of room 1: settles nothing
    assert q.release(now=5.0) == []
    assert q.settled(1, 11, 0)  # rank 0 acknowledged room 1: only the gone rank was pending there
    assert [e.room for e in q.release(now=5.0)] == [1]
    q.peers_gone({"s0"}, now=6.0)  # now room 2's ranks are all gone: a grace for bytes on the wire
    assert q.release(now=6.0 + GONE_PEER_GRACE_S / 2) == []
    assert [e.room for e in q.release(now=6.0 + GONE_PEER_GRACE_S)] == [2]
    q.add(3, 33, [7], None, {0: "s0"}, now=10.0)
    assert q.release(now=109.0) == [] and [e.room for e in q.release(now=110.0)] == [3]  # the lease
    assert q.num_pages == 0


def test_a_room_and_its_next_life_are_quarantined_apart():
    q = Quarantine(lease_s=100.0)
    q.add(1, 11, [4], None, {0: "s0"}, now=0.0)
    q.add(1, 12, [5], None, {0: "s0"}, now=0.0)  # the same room number, a later life
    assert q.num_pages == 2
    q.settled(1, 12, 0)
    assert [(e.room, e.nonce, e.pages) for e in q.release(now=1.0)] == [(1, 12, [5])]


def test_a_paused_peer_is_dead_but_never_confirmed_gone():
    """A stopped process's kernel still accepts connections on its ports (a listening socket
    that never accepts is the same thing) and its registry still lists the session."""
    mailbox = Mailbox()
    paused = socket.socket()
    paused.bind(("127.0.0.1", 0))
    paused.listen(16)
    session = f"127.0.0.1:{paused.getsockname()[1]}"
    monitor = PeerMonitor(_NeverAnswers(), 0.05, mailbox.post)
    try:
        with BootstrapServer("127.0.0.1", 0) as registry:
            _registry(registry, LAYOUT)
            assert not monitor.exited(session, ("127.0.0.1", registry.port))  # transfer port still accepts
            assert not monitor.exited("127.0.0.1:15000", ("127.0.0.1", registry.port))  # still registered
            monitor.watch({session: ("127.0.0.1", registry.port)})
            assert _wait_messages(mailbox) == [PeersDead(frozenset({session}))]
            deadline = time.monotonic() + 0.5  # ten heartbeats: never "gone"
            while time.monotonic() < deadline:
                assert mailbox.recv_all() == []
                time.sleep(0.05)
        paused.close()  # the process exits: its ports refuse, and so does its registry
        assert monitor.exited(session, ("127.0.0.1", registry.port))
    finally:
        monitor.close()
        mailbox.close()
        paused.close()


class _NeverAnswers:
    def probe(self, session: str, timeout_s: float) -> bool:
        return False


def test_an_unreachable_prefill_is_remembered_for_a_back_off():
    mailbox = Mailbox()
    directory = PeerDirectory(COMPAT, DECODE, 5.0, mailbox.post)
    key = ("127.0.0.1", _free_port())
    try:
        t0 = time.monotonic()
        directory.fetch(key)
        (msg,) = _wait_messages(mailbox)
        assert "nothing listens there" in msg.peer.error
        assert time.monotonic() - t0 < 5.0  # refused connections are not retried for the whole fetch timeout
        directory.apply(msg, now=100.0)
        assert directory.get(*key).retry_at == 100.0 + UNREACHABLE_BACKOFF_S
    finally:
        directory.close()
        mailbox.close()


class _Switch:
    """A transfer engine whose probes answer as ``answering`` says (a peer paused and resumed)."""

    def __init__(self):
        self.answering = False

    def probe(self, session: str, timeout_s: float) -> bool:
        return self.answering


def test_a_paused_peer_that_answers_again_gets_a_new_verdict_when_it_really_dies():
    """Found by benchmark/reliability.py: after a pause (a verdict, then answers again) and a later
    real death, decode must hear of the death; a session left in the dead set never was."""
    mailbox, switch = Mailbox(), _Switch()
    paused = socket.socket()
    paused.bind(("127.0.0.1", 0))
    paused.listen(16)
    session = f"127.0.0.1:{paused.getsockname()[1]}"
    monitor = PeerMonitor(switch, 0.05, mailbox.post)
    try:
        with BootstrapServer("127.0.0.1", 0) as registry:
            _registry(registry, LAYOUT)
            monitor.watch({session: ("127.0.0.1", registry.port)})
            assert _wait_messages(mailbox) == [PeersDead(frozenset({session}))]  # the pause
            switch.answering = True  # SIGCONT
            deadline = time.monotonic() + 10
            while session in monitor._dead:
                assert time.monotonic() < deadline, "a session answering again stays dead"
                time.sleep(0.05)
            switch.answering = False  # now it dies for real
            assert _wait_messages(mailbox) == [PeersDead(frozenset({session}))]
    finally:
        monitor.close()
        mailbox.close()
        paused.close()
