"""bootstrap.py: the registry over real HTTP on loopback, the client's retries and refusals,
and RoomTable pairing with an injected clock."""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
import time
import urllib.request

import pytest

from entrypoints.server_utils import free_port
from pdserve.config import ModelConfig
from pdserve.disagg.auth import ANSWER_HEADER, AuthError, FrameBinding, NonceCache, PeerAuth
from pdserve.disagg.bootstrap import (
    DISCARD_IDLE_S,
    MAX_BODY_BYTES,
    MAX_DISCARD_BYTES,
    BootstrapClient,
    BootstrapError,
    BootstrapServer,
    CompatRecord,
    Dropped,
    Expired,
    IncompatiblePeer,
    Paired,
    RankRecord,
    RoomError,
    RoomTable,
)
from pdserve.disagg.layout import KVLayout
from pdserve.transfer.base import BufferDescriptor

WEIGHTS = "ab" * 32  # a sha256 hex digest
COMPAT = CompatRecord("tiny-llama", "LlamaForCausalLM", "bfloat16", 16, "gqa-hnd", 4, 8, 64, WEIGHTS)
LAYOUT = KVLayout("gqa", 2, 8, 16, "bfloat16", 4, 100, 4 * 16 * 128, 100 * 4 * 16 * 128)


def rank_record(rank: int, layout: KVLayout = LAYOUT, seed: int = 0) -> RankRecord:
    bufs = [BufferDescriptor(name, 0x7F0000000000 + (rank * 2 + i) * (1 << 30), layout.page_bytes,
                             layout.layer_stride, layout.num_layers, layout.num_pages)
            for i, name in enumerate(layout.buffers)]
    return RankRecord(rank, f"127.0.0.1:{15000 + rank}", bufs, f"tcp://127.0.0.1:{6000 + rank}", layout, seed)


BINDING = FrameBinding("tcp://127.0.0.1:1#ab", "tcp://127.0.0.1:2", 1, 0)
CLIENT = BootstrapClient(request_timeout_s=2.0, interval_s=0.05)


@pytest.fixture
def server():
    with BootstrapServer("127.0.0.1", 0) as s:
        yield s


def test_compat_check_names_the_field():
    other = CompatRecord("tiny-llama", "LlamaForCausalLM", "bfloat16", 1, "gqa-hnd", 4, 8, 64, WEIGHTS)
    with pytest.raises(IncompatiblePeer, match="^page_size: prefill has 16, decode has 1$"):
        COMPAT.check(other)
    COMPAT.check(CompatRecord(**vars(COMPAT)))
    with pytest.raises(ValueError, match="kv_layout"):
        CompatRecord("m", "a", "bfloat16", 16, "nhd", 4, 8, 64, WEIGHTS)


def test_compat_check_names_the_kv_cache_dtype_and_what_auto_stores():
    """kv_cache_dtype is additive (a record without it, from an older peer, means "auto") and
    compared: an fp8 prefill is refused by a full-precision decode, the message saying what "auto" is."""
    fp8 = CompatRecord(**{**vars(COMPAT), "kv_cache_dtype": "fp8_e4m3"})
    assert COMPAT.kv_cache_dtype == "auto"
    with pytest.raises(IncompatiblePeer, match=r"^kv_cache_dtype: prefill has fp8_e4m3, decode has auto \(bfloat16\)$"):
        fp8.check(COMPAT)
    fp8.check(CompatRecord(**vars(fp8)))


def test_compat_from_model_config():
    llama = CompatRecord.from_model(ModelConfig.from_path("tiny-llama"), page_size=16)
    ds = CompatRecord.from_model(ModelConfig.from_path("tiny-deepseek"), page_size=1, model="ds")
    assert (llama.kv_layout, llama.page_size, ds.kv_layout, ds.num_kv_heads, ds.model) == (
        "gqa-hnd", 16, "mla", 1, "ds")
    with pytest.raises(IncompatiblePeer, match="^architecture: prefill has"):
        llama.check(ds)


def test_fp8_weights_never_pair_with_full_precision_naming_the_quantization():
    fp8 = CompatRecord.from_model(ModelConfig.from_path("tiny-deepseek-fp8"), page_size=1)
    full = CompatRecord.from_model(ModelConfig.from_path("tiny-deepseek"), page_size=1)
    assert (fp8.quantization, full.quantization) == ("fp8-block128x128", "none")
    assert fp8.weights != full.weights  # the weights differ too, but the record names the field that says why
    with pytest.raises(IncompatiblePeer, match="^quantization: prefill has fp8-block128x128, decode has none$"):
        fp8.check(full)
    fp8.check(CompatRecord(**vars(fp8)))


def test_register_then_fetch(server):
    CLIENT.register_compat("127.0.0.1", server.port, COMPAT)
    for r in (1, 0):
        CLIENT.register_rank("127.0.0.1", server.port, rank_record(r))
    info = CLIENT.fetch("127.0.0.1", server.port, timeout_s=5)
    assert info.compat == COMPAT
    assert info.ranks == [rank_record(0), rank_record(1)]
    assert info.layout == LAYOUT
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/health") as r:
        assert r.status == 200


def test_fetch_waits_for_every_rank(server):
    CLIENT.register_compat("127.0.0.1", server.port, COMPAT)
    CLIENT.register_rank("127.0.0.1", server.port, rank_record(0))
    got = {}
    t = threading.Thread(target=lambda: got.update(info=CLIENT.fetch("127.0.0.1", server.port, timeout_s=30)))
    t.start()
    time.sleep(0.3)
    assert t.is_alive(), "fetch returned before rank 1 registered"
    CLIENT.register_rank("127.0.0.1", server.port, rank_record(1))
    t.join(30)
    assert [r.rank for r in got["info"].ranks] == [0, 1]


def test_fetch_and_register_wait_for_the_server_to_come_up():
    port = free_port()
    got = {}

    def decode_side():
        got["info"] = CLIENT.fetch("127.0.0.1", port, timeout_s=30)

    t = threading.Thread(target=decode_side)
    t.start()
    time.sleep(0.3)
    with BootstrapServer("127.0.0.1", port):
        CLIENT.register_compat("127.0.0.1", port, COMPAT)
        for r in (0, 1):
            CLIENT.register_rank("127.0.0.1", port, rank_record(r))
        t.join(30)
    assert got["info"].compat == COMPAT


def test_fetch_gives_up_with_what_it_saw(server):
    with pytest.raises(BootstrapError, match=r"no answer .* after 0\.3s"):
        CLIENT.fetch("127.0.0.1", free_port(), timeout_s=0.3)
    CLIENT.register_rank("127.0.0.1", server.port, rank_record(1))
    with pytest.raises(BootstrapError, match=r"1 prefill ranks registered, missing ranks \[0\], "
                                             r"no compatibility record after 0\.3s"):
        CLIENT.fetch("127.0.0.1", server.port, timeout_s=0.3)


def test_conflicting_registrations_are_refused(server):
    CLIENT.register_compat("127.0.0.1", server.port, COMPAT)
    changed = CompatRecord(**{**vars(COMPAT), "dtype": "float32"})
    with pytest.raises(IncompatiblePeer, match="dtype: registered has bfloat16, new has float32"):
        CLIENT.register_compat("127.0.0.1", server.port, changed)
    CLIENT.register_rank("127.0.0.1", server.port, rank_record(0))
    with pytest.raises(BootstrapError, match="rank 1: layout or seed differs from rank 0"):
        CLIENT.register_rank("127.0.0.1", server.port, rank_record(1, seed=5))
    # A restarted rank registers again: its new record replaces the old one.
    restarted = RankRecord(0, "127.0.0.1:19999", rank_record(0).buffers, "tcp://127.0.0.1:7000", LAYOUT)
    CLIENT.register_rank("127.0.0.1", server.port, restarted)
    CLIENT.register_rank("127.0.0.1", server.port, rank_record(1))
    assert CLIENT.fetch("127.0.0.1", server.port, timeout_s=5).ranks[0].session == "127.0.0.1:19999"


def test_malformed_records_are_refused_naming_the_field(server):
    req = urllib.request.Request(f"http://127.0.0.1:{server.port}/bootstrap/rank", method="PUT",
                                 data=b'{"rank": "zero"}')
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req)
    assert e.value.code == 400 and b"RankRecord.rank: expected int, got str" in e.value.read()
    with pytest.raises(ValueError, match=r"buffers: \('k',\) where the layout has \('k', 'v'\)"):
        RankRecord(0, "s", rank_record(0).buffers[:1], "c", LAYOUT)
    with pytest.raises(ValueError, match=r"rank: 2 outside \[0, 2\)"):
        rank_record(2)


def test_stop_frees_the_port():
    s = BootstrapServer("127.0.0.1", 0).start()
    port = s.port
    s.stop()
    s.stop()  # idempotent
    with BootstrapServer("127.0.0.1", port) as again:
        assert again.port == port


# --- RoomTable ---------------------------------------------------------------------------------


def test_pairs_whichever_half_comes_first():
    t = RoomTable(timeout_s=10)
    assert t.add_http(1, "h1", now=0) is None
    assert t.add_kv(1, 0, "k1", now=1) == Paired(1, "h1", {0: "k1"})
    assert t.add_kv(2, 0, "k2", now=2) is None
    assert t.add_http(2, "h2", now=3) == Paired(2, "h2", {0: "k2"})
    assert len(t) == 0


def test_kv_half_complete_when_every_destination_rank_sent():
    t = RoomTable(timeout_s=10)
    assert t.add_kv(5, 1, "rank1", now=0, parts=2) is None
    assert t.add_http(5, "h", now=0) is None
    assert t.add_kv(5, 0, "rank0", now=0, parts=2) == Paired(5, "h", {0: "rank0", 1: "rank1"})
    t.add_kv(6, 0, "a", now=0)
    with pytest.raises(RoomError, match="room 6: KV request says 2 parts, an earlier one said 1"):
        t.add_kv(6, 1, "b", now=0, parts=2)
    with pytest.raises(RoomError, match=r"part 3 outside \[0, 2\)"):
        t.add_kv(7, 3, "x", now=0, parts=2)


def test_duplicates_are_refused():
    t = RoomTable(timeout_s=10)
    t.add_http(1, "h", now=0)
    with pytest.raises(RoomError, match="room 1: HTTP half already arrived"):
        t.add_http(1, "h", now=0)
    t.add_kv(2, 0, "k", now=0)
    with pytest.raises(RoomError, match="room 2: KV request part 0 already arrived"):
        t.add_kv(2, 0, "k", now=0)
    t.add_kv(1, 0, "k", now=0)  # pairs room 1
    with pytest.raises(RoomError, match="room 1: already paired, duplicate HTTP half refused"):
        t.add_http(1, "h", now=1)
    with pytest.raises(RoomError, match="room 1: already paired, duplicate KV request refused"):
        t.add_kv(1, 0, "k", now=1)


def test_drop_room_before_and_after_the_http_half():
    t = RoomTable(timeout_s=10)
    assert t.drop(1, now=0) is None  # drop first: the HTTP half is answered Dropped on arrival
    assert t.add_http(1, "h1", now=1) == Dropped(1, "h1")
    t.add_http(2, "h2", now=0)
    assert t.drop(2, now=1) == Dropped(2, "h2")
    with pytest.raises(RoomError, match="room 2: dropped by decode, KV request refused"):
        t.add_kv(2, 0, "k", now=2)
    t.add_kv(3, 0, "k", now=0)
    with pytest.raises(RoomError, match="room 3: decode already sent KV requests, cannot drop"):
        t.drop(3, now=0)
    assert len(t) == 1  # room 3 still waits for its HTTP half


def test_cancel_before_either_half_leaves_a_tombstone():
    """Decode gave up before the router's HTTP half reached prefill: that half is answered at once."""
    t = RoomTable(timeout_s=5)
    assert t.cancel(4, now=0) is None
    assert t.add_http(4, "h4", now=1) == Dropped(4, "h4")
    with pytest.raises(RoomError, match="room 4: dropped by decode"):
        t.add_kv(4, 0, "k", now=1)
    t.add_http(5, "h5", now=0)
    assert t.cancel(5, now=1) == Expired(5, "h5", {})
    assert t.add_http(5, "late", now=2) is not None  # answered Dropped, not queued behind the tombstone
    assert len(t) == 0
    assert t.expire(now=7) == []  # tombstones are forgotten, not expired as waiting halves
    assert t.add_http(4, "new life", now=7) is None and len(t) == 1


def test_a_cancelled_room_fails_a_late_http_half_with_decode_s_reason():
    """Decode gave up (a grammar it cannot compile) before the HTTP half arrived: the half is
    failed with decode's reason, not finished as a room decode prefills itself (DropRoom)."""
    t = RoomTable(timeout_s=5)
    t.cancel(6, now=0, reason="decode gave up on the room: sampling_params.regex: bad")
    assert t.add_http(6, "h6", now=1) == Dropped(6, "h6", "decode gave up on the room: sampling_params.regex: bad")
    t.drop(7, now=0)
    assert t.add_http(7, "h7", now=1) == Dropped(7, "h7", None)


def test_unpaired_halves_expire_and_tombstones_are_forgotten():
    t = RoomTable(timeout_s=5)
    t.add_http(1, "h1", now=0)
    t.add_kv(2, 0, "k2", now=2)
    t.add_http(3, "h3", now=0)
    t.add_kv(3, 0, "k3", now=1)  # paired: leaves a tombstone
    assert t.expire(now=4.9) == []
    assert t.expire(now=5.0) == [Expired(1, "h1", {})]
    assert t.expire(now=7.0) == [Expired(2, None, {0: "k2"})]
    assert len(t) == 0
    t.add_http(3, "again", now=7.0)  # tombstone of room 3 forgotten after the timeout
    assert len(t) == 1
    with pytest.raises(ValueError, match="timeout_s"):
        RoomTable(timeout_s=0)


# ------------------------------------------------------------------ who may talk to the registry
def _raw(port: int, method: str, path: str, body: bytes = b"", headers: dict | None = None) -> int:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method, data=body or None,
                                 headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


def test_with_a_token_every_unsigned_or_wrongly_signed_request_is_refused():
    auth = PeerAuth("s3cret")
    with BootstrapServer("127.0.0.1", 0, auth) as server:
        signed = BootstrapClient(request_timeout_s=2.0, interval_s=0.05, auth=auth)
        signed.register_compat("127.0.0.1", server.port, COMPAT)
        for r in (0, 1):
            signed.register_rank("127.0.0.1", server.port, rank_record(r))
        assert signed.fetch("127.0.0.1", server.port, timeout_s=5).compat == COMPAT
        # A forger replacing rank 0's control endpoint (what made decode talk to it before).
        forged = RankRecord(0, "127.0.0.1:15000", rank_record(0).buffers, "tcp://127.0.0.1:6666", LAYOUT)
        for client in (CLIENT, BootstrapClient(request_timeout_s=2.0, auth=PeerAuth("wrong"))):
            with pytest.raises(BootstrapError, match="refused /bootstrap/rank: .*authentication|missing"):
                client.register_rank("127.0.0.1", server.port, forged)
            with pytest.raises(BootstrapError, match="refused: HTTP 401"):
                client.fetch("127.0.0.1", server.port, timeout_s=5)
        body = json.dumps(dataclasses.asdict(forged)).encode()
        target = f"127.0.0.1:{server.port}"
        stale = auth.sign("PUT", "/bootstrap/rank", body, target, now=time.time() - 3600)
        assert _raw(server.port, "PUT", "/bootstrap/rank", body, stale) == 401  # an old signature
        altered = auth.sign("PUT", "/bootstrap/rank", json.dumps(dataclasses.asdict(rank_record(0))).encode(),
                            target)
        assert _raw(server.port, "PUT", "/bootstrap/rank", body, altered) == 401  # signed another body
        assert _raw(server.port, "GET", "/health") == 200  # liveness stays open, it tells nothing
        assert signed.fetch("127.0.0.1", server.port, timeout_s=5).ranks[0].control == "tcp://127.0.0.1:6000"
        assert server.refused["auth"] >= 6


def test_without_a_token_only_loopback_peers_are_accepted():
    open_auth, strict = PeerAuth(allow_unauthenticated=True), PeerAuth()
    for peer in ("127.0.0.1", "::1", "127.3.4.5"):
        strict.verify("GET", "/bootstrap", b"", None, peer)
    for peer in ("192.0.2.7", "2001:db8::1", None, "not-an-address"):
        with pytest.raises(AuthError, match="only loopback peers are accepted"):
            strict.verify("GET", "/bootstrap", b"", None, peer)
        open_auth.verify("GET", "/bootstrap", b"", None, peer)
    with pytest.raises(AuthError, match="has no --disaggregation-auth-token"):
        strict.open(PeerAuth("t").seal(b"{}", BINDING), "127.0.0.1")  # a misconfigured pair is named, not guessed


def test_a_record_with_an_absurd_layout_is_refused_not_stored(server):
    big = {**dataclasses.asdict(LAYOUT), "dp_size": 10**9}
    body = json.dumps({**dataclasses.asdict(rank_record(0)), "layout": big}).encode()
    assert _raw(server.port, "PUT", "/bootstrap/rank", body) == 400
    assert _raw(server.port, "PUT", "/bootstrap/rank", b"{" * 100_000) == 400
    assert _raw(server.port, "PUT", "/bootstrap/rank", b"x" * (MAX_BODY_BYTES + 1)) == 413
    assert _raw(server.port, "PUT", "/bootstrap/rank", b"{}", {"Content-Length": "-1"}) == 400
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/bootstrap", timeout=5) as resp:
        assert len(resp.read()) < 200  # nothing was stored: the snapshot stays small


# --- issue 25: signatures bound to a registry, a nonce and a time; answers signed -----------------------------


def _registered(server: BootstrapServer, auth: PeerAuth) -> BootstrapClient:
    client = BootstrapClient(request_timeout_s=2.0, interval_s=0.05, auth=auth)
    client.register_compat("127.0.0.1", server.port, COMPAT)
    for r in (0, 1):
        client.register_rank("127.0.0.1", server.port, rank_record(r))
    return client


def _get(port: int, headers: dict) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/bootstrap", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, dict(resp.headers)
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers)


def test_a_captured_signed_request_replayed_is_refused():
    auth = PeerAuth("s3cret")
    with BootstrapServer("127.0.0.1", 0, auth) as server:
        _registered(server, auth)
        captured = auth.sign("GET", "/bootstrap", b"", f"127.0.0.1:{server.port}")
        assert _get(server.port, captured)[0] == 200
        assert _get(server.port, captured)[0] == 401  # within the skew window, but seen before
        assert server.refused["replay"] == 1
        assert _get(server.port, auth.sign("GET", "/bootstrap", b"", f"127.0.0.1:{server.port}"))[0] == 200


def test_a_request_signed_for_one_registry_is_refused_by_another():
    """The signed GET decode sends a registry an attacker named (registry A) is worth nothing at
    the deployment's real registry (B)."""
    auth = PeerAuth("s3cret")
    with BootstrapServer("127.0.0.1", 0, auth) as a, BootstrapServer("127.0.0.1", 0, auth) as b:
        _registered(b, auth)
        for_a = auth.sign("GET", "/bootstrap", b"", f"127.0.0.1:{a.port}")
        assert _get(b.port, for_a)[0] == 401
        assert b.refused["wrong_target"] == 1
        for_other_host = auth.sign("GET", "/bootstrap", b"", f"192.0.2.7:{b.port}")
        assert _get(b.port, for_other_host)[0] == 401
        assert b.refused["wrong_target"] == 2
        for name in ("127.0.0.1", "localhost"):  # the names a loopback registry is known by
            assert _get(b.port, auth.sign("GET", "/bootstrap", b"", f"{name}:{b.port}"))[0] == 200


def test_answers_are_signed_and_a_client_under_a_token_refuses_a_registry_that_cannot_sign():
    auth = PeerAuth("s3cret")
    with BootstrapServer("127.0.0.1", 0, auth) as real, BootstrapServer("127.0.0.1", 0) as impostor:
        _registered(real, auth)
        _registered(impostor, PeerAuth())  # a registry without the token (loopback: it takes anyone)
        status, headers = _get(real.port, auth.sign("GET", "/bootstrap", b"", f"127.0.0.1:{real.port}"))
        assert status == 200 and ANSWER_HEADER in headers
        client = BootstrapClient(request_timeout_s=2.0, interval_s=0.05, auth=auth)
        assert client.fetch("127.0.0.1", real.port, timeout_s=5).compat == COMPAT
        with pytest.raises(BootstrapError, match="does not hold this deployment's --disaggregation-auth-token"):
            client.fetch("127.0.0.1", impostor.port, timeout_s=5)
    # A signed answer covers its request's nonce: copied onto the answer of another request, it fails.
    answer = auth.sign_answer("a" * 32, 200, b"{}")[ANSWER_HEADER]
    auth.verify_answer("a" * 32, 200, b"{}", answer)
    for nonce, status, body in (("b" * 32, 200, b"{}"), ("a" * 32, 404, b"{}"), ("a" * 32, 200, b"[]")):
        with pytest.raises(AuthError):
            auth.verify_answer(nonce, status, body, answer)


def test_the_nonce_cache_is_bounded_and_refuses_what_it_may_have_forgotten():
    cache = NonceCache(capacity=3, window_s=300.0)
    now = 1000.0
    assert all(cache.add(n, now - 10 + i, now) for i, n in enumerate("abc"))
    assert not cache.add("a", now, now)  # a replay
    assert cache.add("d", now, now) and len(cache) == 3  # "a" forgotten, its time now a floor
    assert not cache.add("a", now - 10, now)  # so its replay is still refused
    assert cache.add("e", now - 5, now + 400)  # the window moved on: old entries expired
    assert len(cache) == 1


def test_an_oversized_body_gets_its_413_even_while_the_client_is_still_sending(server):
    """The flake: the registry answered 413 and closed before the client had sent its 1 MiB body,
    so the client saw a broken pipe. Now the body is read (and dropped) up to a bound first. The
    client here waits for an early answer before sending the body: with the old registry that
    answer came at once and the send below failed every time."""
    import select

    body = b"x" * (MAX_BODY_BYTES + 1)
    assert len(body) < MAX_DISCARD_BYTES
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(f"PUT /bootstrap/rank HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode())
        # An answer before the body (the old registry's) is readable by now; the registry waits longer than this
        # for a body that stops coming.
        select.select([s], [], [], DISCARD_IDLE_S / 10)
        s.sendall(body)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.0 413")


def test_a_v3_prefill_never_pairs_with_a_v32_decode():
    """The record names the slot's regions with the index keys' width and dtype: a V3 prefill is
    refused by a V3.2 decode, and so is a V3.2 whose index keys are laid out otherwise."""
    v3 = CompatRecord.from_model(ModelConfig.from_path("tiny-deepseek"), page_size=4)
    v32_config = ModelConfig.from_path("tiny-deepseek-v32")
    v32 = CompatRecord.from_model(v32_config, page_size=4)
    di = v32_config.index_head_dim
    assert (v3.state_layout, v32.state_layout) == ("latent", f"latent+index_k[{di}]:float32")
    assert CompatRecord.from_model(ModelConfig.from_path("tiny-llama"), page_size=4).state_layout == "k+v"
    with pytest.raises(IncompatiblePeer, match="^architecture: prefill has DeepseekV3ForCausalLM, decode has "
                                              "DeepseekV32ForCausalLM"):
        v3.check(v32)
    wider = dataclasses.replace(v32, state_layout=f"latent+index_k[{2 * di}]:float32")
    with pytest.raises(IncompatiblePeer, match=rf"^state_layout: prefill has latent\+index_k\[{di}\]:float32, "
                                               rf"decode has latent\+index_k\[{2 * di}\]:float32$"):
        v32.check(wider)
    v32.check(CompatRecord(**vars(v32)))


def test_a_v4_side_never_pairs_with_a_v3_or_v32_side_or_other_layer_kinds():
    """A V4 record names every region of a slot with its width, dtype and the layers keeping it
    (kv_layout "regions"): a V3.2 side is refused by its layout, and a V4 whose layers are of other
    kinds (the same regions on other layers) by the state layout."""
    v4_config = ModelConfig.from_path("tiny-deepseek-v4")
    v4 = CompatRecord.from_model(v4_config, page_size=4)
    kinds = list(v4_config.hf_config.layer_types)
    csa = ",".join(str(i) for i, k in enumerate(kinds) if k == "compressed_sparse_attention")
    D = v4_config.hf_config.head_dim
    assert v4.kv_layout == "regions"
    assert v4.state_layout.startswith(f"window_kv[{D}]:{v4_config.dtype}@{','.join(map(str, range(len(kinds))))}+")
    rate = v4_config.hf_config.compress_rates["compressed_sparse_attention"]
    assert f"+csa_kv[{D}]/{rate}:{v4_config.dtype}@{csa}+" in v4.state_layout  # one entry per `rate` tokens
    v32 = CompatRecord.from_model(ModelConfig.from_path("tiny-deepseek-v32"), page_size=4)
    with pytest.raises(IncompatiblePeer, match="^architecture: prefill has DeepseekV32ForCausalLM"):
        v32.check(v4)
    as_v32 = dataclasses.replace(v4, architecture=v32.architecture)  # even under the same name, the layout differs
    with pytest.raises(IncompatiblePeer, match="^kv_layout: prefill has regions, decode has mla"):
        as_v32.check(dataclasses.replace(v32, num_layers=v4.num_layers, num_kv_heads=v4.num_kv_heads,
                                         head_dim=v4.head_dim, dtype=v4.dtype))
    moved = dataclasses.replace(v4, state_layout=v4.state_layout.replace(f"@{csa}+", "@0+", 1))
    with pytest.raises(IncompatiblePeer, match=r"^state_layout: prefill has window_kv"):
        v4.check(moved)
    v4.check(CompatRecord(**vars(v4)))


def test_a_bounded_v4_side_never_pairs_with_a_page_layout_one():
    """The record names a pool's per-request records (rows x width, dtype, layers; ``none`` when every
    state is in pages): a bounded V4 side and a page-layout one (the hierarchical cache) refuse each other."""
    import torch

    from pdserve.config import CacheConfig
    from pdserve.disagg.roles import state_records
    from pdserve.distributed.parallel_state import SINGLE
    from pdserve.engine.model_runner import create_kv_pool

    mc = ModelConfig.from_path("tiny-deepseek-v4")
    c = mc.hf_config
    bounded = create_kv_pool(mc, CacheConfig(page_size=4, max_total_tokens=64, state_records=2), SINGLE)
    paged = create_kv_pool(mc, CacheConfig(page_size=4, max_total_tokens=64), SINGLE)
    every = ",".join(map(str, range(c.num_hidden_layers)))
    assert state_records(bounded).startswith(f"window_kv[{c.sliding_window - 1}x{c.head_dim}]:float32@{every}+")
    assert state_records(paged) == "none" and bounded.record_buffers()[0][1].dtype == torch.float32
    mine = CompatRecord.from_model(mc, page_size=4, state_records=state_records(bounded))
    theirs = CompatRecord.from_model(mc, page_size=4)
    with pytest.raises(IncompatiblePeer, match=r"^state_records: decode has window_kv\[.*, prefill has none$"):
        mine.check(theirs, mine="decode", theirs="prefill")
