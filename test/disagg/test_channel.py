"""channel.py: a control port is input from anyone (refused frames counted, logged once a minute
per peer, never raised), sends never raise, and peer sockets stay bounded."""

from __future__ import annotations

import hmac
import logging
import time
import types

import pytest

from pdserve.disagg import auth as auth_mod
from pdserve.disagg import channel as channel_mod
from pdserve.disagg import protocol
from pdserve.disagg.auth import FrameBinding, PeerAuth, SequenceGuard
from pdserve.disagg.channel import ControlChannel, FrameGate
from pdserve.disagg.protocol import DropRoom


def _recv(ch: ControlChannel, n: int, timeout_s: float = 10.0) -> list:
    got, deadline = [], time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < deadline:
        ch.socket.poll(50)
        got += ch.recv_all()
    return got


def test_sealed_frames_pass_and_refusals_are_counted_by_reason():
    rx, tx, stranger = (ControlChannel(auth=PeerAuth("k")), ControlChannel(listen=False, auth=PeerAuth("k")),
                        ControlChannel(listen=False))
    try:
        stranger.send(rx.endpoint, DropRoom(1))  # no MAC
        tx.send(rx.endpoint, DropRoom(2))
        assert _recv(rx, 1) == [DropRoom(2)]
        deadline = time.monotonic() + 10
        while rx.gate.refused["auth"] < 1 and time.monotonic() < deadline:
            rx.socket.poll(50)
            rx.recv_all()
        assert rx.gate.refused == {"auth": 1}
    finally:
        for c in (rx, tx, stranger):
            c.close()


def test_a_refusing_peer_is_logged_once_a_minute(caplog):
    clock = [0.0]
    gate = FrameGate(PeerAuth(allow_unauthenticated=True), clock=lambda: clock[0])
    with caplog.at_level(logging.ERROR, logger="pdserve.disagg.channel"):
        for _ in range(50):
            assert gate.accept(b"garbage") is None
        clock[0] = 61.0
        gate.accept(b"garbage")
    assert gate.refused == {"malformed": 51}
    assert len([r for r in caplog.records if "refused a message" in r.message]) == 2


@pytest.mark.parametrize("endpoint", ["tcp://[", "tcp://*:1", "nonsense", "tcp://127.0.0.1:0", "ipc:///tmp/x"])
def test_sending_to_a_bad_endpoint_drops_the_message_and_keeps_going(endpoint):
    ch = ControlChannel(listen=False)
    try:
        assert ch.send(endpoint, DropRoom(1)) is False
        assert ch.num_peer_sockets == 0 and ch.send_failures == 1
    finally:
        ch.close()


def test_peer_sockets_are_bounded_and_idle_ones_closed(monkeypatch):
    monkeypatch.setattr(channel_mod, "MAX_PEERS", 4)
    ch = ControlChannel(listen=False)
    try:
        for port in range(20000, 20010):
            assert ch.send(f"tcp://127.0.0.1:{port}", DropRoom(1))  # queued: nobody listens there yet
        assert ch.num_peer_sockets == 4  # the least recently used ones were closed
        monkeypatch.setattr(channel_mod, "IDLE_PEER_S", 0.0)
        ch.send("tcp://127.0.0.1:20011", DropRoom(1))
        assert ch.num_peer_sockets == 1  # every idle one closed before the new send
    finally:
        ch.close()


def test_a_frame_larger_than_the_bound_never_reaches_the_decoder():
    rx, tx, fresh = ControlChannel(), ControlChannel(listen=False), ControlChannel(listen=False)
    try:
        tx._socket(rx.endpoint, time.monotonic()).send(b" " * (channel_mod.MAX_FRAME_BYTES + 64))
        fresh.send(rx.endpoint, DropRoom(4))
        assert _recv(rx, 1) == [DropRoom(4)]  # the port still serves other peers
        assert rx.gate.refused["malformed"] == 0  # ZMQ dropped the oversized frame before buffering it
    finally:
        for c in (rx, tx, fresh):
            c.close()


# --- issue 25: frames bound to sender, destination, sequence and time; budgets before any MAC work ------------

HERE = "tcp://127.0.0.1:7001"
AUTH = PeerAuth("k")


def _frame(seq: int, to: str = HERE, sender: str = "tcp://127.0.0.1:7002#a", age_s: float = 0.0) -> bytes:
    return AUTH.seal(protocol.encode(DropRoom(1)), FrameBinding(sender, to, seq, int((time.time() - age_s) * 1000)))


def test_a_frame_for_another_endpoint_is_refused_and_counted():
    gate = FrameGate(AUTH, endpoint=HERE)
    assert gate.accept(_frame(1, to="tcp://127.0.0.1:9999")) is None
    assert gate.refused == {"wrong_destination": 1}
    assert gate.accept(_frame(2)) == DropRoom(1)


def test_a_replayed_or_stale_frame_is_refused_and_counted():
    gate = FrameGate(AUTH, endpoint=HERE)
    first = _frame(5)
    assert gate.accept(first) == DropRoom(1)
    assert gate.accept(first) is None  # the same frame again
    assert gate.accept(_frame(3)) is None  # an earlier one of the same sender, never read: still behind
    assert gate.accept(_frame(1, age_s=3600, sender="tcp://127.0.0.1:7003#b")) is None
    assert gate.refused == {"replay": 2, "stale": 1}
    assert gate.accept(_frame(6)) == DropRoom(1)
    assert gate.accept(_frame(1, sender="tcp://127.0.0.1:7003#c")) == DropRoom(1)  # another sender's own count


def test_channels_bind_their_frames_and_a_captured_frame_replays_nowhere():
    """A frame read off the wire is refused by its receiver when replayed, and by any other
    endpoint it is pushed at."""
    rx, other, tx = (ControlChannel(auth=AUTH), ControlChannel(auth=AUTH), ControlChannel(listen=False, auth=AUTH))
    captured: list[bytes] = []
    try:
        seal = tx.auth.seal
        tx.auth = types.SimpleNamespace(seal=lambda payload, b: captured.append(seal(payload, b)) or captured[-1])
        tx.send(rx.endpoint, DropRoom(7))
        assert _recv(rx, 1) == [DropRoom(7)]
        for target in (rx, other):
            assert target.gate.accept(captured[0]) is None
        assert (rx.gate.refused, other.gate.refused) == ({"replay": 1}, {"wrong_destination": 1})
    finally:
        for c in (rx, other, tx):
            c.close()


def test_over_budget_and_oversized_frames_are_refused_before_any_mac_work(monkeypatch):
    """Issue 25: junk frames with bad MACs stalled decode, each one HMAC'd. A peer past its budget
    (here 3 frames) or a frame over the bound costs no MAC computation at all."""
    macs = []

    def counting_new(*args, **kw):
        macs.append(1)
        return hmac.new(*args, **kw)

    monkeypatch.setattr(auth_mod, "hmac", types.SimpleNamespace(new=counting_new, compare_digest=hmac.compare_digest))
    clock = [0.0]
    gate = FrameGate(AUTH, clock=lambda: clock[0], endpoint=HERE, budget=(1e9, 0.0, 3, 0.0))
    junk = auth_mod.FRAME_MAGIC + b"\0" * 4096
    for _ in range(10):
        assert gate.accept(junk) is None
    assert len(macs) == 3 and gate.refused == {"auth": 3, "over_budget": 7}
    assert gate.accept(b" " * (channel_mod.MAX_FRAME_BYTES + 1)) is None
    assert len(macs) == 3 and gate.refused["oversize"] == 1
    assert gate.refused_by_peer == {"?": 8}


def test_a_peers_byte_budget_refills_with_time():
    clock = [0.0]
    gate = FrameGate(AUTH, clock=lambda: clock[0], endpoint=HERE, budget=(300.0, 150.0, 1e9, 1e9))
    frames = [_frame(i + 1) for i in range(3)]
    assert 100 < len(frames[0]) <= 150
    assert [gate.accept(f) is not None for f in frames] == [True, True, False]
    clock[0] = 1.0  # a second later the peer has 150 bytes more
    assert gate.accept(_frame(9)) == DropRoom(1)
    assert gate.refused == {"over_budget": 1}


def test_the_sequence_guard_is_bounded_and_refuses_what_it_may_have_forgotten():
    guard = SequenceGuard(capacity=2)
    assert guard.add(FrameBinding("a", HERE, 1, 1000)) and guard.add(FrameBinding("b", HERE, 1, 2000))
    assert guard.add(FrameBinding("c", HERE, 1, 3000))  # "a" forgotten: frames up to its time are refused
    assert not guard.add(FrameBinding("a", HERE, 2, 1000))
    assert guard.add(FrameBinding("a", HERE, 3, 4000))
