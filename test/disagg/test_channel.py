"""channel.py: a control port is input from anyone (refused frames counted, logged once a minute
per peer, never raised), sends never raise, and peer sockets stay bounded."""

from __future__ import annotations

import logging
import time

import pytest

from pdserve.disagg import channel as channel_mod
from pdserve.disagg.auth import PeerAuth
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
        tx._socket(rx.endpoint, time.monotonic()).send(b" " * (channel_mod.protocol.MAX_FRAME_BYTES + 64))
        fresh.send(rx.endpoint, DropRoom(4))
        assert _recv(rx, 1) == [DropRoom(4)]  # the port still serves other peers
        assert rx.gate.refused["malformed"] == 0  # ZMQ dropped the oversized frame before buffering it
    finally:
        for c in (rx, tx, fresh):
            c.close()
