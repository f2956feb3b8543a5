"""The scheduler paths disaggregation leans on hardest, each checked token by token against
transformers (or an unconstrained run) and with exact page accounting afterwards: abort in
the middle of a chunked prefill, prefix hits in a table row another request used, a shared
prefix locked by several running requests while eviction runs, and retraction with
seeded sampling, logprobs, stop strings and cached_tokens."""

from __future__ import annotations

import pytest

import pdserve
from fixtures.oracle import assert_no_leak, greedy, random_prompts, run_to_completion, sampling
from fixtures.tiny_models import greedy_continuation, make_hf_model_and_dir
from pdserve.engine.request import ReqState


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(transformers model, checkpoint dir) of the tiny Llama, with the preset tokenizer."""
    return make_hf_model_and_dir("LlamaForCausalLM", tmp_path_factory.mktemp("llama"))


def _vocab(hf) -> int:
    return hf.config.vocab_size


# ------------------------------------------------------------- chunked prefill
def test_abort_during_chunked_prefill(llama):
    """A request aborted between two chunks of its prefill releases its pages, the next
    step goes on with the running request, and the prefix its first chunk cached is correct."""
    hf, path = llama
    short, long = random_prompts([12, 70], _vocab(hf), seed=11)
    engine = pdserve.Engine(model_path=path, page_size=4, chunked_prefill_size=16)
    s = engine.scheduler
    s.add_request("short", short, sampling(greedy(16)))
    early = s.step()  # short's prefill: it is now decoding
    s.add_request("long", long, sampling(greedy(16)))
    early += s.step()  # long's first 16-token chunk
    req = s.reqs["long"]
    assert req.state is ReqState.PREFILLING and 0 < req.kv_len < len(long), req
    s.check_memory()
    assert s.abort("long")
    out = run_to_completion(s)
    assert out["long"]["ids"] == [] and out["long"]["final"].finish_reason["type"] == "abort"
    short_ids = [t for o in early if o.rid == "short" for t in o.new_token_ids] + out["short"]["ids"]
    assert short_ids == greedy_continuation(hf, short, 16)
    assert out["short"]["final"].finish_reason == {"type": "length", "length": 16}
    assert_no_leak(engine)
    again = engine.generate(input_ids=long, sampling_params=greedy(16))
    assert again["meta_info"]["cached_tokens"] == 16  # the aborted request's one full chunk
    assert again["output_ids"] == greedy_continuation(hf, long, 16)
    assert_no_leak(engine)


def test_a_chunked_prefill_goes_on_with_no_request_waiting(llama):
    """A step with no request waiting skips admission (the decode steps' shortcut), but never a
    chunked prefill's next chunk: a lone 70-token prompt in 16-token chunks takes five steps, the
    last of which samples its first token, and its output is transformers'."""
    hf, path = llama
    (prompt,) = random_prompts([70], _vocab(hf), seed=12)
    engine = pdserve.Engine(model_path=path, page_size=4, chunked_prefill_size=16)
    try:
        s = engine.scheduler
        req = s.add_request("long", prompt, sampling(greedy(8)))
        kv_lens = []
        for _ in range(5):
            s.step()
            kv_lens.append(req.kv_len)
        assert kv_lens == [16, 32, 48, 64, 70] and req.state is ReqState.RUNNING, (kv_lens, req)
        assert len(req.output_ids) == 1
        run_to_completion(s)
        assert req.output_ids == greedy_continuation(hf, prompt, 8)
        assert_no_leak(engine)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("scenario", ["another_row", "reused_row"])
def test_prefix_hit_in_a_row_another_request_used_with_chunked_prefill(llama, scenario):
    """C's 40-token prefix comes from B's cached pages, but C's table row last held another
    request's slots (A's: B finished first, so any usual row allocator hands out a row other
    than B's; or, with one row, D overwrote it). Its remaining 30 tokens run in two chunks."""
    hf, path = llama
    a, b, tail, d = random_prompts([20, 40, 30, 48], _vocab(hf), seed=3)
    rows = 4 if scenario == "another_row" else 1
    engine = pdserve.Engine(model_path=path, page_size=4, chunked_prefill_size=16, max_running_requests=rows)
    if scenario == "another_row":
        first = engine.generate(input_ids=[a, b], sampling_params=[greedy(40), greedy(2)])
        assert first[0]["output_ids"] == greedy_continuation(hf, a, 40)
    else:
        engine.generate(input_ids=b, sampling_params=greedy(2))
        engine.generate(input_ids=d, sampling_params=greedy(12))
    c = b + tail
    out = engine.generate(input_ids=c, sampling_params=greedy(24))
    assert out["meta_info"]["cached_tokens"] == 40
    assert out["output_ids"] == greedy_continuation(hf, c, 24)
    assert_no_leak(engine)


# --------------------------------------------------------------- radix cache
def test_shared_prefix_locked_by_running_requests_survives_eviction(llama):
    """Four running requests lock one 32-token prefix while their decode pages must come from
    evicting other cached pages. The prefix was touched (by their admission) before the other
    requests' pages were cached, so least-recently-used order reaches it first: only its lock
    keeps it. Every output is transformers', and the prefix is still cached afterwards."""
    hf, path = llama
    vocab = _vocab(hf)
    prefix, warm_tail, *junk = random_prompts([32, 5, 24, 24, 24], vocab, seed=21)
    tails = random_prompts([6, 6, 6, 6], vocab, seed=22)
    # 40 pages of 4. The warm-up caches the prefix (8 pages) and 2 more. Then the four requests
    # (2 pages each beyond the prefix at admission, 7 at the end) and three 24-token requests
    # (6 pages each, cached when they finish after 2 tokens) share the pool: the pages the four
    # still need while they decode must come from evicting cached ones.
    engine = pdserve.Engine(model_path=path, page_size=4, max_total_tokens=160)
    engine.generate(input_ids=prefix + warm_tail, sampling_params=greedy(4))
    s = engine.scheduler
    assert s.stats()["cached_pages"] == 10  # full pages of 37 + 4 - 1 computed tokens
    reqs = [s.add_request(f"r{i}", prefix + t, sampling(greedy(20))) for i, t in enumerate(tails)]
    others = [s.add_request(f"j{i}", j, sampling(greedy(2))) for i, j in enumerate(junk)]
    locked, cached = [], []  # per step: all four prefix requests running; cached pages after it
    while s.has_work():
        outs = s.step()
        s.check_memory()
        locked.append(all(r in s.running for r in reqs))
        cached.append(s.stats()["cached_pages"])
        assert all(o.cached_tokens == 32 for o in outs if o.rid.startswith("r"))
    # Cached pages were evicted in a step while the four held the prefix locked.
    evicted_while_locked = any(b < a and lk for a, b, lk in zip(cached, cached[1:], locked[1:]))
    assert evicted_while_locked, (locked, cached)
    assert s.stats()["num_retractions"] == 0  # eviction alone made room
    for r, t in zip(reqs, tails):
        assert r.output_ids == greedy_continuation(hf, prefix + t, 20)
    for r, j in zip(others, junk):
        assert r.output_ids == greedy_continuation(hf, j, 2)
    assert_no_leak(engine)
    probe = engine.generate(input_ids=prefix + [7, 7, 7, 7], sampling_params=greedy(2))
    assert probe["meta_info"]["cached_tokens"] == 32  # the locked prefix was never evicted
    assert engine.generate(input_ids=junk[0], sampling_params=greedy(2))["meta_info"]["cached_tokens"] < 24
    assert_no_leak(engine)


# ---------------------------------------------------------------- retraction
def _late_stop(tokenizer, ids: list[int], from_token: int) -> str:
    """A 3-character stop string whose first occurrence in the text of ``ids`` starts inside
    the text of token ``from_token`` or later."""
    full = tokenizer.decode(ids)
    start = len(tokenizer.decode(ids[:from_token]))
    for i in range(start, len(full) - 3):
        stop = full[i:i + 3]
        if full.find(stop) == i and stop.strip() and "\ufffd" not in stop:  # no half-decoded character
            return stop
    raise AssertionError(f"no usable stop string in {full!r}")


def _retraction_params(n: int) -> list[dict]:
    """Seeded sampling for most requests, greedy for every fourth; logprobs for all."""
    # 40 tokens each: long enough to outgrow what admission reserves for decode growth, so the
    # 96-token pool below must retract some of them.
    return [greedy(40) if i % 4 == 3 else {"max_new_tokens": 40, "temperature": 0.8, "top_p": 0.95,
                                           "seed": 1000 + i, "ignore_eos": True} for i in range(n)]


def _run(engine, prompts, params) -> tuple[dict, dict]:
    s = engine.scheduler
    reqs = {f"r{i}": s.add_request(f"r{i}", p, sampling(sp), return_logprob=True)
            for i, (p, sp) in enumerate(zip(prompts, params))}
    return run_to_completion(s), reqs


STOPPED = (5, 6, 7)


def test_retraction_keeps_seeded_sampling_logprobs_stop_strings_and_cached_tokens(llama):
    """Under a pool too small for the batch, retracted requests resume with the same random
    stream, the same logprobs, the same stop-string cut and the cached_tokens of their first
    admission: the client cannot tell a retraction happened."""
    hf, path = llama
    prompts = random_prompts(range(12, 20), _vocab(hf), seed=31)
    params = _retraction_params(len(prompts))
    roomy = pdserve.Engine(model_path=path, page_size=4)
    plain, _ = _run(roomy, prompts, params)
    tok = roomy.tokenizer
    # Late stop strings (after token 30) on seeded and greedy requests, so they are cut only
    # after the retractions the tight pool forces (r5 and r7 among them).
    for i in STOPPED:
        params[i] = {**params[i], "stop": [_late_stop(tok, plain[f"r{i}"]["ids"], 30)]}
    assert roomy.flush_cache()  # so the reference run, like the tight one, starts cold
    want, _ = _run(roomy, prompts, params)
    tight = pdserve.Engine(model_path=path, page_size=4, max_total_tokens=96)
    got, reqs = _run(tight, prompts, params)
    retracted = [rid for rid, r in reqs.items() if r.num_retractions > 0]
    stopped = [rid for rid in retracted if got[rid]["final"].finish_reason["type"] == "stop"]
    assert stopped and any("seed" in params[int(rid[1:])] for rid in stopped), (retracted, stopped)
    for rid, w in want.items():
        g = got[rid]
        assert g["ids"] == w["ids"], rid
        assert g["final"].finish_reason == w["final"].finish_reason, rid
        assert g["logprobs"] == pytest.approx(w["logprobs"], abs=1e-4), rid
        assert g["final"].cached_tokens == w["final"].cached_tokens == 0, rid
    for i in STOPPED:
        assert want[f"r{i}"]["final"].finish_reason == {"type": "stop", "matched": params[i]["stop"][0]}
    assert_no_leak(tight)
