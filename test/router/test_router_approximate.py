"""Cache-aware routing with servers started by hand, without KV events: 2 prefill + 1 decode on
tiny-llama behind ``pdserve router``. The router guesses each prefill's cache from its own routing:
every turn >= 2 of a multi-turn chat goes back to the prefill that served the turn before (the
router's per-worker request counters say which one served each turn), and that prefill reports
>= 90% of the previous turn's prompt cached; new conversations spread over both. One deployment."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
from router_utils import Router, wait_for

from disagg.pd_servers import decode_server, prefill_server, start_all

MODEL = "tiny-llama"
TURNS = 3
OPENERS = ["Tell me a long story about a lighthouse keeper and the sea birds he fed every morning.",
           "Describe, step by step, how a river carves a canyon over a million years of slow work.",
           "Explain to a child why the sky is blue at noon and red in the evening, with an example.",
           "List the things a traveller should pack for a week of walking in the mountains in spring."]
FOLLOW_UPS = ["Go on, and add more detail about the weather.", "Now summarise it in a few words."]


@pytest.fixture(scope="module")
def deployment():
    (p0, boot0), (p1, boot1) = (prefill_server(MODEL) for _ in range(2))  # no --kv-events-config
    d = decode_server(MODEL)
    servers = start_all([p0, p1, d])
    try:
        yield [(p0, boot0), (p1, boot1)], d
    finally:
        for s in servers:
            s.stop()


def served(router: Router, prefills: list[str]) -> dict[str, float]:
    return {url: router.metric("pdserve_router:requests_total", role="prefill", worker=url) for url in prefills}


def test_turns_go_back_to_the_prefill_that_served_the_last_one_without_events(deployment):
    prefills, d = deployment
    urls = [p.url for p, _ in prefills]
    router = Router([(p.url, boot) for p, boot in prefills], [d.url], "--policy", "cache_aware").start()
    try:
        info = wait_for(lambda: (lambda i: i if i["cache_view"]["page_size"] else None)(
            router.get("/get_server_info").json()), 60, "the router to hash prompts")
        assert info["cache_view"]["match_by"] == "tokens"  # the preset's tokenizer, found from the workers
        assert all(w["kv_events"] is None and w["cache_view"]["source"] == "approximate" for w in info["prefill"])
        assert all(w["cache_view"]["approximate"]["pool_known"] for w in info["prefill"])
        conversations = [converse(router, urls, opener) for opener in OPENERS]
        hits = sum(router.metric("pdserve_router:policy_decisions_total", role="prefill", worker=url,
                                 policy="cache_aware", reason="cache_hit") for url in urls)
        # said at info on the first health round after the tokenizer loaded, which may come after the turns
        output = wait_for(partial(log_saying, router, "publishes no KV events: cache_aware guesses"), 30,
                          "the no-events line")
    finally:
        assert router.stop() == 0
    for turns in conversations:
        where = [w for w, _, _ in turns]
        assert where == [where[0]] * TURNS, turns  # every later turn back to the first turn's prefill
        assert all(cached >= 0.9 * prev for (_, _, cached), (_, prev, _) in zip(turns[1:], turns)), turns
    assert {turns[0][0] for turns in conversations} == set(urls)  # not everything to one prefill
    assert hits == len(OPENERS) * (TURNS - 1)
    assert " WARNING " not in output and " ERROR " not in output, output


def log_saying(router: Router, line: str) -> str | None:
    """The router's log so far, once it holds ``line``."""
    router.log.flush()
    text = Path(router.log.name).read_text(errors="replace")
    return text if line in text else None


def served_by(router: Router, urls: list[str], before: dict[str, float]) -> str | None:
    """The prefill that took the one request sent since ``before`` (None until it is counted)."""
    after = served(router, urls)
    if sum(after.values()) != sum(before.values()) + 1:
        return None
    (where,) = [url for url in urls if after[url] == before[url] + 1]
    return where


def converse(router: Router, urls: list[str], opener: str) -> list[tuple[str, int, int]]:
    """One chat, a turn at a time: per turn (the prefill that served it, prompt tokens, cached tokens)."""
    messages = [{"role": "user", "content": opener}]
    turns = []
    for t in range(TURNS):
        before = served(router, urls)
        r = router.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 8, "temperature": 0},
                        timeout=120)
        assert r.status_code == 200, r.text
        where = wait_for(partial(served_by, router, urls, before), 30, "the prefill half counted")
        usage = r.json()["usage"]
        turns.append((where, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]))
        messages += [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]}]
        if t < TURNS - 1:
            messages += [{"role": "user", "content": FOLLOW_UPS[t]}]
    return turns
