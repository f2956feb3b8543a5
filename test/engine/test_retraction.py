"""Retraction under memory pressure is bounded: admission keeps KV free for the running requests'
expected decode growth (policy.NewTokenRatio), so a retracted request is not re-admitted only to
be retracted again. Greedy output equals an unconstrained run; page accounting holds every step."""

import collections

import pytest
import torch

import pdserve
from pdserve.engine.request import SamplingParams

# Three requests whose prompts and outputs overflow a 96-token pool (page 1, 16-token chunks):
# with one page of headroom per running request, requests 1 and 2 were retracted alternately
# six times (each re-admitted as soon as its prompt fit, then retracted again).
PROMPT_LENS, MAX_NEW, POOL = (20, 23, 26), 40, 96


def _prompts():
    g = torch.Generator().manual_seed(20)
    return [torch.randint(3, 400, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _run(engine):
    """Step the scheduler to the end, checking page accounting after every step."""
    sched = engine.scheduler
    reqs = [sched.add_request(f"r{i}", p, SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True))
            for i, p in enumerate(_prompts())]
    out = collections.defaultdict(list)
    while sched.has_work():
        for o in sched.step():
            out[o.rid] += o.new_token_ids
        sched.check_memory()
    return dict(out), [r.num_retractions for r in reqs]


@pytest.mark.parametrize("radix", [False, True])
def test_retractions_are_bounded_and_output_unchanged(radix):
    assert sum(PROMPT_LENS) + len(PROMPT_LENS) * MAX_NEW > 1.5 * POOL  # far from fitting at once
    want, _ = _run(pdserve.Engine(model_path="tiny-llama"))
    tight = pdserve.Engine(model_path="tiny-llama", page_size=1, max_total_tokens=POOL, chunked_prefill_size=16,
                           disable_radix_cache=not radix)
    got, per_request = _run(tight)
    sched = tight.scheduler
    assert got == want
    assert all(len(v) == MAX_NEW for v in got.values())
    assert sched.num_retractions == sum(per_request) <= 1
    sched.check_memory()
    assert not sched.has_work()
    assert sched.allocator.num_free + sched.cache.num_cached_pages == sched.allocator.num_pages
