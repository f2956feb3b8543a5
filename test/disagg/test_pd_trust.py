"""The P/D trust boundary and failure behaviour, between a prefill and a decode
scheduler in one process over real Mooncake engines and ZMQ: hostile frames on either control
port, forged and stale messages, a paused prefill after a death verdict, duplicate rooms, and
every abort path acknowledged. Each test ends with both sides serving colocated-identical tokens
and every page accounted for."""

from __future__ import annotations

import dataclasses
import http.server
import json
import threading
import time
import urllib.error
import urllib.request

import pytest
import zmq
from pd_pair import PDPair, greedy
from test_pd_flow import _colocated, _prompts

from pdserve.disagg import protocol
from pdserve.disagg.auth import FrameBinding, PeerAuth
from pdserve.disagg.bootstrap import BootstrapClient
from pdserve.disagg.protocol import KVCompletion, KVRequest
from pdserve.disagg.receiver import PeersDead
from pdserve.engine.io_struct import BootstrapRef
from pdserve.engine.request import ReqState
from pdserve.transfer import FaultInjectingBackend

pytestmark = pytest.mark.skipif(not pytest.importorskip("mooncake"), reason="needs mooncake")

NEW = 8
MODEL = "tiny-llama"


@pytest.fixture
def pair_factory():
    pairs = []

    def make(model=MODEL, **flags) -> PDPair:
        pairs.append(PDPair(model, **flags))
        return pairs[-1]

    yield make
    for p in pairs:
        p.close()


class RawPeer:
    """Whoever can reach a control port: sends bytes as they are (or sealed with a token)."""

    def __init__(self):
        self.ctx = zmq.Context()
        self.socks: dict[str, zmq.Socket] = {}

    def send(self, endpoint: str, data: bytes) -> None:
        if endpoint not in self.socks:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            self.socks[endpoint] = sock
        self.socks[endpoint].send(data)

    def close(self) -> None:
        for s in self.socks.values():
            s.close(linger=0)
        self.ctx.term()


def _completion_frame(field: str, raw: str) -> bytes:
    env = json.loads(protocol.encode(KVCompletion(room=1, nonce=5, src_rank=0, dst_rank=0, writes=3, status="ok")))
    env["body"][field] = "@@"
    return json.dumps(env).replace('"@@"', raw).encode()


HOSTILE = [
    _completion_frame("queue_s", "9" * 400),  # OverflowError in float() before
    _completion_frame("writes", "9" * 5000),  # ValueError: int digit limit before
    b"[" * 100_000,  # RecursionError before
    b'{"v": 1, "type": "Heartbeat", "body": {"server_id": "not an endpoint", "time": 1.0}}',  # connect() raised
    json.dumps({"v": 4, "type": "KVAbort", "body": {"room": 1, "reason": "x", "side": "decode",
                                                    "sender": "tcp://[", "nonce": 0}}).encode(),
    b"\xff" * 1000,
    b"",
]


def _wait_refused(pair: PDPair, side, n: int) -> None:
    pair.run(until=lambda: side.stats()["control_refused"] >= n, timeout_s=30)


def test_hostile_frames_on_either_port_are_counted_and_both_sides_keep_serving(pair_factory):
    pair = pair_factory()
    peer = RawPeer()
    try:
        for endpoint in (pair.prefill.mode.io.endpoint, pair.decode.mode.io.endpoint):
            for frame in HOSTILE:
                peer.send(endpoint, frame)
        _wait_refused(pair, pair.prefill, len(HOSTILE) - 1)  # the KVAbort frame is valid: prefill ignores it
        _wait_refused(pair, pair.decode, len(HOSTILE) - 1)
        prompts = _prompts([30, 21])
        for i, p in enumerate(prompts):
            pair.submit(f"r{i}", p, greedy(NEW))
        pair.run()
        assert [pair.outputs[f"r{i}"]["ids"] for i in range(2)] == _colocated(MODEL, prompts, n=NEW)
        assert pair.decode.stats()["kv_received"] == 2
        pair.assert_idle_and_accounted()
    finally:
        peer.close()


def test_with_a_token_unauthenticated_and_wrongly_keyed_frames_are_refused(pair_factory):
    pair = pair_factory(disaggregation_auth_token="s3cret")
    peer = RawPeer()
    try:
        plain = protocol.encode(protocol.DropRoom(5))
        to = FrameBinding("tcp://127.0.0.1:1#forger", pair.prefill.mode.io.endpoint, 1, int(time.time() * 1000))
        forged = PeerAuth("wrong").seal(plain, to)
        tampered = bytearray(PeerAuth("s3cret").seal(plain, to))
        tampered[-2] ^= 1
        for frame in (plain, forged, bytes(tampered)):
            peer.send(pair.prefill.mode.io.endpoint, frame)
        _wait_refused(pair, pair.prefill, 3)
        (prompt,) = _prompts([27])
        pair.submit("a", prompt, greedy(NEW))
        pair.run()
        assert pair.outputs["a"]["ids"] == _colocated(MODEL, [prompt], n=NEW)[0]
        assert pair.decode.stats()["kv_received"] == 1  # the sides' own frames carry the right MAC
        pair.assert_idle_and_accounted()
    finally:
        peer.close()


def test_a_kv_request_outside_the_published_record_is_refused_before_any_write(pair_factory):
    """A forger (or a bug) asks prefill to write elsewhere than decode published: refused, no byte
    written, decode told at its recorded endpoint, and the room falls back."""
    pair = pair_factory(disaggregation_timeout_s=5.0)
    send, rewritten = pair.decode.mode.io.send, []

    def rewrite(endpoint, msg):
        if isinstance(msg, KVRequest):
            msg = KVRequest(**{**msg.__dict__, "aux_addr": msg.aux_addr + 4})  # not a row of the aux buffer
            rewritten.append(msg)
        send(endpoint, msg)

    pair.decode.mode.io.send = rewrite
    (prompt,) = _prompts([26])
    pair.submit("a", prompt, greedy(NEW))
    pair.run()
    assert rewritten and pair.prefill.stats()["kv_requests_refused"] == 1
    assert pair.prefill.stats()["kv_writes_sent"] == 0
    assert pair.decode.stats()["fallbacks"] == 1
    assert pair.outputs["a"]["ids"] == _colocated(MODEL, [prompt], n=NEW)[0]
    pair.assert_idle_and_accounted()


def test_a_kv_request_from_a_decode_prefill_has_no_record_of_is_refused(pair_factory):
    pair = pair_factory(disaggregation_timeout_s=2.0)
    pair.decode.mode.record = None  # never published
    (prompt,) = _prompts([22])
    pair.submit("a", prompt, greedy(NEW))
    pair.run()
    assert pair.prefill.stats()["kv_requests_refused"] == 1 and pair.prefill.stats()["kv_writes_sent"] == 0
    assert pair.decode.stats()["fallbacks"] == 1  # decode's own deadline: no endpoint to answer at
    assert pair.outputs["a"]["ids"] == _colocated(MODEL, [prompt], n=NEW)[0]
    pair.assert_idle_and_accounted()


def test_a_completion_with_another_nonce_does_not_land_the_room(pair_factory):
    """A forged or stale completion (right room, right write count, wrong nonce) is counted and
    ignored; the room lands on prefill's real completion."""
    pair = pair_factory()
    sender = pair.prefill.mode.sender
    sender.backend = slow = FaultInjectingBackend(sender.backend)
    slow.hold()  # prefill's writes wait until the forgery was read
    (prompt,) = _prompts([31])
    room = pair.submit("a", prompt, greedy(NEW))
    pair.run(until=lambda: room in pair.decode.mode.rooms and pair.prefill.mode.transferring)
    inc = pair.decode.mode.rooms[room].incoming
    ((src, dst), writes), = inc.expected.items()
    forged = KVCompletion(room, inc.nonce % protocol.MAX_NONCE + 1, src, dst, writes, "ok")
    pair.prefill.mode.io.send(pair.decode.mode.io.endpoint, forged)
    pair.run(until=lambda: pair.decode.stats()["stale_messages"] >= 1)
    assert pair.decode.mode.rooms[room].req.state is ReqState.WAITING_FOR_KV
    slow.release()
    pair.run()
    assert pair.decode.stats()["kv_received"] == 1 and pair.decode.stats()["fallbacks"] == 0
    assert pair.outputs["a"]["ids"] == _colocated(MODEL, [prompt], n=NEW)[0]
    pair.assert_idle_and_accounted()


def test_a_paused_prefill_never_writes_pages_decode_gave_to_another_request(pair_factory):
    """The field failure the quarantine exists for: decode declares a paused prefill dead, fails
    R1 over and serves R2; the prefill resumes and finishes R1's writes. R1's pages stay
    quarantined until prefill acknowledges decode's abort, so R2's pages are never among them
    and R2's tokens equal an undisturbed run."""
    pair = pair_factory(page_size=4)
    sender = pair.prefill.mode.sender
    sender.backend = paused = FaultInjectingBackend(sender.backend)
    paused.hold()  # "SIGSTOP": prefill's writes go nowhere until it resumes
    r1, r2 = _prompts([40, 36], seed=3)
    room = pair.submit("r1", r1, greedy(NEW))
    pair.run(until=lambda: pair.prefill.mode.transferring)
    abandoned = set(pair.decode.mode.rooms[room].req.pages)
    pair.decode.mode.io.post(PeersDead(frozenset(pair.decode.mode.directory.sessions())))
    pair.run(until=lambda: pair.decode.stats()["fallbacks"] == 1)
    assert pair.decode.stats()["quarantined_pages"] == len(abandoned)
    resume_at = time.monotonic() + 1.0  # well past any grace a verdict alone once earned
    while time.monotonic() < resume_at:
        _step_decode(pair)
    assert pair.decode.stats()["quarantined_pages"] == len(abandoned)
    pair.submit_local("r2", r2, greedy(NEW))  # decode serves R2 alone, on pages it owns now
    while pair.outputs["r2"]["final"] is None or pair.outputs["r1"]["final"] is None:
        _step_decode(pair)  # the prefill is still "paused": only decode runs
        r2_req = pair.decode.reqs.get("r2")
        if r2_req is not None:
            assert not set(r2_req.pages) & abandoned, "R2 got a page a paused prefill may still write"
    assert pair.decode.stats()["quarantined_pages"] == len(abandoned)  # no ack, no proof of exit: held
    paused.release()  # "SIGCONT": R1's writes land in its quarantined pages; prefill reads the abort
    pair.run()
    assert pair.decode.stats()["quarantined_pages"] == 0  # released on prefill's acknowledgement
    expected = _colocated(MODEL, [r1, r2], n=NEW, page_size=4)
    assert [pair.outputs["r1"]["ids"], pair.outputs["r2"]["ids"]] == expected
    pair.assert_idle_and_accounted()


def _step_decode(pair: PDPair) -> None:
    for o in pair.decode.step():
        acc = pair.outputs.setdefault(o.rid, {"ids": [], "final": None})
        acc["ids"] += o.new_token_ids
        if o.finished:
            acc["final"] = o


def test_prefill_writes_nothing_for_a_room_past_its_deadline(pair_factory):
    """A prefill resumed after its room's deadline posts nothing more for it (decode may have
    leased the pages out by then), fails the room and acknowledges."""
    pair = pair_factory(page_size=4, chunked_prefill_size=8, disaggregation_timeout_s=30.0)
    (prompt,) = _prompts([40], seed=4)
    pair.submit("a", prompt, greedy(NEW))
    pair.run(until=lambda: pair.prefill.mode.sender.rooms)
    (r,) = pair.prefill.mode.sender.rooms.values()
    posted = pair.prefill.stats()["kv_writes_sent"]  # the first chunk's, at most: 4 of its 10 pages
    assert r.next_page < 10
    r.deadline = 0.0  # as if the process had been stopped for longer than the timeout
    pair.run()
    assert pair.prefill.stats()["kv_writes_sent"] == posted
    assert pair.decode.stats()["fallbacks"] == 1 and pair.decode.stats()["quarantined_pages"] == 0
    assert pair.outputs["a"]["ids"] == _colocated(MODEL, [prompt], n=NEW, page_size=4)[0]
    pair.assert_idle_and_accounted()


def test_a_prefill_side_timeout_tells_decode_and_acknowledges(pair_factory, caplog):
    """Prefill gives up on writes that do not land: decode hears it at once (not at its own
    deadline) and its quarantine empties on the acknowledgement, not the lease."""
    pair = pair_factory(prefill_flags={"disaggregation_timeout_s": 1.0},
                        decode_flags={"disaggregation_timeout_s": 60.0})
    sender = pair.prefill.mode.sender
    sender.backend = stuck = FaultInjectingBackend(sender.backend)
    stuck.hold()
    (prompt,) = _prompts([29])
    pair.submit("a", prompt, greedy(NEW))
    pair.run(until=lambda: pair.prefill.stats()["rooms_failed"] == 1)
    pair.run(until=lambda: pair.decode.stats()["fallbacks"] == 1, timeout_s=20)
    assert "prefill gave up: writes not landed" in caplog.text  # not decode's 60 s deadline
    assert pair.decode.stats()["quarantined_pages"] > 0  # the writes may still land
    stuck.release()  # the writes settle: now prefill may acknowledge
    pair.run()
    assert pair.decode.stats()["fallbacks"] == 1 and pair.decode.stats()["quarantined_pages"] == 0
    assert pair.outputs["a"]["ids"] == _colocated(MODEL, [prompt], n=NEW)[0]
    pair.assert_idle_and_accounted()


def test_a_second_request_with_a_live_room_is_refused_and_the_first_completes(pair_factory):
    pair = pair_factory()
    a, b = _prompts([28, 24], seed=5)
    room = pair.submit("a", a, greedy(NEW))
    pair.outputs["b"] = {"ids": [], "final": None}
    pair.decode.add_request("b", b, greedy(NEW), bootstrap=pair.ref(room))
    pair.run()
    assert "already used by a request in flight" in pair.outputs["b"]["final"].finish_reason["message"]
    assert pair.outputs["a"]["ids"] == _colocated(MODEL, [a], n=NEW)[0]
    assert pair.decode.stats()["duplicate_rooms"] == 1
    pair.assert_idle_and_accounted()


def test_decode_abort_of_a_room_prefill_never_saw_is_acknowledged(pair_factory):
    """Decode aborts a room whose KV request prefill refused or forgot: the ack still comes, so
    the quarantine empties at once."""
    pair = pair_factory(disaggregation_timeout_s=30.0)
    send = pair.decode.mode.io.send

    def lose_kv_requests(endpoint, msg):
        if not isinstance(msg, KVRequest):
            send(endpoint, msg)

    pair.decode.mode.io.send = lose_kv_requests
    (prompt,) = _prompts([25])
    pair.submit("a", prompt, greedy(NEW), to_prefill=False)
    pair.run(until=lambda: pair.decode.mode.rooms)
    req = next(iter(pair.decode.mode.rooms.values())).req
    pair.decode.abort(req.rid, "client left")
    pair.run(until=lambda: pair.outputs["a"]["final"] is not None)
    pair.run(timeout_s=20)  # idle includes an empty quarantine: the ack, well before the 60 s lease
    assert pair.decode.stats()["quarantined_pages"] == 0
    pair.assert_idle_and_accounted()


# --- issue 25, finding 2: an API client changes another user's output --------------------------------------


class FakeRegistry:
    """The attacker's bootstrap registry (it holds no token): it replays decode's signed GET to the
    real registry and answers with the real records, every control endpoint replaced by its own
    PULL socket, where it collects decode's sealed frames. ``known``: a snapshot of the real
    registry it learned otherwise (records are no secret), answered when the replay is refused."""

    def __init__(self, real_port: int, known: dict):
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.control = f"tcp://127.0.0.1:{self.pull.bind_to_random_port('tcp://127.0.0.1')}"
        self.replays: list[int] = []
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                headers = {k: v for k, v in self.headers.items() if k.lower().startswith("x-pdserve")}
                req = urllib.request.Request(f"http://127.0.0.1:{real_port}/bootstrap", headers=headers)
                snap, answer_headers = known, {}
                try:
                    with urllib.request.urlopen(req, timeout=5) as resp:
                        snap = json.loads(resp.read())
                        answer_headers = {k: v for k, v in resp.headers.items() if k.lower().startswith("x-pdserve")}
                        fake.replays.append(200)
                except urllib.error.HTTPError as e:
                    fake.replays.append(e.code)
                snap = {**snap, "ranks": [{**r, "control": fake.control} for r in snap["ranks"]]}
                data = json.dumps(snap).encode()
                self.send_response(200)
                for k, v in {**answer_headers, "Content-Type": "application/json",
                             "Content-Length": str(len(data))}.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.http.server_address[1]
        self.thread = threading.Thread(target=self.http.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def frames(self) -> list[bytes]:
        out = []
        while True:
            try:
                out.append(self.pull.recv(zmq.NOBLOCK))
            except zmq.Again:
                return out

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()
        self.pull.close(linger=0)
        self.ctx.term()


def _snapshot(pair: PDPair, token: str) -> dict:
    info = BootstrapClient(auth=PeerAuth(token)).fetch("127.0.0.1", pair.bootstrap.port, timeout_s=10)
    return {"compat": dataclasses.asdict(info.compat), "ranks": [dataclasses.asdict(r) for r in info.ranks],
            "complete": True, "missing": []}


def test_an_api_client_cannot_write_its_kv_into_another_users_cached_prefix(pair_factory):
    """Issue 25, finding 2, as reproduced: a client with the API key only names its own registry
    in a request to decode; it replays decode's signed GET to the real registry, answers with
    records whose control endpoint is its own, collects decode's DecodeRecord and KVRequest, and
    once decode's lease on those pages has lapsed (and a victim's prefix is cached in them)
    replays both frames into prefill together with its own prompt for that room. The victim's
    prompt must still return the colocated tokens, and prefill must write nothing."""
    token = "s3cret"
    pair = pair_factory(page_size=4, disaggregation_auth_token=token, disaggregation_timeout_s=2.0)
    fake = FakeRegistry(pair.bootstrap.port, _snapshot(pair, token))
    peer = RawPeer()
    try:
        atk, victim, evil = _prompts([40, 40, 40], seed=11)
        room = 4242
        pair.outputs["atk"] = {"ids": [], "final": None}
        pair.decode.add_request("atk", atk, greedy(NEW), bootstrap=BootstrapRef("127.0.0.1", fake.port, room))
        pair.run(until=lambda: pair.outputs["atk"]["final"] is not None)
        pair.run()  # the attacker's pages leave quarantine: the lease lapsed
        # Frames travel in clear: the attacker keeps decode's record and KV request, not its abort.
        captured = [f for f in fake.frames() if b'"type":"KVAbort"' not in f]
        pair.submit_local("victim1", victim, greedy(NEW))  # the victim's prefix, cached in the freed pages
        pair.run()
        pair.prefill.add_request("evil", evil, greedy(NEW), bootstrap=pair.ref(room))
        for frame in captured:
            peer.send(pair.prefill.mode.io.endpoint, frame)
        if captured:
            _wait_refused_or_written(pair, len(captured))
        pair.run()
        pair.submit_local("victim2", victim, greedy(NEW))
        pair.run()
        expected = _colocated(MODEL, [victim], n=NEW, page_size=4)[0]
        assert pair.outputs["victim1"]["ids"] == expected
        assert pair.outputs["victim2"]["ids"] == expected, "the attacker's KV reached the victim's cached prefix"
        assert pair.prefill.stats()["kv_writes_sent"] == 0
        assert 200 not in fake.replays  # decode's signed GET is bound to the registry it meant
        assert pair.bootstrap.refused["wrong_target"] == len(fake.replays) >= 1
        assert not captured  # decode took no record from a registry that cannot prove the token
        assert pair.decode.stats()["kv_received"] == 0
        pair.assert_idle_and_accounted()
    finally:
        peer.close()
        fake.close()


def _wait_refused_or_written(pair: PDPair, n: int) -> None:
    pair.run(until=lambda: pair.prefill.stats()["control_refused"] >= n
             or pair.prefill.stats()["kv_writes_sent"] > 0, timeout_s=30)


def _capture_sealed(channel) -> list[bytes]:
    """Every frame ``channel`` seals from now on, as it leaves (what a sniffer on the wire sees)."""
    frames: list[bytes] = []
    seal = channel.auth.seal

    class Capturing:
        token = channel.auth.token

        def seal(self, *args):
            frames.append(seal(*args))
            return frames[-1]

    channel.auth = Capturing()
    return frames


def test_a_control_frame_replayed_after_the_lease_is_refused_and_nothing_is_written(pair_factory):
    """A KV request read off the wire (it travels in clear) and replayed into prefill once the room's
    tombstone and decode's lease are gone, together with an HTTP half for that room carrying
    someone else's prompt: refused as a replay and counted; prefill writes nothing, and the pages
    the original request left in decode's cache still hold its prompt's KV."""
    pair = pair_factory(page_size=4, disaggregation_auth_token="s3cret", disaggregation_timeout_s=1.0)
    sniffed = _capture_sealed(pair.decode.mode.io.channel)
    prompt, evil = _prompts([40, 40], seed=12)
    room = pair.submit("a", prompt, greedy(NEW))
    pair.run()
    writes = pair.prefill.stats()["kv_writes_sent"]
    assert writes > 0 and sniffed
    lapsed = time.monotonic() + 2 * 1.0 + 0.5  # past the room's tombstone and decode's lease (twice the timeout)
    pair.run(until=lambda: time.monotonic() > lapsed)
    peer = RawPeer()
    try:
        pair.prefill.add_request("evil", evil, greedy(NEW), bootstrap=pair.ref(room))
        for frame in sniffed:  # the record and the KV request (not aborts, not progress acknowledgements)
            if b'"type":"KVAbort"' not in frame and b'"type":"KVProgressAck"' not in frame:
                peer.send(pair.prefill.mode.io.endpoint, frame)
        _wait_refused_or_written(pair, 2)  # the record and the KV request
        pair.run()
        assert pair.prefill.stats()["kv_writes_sent"] == writes, "a replayed KV request was served"
        assert pair.prefill.stats()["control_refused_by_reason"] == {"replay": 2}
        pair.submit_local("again", prompt, greedy(NEW))  # served from decode's cache: the pages the replay aimed at
        pair.run()
        expected = _colocated(MODEL, [prompt], n=NEW, page_size=4)[0]
        assert pair.outputs["a"]["ids"] == pair.outputs["again"]["ids"] == expected
        pair.assert_idle_and_accounted()
    finally:
        peer.close()
