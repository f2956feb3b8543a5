"""Cache-aware routing through real P/D servers: 2 prefill (publishing KV events) + 1 decode on
tiny-llama behind ``pdserve router``. Multi-turn chats: with cache_aware every turn >= 2 lands on
the prefill holding its history (``cached_tokens`` >= 90% of the previous turn's prompt); with
round_robin they do not; the answers are the same token for token. One deployment for the module."""

from __future__ import annotations

import json
import time

import pytest
from router_utils import Router

from disagg.pd_servers import decode_server, prefill_server, start_all

MODEL = "tiny-llama"
EVENTS = json.dumps({"publisher": "zmq", "endpoint": "tcp://127.0.0.1:*"})
TURNS = 3
OPENERS = ["Tell me a long story about a lighthouse keeper and the sea birds he fed every morning.",
           "Describe, step by step, how a river carves a canyon over a million years of slow work."]
FOLLOW_UPS = ["Go on, and add more detail about the weather.", "Now summarise it in a few words."]


@pytest.fixture(scope="module")
def deployment():
    (p0, boot0), (p1, boot1) = (prefill_server(MODEL, "--kv-events-config", EVENTS) for _ in range(2))
    d = decode_server(MODEL)
    servers = start_all([p0, p1, d])
    try:
        yield [(p0, boot0), (p1, boot1)], d
    finally:
        for s in servers:
            s.stop()


def start_router(deployment, policy: str) -> Router:
    prefills, d = deployment
    r = Router([(p.url, boot) for p, boot in prefills], [d.url], "--policy", policy).start()
    if policy == "cache_aware":
        wait_until(lambda: all((w["kv_events"] or {}).get("fresh") for w in prefill_views(r)),
                   "the router to follow both prefills' KV events", r)
    return r


def prefill_views(router: Router) -> list[dict]:
    return router.get("/get_server_info").json()["prefill"]


def wait_until(condition, what: str, router: Router, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}:\n{router.output()}")
        time.sleep(0.1)


def settled(router: Router, prefills) -> bool:
    """The router's index of each prefill is current to its last event batch."""
    views = {w["url"]: w["kv_events"] for w in prefill_views(router)}
    # a prefill the router lists nowhere (yet) is not settled: wait_until's timeout then shows the router's log
    return all(p.url in views and (views[p.url] or {}).get("seq") == p.info()["kv_events_seq"] for p, _ in prefills)


def chat(router: Router, prefills, policy: str) -> list[tuple[int, int, str]]:
    """Every conversation's turns: (prompt tokens, cached tokens, answer)."""
    turns = []
    for opener in OPENERS:
        messages = [{"role": "user", "content": opener}]
        for t in range(TURNS):
            r = router.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 8, "temperature": 0},
                            timeout=120)
            assert r.status_code == 200, r.text
            body = r.json()
            answer = body["choices"][0]["message"]["content"]
            turns.append((body["usage"]["prompt_tokens"], body["usage"]["prompt_tokens_details"]["cached_tokens"],
                          answer))
            messages += [{"role": "assistant", "content": answer}]
            if t < TURNS - 1:
                messages += [{"role": "user", "content": FOLLOW_UPS[t]}]
            if policy == "cache_aware":  # the next turn is routed on what the prefills hold now
                wait_until(lambda: settled(router, prefills), "the KV events of this turn", router)
    return turns


def later_turns_hit(turns: list[tuple[int, int, str]]) -> list[bool]:
    """Per turn >= 2: did it report >= 90% of the previous turn's prompt as cached?"""
    out = []
    for c in range(len(OPENERS)):
        conv = turns[c * TURNS:(c + 1) * TURNS]
        out += [conv[t][1] >= 0.9 * conv[t - 1][0] for t in range(1, TURNS)]
    return out


def test_cache_aware_finds_the_history_round_robin_does_not(deployment):
    prefills, _ = deployment
    router = start_router(deployment, "cache_aware")
    try:
        aware = chat(router, prefills, "cache_aware")
        hits = router.metric("pdserve_router:policy_decisions_total", role="prefill", worker=prefills[0][0].url,
                             policy="cache_aware", reason="cache_hit")
        hits += router.metric("pdserve_router:policy_decisions_total", role="prefill", worker=prefills[1][0].url,
                              policy="cache_aware", reason="cache_hit")
        predicted = sum(router.metric("pdserve_router:predicted_cached_tokens_total", role="prefill", worker=p.url)
                        for p, _ in prefills)
        reported = sum(router.metric("pdserve_router:reported_cached_tokens_total", role="prefill", worker=p.url)
                       for p, _ in prefills)
        assert router.post("/flush_cache").status_code == 200
    finally:
        assert router.stop() == 0
    assert all(later_turns_hit(aware)), aware
    assert hits >= len(OPENERS) * (TURNS - 1)  # every later turn (an opener may share the template head)
    assert 0 < predicted <= reported  # the router's prediction never claims more than the servers found

    router = start_router(deployment, "round_robin")
    try:
        robin = chat(router, prefills, "round_robin")
    finally:
        assert router.stop() == 0
    assert not any(later_turns_hit(robin)), robin
    assert [t[2] for t in robin] == [t[2] for t in aware]  # same answers whichever prefill computed them


def test_two_router_replicas_fed_the_same_events_keep_conversations_together(deployment):
    """Replicas behind one Service: turns of one conversation alternate between two routers; each
    later turn still goes to the prefill holding its history (each replica learns it from the same
    KV events, not from having routed the turn before)."""
    prefills, _ = deployment
    replicas = [start_router(deployment, "cache_aware") for _ in range(2)]
    try:
        assert replicas[0].post("/flush_cache").status_code == 200
        turns = []
        for c, opener in enumerate(OPENERS):
            messages = [{"role": "user", "content": opener}]
            for t in range(TURNS):
                router = replicas[(c + t) % 2]
                r = router.post("/v1/chat/completions", timeout=120,
                                json={"messages": messages, "max_tokens": 8, "temperature": 0})
                assert r.status_code == 200, r.text
                usage = r.json()["usage"]
                turns.append((usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"], ""))
                messages += [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]}]
                if t < TURNS - 1:
                    messages += [{"role": "user", "content": FOLLOW_UPS[t]}]
                for replica in replicas:
                    wait_until(lambda r=replica: settled(r, prefills), "the KV events of this turn", replica)
        hits = [sum(r.metric("pdserve_router:policy_decisions_total", role="prefill", worker=p.url,
                             policy="cache_aware", reason="cache_hit") for p, _ in prefills) for r in replicas]
    finally:
        for replica in replicas:
            assert replica.stop() == 0
    assert all(later_turns_hit(turns)), turns
    assert all(h >= 1 for h in hits) and sum(hits) >= len(OPENERS) * (TURNS - 1), hits  # both replicas did
