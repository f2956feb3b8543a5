"""The KV pool's size from a byte budget (mem/kv_budget.py) and from the flags (engine/model_runner.py)."""

import pytest

from pdserve.config import CacheConfig, ModelConfig, ServerArgs
from pdserve.distributed.parallel_state import ParallelState
from pdserve.engine.model_runner import create_kv_pool, kv_pool_budget
from pdserve.mem.kv_budget import DEFAULT_KV_CACHE_MEMORY_BYTES, DeviceMemory, host_memory, size_pool

GIB = 1 << 30
HOST = DeviceMemory("cpu", total=16 * GIB, available=10 * GIB, used=2 * GIB)


def test_a_byte_budget_gives_whole_pages_of_tokens():
    b = size_pool(page_size=16, bytes_per_token=1000, max_total_tokens=None, kv_cache_memory_bytes=1_000_000,
                  memory=HOST)
    assert (b.source, b.budget_bytes, b.num_pages, b.max_total_tokens) == ("kv_cache_memory_bytes", 10**6, 62, 992)
    assert b.pool_bytes == 992_000 <= b.budget_bytes


def test_no_flag_is_the_default_budget_with_no_token_cap():
    b = size_pool(page_size=1, bytes_per_token=64, max_total_tokens=None, memory=HOST)
    assert b.source == "default" and b.budget_bytes == DEFAULT_KV_CACHE_MEMORY_BYTES
    assert b.max_total_tokens == DEFAULT_KV_CACHE_MEMORY_BYTES // 64 > 1 << 18  # the old hidden cap is gone


def test_max_total_tokens_alone_is_exact_and_caps_a_budget():
    exact = size_pool(page_size=4, bytes_per_token=1000, max_total_tokens=403)
    assert (exact.source, exact.budget_bytes, exact.num_pages) == ("max_total_tokens", None, 100)
    capped = size_pool(page_size=4, bytes_per_token=1000, max_total_tokens=400, kv_cache_memory_bytes=10**9,
                       memory=HOST)
    assert (capped.source, capped.num_pages) == ("kv_cache_memory_bytes", 100)
    under = size_pool(page_size=4, bytes_per_token=1000, max_total_tokens=400, kv_cache_memory_bytes=200_000,
                      memory=HOST)
    assert under.num_pages == 50


def test_mem_fraction_static_takes_its_share_less_what_is_in_use():
    b = size_pool(page_size=1, bytes_per_token=1024, max_total_tokens=None, mem_fraction_static=0.5, memory=HOST)
    assert b.source == "mem_fraction_static" and b.budget_bytes == 8 * GIB - 2 * GIB
    assert b.max_total_tokens == 6 * GIB // 1024
    assert b.to_dict()["device_memory"] == {"device": "cpu", "total": 16 * GIB, "available": 10 * GIB,
                                            "used": 2 * GIB}
    assert "--mem-fraction-static" in b.describe() and "6.00 GiB" in b.describe()


@pytest.mark.parametrize("kwargs, field", [
    ({"mem_fraction_static": 0.1}, "mem_fraction_static"),  # 1.6 GiB of 16 with 2 in use: nothing left
    ({"mem_fraction_static": 0.9}, "mem_fraction_static"),  # 12.4 GiB: more than the 10 available
    ({"kv_cache_memory_bytes": 11 * GIB}, "kv_cache_memory_bytes"),
])
def test_a_budget_the_device_cannot_hold_is_refused_naming_the_flag(kwargs, field):
    with pytest.raises(ValueError, match=field):
        size_pool(page_size=1, bytes_per_token=1024, max_total_tokens=None, memory=HOST, **kwargs)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-deepseek", "tiny-qwen3-moe"])
def test_fp8_holds_four_times_the_tokens_of_fp32_in_the_same_budget(preset):
    """No flag: the default budget. fp8 used to hit the hidden 2^18-token cap (tiny-deepseek: 209,715
    pages in fp32, 262,144 in fp8)."""
    model = ModelConfig.from_path(preset)  # float32 on CPU
    fp32 = kv_pool_budget(model, CacheConfig(), ParallelState())
    fp8 = kv_pool_budget(model, CacheConfig(kv_cache_dtype="fp8_e4m3"), ParallelState())
    assert fp32.bytes_per_token == 4 * fp8.bytes_per_token == model.kv_bytes_per_token()
    assert 4 * fp32.num_pages <= fp8.num_pages < 4 * (fp32.num_pages + 1)
    assert fp8.pool_bytes <= DEFAULT_KV_CACHE_MEMORY_BYTES and fp32.pool_bytes <= DEFAULT_KV_CACHE_MEMORY_BYTES


def test_the_pool_built_holds_what_the_budget_says_in_its_bytes():
    """A small explicit budget: the allocated fp8 pool has 4x the pages of the fp32 one, and neither
    pool's buffers exceed the budget."""
    model = ModelConfig.from_path("tiny-llama")
    budget = 1 << 20
    pools = {dtype: create_kv_pool(model, CacheConfig(page_size=4, kv_cache_dtype=dtype,
                                                      kv_cache_memory_bytes=budget), ParallelState())
             for dtype in ("auto", "fp8_e4m3")}
    assert pools["fp8_e4m3"].num_pages == 4 * pools["auto"].num_pages == budget // model.kv_bytes_per_token()
    for pool in pools.values():
        held = sum(d.page_bytes * d.num_layers * pool.num_pages for d in pool.buffer_descriptors())
        assert held == budget  # 1 MiB is a whole number of pages of either dtype here


def test_a_rank_budget_counts_its_own_kv_heads_and_the_draft_layers():
    model = ModelConfig.from_path("tiny-llama")  # 4 KV heads
    cache = CacheConfig(kv_cache_memory_bytes=1 << 20)
    one = kv_pool_budget(model, cache, ParallelState())
    half = kv_pool_budget(model, cache, ParallelState(tp_rank=0, tp_size=2))
    assert half.bytes_per_token * 2 == one.bytes_per_token and half.num_pages == 2 * one.num_pages
    draft = kv_pool_budget(model, cache, ParallelState(), extra_layers=model.num_layers)
    assert draft.bytes_per_token == 2 * one.bytes_per_token


def test_the_host_memory_reading_is_sane():
    m = host_memory()
    assert m.device == "cpu" and 0 < m.available <= m.total and 0 < m.used < m.total


@pytest.mark.parametrize("kwargs, field", [
    ({"mem_fraction_static": 0.0}, "mem_fraction_static"),
    ({"mem_fraction_static": 1.5}, "mem_fraction_static"),
    ({"kv_cache_memory_bytes": 0}, "kv_cache_memory_bytes"),
    ({"kv_cache_memory_bytes": 1 << 30, "mem_fraction_static": 0.5}, "kv_cache_memory_bytes"),
])
def test_bad_budget_flags_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ServerArgs(model_path="tiny-llama", **kwargs)


def test_the_flags_reach_the_cache_config():
    from pdserve.entrypoints.cli import build_parser, server_args_from_namespace

    ns = build_parser().parse_args(["serve", "--model-path", "tiny-llama", "--kv-cache-memory-bytes", "64Mi"])
    assert server_args_from_namespace(ns).cache_config().kv_cache_memory_bytes == 64 << 20
    ns = build_parser().parse_args(["serve", "--model-path", "tiny-llama", "--mem-fraction-static", "0.25"])
    assert server_args_from_namespace(ns).cache_config().mem_fraction_static == 0.25


def test_per_request_records_come_out_of_the_budget_first():
    """DeepSeek-V4's bounded layout keeps a record per request-table row beside the pages: a byte budget
    pays for them before pages; one they would exhaust is refused naming the flag."""
    b = size_pool(page_size=16, bytes_per_token=1000, max_total_tokens=None, kv_cache_memory_bytes=1_000_000,
                  record_bytes=200_000)
    assert b.num_pages == 800_000 // 1000 // 16 and b.record_bytes == 200_000
    assert b.to_dict()["record_bytes"] == 200_000 and "of per-request records" in b.describe()
    with pytest.raises(ValueError, match="kv_cache_memory_bytes: the budget of 1000000 B leaves nothing for pages "
                                         "after 1000000 B of per-request state records"):
        size_pool(page_size=16, bytes_per_token=1000, max_total_tokens=None, kv_cache_memory_bytes=1_000_000,
                  record_bytes=1_000_000)
