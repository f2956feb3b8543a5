"""Overlap scheduling (engine/overlap.py): the decode step runs one step ahead on a worker thread and
gives the plain loop's tokens, streams nothing after a request's end, and keeps the page books."""

import pytest
import torch

import pdserve
from pdserve.engine.request import SamplingParams

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def engines():
    """(plain, overlapped) engines of one model and flags, made when first asked for."""
    made: dict[str, tuple[pdserve.Engine, pdserve.Engine]] = {}

    def get(**kw) -> tuple[pdserve.Engine, pdserve.Engine]:
        key = repr(sorted(kw.items()))
        if key not in made:
            base = {"model_path": MODEL, "num_threads": 1, "page_size": 4, **kw}
            made[key] = (pdserve.Engine(**base, disable_overlap_schedule=True), pdserve.Engine(**base))
            assert not made[key][0].scheduler.overlap and made[key][1].scheduler.overlap
        return made[key]

    yield get
    for pair in made.values():
        for e in pair:
            e.shutdown()


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1500, (3 + 7 * i,), generator=g).tolist() for i in range(n)]


def _greedy(n, **kw):
    return {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True, **kw}


def _both(engines, flags, prompts, sps, **kw):
    plain, over = engines(**flags)
    outs = [e.generate(input_ids=prompts, sampling_params=sps, **kw) for e in (plain, over)]
    for e in (plain, over):
        _no_leak(e)
    return outs


def _no_leak(engine):
    s = engine.scheduler
    s.check_memory()
    assert not s.has_work()
    assert s.allocator.num_free + s.cache.num_cached_pages == s.allocator.num_pages


def _ids(outs):
    return [o["output_ids"] for o in outs]


def test_on_by_default_and_shown_in_stats(engines):
    plain, over = engines()
    assert over.get_server_info()["overlap_schedule"] is True
    assert plain.get_server_info()["overlap_schedule"] is False


def test_mixed_lengths_chunked_prefill_and_max_tokens_match_the_plain_loop(engines):
    prompts = _prompts(10)  # 3..66 tokens: several chunks of 16 for the long ones
    sps = [_greedy(1 + 5 * i) for i in range(10)]  # 1..46 new tokens: requests end at every step
    plain, over = _both(engines, {"chunked_prefill_size": 16}, prompts, sps)
    assert _ids(over) == _ids(plain)
    assert [len(o["output_ids"]) for o in over] == [1 + 5 * i for i in range(10)]


def test_stop_tokens_and_stop_strings_match_the_plain_loop(engines):
    """Ends only sampling can tell (a stop token, a stop string): the step in flight then holds a
    token the request must not get."""
    plain, over = engines()
    prompts = _prompts(6, seed=1)
    free = _ids(plain.generate(input_ids=prompts, sampling_params=_greedy(20)))
    sps = [_greedy(20, stop_token_ids=[ids[3 + i]]) for i, ids in enumerate(free)]
    a, b = (_ids(e.generate(input_ids=prompts, sampling_params=sps)) for e in (plain, over))
    assert b == a and all(len(x) < 20 for x in b)
    text = plain.tokenizer.decode(free[0][4:7])
    stop = [_greedy(20, stop=[text])] * 2
    a, b = (e.generate(input_ids=prompts[:2], sampling_params=stop) for e in (plain, over))
    assert [o["text"] for o in b] == [o["text"] for o in a]
    assert b[0]["meta_info"]["finish_reason"] == {"type": "stop", "matched": text}
    for e in engines():
        _no_leak(e)


def test_seeded_sampling_logprobs_and_penalties_match_the_plain_loop(engines):
    prompts = _prompts(5, seed=2)
    sps = [{"max_new_tokens": 12, "temperature": 0.8, "top_p": 0.9, "seed": 7 + i, "ignore_eos": True}
           for i in range(4)] + [_greedy(12, frequency_penalty=0.5)]
    plain, over = _both(engines, {}, prompts, sps, return_logprob=True, top_logprobs_num=2)
    assert _ids(over) == _ids(plain)
    for a, b in zip(plain, over):
        assert b["meta_info"]["output_token_logprobs"] == a["meta_info"]["output_token_logprobs"]
        assert b["meta_info"]["output_top_logprobs"] == a["meta_info"]["output_top_logprobs"]


def test_retraction_under_a_tight_pool_matches_the_plain_loop(engines):
    prompts = _prompts(8, seed=3)
    flags = {"max_total_tokens": 128, "chunked_prefill_size": 16}
    plain, over = _both(engines, flags, prompts, _greedy(24))
    assert _ids(over) == _ids(plain)
    assert engines(**flags)[1].scheduler.num_retractions > 0


def test_grammar_requests_beside_plain_ones_match_the_plain_loop(engines):
    prompts = _prompts(4, seed=4)
    sps = [_greedy(16), {**_greedy(16), "ignore_eos": False, "regex": "(yes|no) [0-9]{2,4}"}, _greedy(9),
           {**_greedy(16), "ignore_eos": False, "regex": "[a-c]+"}]
    plain, over = _both(engines, {}, prompts, sps)
    assert _ids(over) == _ids(plain)
    assert over[0]["output_ids"] != [] and len(over[2]["output_ids"]) == 9


def _stream(sched, rids_prompts, sp, abort_after=None):
    """Add the requests, step ``sched`` until idle; rid -> tokens streamed, and rid -> outputs seen
    after its finished one (every request stepped, those added before too)."""
    for rid, p in rids_prompts:
        sched.add_request(rid, p, sp)
    got: dict[str, list[int]] = {}
    after_end: dict[str, int] = {}
    ended: set[str] = set()
    steps = 0
    while sched.has_work():
        for o in sched.step():
            after_end[o.rid] = after_end.get(o.rid, 0) + (o.rid in ended)
            got.setdefault(o.rid, []).extend(o.new_token_ids)
            if o.finished:
                ended.add(o.rid)
        sched.check_memory()
        steps += 1
        if abort_after is not None and steps == abort_after[1]:
            assert sched.abort(abort_after[0])
    assert ended == set(got)
    return got, after_end


def test_a_finished_request_gets_no_token_from_the_step_in_flight(engines):
    """Each request stops on a token only sampling reveals; the next step, already running with
    it, must stream nothing more for it (the one-step lag)."""
    plain, over = engines()
    prompts = _prompts(4, seed=5)
    free = _ids(plain.generate(input_ids=prompts, sampling_params=_greedy(16)))
    busy = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True).validate()
    for i, (p, ids) in enumerate(zip(prompts, free)):
        over.scheduler.add_request("busy", prompts[(i + 1) % 4], busy)  # decodes beside it, on to the end
        stop = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True,
                              stop_token_ids=[ids[2 + i]]).validate()
        got, after_end = _stream(over.scheduler, [(f"t{i}", p)], stop)
        assert got[f"t{i}"] == ids[:ids.index(ids[2 + i]) + 1]
        assert after_end == {f"t{i}": 0, "busy": 0} and len(got["busy"]) == 16
    _no_leak(over)


def test_an_abort_mid_decode_ends_the_stream_and_frees_the_pages(engines):
    _, over = engines()
    prompts = _prompts(3, seed=6)
    sp = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True).validate()
    got, after_end = _stream(over.scheduler, [(f"a{i}", p) for i, p in enumerate(prompts)], sp,
                             abort_after=("a1", 6))
    assert not any(after_end.values())
    assert len(got["a0"]) == 30 and len(got["a2"]) == 30 and len(got["a1"]) < 30
    _no_leak(over)


def test_pages_of_a_request_ended_under_the_step_in_flight_stay_taken_until_it_lands(engines):
    """That step still writes the request's next position: a page freed before it lands could be
    handed to a KV transfer or a load-back, and the late write would land on the new owner's KV."""
    plain, over = engines()
    sched = over.scheduler
    prompts = _prompts(4, seed=7)
    free = _ids(plain.generate(input_ids=prompts, sampling_params=_greedy(12)))
    reqs = {}
    for i, (p, ids) in enumerate(zip(prompts, free)):
        stop = [ids[2 + 2 * i]] if i % 2 else []  # two end on a token only sampling reveals
        reqs[f"e{i}"] = sched.add_request(f"e{i}", p, SamplingParams(max_new_tokens=12, temperature=0.0,
                                                                     ignore_eos=True, stop_token_ids=stop).validate())
    held = 0
    while sched.has_work():
        for o in sched.step():
            req = reqs[o.rid]
            if o.finished and sched._inflight is not None and sched._inflight.row_of(req) >= 0:
                held += 1
                assert req.pages and not any(sched.allocator.is_free(p) for p in req.pages), req
        sched.check_memory()
    assert held > 0  # the case happened
    _no_leak(over)
