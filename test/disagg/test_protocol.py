"""protocol.py: every message round-trips; anything else is refused naming the field."""

from __future__ import annotations

import json

import pytest

from pdserve.disagg.layout import KVLayout
from pdserve.disagg.protocol import (
    PROTOCOL_VERSION,
    DropRoom,
    Heartbeat,
    HeartbeatAck,
    KVAbort,
    KVAbortAck,
    KVCompletion,
    KVRequest,
    ProtocolError,
    decode,
    encode,
)

LAYOUT = KVLayout("gqa", 2, 8, 16, "bfloat16", 4, 100, 4 * 16 * 256, 100 * 4 * 16 * 256, dp_size=2)


def kv_request(**kw) -> KVRequest:
    fields = dict(room=2**63 + 5, decode_id="decode-0", decode_rank=3, session="127.0.0.1:15000",
                  buffers=[0x7F0000000000, 0x7F1000000000], layout=LAYOUT, dst_pages=[5, 6, 9],
                  start_pos=32, num_tokens=40, aux_addr=0x7F2000000000, aux_bytes=256,
                  reply_to="tcp://127.0.0.1:5555")
    return KVRequest(**{**fields, **kw})


MESSAGES = [
    kv_request(),
    KVCompletion(room=1, src_rank=0, dst_rank=2, writes=24, status="ok"),
    KVCompletion(room=1, src_rank=1, dst_rank=2, writes=0, status="failed", error="write to x failed"),
    KVAbort(room=7, reason="client disconnected", side="decode"),
    KVAbortAck(room=7, src_rank=1),
    Heartbeat(server_id="decode-0", time=1234.5),
    HeartbeatAck(server_id="prefill-0", time=1234.5),
    DropRoom(room=0),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    assert decode(encode(msg)) == msg


def test_kv_request_knows_its_dp_group():
    assert kv_request().dst_dp_rank == 1


def envelope(msg) -> dict:
    return json.loads(encode(msg))


@pytest.mark.parametrize("mutate,match", [
    (lambda e: e.update(v=PROTOCOL_VERSION + 1), "v: unsupported protocol version 2"),
    (lambda e: e.update(type="KVRead"), "type: unknown message type 'KVRead'"),
    (lambda e: e.pop("body"), "malformed message"),
    (lambda e: e["body"].pop("room"), r"KVCompletion.room: missing field"),
    (lambda e: e["body"].update(extra=1), r"KVCompletion.extra: unknown field"),
    (lambda e: e["body"].update(room="1"), r"KVCompletion.room: expected int, got str"),
    (lambda e: e["body"].update(writes=True), r"KVCompletion.writes: expected int, got bool"),
    (lambda e: e["body"].update(status="partial"), r"KVCompletion: status: 'partial' is not one of"),
    (lambda e: e["body"].update(status="failed"), r"KVCompletion: error: a failed completion must say why"),
    (lambda e: e["body"].update(room=-1), r"room: -1 is not an unsigned 64-bit value"),
])
def test_completion_refusals_name_the_field(mutate, match):
    env = envelope(KVCompletion(room=1, src_rank=0, dst_rank=0, writes=3, status="ok"))
    mutate(env)
    with pytest.raises(ProtocolError, match=match):
        decode(json.dumps(env).encode())


@pytest.mark.parametrize("change,match", [
    ({"dst_pages": [5, 6]}, "dst_pages: 2 pages for 40 tokens of page_size 16"),
    ({"start_pos": 30}, "start_pos: 30 is not a non-negative multiple of page_size 16"),
    ({"num_tokens": 0}, "num_tokens: must be >= 1"),
    ({"dst_pages": [5, 6, 100]}, r"dst_pages: a page outside \[0, 100\)"),
    ({"buffers": [1]}, r"buffers: 1 addresses for buffers \('k', 'v'\)"),
    ({"decode_rank": 4}, r"decode_rank: 4 outside \[0, 4\)"),
    ({"aux_addr": 0}, "aux_addr, aux_bytes: both zero or both set"),
])
def test_kv_request_invariants(change, match):
    with pytest.raises(ProtocolError, match=match):
        kv_request(**change)
    env = envelope(kv_request())
    env["body"].update({k: v for k, v in change.items()})
    with pytest.raises(ProtocolError, match="KVRequest: " + match):
        decode(json.dumps(env).encode())


def test_nested_layout_is_checked():
    env = envelope(kv_request())
    env["body"]["layout"]["page_size"] = "16"
    with pytest.raises(ProtocolError, match=r"KVRequest.layout.page_size: expected int, got str"):
        decode(json.dumps(env).encode())
    env["body"]["layout"]["page_size"] = 0
    with pytest.raises(ProtocolError, match=r"KVRequest.layout: page_size: must be >= 1"):
        decode(json.dumps(env).encode())
    env["body"]["layout"]["page_size"] = 16
    env["body"]["dst_pages"][0] = 1.5
    with pytest.raises(ProtocolError, match=r"KVRequest.dst_pages\[0\]: expected int, got float"):
        decode(json.dumps(env).encode())


@pytest.mark.parametrize("data,match", [
    (b"\xff\xfe", "not JSON"),
    (b"{not json", "not JSON"),
    (b"[1, 2]", "malformed message"),
    (b'{"v": 1, "type": 3, "body": {}}', "unknown message type 3"),
    (b'{"v": 1, "type": "DropRoom", "body": []}', "DropRoom: expected an object"),
])
def test_garbage_is_refused(data, match):
    with pytest.raises(ProtocolError, match=match):
        decode(data)


def test_other_side_value_refused():
    with pytest.raises(ProtocolError, match="side: 'router' is not one of"):
        KVAbort(room=1, reason="x", side="router")
    with pytest.raises(ProtocolError, match="type: dict is not a protocol message"):
        encode({"room": 1})
