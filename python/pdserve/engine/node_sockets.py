"""How the frontend and the scheduler ranks open their sockets: ``ipc://`` on one node; with
``--nnodes`` > 1, TCP on node 0's own address, and under the cluster token ZMQ CURVE.

Where node 0 binds (``node_bind_host``): the host of ``--dist-init-addr`` when it is an address
of this node (the other nodes already reach node 0 there), else ``--host``; a wildcard only when
``--host`` says so. Never ``*`` by default: the ports carry prompts.

Why CURVE and not a MAC per frame: the frontend's PUSH deals requests round-robin to whoever
is connected, so a stranger who connects as PULL would take a share of the prompts, and one who
connects as PUSH could inject outputs. With CURVE a peer that cannot prove it holds the token
never completes the handshake: it neither receives nor sends a frame, and the frames are
encrypted on the wire. Both keypairs derive from the token (``CurveKeys.from_token``), so every
node computes them alone; the binding side (the frontend) is the CURVE server, and its ZAP
handler admits the derived client key only. Without a token a multi-node server still binds the
node's address but warns once: anyone who reaches the two ports can read prompts.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import socket
from dataclasses import dataclass, field
from typing import Any, TypeVar

import zmq
import zmq.auth.thread
from zmq.utils import z85

from pdserve.config import ServerArgs, split_host_port
from pdserve.engine.codec import MAX_FRAME_BYTES

logger = logging.getLogger(__name__)

_Socket = TypeVar("_Socket", bound=zmq.Socket)
WILDCARDS = ("0.0.0.0", "::", "*", "")
SERVER_KEY_LABEL = b"pdserve frontend<->rank sockets, CURVE server key, v1"
CLIENT_KEY_LABEL = b"pdserve frontend<->rank sockets, CURVE client key, v1"


@dataclass(frozen=True)
class CurveKeys:
    """Z85 CURVE keypairs derived from the cluster token: the server's (the frontend, which
    binds) and the one client key its ZAP handler admits (every scheduler rank)."""

    server_public: bytes
    server_secret: bytes = field(repr=False)
    client_public: bytes
    client_secret: bytes = field(repr=False)

    @classmethod
    def from_token(cls, token: str) -> CurveKeys:
        server_public, server_secret = _keypair(token, SERVER_KEY_LABEL)
        client_public, client_secret = _keypair(token, CLIENT_KEY_LABEL)
        return cls(server_public, server_secret, client_public, client_secret)


def _keypair(token: str, label: bytes) -> tuple[bytes, bytes]:
    """HMAC-SHA256(token, label) as the 32-byte secret key: the token never leaves the node."""
    secret = z85.encode(hmac.new(token.encode(), label, hashlib.sha256).digest())
    return zmq.curve_public(secret), secret


def node_keys(args: ServerArgs) -> CurveKeys | None:
    """The CURVE keys of a multi-node server under the cluster token; None otherwise."""
    if args.nnodes == 1:
        return None
    token = args.disagg_config().auth_token
    return CurveKeys.from_token(token) if token else None


# ------------------------------------------------------------------ where to bind
def local_address(host: str) -> str | None:
    """An IP address of this node that ``host`` names (resolved), or None (not ours, or a wildcard)."""
    if host in WILDCARDS:
        return None
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return None
    # IPv4 first: the other nodes' ZMQ resolves the same name to IPv4 (ZMQ_IPV6 is off)
    for family, _, _, _, sockaddr in sorted(infos, key=lambda info: info[0] != socket.AF_INET):
        ip = str(sockaddr[0])
        if _is_wildcard(ip):
            continue
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((ip, 0))  # only an address of this node can be bound
            except OSError:
                continue
        return ip
    return None


def _is_wildcard(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip.split("%")[0]).is_unspecified
    except ValueError:
        return False


def node_bind_host(dist_init_addr: str, host: str) -> str:
    """Where node 0's frontend binds its scheduler sockets (module docstring); ValueError when
    neither flag names an address the other nodes could reach here."""
    init_host, port = split_host_port(dist_init_addr, "dist_init_addr")
    ip = local_address(init_host)
    if ip is not None:
        return ip
    if host in WILDCARDS:
        return "0.0.0.0" if host in ("*", "") else host
    ip = local_address(host)
    if ip is None or ipaddress.ip_address(ip.split("%")[0]).is_loopback:
        raise ValueError(f"dist_init_addr: {init_host} is not an address of this node, and host {host!r} is "
                         f"{'loopback' if ip else 'not one either'}: node 0's frontend binds ports {port + 1} and "
                         f"{port + 2} for the other nodes' ranks; give --host the address they reach this node at "
                         "(0.0.0.0 binds every interface)")
    return ip


def tcp_endpoint(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


# ------------------------------------------------------------------ sockets
class FrontendSockets:
    """The frontend's side: binds ``kind`` sockets, as CURVE server under ``keys`` (a ZAP handler
    per ZMQ context admits the ranks' key only). A TCP socket takes frames of ``max_bytes`` at most:
    ZMQ drops the connection of a peer sending more before buffering it. ``close()`` stops the handlers."""

    def __init__(self, keys: CurveKeys | None, bind_host: str | None = None, max_bytes: int = MAX_FRAME_BYTES):
        self.keys = keys
        self.bind_host = bind_host  # multi-node: the node's address (node_bind_host)
        self.max_bytes = max_bytes
        self._auths: list[zmq.auth.thread.ThreadAuthenticator] = []

    def bind(self, ctx: zmq.Context[_Socket], kind: int, endpoint: str) -> _Socket:
        sock = ctx.socket(kind)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        if endpoint.startswith("tcp://"):
            self._secure(ctx, sock)
        sock.bind(self.bind_address(endpoint))
        return sock

    def bind_address(self, endpoint: str) -> str:
        """A TCP endpoint moves to the node's own address; ipc stays as it is."""
        if not endpoint.startswith("tcp://"):
            return endpoint
        if self.bind_host is None:
            raise ValueError(f"{endpoint}: a TCP scheduler socket needs the node's address to bind")
        return tcp_endpoint(self.bind_host, int(endpoint.rpartition(":")[2]))

    def _secure(self, ctx: zmq.Context[Any], sock: zmq.Socket) -> None:
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_bytes)
        if self.bind_host is not None and ":" in self.bind_host:
            sock.setsockopt(zmq.IPV6, 1)
        if self.keys is None:
            return
        self._authenticate(ctx, self.keys)
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.keys.server_secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.keys.server_public)

    def _authenticate(self, ctx: zmq.Context[Any], keys: CurveKeys) -> None:
        """ZAP runs per ZMQ context: one handler thread for each context a socket binds in (the
        frontend has a plain one and an asyncio one), admitting the ranks' client key only."""
        if any(a.context.underlying == ctx.underlying for a in self._auths):
            return
        auth = zmq.auth.thread.ThreadAuthenticator(zmq.Context.shadow(ctx.underlying), log=logger)
        auth.start()
        auth.configure_curve_callback("*", _OneKey(keys.client_public))
        self._auths.append(auth)

    def close(self) -> None:
        for auth in self._auths:
            auth.stop()
        self._auths.clear()


class _OneKey:
    """ZAP credentials provider (pyzmq's interface): admits one Z85 client public key."""

    def __init__(self, allowed: bytes):
        self.allowed = allowed

    def callback(self, domain: str, key: bytes) -> bool:
        return hmac.compare_digest(key, self.allowed)


def connect_socket(ctx: zmq.Context, kind: int, endpoint: str, keys: CurveKeys | None = None) -> zmq.Socket:
    """A scheduler rank's side: connects, as CURVE client of the frontend under ``keys`` (TCP only)."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    if endpoint.startswith("tcp://"):
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        sock.setsockopt(zmq.IPV6, int(endpoint.startswith("tcp://[")))
        if keys is not None:
            sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)
    sock.connect(endpoint)
    return sock


def frontend_sockets(args: ServerArgs) -> FrontendSockets:
    """The frontend's socket maker for ``args``: ipc on one node; on several, the node's address
    (and CURVE under the token, else one warning naming the ports)."""
    if args.nnodes == 1:
        return FrontendSockets(None)
    assert args.dist_init_addr is not None  # ParallelConfig requires it with nnodes > 1
    host = node_bind_host(args.dist_init_addr, args.host)
    keys = node_keys(args)
    if keys is None:
        port = split_host_port(args.dist_init_addr, "dist_init_addr")[1]
        logger.warning("--nnodes %d without a cluster token: anyone who can reach %s ports %d and %d can read "
                       "prompts and inject outputs; set --disaggregation-auth-token (or its file or environment "
                       "variable) on every node to authenticate and encrypt them", args.nnodes, host, port + 1,
                       port + 2)
    return FrontendSockets(keys, host)
