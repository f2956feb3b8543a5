"""The router's cache view and cache_aware's choices without servers: a fake worker API answers
``/get_server_info`` and ``/get_model_info``; KV events are fed to unstarted subscribers by hand
(no socket, a fake clock). What is routed is recorded as the router's guess; fresh events replace
the guess, stale ones fall back to it; two routers fed the same events choose alike."""

from __future__ import annotations

import asyncio
import json
import logging
import random

import orjson

from pdserve.assets import preset_dir
from pdserve.obs.kv_event_publisher import EventCurveKeys
from pdserve.router.app import build_context
from pdserve.router.cache_view import MATCH_TEXT, MATCH_TOKENS, PrefixView
from pdserve.router.config import PrefillSpec, RouterArgs
from pdserve.router.kv_events import KVEventSubscriber
from pdserve.router.kv_index import prompt_block_hashes
from pdserve.router.proxy import UpstreamReply

P0, P1, D = "http://127.0.0.1:20001", "http://127.0.0.1:20002", "http://127.0.0.1:20003"
PAGE = 4
TINY = str(preset_dir("tiny-llama"))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeWorkers:
    """``PDProxy.call`` answered from dicts; a path missing from ``answers`` fails like a dead worker."""

    def __init__(self, total_pages: int = 1000, tokenizer_path: str | None = TINY):
        self.info = {"page_size": PAGE, "total_pages": total_pages, "free_pages": total_pages}
        self.model: dict | None = {"tokenizer_path": tokenizer_path}
        self.asked: list[str] = []

    async def __call__(self, w, method, path, timeout=None, json_body=None, headers=None) -> UpstreamReply:
        self.asked.append(path)
        body = {"/get_server_info": self.info, "/get_model_info": self.model}.get(path)
        if body is None:
            raise ConnectionError(f"{w.url}{path}: no answer")
        return UpstreamReply(200, json.dumps(body).encode(), "application/json")


def router(workers: FakeWorkers, seed: int = 0, tokenizer_path: str | None = None, **flags):
    args = RouterArgs(prefill=(PrefillSpec(P0), PrefillSpec(P1)), decode=(D,), tokenizer_path=tokenizer_path,
                      **flags)
    ctx = build_context(args, random.Random(seed))
    for s in ctx.sets:
        for w in s.workers:
            s.mark_alive(w)
    ctx.cache.call = workers
    refresh(ctx)
    return ctx


def refresh(ctx) -> None:
    """One refresh after a health round, and the tokenizer's load (on its thread) it may start."""
    async def run() -> None:
        await ctx.cache._refresh()
        for _ in range(1200):
            if not ctx.cache._loading:
                break
            await asyncio.sleep(0.05)
        await ctx.cache._refresh()

    asyncio.run(run())


def route(ctx, body: dict, path: str = "/generate") -> tuple[str, str]:
    """(the prefill chosen, why) for one request, its lease released at once."""
    lease = ctx.prefill.pick(block_hashes=ctx.cache.prompt_hashes(path, body))
    lease.release()
    placement = ctx.cache.take_placement()
    if placement is not None:  # as the proxy does once the workers accepted the request
        ctx.cache.accepted(placement)
    return lease.worker.url, ctx.prefill.policy.reason


def view(ctx, url: str) -> PrefixView:
    kv = next(w for w in ctx.prefill.workers if w.url == url).kv
    assert isinstance(kv, PrefixView)
    return kv


def follow(ctx, url: str, blocks: list[int], clock: Clock) -> KVEventSubscriber:
    """``url``'s view follows events (by hand) whose snapshot holds ``blocks``."""
    snapshot = {"seq": 1, "epoch": 7, "blocks": [{"block_hash": h} for h in blocks]}
    events = KVEventSubscriber(url, "tcp://127.0.0.1:1", lambda: snapshot, stale_s=5.0, clock=clock)
    events.handle([b"", (1).to_bytes(8, "big"), orjson.dumps({"seq": 1, "epoch": 7, "events": []})])
    assert events.fresh
    view(ctx, url).events = events
    return events


def ids(n: int, start: int) -> list[int]:
    return list(range(start, start + n))


def test_a_conversation_goes_back_where_its_last_turn_was_routed():
    ctx = router(FakeWorkers())
    assert ctx.cache.match_by == MATCH_TOKENS and ctx.cache.page_size == PAGE
    turn = ids(40, 100)
    first, why = route(ctx, {"input_ids": turn})
    assert why == "load"
    for t in range(4):
        turn = turn + ids(12, 1000 * (t + 1))
        assert route(ctx, {"input_ids": turn}) == (first, "cache_hit")
    spread = {route(ctx, {"input_ids": ids(40, 5000 + 100 * c)})[0] for c in range(16)}
    assert spread == {P0, P1}  # new conversations: by the prompt's hash, over both workers
    assert view(ctx, first).status()["source"] == "approximate" and view(ctx, first).pool_known


def test_no_approximate_index_routes_a_worker_without_events_as_caching_nothing():
    ctx = router(FakeWorkers(), approximate_index=False)
    turn = ids(40, 100)
    assert route(ctx, {"input_ids": turn})[1] == "load"
    assert route(ctx, {"input_ids": turn + ids(12, 1000)})[1] == "load"
    assert view(ctx, P0).guess.num_blocks == view(ctx, P1).guess.num_blocks == 0


def test_the_guess_forgets_at_the_worker_s_pool_size_and_on_a_flush():
    ctx = router(FakeWorkers(total_pages=30))
    a = ids(41, 100)  # 10 pages
    where, _ = route(ctx, {"input_ids": a})
    assert view(ctx, where).guess.capacity == 30
    for c in range(8):  # 80 more pages, half of them to a's worker (ties go to the smaller cache)
        route(ctx, {"input_ids": ids(41, 10_000 * (c + 1))})
    assert all(len(view(ctx, u).guess) <= 30 for u in (P0, P1))
    assert view(ctx, where).guess.evicted > 0
    assert route(ctx, {"input_ids": a + [1, 2, 3, 4]})[1] == "load"  # a's pages were forgotten
    assert view(ctx, where).guess.matched_blocks(prompt_block_hashes(a, PAGE)) == 10  # routed again just now
    ctx.cache.forget()
    assert view(ctx, P0).guess.num_blocks == view(ctx, P1).guess.num_blocks == 0


def test_fresh_events_replace_the_guess_and_stale_ones_fall_back_to_it():
    ctx = router(FakeWorkers())
    prompt = ids(33, 100)
    hashes = prompt_block_hashes(prompt, PAGE)
    guessed, _ = route(ctx, {"input_ids": prompt})
    other = P1 if guessed == P0 else P0
    clock = Clock()
    follow(ctx, guessed, [], clock)  # its events: it holds nothing (say, it was flushed)
    follow(ctx, other, hashes, clock)  # the other one holds the prompt
    assert view(ctx, guessed).on_events and view(ctx, guessed).matched_blocks(hashes) == 0
    assert view(ctx, other).matched_blocks(hashes) == len(hashes)
    assert route(ctx, {"input_ids": prompt + [9]}) == (other, "cache_hit")
    clock.now += 6.0  # both streams silent past stale_s: the router's guesses again
    assert not view(ctx, guessed).on_events and view(ctx, guessed).status()["source"] == "approximate"
    assert view(ctx, guessed).matched_blocks(hashes) == len(hashes)
    assert route(ctx, {"input_ids": prompt + [9]})[1] == "cache_hit"  # both guessed it now: either
    status = ctx.cache.status(next(w for w in ctx.prefill.workers if w.url == other))
    assert status["kv_events"]["fresh"] is False and status["cache_view"]["source"] == "approximate"


def test_two_routers_fed_the_same_events_choose_alike():
    """Replicas behind one Service: each counts only its own in-flight requests and keeps its own
    guesses, but with the same events and no load they agree, ties included (rendezvous hashing)."""
    a, b = router(FakeWorkers(), seed=1), router(FakeWorkers(), seed=2)
    held = {P0: ids(21, 100), P1: ids(21, 200)}
    prompts = []
    for k in range(12):
        prompts += [held[P0] + ids(8, 1000 * k), held[P1] + ids(8, 1000 * k), ids(21, 50_000 + 100 * k)]
    for ctx in (a, b):
        clock = Clock()
        for url, tokens in held.items():
            follow(ctx, url, prompt_block_hashes(tokens, PAGE), clock)
    choices = [(route(a, {"input_ids": p}), route(b, {"input_ids": p})) for p in prompts]
    assert all(x == y for x, y in choices), choices
    assert [c[0] for c, _ in choices[:3]] == [P0, P1, choices[2][0][0]]
    ties = [c for c, _ in choices if c[1] == "load"]
    assert len(ties) == 12 and {url for url, _ in ties} == {P0, P1}
    # the control: breaking ties at random (no observer), the same two routers soon disagree
    for ctx in (a, b):
        ctx.prefill.policy.observer = None
    fresh = [ids(21, 90_000 + 100 * k) for k in range(30)]
    assert [route(a, {"input_ids": p}) for p in fresh] != [route(b, {"input_ids": p}) for p in fresh]


def test_without_a_local_tokenizer_prompts_are_matched_by_text_said_once_when_final(caplog):
    workers = FakeWorkers(tokenizer_path="some-org/hub-model")  # not a local directory
    workers.model = None  # /get_model_info does not answer yet
    caplog.set_level(logging.DEBUG, logger="pdserve.router")
    ctx = router(workers)
    chat = {"messages": [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]}
    assert ctx.cache.match_by is None and ctx.cache.prompt_hashes("/v1/chat/completions", chat) == []
    assert not [r for r in caplog.records if "tokenizer" in r.getMessage()]  # nothing final to say yet
    workers.model = {"tokenizer_path": "some-org/hub-model"}
    refresh(ctx)
    refresh(ctx)
    said = [r for r in caplog.records if "tokenizer" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO and "by their text" in said[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert ctx.cache.match_by == MATCH_TEXT
    first, _ = route(ctx, chat, "/v1/chat/completions")
    chat["messages"] += [{"role": "assistant", "content": "Once upon a time, on a rock in the sea..."},
                         {"role": "user", "content": "Go on."}]
    assert route(ctx, chat, "/v1/chat/completions") == (first, "cache_hit")


def test_a_given_tokenizer_decides_at_once():
    ctx = router(FakeWorkers(tokenizer_path=None), tokenizer_path=TINY)
    assert ctx.cache.match_by == MATCH_TOKENS and ctx.cache.tokenizer is not None
    chat = {"messages": [{"role": "user", "content": "Describe how a river carves a canyon, step by step."}]}
    assert len(ctx.cache.prompt_hashes("/v1/chat/completions", chat)) > 5


def test_the_router_hashes_under_the_deployment_key_and_skips_a_worker_keyed_otherwise(tmp_path, monkeypatch, caplog):
    """Workers publish keyed hashes (--kv-hash-key-file): the router hashes prompts under the same key,
    and a worker whose key check differs is not followed (its events would never match)."""
    from pdserve.config import KV_HASH_KEY_ENV, resolve_kv_hash_key
    from pdserve.router.kv_index import key_check

    monkeypatch.delenv(KV_HASH_KEY_ENV, raising=False)
    key_file = tmp_path / "kv.key"
    key_file.write_text("deployment-secret\n")
    key = resolve_kv_hash_key(str(key_file))
    workers = FakeWorkers()
    workers.info = {**workers.info, "kv_events_endpoint": "tcp://127.0.0.1:1",
                    "kv_hash_key_check": key_check(resolve_kv_hash_key(None, {KV_HASH_KEY_ENV: "another"}))}
    caplog.set_level(logging.ERROR, "pdserve.router.cache_view")
    ctx = router(workers, tokenizer_path=TINY, kv_hash_key_file=str(key_file))
    body = {"input_ids": list(range(1, 18))}
    assert ctx.cache.prompt_hashes("/generate", body) == prompt_block_hashes(body["input_ids"], PAGE, key)
    assert ctx.cache.prompt_hashes("/generate", body) != prompt_block_hashes(body["input_ids"], PAGE)
    salted = {**body, "cache_salt": "tenant-a"}  # a salted request: the worker's salted tree, hashed so
    assert ctx.cache.prompt_hashes("/generate", salted) == prompt_block_hashes(body["input_ids"], PAGE, key, "tenant-a")
    assert set(ctx.cache.prompt_hashes("/generate", salted)).isdisjoint(ctx.cache.prompt_hashes("/generate", body))
    assert view(ctx, P0).events is None and view(ctx, P1).events is None
    assert any("another key" in r.getMessage() and P0 in r.getMessage() for r in caplog.records)
    workers.info["kv_hash_key_check"] = key_check(key)
    refresh(ctx)
    try:
        assert view(ctx, P0).events is not None  # the same key: followed
        assert view(ctx, P0).events.curve is None  # a loopback publisher: plain
        for url in (P0, P1):
            view(ctx, url).unfollow()
        workers.info.update(kv_events_endpoint="tcp://0.0.0.0:2", kv_events_curve=True)  # reachable from elsewhere
        refresh(ctx)
        assert view(ctx, P0).events.curve == EventCurveKeys.from_hash_key(key)  # CURVE under the deployment key
    finally:
        for url in (P0, P1):
            view(ctx, url).unfollow()
