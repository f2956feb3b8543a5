"""Decode acts only on bootstrap fields the router signed, or that are allowed unsigned
(disagg/routed.py): an API client cannot point decode at a registry of its choosing (issue 33)."""

from __future__ import annotations

import pytest
from pd_pair import PDPair, greedy

from pdserve.disagg.auth import ROUTE_TTL_S, AuthError, Misdirected, PeerAuth
from pdserve.disagg.bootstrap import with_bootstrap
from pdserve.disagg.routed import BootstrapGate, parse_endpoint, route_refs

TOKEN = "route-token"
NOW = 1_800_000_000.0
REFS = [("10.0.0.11", 8998, 12345)]


def signed(refs=REFS, instance="decode-1", token=TOKEN, now=NOW) -> str:
    sig = PeerAuth(token).sign_route(refs, instance, now=now)
    assert sig is not None
    return sig


def test_a_signed_route_is_accepted_once():
    gate = BootstrapGate(PeerAuth(TOKEN), instance="decode-1")
    sig = signed()
    gate.check(REFS, sig, now=NOW + 1)
    with pytest.raises(AuthError, match="already used"):
        gate.check(REFS, sig, now=NOW + 2)


@pytest.mark.parametrize("refs,token,now,message", [
    ([("10.0.0.66", 8998, 12345)], TOKEN, NOW, "not valid for these bootstrap fields"),  # host altered
    ([("10.0.0.11", 22, 12345)], TOKEN, NOW, "not valid for these bootstrap fields"),  # port altered
    ([("10.0.0.11", 8998, 1)], TOKEN, NOW, "not valid for these bootstrap fields"),  # room altered
    (REFS, "another-token", NOW, "not valid for these bootstrap fields"),
    (REFS, TOKEN, NOW + ROUTE_TTL_S + 400, "expired"),
])
def test_a_signature_for_other_fields_another_token_or_too_old_is_refused(refs, token, now, message):
    gate = BootstrapGate(PeerAuth(TOKEN), instance="decode-1")
    with pytest.raises(AuthError, match=message):
        gate.check(refs, signed(token=token), now=now)


def test_a_signature_for_another_server_is_misdirected():
    gate = BootstrapGate(PeerAuth(TOKEN), instance="decode-2")
    with pytest.raises(Misdirected, match="decode-1"):
        gate.check(REFS, signed(instance="decode-1"), now=NOW)


def test_a_malformed_signature_is_refused_naming_the_field():
    gate = BootstrapGate(PeerAuth(TOKEN), instance="decode-1")
    for sig in ("", "e=1", "e=x,n=y,i=decode-1,mac=z", "mac=" + "0" * 64):
        with pytest.raises(AuthError, match="bootstrap_signature"):
            gate.check(REFS, sig, now=NOW)


def test_unsigned_fields_are_allowed_only_on_the_loopback_without_a_token_or_by_the_allow_list():
    open_gate = BootstrapGate(PeerAuth(None))
    open_gate.check([("127.0.0.1", 8998, 1), ("::1", 9000, 2)], None)
    for host in ("10.0.0.11", "169.254.169.254", "example.com"):
        with pytest.raises(AuthError, match=f"bootstrap_host: {host}:8998 is not on the loopback"):
            open_gate.check([(host, 8998, 1)], None)
    tokened = BootstrapGate(PeerAuth(TOKEN), allow=("10.0.0.11:8998", "[fd00::1]:9000"))
    tokened.check([("10.0.0.11", 8998, 1), ("fd00::1", 9000, 2)], None)
    with pytest.raises(AuthError, match="not signed by the router"):
        tokened.check([("127.0.0.1", 8998, 1)], None)  # a token: the loopback alone is no reason
    with pytest.raises(AuthError, match="10.0.0.11:8999"):
        tokened.check([("10.0.0.11", 8999, 1)], None)  # the allow list names ports too
    with pytest.raises(AuthError, match="no --disaggregation-auth-token"):
        open_gate.check(REFS, signed())  # a signature this server cannot check is no permission


def test_the_router_signs_what_decode_reads_batches_and_brackets_included():
    body = with_bootstrap({"text": ["a", "b"], "bootstrap_host": "10.9.9.9", "bootstrap_signature": "forged"},
                          "[fd00::1]", 8998)
    assert "forged" not in body.values() and "bootstrap_signature" not in body
    refs = route_refs(body)
    assert [r[:2] for r in refs] == [("fd00::1", 8998)] * 2 and len({r[2] for r in refs}) == 2
    gate = BootstrapGate(PeerAuth(TOKEN), instance="d")
    gate.check(refs, PeerAuth(TOKEN).sign_route(refs, "d"))


def test_parse_endpoint_names_the_value():
    assert parse_endpoint("[::1]:8998") == ("::1", 8998)
    for bad in ("10.0.0.1", ":8998", "host:0", "host:x"):
        with pytest.raises(ValueError, match=repr(bad)):
            parse_endpoint(bad)


def test_a_room_whose_prefill_half_broke_is_prefilled_locally_at_once():
    """Decode's half alone, its wait far longer than the test: told that prefill's half broke
    (``prefill_lost``), decode falls back now (a room waiting for KV, and the next one, waiting for
    KV or still for pages)."""
    pair = PDPair("tiny-llama", backend="memory", disaggregation_timeout_s=900.0)
    try:
        rooms = {rid: pair.submit(rid, list(range(10 + i, 40 + i)), greedy(4), to_prefill=False)
                 for i, rid in enumerate(("waiting-for-kv", "pending"))}
        pair.run(until=lambda: rooms["waiting-for-kv"] in pair.decode.mode.rooms)
        assert pair.decode.mode.prefill_lost(rooms["waiting-for-kv"], "the router saw prefill's half break")
        assert pair.decode.mode.prefill_lost(rooms["pending"], "the router saw prefill's half break")
        assert not pair.decode.mode.prefill_lost(12345, "no such room")
        pair.run(until=lambda: all(pair.outputs[r]["final"] is not None for r in rooms))
        assert all(len(pair.outputs[r]["ids"]) == 4 for r in rooms)
        assert pair.decode.stats()["fallbacks"] == 2
    finally:
        pair.close()


def test_a_room_lost_before_its_request_arrives_is_prefilled_locally_as_it_arrives():
    """The router's notice and its call to decode travel apart: a notice for a room decode does not
    hold yet is remembered (for the disaggregation timeout), and the request falls back the moment it
    arrives instead of waiting (here 900 s) for KV that will never come. Once only: the room's next
    request is disaggregated again."""
    pair = PDPair("tiny-llama", backend="memory", disaggregation_timeout_s=900.0)
    try:
        room = 4242
        assert not pair.decode.mode.prefill_lost(room, "the router saw prefill's half break")
        pair.submit("early-notice", list(range(10, 40)), greedy(4), to_prefill=False, room=room)
        assert room not in pair.decode.mode.rooms and not pair.decode.mode.pending  # fell back at once
        pair.run(until=lambda: pair.outputs["early-notice"]["final"] is not None, timeout_s=60)
        assert len(pair.outputs["early-notice"]["ids"]) == 4
        stats = pair.decode.stats()
        assert stats["fallbacks"] == 1 and stats["transfer_failures"] == 1
        assert not pair.decode.mode.lost_early  # taken: the notice is gone
        pair.submit("after", list(range(50, 80)), greedy(4), room=room)  # the room reused, both halves
        pair.run(until=lambda: pair.outputs["after"]["final"] is not None)
        assert pair.decode.stats()["fallbacks"] == 1 and pair.decode.stats()["kv_received"] == 1
    finally:
        pair.close()


def test_early_notices_expire_and_stay_bounded(monkeypatch):
    """Notices for rooms whose requests never come are dropped after the timeout, and never more than
    LOST_EARLY_MAX are kept (the oldest go first)."""
    from pdserve.disagg import decode as decode_mode

    pair = PDPair("tiny-llama", backend="memory", disaggregation_timeout_s=5.0)
    try:
        mode = pair.decode.mode
        monkeypatch.setattr(decode_mode, "LOST_EARLY_MAX", 3)
        now = [1000.0]
        monkeypatch.setattr(mode.io, "now", lambda: now[0])
        for room in (1, 2, 3, 4):
            mode.prefill_lost(room, "lost")
        assert list(mode.lost_early) == [2, 3, 4]
        now[0] += 6.0  # past the timeout: a request for room 2 now waits for its KV as usual
        pair.submit("late", list(range(10, 40)), greedy(2), to_prefill=False, room=2)
        assert not mode.lost_early and any(r.room == 2 for r in mode.pending)
        assert pair.decode.abort("late")
    finally:
        pair.close()
