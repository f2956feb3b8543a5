"""The control channel of the KV messenger: protocol messages between scheduler processes over ZMQ.

Each side binds one PULL socket (its ``endpoint``: where peers send KV requests, completions,
aborts) and opens a PUSH socket to a peer on first use. Sends never block the scheduler loop:
a peer that is gone or not reading loses what exceeds the high-water mark, and the protocol's
timeouts and aborts cover that loss.
"""

from __future__ import annotations

import logging
import socket

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
    """One process's end of the control plane; used from the scheduler thread only."""

    def __init__(self, host: str = "127.0.0.1"):
        self._ctx = zmq.Context()
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
        while True:
            try:
                data = self.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            try:
                out.append(protocol.decode(data))
            except ProtocolError as e:
                logger.error("control channel: refused a message: %s", e)

    def forget(self, endpoint: str) -> None:
        """Drop the connection to a peer that is gone (queued messages to it are discarded)."""
        sock = self._peers.pop(endpoint, None)
        if sock is not None:
            sock.close(linger=0)

    def close(self) -> None:
        for sock in self._peers.values():
            sock.close(linger=0)
        self._peers.clear()
        self.socket.close(linger=0)
        self._ctx.term()
