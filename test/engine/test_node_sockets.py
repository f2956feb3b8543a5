"""node_sockets.py: a multi-node frontend binds the node's own address (never ``*`` unless --host
says so), and under the cluster token its sockets admit only a peer holding the token: a
stranger (no CURVE, or its own keys, or another token's) neither receives a request nor
completes a handshake. Real ZMQ sockets on loopback."""

from __future__ import annotations

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from pdserve.config import ServerArgs
from pdserve.engine.node_sockets import (
    CurveKeys,
    FrontendSockets,
    connect_socket,
    frontend_sockets,
    local_address,
    node_bind_host,
    node_keys,
)

TOKEN = "cluster-token"
NOT_OURS = "192.0.2.1"  # TEST-NET-1: never an address of this host
HANDSHAKE_TIMEOUT_MS = 20_000
HANDSHAKE_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED, zmq.EVENT_HANDSHAKE_FAILED_AUTH,
                    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


def test_keys_derive_from_the_token_alone():
    a, b = CurveKeys.from_token(TOKEN), CurveKeys.from_token(TOKEN)
    assert a == b and a.server_public != a.client_public
    assert zmq.curve_public(a.server_secret) == a.server_public
    assert zmq.curve_public(a.client_secret) == a.client_public
    other = CurveKeys.from_token(TOKEN + "x")
    assert {other.server_public, other.client_public}.isdisjoint({a.server_public, a.client_public})
    assert TOKEN not in repr(a) and a.server_secret.decode() not in repr(a)


@pytest.mark.parametrize("dist_init, host, want", [
    ("127.0.0.1:5000", "127.0.0.1", "127.0.0.1"),
    ("127.0.0.1:5000", "0.0.0.0", "127.0.0.1"),  # node 0's rendezvous address wins over a wildcard
    ("localhost:5000", "0.0.0.0", "127.0.0.1"),
    (f"{NOT_OURS}:5000", "0.0.0.0", "0.0.0.0"),  # behind NAT: the operator said every interface
    (f"{NOT_OURS}:5000", "*", "0.0.0.0"),
])
def test_the_frontend_binds_the_nodes_own_address(dist_init, host, want):
    assert node_bind_host(dist_init, host) == want


@pytest.mark.parametrize("host", ["127.0.0.1", NOT_OURS])
def test_no_reachable_address_is_refused_naming_the_flags(host):
    with pytest.raises(ValueError, match=f"dist_init_addr: {NOT_OURS} is not an address of this node.*ports 5001 "
                                         "and 5002.*--host"):
        node_bind_host(f"{NOT_OURS}:5000", host)


def test_local_address():
    assert local_address("127.0.0.1") == "127.0.0.1"
    assert local_address(NOT_OURS) is None
    assert local_address("0.0.0.0") is None and local_address("no-such-host.invalid") is None


def test_tcp_binds_move_to_the_node_address_and_ipc_stays():
    sockets = FrontendSockets(None, "127.0.0.1")
    assert sockets.bind_address("tcp://10.0.0.1:5001") == "tcp://127.0.0.1:5001"
    assert sockets.bind_address("ipc:///tmp/x/to_scheduler") == "ipc:///tmp/x/to_scheduler"
    assert FrontendSockets(None, "::1").bind_address("tcp://h:5002") == "tcp://[::1]:5002"


def _monitored(sock: zmq.Socket):
    return sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                   | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


def _handshake(monitor) -> int:
    """The first handshake outcome a monitored socket reports."""
    assert monitor.poll(HANDSHAKE_TIMEOUT_MS), "no handshake outcome"
    event = recv_monitor_message(monitor)["event"]
    assert event in HANDSHAKE_EVENTS
    return event


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def test_under_the_token_only_a_rank_holding_it_gets_requests(ctx):
    keys = CurveKeys.from_token(TOKEN)
    frontend = FrontendSockets(keys, "127.0.0.1")
    try:
        push = frontend.bind(ctx, zmq.PUSH, "tcp://127.0.0.1:0")
        endpoint = push.getsockopt(zmq.LAST_ENDPOINT).decode()
        other = CurveKeys.from_token("another token")
        strangers = {
            "plain": ctx.socket(zmq.PULL),
            "own keys": _curve_client(ctx, zmq.PULL, keys.server_public, *zmq.curve_keypair()),
            "another token": _curve_client(ctx, zmq.PULL, other.server_public, other.client_public,
                                           other.client_secret),
        }
        monitors = {name: _monitored(s) for name, s in strangers.items()}
        for s in strangers.values():
            s.connect(endpoint)
        for name, monitor in monitors.items():
            assert _handshake(monitor) != zmq.EVENT_HANDSHAKE_SUCCEEDED, name
        rank = connect_socket(ctx, zmq.PULL, endpoint, keys)
        for i in range(20):
            push.send(b"prompt %d" % i)  # round-robin over every attached peer: the rank alone
        assert [rank.recv() for _ in range(20)] == [b"prompt %d" % i for i in range(20)]
        assert not any(s.poll(200) for s in strangers.values())
        for s in (*strangers.values(), *monitors.values(), rank, push):
            s.close(linger=0)
    finally:
        frontend.close()


def _curve_client(ctx, kind: int, server_public: bytes, public: bytes, secret: bytes) -> zmq.Socket:
    """A CURVE client with these keys (not yet connected)."""
    sock = ctx.socket(kind)
    sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = server_public, public, secret
    return sock


def test_under_the_token_a_stranger_cannot_push_outputs(ctx):
    keys = CurveKeys.from_token(TOKEN)
    frontend = FrontendSockets(keys, "127.0.0.1")
    try:
        pull = frontend.bind(ctx, zmq.PULL, "tcp://127.0.0.1:0")
        endpoint = pull.getsockopt(zmq.LAST_ENDPOINT).decode()
        # It knows the server's public key, but its client key is its own: the ZAP handler refuses it.
        stranger = _curve_client(ctx, zmq.PUSH, keys.server_public, *zmq.curve_keypair())
        monitor = _monitored(stranger)
        stranger.connect(endpoint)
        assert _handshake(monitor) == zmq.EVENT_HANDSHAKE_FAILED_AUTH
        rank = connect_socket(ctx, zmq.PUSH, endpoint, keys)
        rank.send(b"output")
        assert pull.recv() == b"output"
        assert not pull.poll(200)
        for s in (monitor, stranger, rank, pull):
            s.close(linger=0)
    finally:
        frontend.close()


def test_without_a_token_the_sockets_bind_the_node_address_in_clear(ctx):
    frontend = FrontendSockets(None, "127.0.0.1")
    pull = frontend.bind(ctx, zmq.PULL, "tcp://10.9.9.9:0")
    assert pull.getsockopt(zmq.LAST_ENDPOINT).decode().startswith("tcp://127.0.0.1:")
    assert pull.getsockopt(zmq.CURVE_SERVER) == 0
    pull.close(linger=0)
    frontend.close()


def _args(**kw) -> ServerArgs:
    return ServerArgs(model_path="tiny-llama", dp_size=2, nnodes=2, dist_init_addr="127.0.0.1:5000", **kw)


def test_several_nodes_under_the_token_use_curve_and_warn_without_it(caplog):
    assert node_keys(_args(disaggregation_auth_token=TOKEN)) == CurveKeys.from_token(TOKEN)
    assert node_keys(ServerArgs(model_path="tiny-llama", disaggregation_auth_token=TOKEN)) is None  # ipc: one node
    with caplog.at_level("WARNING"):
        secured = frontend_sockets(_args(disaggregation_auth_token=TOKEN))
        assert caplog.records == []
        clear = frontend_sockets(_args())
    assert (secured.keys, secured.bind_host) == (CurveKeys.from_token(TOKEN), "127.0.0.1")
    assert (clear.keys, clear.bind_host) == (None, "127.0.0.1")
    (record,) = caplog.records
    assert "anyone who can reach 127.0.0.1 ports 5001 and 5002 can read prompts" in record.getMessage()
    assert "--disaggregation-auth-token" in record.getMessage()


def test_a_frame_over_the_bound_never_reaches_the_frontend(ctx):
    frontend = FrontendSockets(None, "127.0.0.1", max_bytes=1024)
    pull = frontend.bind(ctx, zmq.PULL, "tcp://127.0.0.1:0")
    endpoint = pull.getsockopt(zmq.LAST_ENDPOINT).decode()
    stranger = connect_socket(ctx, zmq.PUSH, endpoint)
    stranger.send(b"x" * 2048)  # ZMQ drops the connection instead of buffering the frame
    rank = connect_socket(ctx, zmq.PUSH, endpoint)
    rank.send(b"output")
    assert pull.recv() == b"output"
    assert not pull.poll(200)
    for s in (stranger, rank, pull):
        s.close(linger=0)
    frontend.close()
