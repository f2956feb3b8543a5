"""The control channel of the KV messenger: protocol messages between scheduler processes over ZMQ.

Each server reads one PULL socket (its ``endpoint``: where peers send KV requests, completions,
aborts; with several scheduler ranks, rank 0's alone) and opens a PUSH socket to a peer on first
use. Sends never block the scheduler loop: a peer that is gone or not reading loses what exceeds
the high-water mark, and the protocol's timeouts and aborts cover that loss.

``Mailbox``: how the messenger's helper threads (bootstrap fetches, the heartbeat) hand their
verdicts to the scheduler loop, as messages it reads like the channel's.
"""

from __future__ import annotations

import itertools
import logging
import pickle
import socket
import threading

import zmq

from pdserve.disagg import protocol
from pdserve.disagg.protocol import Message, ProtocolError

logger = logging.getLogger(__name__)

SEND_HWM = 10_000  # messages queued to one peer before sends to it are dropped


def advertised_host(host: str) -> str:
    """The address peers should use to reach ``host`` (a wildcard bind is not reachable)."""
    if host in ("0.0.0.0", "::", ""):
        return socket.gethostbyname(socket.gethostname())
    return host


class ControlChannel:
    """One process's end of the control plane; used from the scheduler thread only.

    ``listen=False``: a channel that only sends (a scheduler rank other than 0, whose peers
    write to rank 0's endpoint); it has no ``socket`` and its ``endpoint`` is None."""

    def __init__(self, host: str = "127.0.0.1", listen: bool = True):
        self._ctx = zmq.Context()
        self.socket: zmq.Socket | None = None
        self.endpoint: str | None = None
        if listen:
            self.socket = self._ctx.socket(zmq.PULL)
            self.socket.setsockopt(zmq.LINGER, 0)
            port = self.socket.bind_to_random_port(f"tcp://{host if host not in ('', '::') else '0.0.0.0'}")
            self.endpoint = f"tcp://{advertised_host(host)}:{port}"
        self._peers: dict[str, zmq.Socket] = {}

    def send(self, endpoint: str, msg: Message) -> bool:
        """Queue ``msg`` for ``endpoint``; False when it had to be dropped."""
        sock = self._peers.get(endpoint)
        if sock is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, SEND_HWM)
            sock.setsockopt(zmq.IMMEDIATE, 0)  # queue before the connection is up
            sock.connect(endpoint)
            self._peers[endpoint] = sock
        try:
            sock.send(protocol.encode(msg), zmq.NOBLOCK)
            return True
        except zmq.Again:
            logger.warning("control channel: %s is not reading; dropped %s", endpoint, type(msg).__name__)
            return False

    def recv_all(self) -> list[Message]:
        """Every message waiting now; a malformed one is logged and skipped."""
        out: list[Message] = []
        while self.socket is not None:
            try:
                msg = decode_frame(self.socket.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
            if msg is not None:
                out.append(msg)
        return out

    def forget(self, endpoint: str) -> None:
        """Drop the connection to a peer that is gone (queued messages to it are discarded)."""
        sock = self._peers.pop(endpoint, None)
        if sock is not None:
            sock.close(linger=0)

    def close(self) -> None:
        for sock in self._peers.values():
            sock.close(linger=0)
        self._peers.clear()
        if self.socket is not None:
            self.socket.close(linger=0)
        self._ctx.term()


def decode_frame(data: bytes) -> Message | None:
    """A frame read from a channel's socket by someone else (the rank loop), or None when it is
    malformed (logged, as ``recv_all`` does)."""
    try:
        return protocol.decode(data)
    except ProtocolError as e:
        logger.error("control channel: refused a message: %s", e)
        return None


class Mailbox:
    """Messages from helper threads to the scheduler thread: ``post`` from any thread, ``recv_all``
    (or the rank loop, reading ``socket``: frames are pickled objects) on the scheduler thread."""

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
        self._lock = threading.Lock()  # a ZMQ socket is used by one thread at a time
        self._closed = False

    def post(self, msg) -> None:
        with self._lock:
            if not self._closed:
                self._push.send(pickle.dumps(msg))

    def recv_all(self) -> list:
        out = []
        while True:
            try:
                out.append(pickle.loads(self.socket.recv(zmq.NOBLOCK)))
            except zmq.Again:
                return out

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._push.close(linger=0)
        self.socket.close(linger=0)
        self._ctx.term()
