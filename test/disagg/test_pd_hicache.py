"""The hierarchical cache across P/D: two prefill schedulers and one decode scheduler in this process
sharing one Mooncake Store (a real ``mooncake_master`` per module). Decode writes a finished turn's
pages back to the store, so turn 2 is a storage hit on whichever prefill serves it; prefill loads
store hits instead of recomputing and still sends those pages to decode; tokens stay identical to a
colocated engine without any cache tier.

The device pools hold 16 pages of 4 tokens, so pages also cycle through host memory.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch
from pd_pair import PDPair, free_port, greedy

import pdserve
from pdserve.config import ServerArgs
from pdserve.disagg.bootstrap import BootstrapServer
from pdserve.engine.io_struct import BootstrapRef
from pdserve.engine.scheduler import Scheduler
from pdserve.entrypoints.scheduler_process import build_scheduler
from pdserve.mem.hiradix_cache import HiRadixCache

mooncake_store = pytest.importorskip("pdserve.mem.storage.mooncake_store")
pytest.importorskip("mooncake.store")

KW = dict(page_size=4, max_total_tokens=64, max_running_requests=2, chunked_prefill_size=64)
NEW_TOKENS = 8
CHUNK = 8  # tokens per storage object: two pages


def _prompts(n: int, length: int = 28, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 200, (length,), generator=g).tolist() for _ in range(n)]


class PDTrio(PDPair):
    """A PDPair plus a second prefill server (its own bootstrap registry) that decode also reaches."""

    def __init__(self, model: str, **flags: object) -> None:
        super().__init__(model, backend="memory", **flags)
        self.bootstrap_b = BootstrapServer("127.0.0.1", free_port()).start()
        self.prefill_b = build_scheduler(ServerArgs(
            model_path=model, disaggregation_bootstrap_port=self.bootstrap_b.port, num_threads=1,
            disaggregation_transfer_backend="memory", disaggregation_mode="prefill", port=free_port(), **flags))
        self.registered_b = self.prefill_b.mode.sender.backend.outstanding().regions

    def submit_to(self, prefill: str, rid: str, ids: list[int]) -> None:
        if prefill == "a":
            self.submit(rid, ids, greedy(NEW_TOKENS))
            return
        room = int(torch.randint(1, 2**62, (1,)).item())
        self.outputs[rid] = {"ids": [], "final": None}
        ref = BootstrapRef("127.0.0.1", self.bootstrap_b.port, room)
        self.prefill_b.add_request(rid, ids, greedy(NEW_TOKENS), bootstrap=ref)
        self.decode.add_request(rid, ids, greedy(NEW_TOKENS), bootstrap=ref)

    def step(self) -> None:
        self.prefill_b.step()
        super().step()

    def run(self, until=None, timeout_s: float = 120.0) -> None:
        super().run(until or (lambda: not any(s.has_work() for s in (self.prefill, self.prefill_b, self.decode))),
                    timeout_s)

    def close(self) -> None:
        self.prefill_b.mode.close()
        self.prefill_b.mode.sender.backend.close()
        self.bootstrap_b.stop()
        for s in (self.prefill, self.prefill_b, self.decode):
            s.close()  # the storage legs: threads and store clients
        super().close()


def _hi(s: Scheduler) -> HiRadixCache:
    cache = s.cache
    assert isinstance(cache, HiRadixCache) and cache.storage is not None
    return cache


def _flush_puts(*schedulers: Scheduler) -> None:
    for s in schedulers:
        storage = _hi(s).storage
        assert storage is not None
        storage.flush()


def _balanced(trio: PDTrio) -> None:
    trio.assert_idle_and_accounted()
    trio.prefill_b.check_memory()
    for s in (trio.prefill, trio.prefill_b, trio.decode):
        s.cache.check_invariants()


@pytest.fixture(scope="module")
def master() -> Iterator[object]:
    with mooncake_store.MooncakeMaster() as m:
        yield m


# DeepSeek-V3.2's index keys are one more region of every page that moves, goes down or comes back
@pytest.fixture(scope="module", params=["tiny-llama", "tiny-deepseek-v32"])
def model(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def trio(master, model) -> Iterator[PDTrio]:
    extra = {"master_server_address": master.address, "metadata_server": master.metadata_server,
             "global_segment_size": "32mb", "local_buffer_size": "16mb"}
    t = PDTrio(model, enable_hierarchical_cache=True, hicache_storage_backend="mooncake",
               hicache_storage_chunk_tokens=CHUNK, hicache_storage_prefetch_policy="wait_complete",
               hicache_storage_backend_extra_config=json.dumps(extra), **KW)
    try:
        yield t
    finally:
        t.close()


@pytest.fixture(scope="module")
def engine(model) -> Iterator[pdserve.Engine]:
    """The reference: colocated, no hierarchical cache."""
    with pdserve.Engine(model_path=model, **KW) as e:
        yield e


def _ref(engine: pdserve.Engine, ids: list[int]) -> list[int]:
    return engine.generate(input_ids=ids, sampling_params={"max_new_tokens": NEW_TOKENS, "temperature": 0.0,
                                                           "ignore_eos": True})["output_ids"]


def _run(trio: PDTrio, prefill: str, rid: str, ids: list[int]) -> list[int]:
    trio.submit_to(prefill, rid, ids)
    trio.run()
    final = trio.outputs[rid]["final"]
    assert final is not None and final.finish_reason["type"] == "length", final
    return trio.outputs[rid]["ids"]


def test_decode_writes_back_a_turn_and_either_prefill_hits_it(trio, engine):
    turn1 = _prompts(1, seed=1)[0]
    out1 = _run(trio, "a", "t1", turn1)
    assert out1 == _ref(engine, turn1)
    _flush_puts(trio.decode)
    put = trio.decode.stats()["storage_put_bytes"]
    assert put > 0  # decode's finished turn went host -> storage
    turn2 = turn1 + out1 + _prompts(1, length=8, seed=2)[0]
    want = _ref(engine, turn2)
    # Prefill B has never seen this conversation: all of it comes from the store decode filled.
    got = _run(trio, "b", "t2b", turn2)
    assert got == want
    stats_b = trio.prefill_b.stats()
    stored = len(turn1 + out1) - 1  # decode caches up to the last fed token
    assert stats_b["cache_hit_tokens_storage"] >= stored // CHUNK * CHUNK > len(turn1)
    assert stats_b["cache_hit_tokens_device"] == 0
    # decode reports prefill's hit, by tier
    by_tier = trio.outputs["t2b"]["final"].cached_tokens_by_tier
    assert by_tier["storage"] == stats_b["cache_hit_tokens_storage"]
    assert sum(by_tier.values()) == trio.outputs["t2b"]["final"].cached_tokens
    # Prefill A holds turn 1's prompt on its device; the answer's pages come from the store.
    got = _run(trio, "a", "t2a", turn2)
    assert got == want
    assert trio.prefill.stats()["cache_hit_tokens_storage"] > 0
    _balanced(trio)


def test_prompt_prefilled_on_one_prefill_is_a_storage_hit_on_the_other(trio, engine):
    prompts = _prompts(4, seed=20)
    outs = [_run(trio, "a", f"p{i}", p) for i, p in enumerate(prompts)]  # also pushes pages off the devices
    _flush_puts(trio.prefill, trio.decode)
    assert trio.decode.flush_cache()  # decode must receive every page, the loaded ones included
    before = trio.prefill_b.stats()["cache_hit_tokens_storage"]
    received = trio.decode.stats()["kv_pages_received"]
    again = _run(trio, "b", "again", prompts[0])
    assert trio.decode.stats()["kv_pages_received"] - received == 7  # 27 positions in pages of 4
    assert outs + [again] == [_ref(engine, p) for p in prompts] + [outs[0]]
    # 27 tokens before the held-back last one: three whole chunks of 8
    assert trio.prefill_b.stats()["cache_hit_tokens_storage"] - before == 24
    _balanced(trio)

