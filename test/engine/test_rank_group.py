"""The pure parts of the multi-rank engine: DP assignment, batch fingerprints, merged stats,
and the KV pool each rank gets for its split (what disaggregation registers per rank)."""

from __future__ import annotations

from pdserve.config import CacheConfig, ModelConfig
from pdserve.distributed.parallel_state import ParallelState
from pdserve.engine.model_runner import ScheduledBatch, create_kv_pool
from pdserve.engine.rank_group import batch_fingerprint, merge_stats, pick_dp_rank
from pdserve.layers.forward_batch import ForwardMode


def test_least_loaded_attention_group_gets_the_request():
    assert pick_dp_rank([0, 0]) == 0  # tie: lowest index
    assert pick_dp_rank([3, 1, 2]) == 1
    loads = [0, 0, 0]
    order = []
    for _ in range(7):  # what the loop does for a burst of requests in one exchange
        d = pick_dp_rank(loads)
        loads[d] += 1
        order.append(d)
    assert order == [0, 1, 2, 0, 1, 2, 0]


def _batch(**kw) -> ScheduledBatch:
    base = dict(mode=ForwardMode.EXTEND, input_ids=[5, 6, 7], positions=[0, 1, 2], out_cache_loc=[8, 9, 10],
                prefix_lens=[0], extend_lens=[3], rows=[0])
    return ScheduledBatch(**{**base, **kw})


def test_fingerprint_tells_batches_apart():
    a = batch_fingerprint(_batch())
    assert a == batch_fingerprint(_batch())
    assert 0 <= a < 1 << 62
    for change in (dict(input_ids=[5, 6, 8]), dict(positions=[1, 2, 3]), dict(out_cache_loc=[8, 9, 11]),
                   dict(rows=[1]), dict(mode=ForwardMode.DECODE)):
        assert batch_fingerprint(_batch(**change)) != a, change


def test_fingerprint_is_the_same_in_another_process():
    """Ranks compare fingerprints, so they must not depend on per-process hash seeds."""
    import os
    import subprocess
    import sys

    code = ("from pdserve.engine.rank_group import batch_fingerprint;"
            "from pdserve.engine.model_runner import ScheduledBatch;"
            "from pdserve.layers.forward_batch import ForwardMode;"
            "print(batch_fingerprint(ScheduledBatch(ForwardMode.EXTEND, [5, 6, 7], [0, 1, 2], [8, 9, 10], [0], [3],"
            " [0])))")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip()
            for seed in ("1", "2")}
    assert outs == {str(batch_fingerprint(_batch()))}


def _stats(running, waiting, total, free, cached, usage, steps):
    return dict(num_running_reqs=running, num_waiting_reqs=waiting, total_pages=total, free_pages=free,
                cached_pages=cached, page_size=4, token_usage=usage, num_retractions=1, forward_steps=steps)


def test_merged_stats_add_up():
    one = _stats(1, 2, 100, 50, 10, 0.4, 7)
    assert merge_stats([one]) is one
    both = merge_stats([one, _stats(3, 0, 100, 90, 0, 0.1, 9)])
    assert (both["num_running_reqs"], both["num_waiting_reqs"], both["total_pages"], both["free_pages"],
            both["cached_pages"], both["num_retractions"], both["forward_steps"]) == (4, 2, 200, 140, 10, 2, 9)
    assert abs(both["token_usage"] - 0.25) < 1e-9
    assert len(both["dp_ranks"]) == 2


def test_each_rank_pool_holds_its_heads_and_describes_them():
    """GQA: KV heads split over attention TP (replicated past the head count); MLA: the whole
    latent on every rank. Buffer descriptors follow the local shapes."""
    cache = CacheConfig(page_size=4, max_total_tokens=64)
    llama = ModelConfig.from_path("tiny-llama")  # 4 KV heads of 32
    for attn_tp, heads in ((1, 4), (2, 2), (4, 1), (8, 1)):
        pool = create_kv_pool(llama, cache, ParallelState(tp_rank=0, tp_size=attn_tp))
        assert pool.num_kv_heads == heads
        k = pool.buffer_descriptors()[0]
        assert k.page_bytes == heads * 4 * llama.head_dim * 4 and k.num_layers == llama.num_layers
    deepseek = ModelConfig.from_path("tiny-deepseek")
    dp_attention = ParallelState(tp_rank=1, tp_size=2, attn=ParallelState(), attn_dp_rank=1, attn_dp_size=2)
    latent = create_kv_pool(deepseek, cache, dp_attention).buffer_descriptors()
    assert [d.name for d in latent] == ["latent"]
    assert latent[0].page_bytes == 4 * deepseek.head_dim * 4
