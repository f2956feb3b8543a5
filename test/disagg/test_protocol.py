"""protocol.py: every message round-trips; anything else is refused naming the field."""

from __future__ import annotations

import json

import pytest

from pdserve.disagg.layout import KVLayout
from pdserve.disagg.protocol import (
    MAX_DEPTH,
    PROTOCOL_VERSION,
    BufferRange,
    DecodeRecord,
    DropRoom,
    KVAbort,
    KVAbortAck,
    KVCompletion,
    KVProgress,
    KVProgressAck,
    KVRequest,
    ProtocolError,
    decode,
    encode,
)

LAYOUT = KVLayout("gqa", 2, 8, 16, "bfloat16", 4, 100, 4 * 16 * 256, 100 * 4 * 16 * 256, dp_size=2)


def kv_request(**kw) -> KVRequest:
    fields = dict(room=2**63 + 5, nonce=77, decode_id="decode-0", decode_rank=3, session="127.0.0.1:15000",
                  buffers=[0x7F0000000000, 0x7F1000000000], layout=LAYOUT, dst_pages=[5, 6, 9],
                  start_pos=32, num_tokens=40, aux_addr=0x7F2000000000, aux_bytes=256,
                  reply_to="tcp://127.0.0.1:5555")
    return KVRequest(**{**fields, **kw})


def decode_record(**kw) -> DecodeRecord:
    fields = dict(decode_id="decode-0", decode_rank=3, session="127.0.0.1:15000",
                  buffers=[BufferRange(0x7F0000000000, LAYOUT.layer_stride * 4),
                           BufferRange(0x7F1000000000, LAYOUT.layer_stride * 4)],
                  layout=LAYOUT, aux=BufferRange(0x7F2000000000, 256 * 8), aux_row_bytes=256,
                  reply_to="tcp://127.0.0.1:5555")
    return DecodeRecord(**{**fields, **kw})


MESSAGES = [
    kv_request(),
    decode_record(),
    KVCompletion(room=1, nonce=9, src_rank=0, dst_rank=2, writes=24, status="ok"),
    KVCompletion(room=1, nonce=9, src_rank=1, dst_rank=2, writes=0, status="failed", error="write to x failed"),
    KVAbort(room=7, reason="client disconnected", side="decode", sender="decode-0", nonce=9),
    KVAbort(room=7, reason="never paired", side="decode", sender="decode-0"),
    KVAbortAck(room=7, nonce=9, src_rank=1),
    DropRoom(room=0),
    KVProgress(room=7, nonce=9, src_rank=0, session="127.0.0.1:17000", seq=3),
    KVProgressAck(room=7, nonce=9, seq=3, sender="decode-0", wait_s=30.0),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    assert decode(encode(msg)) == msg


def test_kv_request_knows_its_dp_group():
    assert kv_request().dst_dp_rank == 1


def envelope(msg) -> dict:
    return json.loads(encode(msg))


@pytest.mark.parametrize("mutate,match", [
    (lambda e: e.update(v=PROTOCOL_VERSION + 1), f"v: unsupported protocol version {PROTOCOL_VERSION + 1}"),
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
    env = envelope(KVCompletion(room=1, nonce=5, src_rank=0, dst_rank=0, writes=3, status="ok"))
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
    ({"record_slot": 0}, r"record_slot: 0 for a layout without records \(-1\)"),
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
    (b'{"v": 4, "type": 3, "body": {}}', "unknown message type 3"),
    (b'{"v": 4, "type": "DropRoom", "body": []}', "DropRoom: expected an object"),
])
def test_garbage_is_refused(data, match):
    with pytest.raises(ProtocolError, match=match):
        decode(data)


def test_other_side_value_refused():
    with pytest.raises(ProtocolError, match="side: 'router' is not one of"):
        KVAbort(room=1, reason="x", side="router", sender="r")
    with pytest.raises(ProtocolError, match="type: dict is not a protocol message"):
        encode({"room": 1})


def completion_with(field: str, raw: str) -> bytes:
    """A KVCompletion frame whose ``field`` is the literal JSON text ``raw``."""
    env = envelope(KVCompletion(room=1, nonce=5, src_rank=0, dst_rank=0, writes=3, status="ok"))
    env["body"][field] = "@@"
    return json.dumps(env).replace('"@@"', raw).encode()


@pytest.mark.parametrize("data,match", [
    # Each of these ended a scheduler before (OverflowError, ValueError, RecursionError).
    (completion_with("queue_s", "9" * 400), "a number of 400 digits"),
    (completion_with("writes", "9" * 5000), "a number of 5000 digits"),
    (completion_with("queue_s", "1e999"), "not a finite number"),
    (completion_with("queue_s", "NaN"), "NaN is not a JSON number"),
    (completion_with("writes", "18446744073709551616000"), "writes: 18446744073709551616000 is out of range"),
    (completion_with("error", "[" * 100_000 + "]" * 100_000), f"nested 100002 deep \\(at most {MAX_DEPTH}\\)"),
    (b"[" * 1_000_000, "nested 1000000 deep"),
    (b'"' + b"\\" * 10 + b'"', "malformed message: expected an object"),
    (b"\x00" * 64, "not JSON"),
    (b"{" * 3 + b'"' * 7, "not JSON"),
])
def test_hostile_frames_are_refused_not_raised(data, match):
    with pytest.raises(ProtocolError, match=match):
        decode(data)


def test_a_frame_over_the_size_bound_is_refused_before_parsing():
    from pdserve.disagg.protocol import MAX_FRAME_BYTES
    with pytest.raises(ProtocolError, match="bytes \\(at most"):
        decode(b" " * (MAX_FRAME_BYTES + 1))


@pytest.mark.parametrize("endpoint", ["not-an-endpoint", "tcp://", "tcp://host:0", "tcp://host:99999",
                                      "tcp://*:5555", "ipc:///tmp/x", "tcp://h:1;x"])
def test_reply_endpoints_must_be_tcp_host_port(endpoint):
    with pytest.raises(ProtocolError, match="reply_to: .* is not an endpoint tcp://host:port"):
        kv_request(reply_to=endpoint)


@pytest.mark.parametrize("change,match", [
    ({"session": "127.0.0.1:16000"}, "session: 127.0.0.1:16000 is not the published"),
    ({"buffers": [0x7F0000000000, 0x7F1000001000]}, "buffers: differ"),
    ({"layout": KVLayout("gqa", 2, 8, 16, "bfloat16", 4, 200, 4 * 16 * 256, 200 * 4 * 16 * 256, dp_size=2)},
     "layout: differs"),
    ({"reply_to": "tcp://127.0.0.1:6666"}, "reply_to: tcp://127.0.0.1:6666 is not the published"),
    ({"aux_addr": 0x7F2000000000 + 256 * 8}, "aux_addr: .* is not a row of the published aux buffer"),
    ({"aux_addr": 0x7F2000000000 + 100}, "aux_addr: .* is not a row"),
    ({"aux_bytes": 512}, "aux_addr: .* is not a row"),
])
def test_a_kv_request_must_match_its_decode_record(change, match):
    rec = decode_record()
    rec.check_request(kv_request())  # the published destinations pass
    with pytest.raises(ProtocolError, match=match):
        rec.check_request(kv_request(**change))


ROOM_STAGING = LAYOUT.num_layers * 2 * 3 * LAYOUT.page_bytes  # layers x buffers x pages x page bytes
STAGING = BufferRange(0x7F3000000000, 4 * ROOM_STAGING)


def test_a_staging_range_must_lie_in_the_published_staging_buffer():
    """Packed transfers write into decode's staging: only inside the buffer its record published,
    and exactly the room's size (so no planned write leaves it); a record without one takes none."""
    rec = decode_record(staging=[STAGING])
    assert decode(encode(rec)) == rec
    rec.check_request(kv_request(staging_addr=STAGING.addr + ROOM_STAGING, staging_bytes=ROOM_STAGING))
    for addr in (STAGING.addr + 3 * ROOM_STAGING + 1, STAGING.addr - 256, 0x7F0000000000):
        with pytest.raises(ProtocolError, match="staging_addr: .* is not inside the published staging buffer"):
            rec.check_request(kv_request(staging_addr=addr, staging_bytes=ROOM_STAGING))
    with pytest.raises(ProtocolError, match="staging_addr: .* is not inside"):
        decode_record().check_request(kv_request(staging_addr=STAGING.addr, staging_bytes=ROOM_STAGING))
    with pytest.raises(ProtocolError, match=f"staging_bytes: {ROOM_STAGING * 2} for 3 pages, the layout needs"):
        kv_request(staging_addr=STAGING.addr, staging_bytes=ROOM_STAGING * 2)
    with pytest.raises(ProtocolError, match="staging_addr, staging_bytes: both zero or both set"):
        kv_request(staging_addr=STAGING.addr)
    with pytest.raises(ProtocolError, match="staging: 2 ranges"):
        decode_record(staging=[STAGING, STAGING])


def test_decode_record_invariants():
    with pytest.raises(ProtocolError, match="buffers: a range shorter than the layout"):
        decode_record(buffers=[BufferRange(1, 10), BufferRange(2, 10)])
    with pytest.raises(ProtocolError, match="aux_row_bytes: 300 does not divide"):
        decode_record(aux_row_bytes=300)


def test_nonces_are_required_and_bounded():
    with pytest.raises(ProtocolError, match="nonce: 0 is not in"):
        kv_request(nonce=0)
    with pytest.raises(ProtocolError, match="nonce: .* is not in"):
        KVAbortAck(room=1, nonce=2**63, src_rank=0)


def test_progress_notices_name_the_field_they_break():
    with pytest.raises(ProtocolError, match="nonce: 0 is not in"):
        KVProgress(room=1, nonce=0, src_rank=0, session="h:1", seq=1)
    with pytest.raises(ProtocolError, match="seq: 0 is not in"):
        KVProgress(room=1, nonce=2, src_rank=0, session="h:1", seq=0)
    with pytest.raises(ProtocolError, match="src_rank: must be >= 0"):
        KVProgress(room=1, nonce=2, src_rank=-1, session="h:1", seq=1)
    with pytest.raises(ProtocolError, match="session: 0 characters"):
        KVProgress(room=1, nonce=2, src_rank=0, session="", seq=1)
    with pytest.raises(ProtocolError, match="seq: .* is not in"):
        KVProgressAck(room=1, nonce=2, seq=2**63, sender="d", wait_s=1.0)
    with pytest.raises(ProtocolError, match="sender: empty"):
        KVProgressAck(room=1, nonce=2, seq=1, sender="", wait_s=1.0)
    with pytest.raises(ProtocolError, match="wait_s: must be finite and > 0"):
        KVProgressAck(room=1, nonce=2, seq=1, sender="d", wait_s=0.0)


def test_a_kv_request_names_a_record_slot_of_a_layout_with_records():
    """A layout with per-request records (DeepSeek-V4's bounded layout) needs decode's slot among its own."""
    from pdserve.disagg.layout import Region

    lay = KVLayout("regions", 1, 1, 16, "float32", 4, 100, 256, 100 * 256, regions=(Region("hca_kv", "float32", 256,
                   100 * 256),), records=(Region("window_kv", "float32", 96, 8 * 96),), record_slots=8)
    ok = kv_request(layout=lay, buffers=[0x7F0000000000, 0x7F1000000000], decode_rank=0, record_slot=7)
    assert decode(encode(ok)) == ok
    for slot in (-1, 8):
        with pytest.raises(ProtocolError, match=f"record_slot: {slot} is not one of the layout's 8 record slots"):
            kv_request(layout=lay, buffers=[0x7F0000000000, 0x7F1000000000], decode_rank=0, record_slot=slot)
