"""Storage prefetch policies and the tier-skip rule.

One engine for the module (tiny-llama, a file tier wrapped in ``FaultyStore`` so gets can be
slowed down): a prompt is pushed off the device and out of host memory, so only storage holds
it, then served again under each ``--hicache-storage-prefetch-policy``. Outputs must match the
first run whatever the policy took; nothing of a prefetch given up may stay behind.
"""

from __future__ import annotations

import math

import pytest
import torch

import pdserve
from pdserve.engine.request import SamplingParams
from pdserve.mem.hicache_storage import PrefetchPolicy, StorageLeg, prefetch_can_stop
from pdserve.mem.hiradix_cache import HiRadixCache
from pdserve.mem.storage.memory import Faults, FaultyStore
from pdserve.mem.tier_costs import LegSpeed, TierCosts, break_even_tokens

KW = dict(page_size=4, max_total_tokens=64, max_running_requests=2, chunked_prefill_size=64,
          enable_hierarchical_cache=True, hicache_ratio=0.5, hicache_storage_backend="file",
          hicache_storage_size_gb=0.01, hicache_storage_chunk_tokens=8,
          hicache_storage_prefetch_policy="wait_complete")
GREEDY = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
SLOW_GET_S = 0.4  # per chunk: three chunks take 1.2 s, far longer than a scheduling pass


def _prompts(n: int, seed: int, length: int = 28) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 200, (length,), generator=g).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(engine, its cache, the faults of its store, a prompt only storage holds, its tokens)."""
    engine = pdserve.Engine(model_path="tiny-llama", hicache_storage_dir=str(tmp_path_factory.mktemp("tier")), **KW)
    hi = engine.scheduler.cache
    assert isinstance(hi, HiRadixCache) and hi.storage is not None
    faults = Faults()
    hi.storage.store = FaultyStore(hi.storage.store, faults)
    prompt = _prompts(1, seed=40)[0]
    want = engine.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"]
    yield engine, hi, faults, prompt, want
    engine.shutdown()


def _only_in_storage(engine: pdserve.Engine, hi: HiRadixCache, prompt: list[int]) -> None:
    for p in _prompts(3, seed=41):  # off the device, then out of the 8-page host pool
        engine.generate(input_ids=p, sampling_params=GREEDY)
    assert hi.storage is not None
    hi.storage.flush()
    assert hi.match_tiers(prompt[:-1]).device.num_tokens == 0 and not hi.match_tiers(prompt[:-1]).host


def _serve(engine: pdserve.Engine, rid: str, prompt: list[int]) -> tuple[list[int], dict[str, int]]:
    sched = engine.scheduler
    sched.add_request(rid, prompt, SamplingParams(**GREEDY))
    req = sched.reqs[rid]
    out: list[int] = []
    while sched.has_work():
        out += [t for o in sched.step() for t in o.new_token_ids]
    return out, dict(req.cached_by_tier_reported or {})


def _balanced(engine: pdserve.Engine, hi: HiRadixCache) -> None:
    engine.scheduler.check_memory()
    hi.check_invariants()
    assert hi.num_prefetching == 0
    assert hi.num_evictable_pages == hi.num_cached_pages


def _set_policy(hi: HiRadixCache, policy: PrefetchPolicy) -> StorageLeg:
    assert hi.storage is not None
    hi.storage.policy = policy
    return hi.storage


def test_wait_complete_waits_for_every_chunk(served):
    engine, hi, faults, prompt, want = served
    _only_in_storage(engine, hi, prompt)
    _set_policy(hi, PrefetchPolicy("wait_complete"))
    faults.get_delay_s = SLOW_GET_S / 4
    try:
        out, by_tier = _serve(engine, "wc", prompt)
    finally:
        faults.get_delay_s = 0.0
    assert out == want
    assert by_tier["storage"] == 24  # 3 whole chunks of 8; the last prompt token always runs
    _balanced(engine, hi)


@pytest.mark.parametrize("policy", [PrefetchPolicy("best_effort"),
                                    PrefetchPolicy("timeout", timeout_base_s=0.05, timeout_per_ki_token_s=0.01)])
def test_early_stopping_policies_admit_with_what_landed(served, policy):
    engine, hi, faults, prompt, want = served
    _only_in_storage(engine, hi, prompt)
    leg = _set_policy(hi, policy)
    stopped = leg.stats()["storage_prefetch_stopped_early"]
    faults.get_delay_s = SLOW_GET_S
    try:
        out, by_tier = _serve(engine, policy.name, prompt)
    finally:
        faults.get_delay_s = 0.0
    assert out == want  # whatever landed (here: not everything), never a wrong token
    assert by_tier["storage"] < 24
    assert leg.stats()["storage_prefetch_stopped_early"] == stopped + 1
    leg.flush()
    _balanced(engine, hi)


def test_abort_mid_prefetch_leaves_nothing_behind(served):
    engine, hi, faults, prompt, want = served
    _only_in_storage(engine, hi, prompt)
    _set_policy(hi, PrefetchPolicy("wait_complete"))
    sched = engine.scheduler
    host_before = hi.num_host_cached_pages
    faults.get_delay_s = SLOW_GET_S
    try:
        sched.add_request("gone", prompt, SamplingParams(**GREEDY))
        for _ in range(3):
            assert sched.step() == []  # waits: its chunks are still being read
        assert hi.num_prefetching == 1 and sched.reqs["gone"].row is None
        assert sched.abort("gone")
        while sched.has_work():
            sched.step()
    finally:
        faults.get_delay_s = 0.0
    assert hi.num_host_cached_pages == host_before  # the read's chunks never entered the cache
    _balanced(engine, hi)
    out, _ = _serve(engine, "after", prompt)  # and the storage tier still serves it
    assert out == want


def test_a_host_hit_shorter_than_break_even_is_recomputed(served):
    engine, hi, _, prompt, want = served
    engine.generate(input_ids=prompt, sampling_params=GREEDY)
    engine.scheduler.kv_manager.evict(hi.num_evictable_pages)  # off the device; the host copies stay
    assert hi.match_tiers(prompt[:-1]).host
    skipped = hi.counters.host_loads_skipped
    hi.costs.pinned_prefill = 1e15  # recomputing is "free": no load can beat it
    try:
        out, by_tier = _serve(engine, "skip", prompt)
    finally:
        hi.costs.pinned_prefill = None
    assert out == want
    assert by_tier["host"] == 0 and hi.counters.host_loads_skipped == skipped + 1
    info = engine.get_server_info()
    assert info["tier_host_bytes_per_s"] > 0 and "tier_storage_bytes_per_s" in info
    _balanced(engine, hi)


def test_prefetch_policy_table():
    wc, be = PrefetchPolicy("wait_complete"), PrefetchPolicy("best_effort")
    to = PrefetchPolicy("timeout", timeout_base_s=1.0, timeout_per_ki_token_s=0.5)
    assert prefetch_can_stop(be, done=False, elapsed_s=0.0, tokens=4096)
    assert not prefetch_can_stop(wc, done=False, elapsed_s=1e6, tokens=4096)
    assert prefetch_can_stop(wc, done=True, elapsed_s=0.0, tokens=4096)
    assert to.bound_s(2048) == 2.0
    assert not prefetch_can_stop(to, done=False, elapsed_s=1.9, tokens=2048)
    assert prefetch_can_stop(to, done=False, elapsed_s=2.0, tokens=2048)


def test_break_even_rule():
    leg = LegSpeed(latency_s=0.001, bytes_per_s=1e9)
    # Unknown prefill speed: load every hit.
    assert break_even_tokens([leg], bytes_per_token=1000, prefill_tokens_per_s=None) == 0.0
    # Recompute 1e4 tok/s = 100 us/token; load 1 us/token + 1 ms: loading wins past ~10.1 tokens.
    assert break_even_tokens([leg], 1000, 1e4) == pytest.approx(0.001 / (1e-4 - 1e-6))
    # The per-token load cost alone exceeds recomputation: never load.
    assert math.isinf(break_even_tokens([leg], 1e6, 1e4))
    # A storage hit pays both legs.
    costs = TierCosts(1000, host=leg, storage=LegSpeed(0.004, 1e8), prefill_tokens_per_s=1e4)
    assert costs.break_even("storage") > costs.break_even("host")
    assert not costs.worth_loading("host", 8) and costs.worth_loading("host", 16)
    costs.observe_prefill(tokens=8, seconds=1.0)  # too small a sample to count
    assert costs.observed_prefill is None
