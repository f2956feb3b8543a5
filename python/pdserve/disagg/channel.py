"""The control channel of the KV messenger: protocol messages between scheduler processes over ZMQ.

Each server reads one PULL socket (its ``endpoint``: where peers send KV requests, completions,
aborts; with several scheduler ranks, rank 0's alone) and opens a PUSH socket to a peer on first
use. Sends never block the scheduler loop: a peer that is gone or not reading loses what exceeds
the high-water mark, and the protocol's timeouts and aborts cover that loss.

Every frame read is input from whoever can reach the port (docs/disaggregation.md, "The trust boundary"): it is
bounded (``zmq.MAXMSGSIZE``) and held to a per-peer budget (``PeerBudget``: bytes and frames per second) before
any MAC work, so junk cannot make the scheduler hash gigabytes; then authenticated (``disagg/auth.py``: an HMAC
with the shared token, else loopback peers only) and, under a token, bound: a frame meant for another endpoint,
an old one, or a replay of one already read is refused; then decoded (``protocol.decode``'s limits). Whatever
fails is counted by reason (``refused``) and logged once per peer per minute, and nothing a frame holds can raise
past the channel. Peer sockets are bounded: one idle for ``IDLE_PEER_S`` is closed, and
past ``MAX_PEERS`` the least recently used goes.

``Mailbox``: how the messenger's helper threads (bootstrap fetches, the heartbeat) hand their
verdicts to the scheduler loop, as messages it reads like the channel's.
"""

from __future__ import annotations

import itertools
import logging
import queue
import secrets
import socket
import threading
import time
from collections import Counter, OrderedDict

import zmq

from pdserve.disagg import protocol
from pdserve.disagg.auth import FRAME_OVERHEAD, MAX_CLOCK_SKEW_S, AuthError, FrameBinding, PeerAuth, SequenceGuard
from pdserve.disagg.protocol import Message, ProtocolError

logger = logging.getLogger(__name__)

SEND_HWM = 10_000  # messages queued to one peer before sends to it are dropped
MAX_PEERS = 256  # open PUSH sockets; the least recently used one is closed past this
IDLE_PEER_S = 600.0  # a peer socket unused this long is closed (reopened on the next send)
LOG_EVERY_S = 60.0  # a refused peer is logged at most once a minute
MAX_FRAME_BYTES = protocol.MAX_FRAME_BYTES + FRAME_OVERHEAD  # a sealed frame of the largest message
# What one peer address may make the gate authenticate: a burst of two of the largest frames, then 16 MiB a
# second (a decode's KV requests are kilobytes each; one for a million-token prompt is about 8 MiB).
PEER_BURST_BYTES = 2 * MAX_FRAME_BYTES
PEER_BYTES_PER_S = 16 * 2**20
PEER_BURST_FRAMES = 20_000
PEER_FRAMES_PER_S = 10_000
REASONS = ("auth", "malformed", "oversize", "over_budget", "wrong_destination", "stale", "replay")


def advertised_host(host: str) -> str:
    """The address peers should use to reach ``host`` (a wildcard bind is not reachable)."""
    if host in ("0.0.0.0", "::", ""):
        return socket.gethostbyname(socket.gethostname())
    return host


class PeerBudget:
    """A token bucket in bytes and in frames: what one peer may spend of the gate's MAC work."""

    def __init__(self, now: float, burst_bytes: float, bytes_per_s: float, burst_frames: float, frames_per_s: float):
        self.rates = (bytes_per_s, frames_per_s)
        self.caps = (burst_bytes, burst_frames)
        self.left = [burst_bytes, burst_frames]
        self.at = now

    def take(self, nbytes: int, now: float) -> bool:
        """Spend a frame of ``nbytes``; False (nothing spent) when the peer is over its budget."""
        dt, self.at = max(0.0, now - self.at), now
        self.left = [min(cap, left + dt * rate) for cap, left, rate in zip(self.caps, self.left, self.rates)]
        if self.left[0] < nbytes or self.left[1] < 1:
            return False
        self.left[0] -= nbytes
        self.left[1] -= 1
        return True


class FrameGate:
    """Turns received frames into messages: size and per-peer budget (before any MAC work),
    authentication, the frame's binding (under a token: meant for ``endpoint``, fresh, not seen
    before from its sender), bounds, decoding. Counts what it refuses by reason and rate-limits
    the log per peer. Any thread may hold one, one at a time.

    ``endpoint``: where this gate's socket is reached (what senders bind their frames to)."""

    def __init__(self, auth: PeerAuth | None = None, clock=time.monotonic, endpoint: str | None = None,
                 wall=time.time, budget: tuple[float, float, float, float] | None = None):
        self.auth = auth or PeerAuth()
        self.clock, self.wall = clock, wall
        self.endpoint = endpoint
        self.budget = budget or (PEER_BURST_BYTES, PEER_BYTES_PER_S, PEER_BURST_FRAMES, PEER_FRAMES_PER_S)
        self.refused: Counter[str] = Counter()  # REASONS -> frames
        self.refused_by_peer: Counter[str] = Counter()  # oversize or over budget, by peer address (bounded)
        self._logged: dict[tuple[str, str], float] = {}  # (peer, reason) -> last logged
        self._budgets: OrderedDict[str, PeerBudget] = OrderedDict()  # peer address -> its budget, least recent first
        self._seen = SequenceGuard()

    def accept(self, frame) -> Message | None:
        """A ``zmq.Frame`` (or bytes) -> its message, or None when refused."""
        peer = _peer_address(frame)
        size = len(frame.buffer) if isinstance(frame, zmq.Frame) else len(frame)
        if size > MAX_FRAME_BYTES or not self._spend(peer, size):
            self._refuse_unread(peer, "oversize" if size > MAX_FRAME_BYTES else "over_budget", size)
            return None
        data = frame.bytes if isinstance(frame, zmq.Frame) else bytes(frame)
        try:
            binding, payload = self.auth.open(data, peer)
            if binding is not None and not self._bound_here(binding, peer):
                return None
            return protocol.decode(payload)
        except AuthError as e:
            self._refuse("auth", peer, str(e))
        except ProtocolError as e:
            self._refuse("malformed", peer, str(e))
        except Exception as e:  # noqa: BLE001 - a frame must never take the scheduler down
            self._refuse("malformed", peer, f"{type(e).__name__}: {e}")
        return None

    def _spend(self, peer: str | None, size: int) -> bool:
        key, now = peer or "?", self.clock()
        budget = self._budgets.pop(key, None) or PeerBudget(now, *self.budget)
        self._budgets[key] = budget
        while len(self._budgets) > MAX_PEERS:  # bounded: the least recently heard peer starts afresh
            self._budgets.popitem(last=False)
        return budget.take(size, now)

    def _bound_here(self, b: FrameBinding, peer: str | None) -> bool:
        """Under a token: the frame was sent to this endpoint, lately, and not read before."""
        if b.destination != self.endpoint:
            self._refuse("wrong_destination", peer, f"frame from {b.sender[:100]} meant for {b.destination[:100]}, "
                                                    f"not this endpoint ({self.endpoint})")
        elif abs(self.wall() - b.t_ms / 1000) > MAX_CLOCK_SKEW_S:
            self._refuse("stale", peer, f"frame from {b.sender[:100]} sent {self.wall() - b.t_ms / 1000:.0f} s ago "
                                        f"(at most {MAX_CLOCK_SKEW_S:.0f} s of age or clock skew)")
        elif not self._seen.add(b):
            self._refuse("replay", peer, f"frame {b.seq} from {b.sender[:100]} was read before (a replay)")
        else:
            return True
        return False

    def _refuse_unread(self, peer: str | None, reason: str, size: int) -> None:
        key = peer or "?"
        if key in self.refused_by_peer or len(self.refused_by_peer) < MAX_PEERS:
            self.refused_by_peer[key] += 1
        self._refuse(reason, peer, f"{size} bytes (frames of at most {MAX_FRAME_BYTES} bytes; per peer "
                                   f"{PEER_BYTES_PER_S >> 20} MiB and {PEER_FRAMES_PER_S} frames a second)")

    def _refuse(self, reason: str, peer: str | None, why: str) -> None:
        self.refused[reason] += 1
        key, now = (peer or "?", reason), self.clock()
        if now - self._logged.get(key, -LOG_EVERY_S) >= LOG_EVERY_S:
            self._logged[key] = now
            if len(self._logged) > MAX_PEERS:  # bounded even under a flood from many addresses
                self._logged.pop(next(iter(self._logged)))
            logger.error("control channel: refused a message from %s (%s; %d refused so far, logged once a "
                         "minute per peer): %s", peer or "an unknown peer", reason, sum(self.refused.values()),
                         why[:300])


def _peer_address(frame) -> str | None:
    try:
        address = frame.get("Peer-Address") if isinstance(frame, zmq.Frame) else None
        return address if isinstance(address, str) else None  # typed int | str: Peer-Address is a str
    except zmq.ZMQError:
        return None


class ControlChannel:
    """One process's end of the control plane; used from the scheduler thread only.

    ``listen=False``: a channel that only sends (a scheduler rank other than 0, whose peers
    write to rank 0's endpoint); it has no ``socket`` and its ``endpoint`` is None."""

    def __init__(self, host: str = "127.0.0.1", listen: bool = True, auth: PeerAuth | None = None):
        self._ctx = zmq.Context()
        self.auth = auth or PeerAuth()
        self.socket: zmq.Socket | None = None
        self.endpoint: str | None = None
        if listen:
            self.socket = self._ctx.socket(zmq.PULL)
            self.socket.setsockopt(zmq.LINGER, 0)
            # ZMQ drops a larger frame (and the connection) before it is buffered.
            self.socket.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
            port = self.socket.bind_to_random_port(f"tcp://{host if host not in ('', '::') else '0.0.0.0'}")
            self.endpoint = f"tcp://{advertised_host(host)}:{port}"
        self.gate = FrameGate(self.auth, endpoint=self.endpoint)
        # This channel's frames: a session of its own (a restarted process starts a new one) and a sequence
        # its receivers check for replays.
        self.session = f"{self.endpoint or 'send-only'}#{secrets.token_hex(8)}"
        self._seq = itertools.count(1)
        self._peers: OrderedDict[str, tuple[zmq.Socket, float]] = OrderedDict()  # endpoint -> (socket, last use)
        self.send_failures = 0

    def send(self, endpoint: str, msg: Message) -> bool:
        """Queue ``msg`` for ``endpoint``; False when it had to be dropped (logged)."""
        now = time.monotonic()
        self._close_idle(now)
        try:
            sock = self._socket(endpoint, now)
            binding = FrameBinding(self.session, endpoint, next(self._seq), int(time.time() * 1000))
            sock.send(self.auth.seal(protocol.encode(msg), binding), zmq.NOBLOCK)
            return True
        except zmq.Again:
            logger.warning("control channel: %s is not reading; dropped %s", endpoint, type(msg).__name__)
        except (zmq.ZMQError, ProtocolError) as e:  # a bad endpoint, or no socket left: drop, keep serving
            self.forget(endpoint)
            logger.warning("control channel: cannot send %s to %s: %s", type(msg).__name__, endpoint[:80], e)
        self.send_failures += 1
        return False

    def _socket(self, endpoint: str, now: float) -> zmq.Socket:
        entry = self._peers.pop(endpoint, None)
        if entry is None:
            protocol.check_endpoint(endpoint, "endpoint")
            while len(self._peers) >= MAX_PEERS:
                self._peers.popitem(last=False)[1][0].close(linger=0)
            sock = self._ctx.socket(zmq.PUSH)
            try:
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, SEND_HWM)
                sock.setsockopt(zmq.IMMEDIATE, 0)  # queue before the connection is up
                sock.connect(endpoint)
            except zmq.ZMQError:
                sock.close(linger=0)
                raise
            entry = (sock, now)
        self._peers[endpoint] = (entry[0], now)  # most recently used last
        return entry[0]

    def _close_idle(self, now: float) -> None:
        while self._peers:
            endpoint, (sock, used) = next(iter(self._peers.items()))
            if now - used < IDLE_PEER_S:
                return
            del self._peers[endpoint]
            sock.close(linger=0)

    @property
    def num_peer_sockets(self) -> int:
        return len(self._peers)

    def recv_all(self) -> list[Message]:
        """Every message waiting now; a refused frame is counted and skipped."""
        out: list[Message] = []
        while self.socket is not None:
            try:
                frame = self.socket.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            msg = self.gate.accept(frame)
            if msg is not None:
                out.append(msg)
        return out

    def forget(self, endpoint: str) -> None:
        """Drop the connection to a peer that is gone (queued messages to it are discarded)."""
        entry = self._peers.pop(endpoint, None)
        if entry is not None:
            entry[0].close(linger=0)

    def close(self) -> None:
        for sock, _ in self._peers.values():
            sock.close(linger=0)
        self._peers.clear()
        if self.socket is not None:
            self.socket.close(linger=0)
        self._ctx.term()


class Mailbox:
    """Messages from helper threads to the scheduler thread, within this process: ``post`` (any
    thread) queues the message and sends an empty frame on an inproc socket, so a poller on
    ``socket`` wakes; ``recv_all``, or the rank loop taking one message per frame it reads from
    ``socket`` (``take``), on the scheduler thread. Nothing is serialized: the objects never leave
    the process (a rank loop shares them with its other ranks through its typed codec)."""

    _ids = itertools.count()

    def __init__(self):
        self._ctx = zmq.Context()
        address = f"inproc://pdserve-mailbox-{next(self._ids)}"
        self.socket = self._ctx.socket(zmq.PULL)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(address)
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.connect(address)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # a ZMQ socket is used by one thread at a time
        self._closed = False

    def post(self, msg) -> None:
        with self._lock:
            if not self._closed:
                self._queue.put(msg)  # before its frame: a frame read always finds its message
                self._push.send(b"")

    def take(self, _frame=None):
        """The message behind one frame read from ``socket`` (first posted, first taken)."""
        try:
            return self._queue.get_nowait()
        except queue.Empty:
            return None

    def recv_all(self) -> list:
        out: list = []
        while True:
            try:
                self.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            msg = self.take()
            if msg is not None:
                out.append(msg)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._push.close(linger=0)
        self.socket.close(linger=0)
        self._ctx.term()
