"""The single-process mode I/O and its parts: control channels (one that only sends), the mailbox
helper threads post to, and what the rank loop decodes from a channel's frames. (The lock-step
I/O runs in the multi-rank P/D server tests, test/disagg/test_pd_ranks.py.)"""

from __future__ import annotations

import threading
import time

from pdserve.disagg import protocol
from pdserve.disagg.auth import PeerAuth
from pdserve.disagg.channel import ControlChannel, FrameGate, Mailbox
from pdserve.disagg.mode_io import DirectIO
from pdserve.disagg.protocol import DropRoom, KVAbortAck
from pdserve.disagg.receiver import PeersDead


def _recv(io: DirectIO, n: int, timeout_s: float = 10.0) -> list:
    got, deadline = [], time.monotonic() + timeout_s
    while len(got) < n:
        assert time.monotonic() < deadline, f"got {got}"
        got += io.recv_all()
        time.sleep(0.001)
    return got


def test_direct_io_reads_its_channel_and_mailbox_and_agrees_alone():
    io = DirectIO(ControlChannel(), Mailbox())
    sender = ControlChannel(listen=False)  # a rank other than 0: it only sends
    try:
        assert sender.socket is None and sender.endpoint is None and sender.recv_all() == []
        assert io.endpoint == io.channel.endpoint and io.is_fetcher
        posters = [threading.Thread(target=io.post, args=(PeersDead(frozenset({f"s{i}"})),)) for i in range(8)]
        for t in posters:
            t.start()
        sender.send(io.endpoint, DropRoom(7))
        io.send_once(io.endpoint, KVAbortAck(7, 3, 1))
        for t in posters:
            t.join()
        got = _recv(io, 10)
        assert sorted(m.room for m in got if not isinstance(m, PeersDead)) == [7, 7]
        assert {s for m in got if isinstance(m, PeersDead) for s in m.sessions} == {f"s{i}" for i in range(8)}
        assert io.agree({"mine": 1}) == [{"mine": 1}]
        t0 = time.monotonic()
        assert t0 <= io.now() <= time.monotonic()
        assert set(io.sockets()) == {io.channel.socket, io.mailbox.socket}
    finally:
        sender.close()
        io.close()


def test_a_malformed_frame_is_dropped_not_shared():
    gate = FrameGate(PeerAuth(allow_unauthenticated=True))
    assert gate.accept(protocol.encode(DropRoom(3))) == DropRoom(3)
    assert gate.accept(b"not json") is None
    assert gate.accept(b'{"v": 99, "type": "DropRoom", "body": {"room": 1}}') is None
    assert gate.refused == {"malformed": 2}


def test_a_closed_mailbox_drops_late_posts():
    box = Mailbox()
    box.post("early")
    assert box.recv_all() == ["early"]
    box.close()
    box.post("late")  # a helper thread finishing after shutdown: no error, nothing delivered
