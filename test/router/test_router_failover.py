"""``pdserve router`` in front of 1 prefill + 2 decode real servers (tiny-llama, real Mooncake), all
started with ``--api-key`` and ``--admin-api-key``: the router's own keys and the keys it sends the
workers, and a client's request that another client cannot abort through the router; then kill -9 of
the decode serving a stream mid-stream, and the client's one stream carries the same greedy tokens
and text as an undisturbed run (the router resumes it on the other decode)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import httpx
import pytest
from router_utils import Router

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "disagg"))
from pd_servers import decode_server, kill9, prefill_server, start_all  # noqa: E402

MODEL = "tiny-llama"
KEY = "worker-secret"
ADMIN_KEY = "admin-secret"
FLAGS = ("--max-total-tokens", "8192", "--num-threads", "1", "--api-key", KEY, "--admin-api-key", ADMIN_KEY)
AUTH = {"Authorization": f"Bearer {KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
# The kill must land while the decode still generates: once the router has read the whole stream from
# it, there is nothing to resume. The client reads its events behind the router (and, in a loaded CI
# run, far behind), so the kill comes early in a long stream: 475 tokens still to generate.
RESUMED = {"max_new_tokens": 480, "temperature": 0.0, "ignore_eos": True}
KILL_AFTER_EVENTS = 5


@pytest.fixture(scope="module")
def pd():
    prefill, boot = prefill_server(MODEL, *FLAGS)
    decodes = [decode_server(MODEL, *FLAGS) for _ in range(2)]
    router = None
    try:
        start_all([prefill, *decodes])
        router = Router([(prefill.url, boot)], [d.url for d in decodes], "--policy", "round_robin",
                        "--api-key", KEY, "--admin-api-key", ADMIN_KEY).start()
        yield prefill, decodes, router
    finally:
        if router is not None:
            assert router.stop() == 0, router.output()
        for s in (prefill, *decodes):
            s.stop()


def stream(url: str, body: dict, on_event=None, headers: dict = AUTH) -> list[dict]:
    """The events of one streamed /generate; ``on_event(i, event)`` after event i arrives."""
    out = []
    with httpx.stream("POST", url + "/generate", json={**body, "stream": True}, headers=headers, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
                if on_event is not None:
                    on_event(len(out), out[-1])
            elif line == "data: [DONE]":
                out.append("[DONE]")
    return out


def test_api_keys_with_servers_that_require_one(pd):
    prefill, decodes, router = pd
    body = {"text": "Keys", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    assert router.post("/generate", json=body, headers={}).status_code == 401
    ok = router.post("/generate", json=body, headers=AUTH)
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 4
    assert router.post("/flush_cache", headers=AUTH).status_code == 403  # the inference key is not the admin's
    assert router.post("/flush_cache", headers=ADMIN).json()["success"] is True  # the key reached every worker
    assert router.post("/abort_request", json={"rid": "nobody"}, headers=AUTH).json()["success"] is True
    assert router.get("/health_generate", headers={}).status_code == 401  # it generates: a client's call
    assert router.get("/health", headers={}).status_code == 200  # the probe stays open
    health = router.get("/health_generate", headers=AUTH)
    assert health.status_code == 200 and [w["status"] for w in health.json()["workers"]] == [200] * 3
    own = Router([(prefill.url, pd_boot(prefill))], [decodes[0].url], "--api-key", "client-key",
                 "--worker-api-key", KEY).start()
    try:
        assert own.post("/generate", json=body, headers=AUTH).status_code == 401  # the workers' key is not its own
        again = own.post("/generate", json=body, headers={"Authorization": "Bearer client-key"})
        assert again.status_code == 200 and again.json()["output_ids"] == ok.json()["output_ids"]
        assert own.get("/get_server_info", headers={"Authorization": "Bearer client-key"}).json()[
            "decode"][0]["server_info"]["disaggregation_mode"] == "decode"
    finally:
        assert own.stop() == 0, own.output()


def test_a_client_cannot_abort_another_clients_request_through_the_router(pd):
    """Both hold the one inference key; only the X-Client-Token differs. The router forwards the
    token on the request and on the abort, and the other client's abort reaches nothing on the workers
    (rids live in their owner's namespace; it answers as for an unknown rid)."""
    _, _, router = pd
    body = {"text": "Mine", "sampling_params": {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True}}

    def foreign_then_own_abort(rid: str, owner: dict):
        # The stream is long (2000 tokens): at event 2 the decode still runs it, so the refusal comes
        # from the worker that holds it, not from a request that had already ended (a 64-token stream
        # could finish on the decode before the client read its second event, and the abort found
        # nothing to refuse). Its owner then ends it, which shows mallory's abort stopped nothing.
        def on_event(i: int, _event: dict):
            if i == 2:
                r = router.post("/abort_request", json={"rid": rid}, headers={**AUTH, "X-Client-Token": "mallory"})
                assert r.status_code == 200, r.text  # answered as an unknown rid: it reached nothing
            elif i == 4:
                r = router.post("/abort_request", json={"rid": rid}, headers=owner)
                assert r.status_code == 200, r.text
        return on_event

    alice = {**AUTH, "X-Client-Token": "alice"}
    long_body = {**body, "sampling_params": {**body["sampling_params"], "max_new_tokens": 2000}}
    events = stream(router.url, {**long_body, "rid": "alice-1"}, foreign_then_own_abort("alice-1", alice),
                    headers=alice)
    assert events[-1] == "[DONE]" and events[-2]["meta_info"]["finish_reason"]["type"] == "abort"
    assert 4 <= len(events[-2]["output_ids"]) < 2000  # it ran past mallory's abort, to its owner's

    def admin_abort(i: int, _event: dict):
        if i == 2:
            assert router.post("/abort_request", json={"rid": "alice-2"}, headers=ADMIN).status_code == 200

    events = stream(router.url, {**body, "rid": "alice-2", "sampling_params": {**body["sampling_params"],
                                                                               "max_new_tokens": 2000}},
                    admin_abort, headers=alice)
    assert [e for e in events if e != "[DONE]"][-1]["meta_info"]["finish_reason"]["type"] == "abort"


def same_text_but_a_split_character(got: str, want: str) -> bool:
    """``got`` is ``want``, or differs at one place only, the way router/resume.py documents: a
    character whose UTF-8 bytes span the resume point. The decode that died held its first bytes
    back (waiting for the rest); the resumed decode starts after them, so it renders the rest, if
    any, as U+FFFD. So one spot of ``want`` (U+FFFD's, or one non-ASCII character among them)
    reads as U+FFFD's, or nothing, in ``got``. Where the router's resume point falls is timing (the
    events it had relayed, not those the client had read when it killed the decode)."""
    if got == want:
        return True
    i = 0
    while i < min(len(got), len(want)) and got[i] == want[i]:
        i += 1
    k = 0
    while k < min(len(got), len(want)) - i and got[-1 - k] == want[-1 - k]:
        k += 1
    spot_w, spot_g = want[i:len(want) - k], got[i:len(got) - k]
    return (re.fullmatch("\ufffd*[^\x00-\x7f]?\ufffd*", spot_w) is not None
            and re.fullmatch("\ufffd*", spot_g) is not None and spot_w != spot_g and spot_w != "")


def test_split_character_rule_allows_only_the_held_back_bytes():
    assert same_text_but_a_split_character("grey colum", "grey colum")
    assert same_text_but_a_split_character("grey colum", "grey\ufffd colum")
    assert same_text_but_a_split_character("grey colum", "grey\ufffd\ufffd colum")
    assert same_text_but_a_split_character("dro\ufffd Will", "dro\u00ed Will")  # í's second byte alone
    assert not same_text_but_a_split_character("grey colum", "grey\ufffd colum\ufffd x")  # two places
    assert not same_text_but_a_split_character("grey column", "grey\ufffd colum")  # anything else
    assert not same_text_but_a_split_character("grey\ufffd colum", "grey colum")  # an added one
    assert not same_text_but_a_split_character("dro Will", "droi Will")  # ASCII is never split


def pd_boot(prefill) -> int:
    cmd = prefill.cmd
    return int(cmd[cmd.index("--disaggregation-bootstrap-port") + 1])


def test_decode_killed_mid_stream_is_resumed_on_the_other(pd):
    """A text prompt: the router asks the surviving decode for the prompt's ids first."""
    prefill, decodes, router = pd
    body = {"text": "Once upon a time, in a land far away,", "sampling_params": RESUMED}
    undisturbed = stream(router.url, body)
    killed = []

    def kill_midway(i: int, _event: dict):
        if i == KILL_AFTER_EVENTS:  # the decode serving this stream, as the router sees it
            busy = [d for d in decodes if router.worker_state(d.url)["in_flight"] == 1]
            assert len(busy) == 1
            kill9(busy[0])
            killed.append(busy[0])

    got = stream(router.url, body, kill_midway)
    assert killed and killed[0].proc.poll() is not None  # it died with the stream open
    assert got[-1] == "[DONE]" and all("error" not in e for e in got[:-1])
    final, want = got[-2], undisturbed[-2]
    assert final["output_ids"] == want["output_ids"] and len(want["output_ids"]) == RESUMED["max_new_tokens"]
    assert same_text_but_a_split_character(final["text"], want["text"])
    assert all(e["output_ids"] == want["output_ids"][:len(e["output_ids"])] for e in got[:-1])  # one stream
    assert final["meta_info"]["completion_tokens"] == RESUMED["max_new_tokens"]
    assert router.metric("pdserve_router:resumed_streams_total") == 1
    assert [router.worker_state(d.url)["in_flight"] for d in decodes] == [0, 0]
