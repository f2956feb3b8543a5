"""``--enable-torch-compile``: compiled decode steps give the eager engine's exact greedy tokens.

One eager and one compiled Engine per model (tiny-llama: GQA; tiny-deepseek: MLA + MoE), with
``torch_compile_max_bs`` 4 (buckets 1, 2, 4), kept for the module because compiling is the slow
part. Requests with different output lengths finish one by one, so a run decodes batches of
5 (above the buckets: eager), 4, 3 (padded to bucket 4), 2 and 1. Every compiled run is made
under ``torch.compiler.set_stance("fail_on_recompile")``: the graphs compiled at start-up serve
it, and a guard miss would fail the test instead of compiling silently. The per-layer KV hook
(disaggregation's seam) and the torch_native staged decode KV are checked against the eager
run write by write, and the compiled steps keep the oneDNN-packed GEMMs (``pdserve::packed_linear``).
"""

from __future__ import annotations

import pytest
import torch

import pdserve

MAX_BS = 4
PROMPTS = [[11, 12, 13, 14, 15, 16, 17], [21, 22, 23], [31, 32, 33, 34, 35], [41], [51, 52, 53, 54]]
OUTPUT_LENS = [14, 12, 10, 8, 6]  # one finishes every other step or so: batch 5, 4, 3, 2, 1


def engine_pair(model: str) -> dict[bool, pdserve.Engine]:
    kw = {"model_path": model, "num_threads": 1, "disable_radix_cache": True, "page_size": 4,
          "max_total_tokens": 1024, "torch_compile_max_bs": MAX_BS}
    return {compiled: pdserve.Engine(enable_torch_compile=compiled, **kw) for compiled in (False, True)}


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-deepseek"])
def engines(request):
    pair = engine_pair(request.param)
    yield pair
    for e in pair.values():
        e.shutdown()


def generate(engine: pdserve.Engine, prompts=PROMPTS, lens=OUTPUT_LENS) -> list[list[int]]:
    params = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in lens]
    with torch.compiler.set_stance("fail_on_recompile"):
        outs = engine.generate(input_ids=prompts, sampling_params=params)
    return [o["output_ids"] for o in outs]


def test_compiled_greedy_tokens_equal_eager(engines):
    compiled = engines[True].scheduler.runner.compiled
    before = dict(compiled.steps)
    want, got = generate(engines[False]), generate(engines[True])
    assert got == want
    assert [len(ids) for ids in got] == OUTPUT_LENS
    used = {b: compiled.steps[b] - before.get(b, 0) for b in compiled.steps}
    assert used == expected_bucket_steps(OUTPUT_LENS)


class CountingLookup:
    """Stands in for cpu_gemm's packed-weight table: counts the lookups pdserve::packed_linear makes."""

    def __init__(self, table):
        self.table, self.hits = table, 0

    def get(self, weight):
        self.hits += 1
        return self.table.get(weight)


def test_compiled_steps_keep_the_packed_gemms(engines, monkeypatch):
    """Bucket 4 has the rows where the float32 policy packs: its compiled steps run those GEMMs on the
    packed weights through the custom op, which eager layers never call (they call oneDNN directly)."""
    from pdserve.layers import cpu_gemm

    layers = engines[True].scheduler.runner.model.model.layers  # the compiled part (not the LM head)
    packed = [m.packed for m in layers.modules() if getattr(m, "packed", None)]
    if not any(p.policy.pays(MAX_BS, p.numel) for p in packed):
        pytest.skip("no weight of this model is packed for the GEMMs of a bucket-4 step")
    lookups = CountingLookup(cpu_gemm._PACKED)
    monkeypatch.setattr(cpu_gemm, "_PACKED", lookups)
    generate(engines[False])
    assert lookups.hits == 0
    generate(engines[True])
    assert lookups.hits > 0


def expected_bucket_steps(lens: list[int]) -> dict[int, int]:
    """Compiled decode steps per bucket: the step making token t (t >= 2; the prefill makes the
    first) runs every request wanting t or more tokens; batches above MAX_BS run eagerly."""
    steps = {1: 0, 2: 0, 4: 0}
    for t in range(2, max(lens) + 1):
        batch = sum(n >= t for n in lens)
        if batch <= MAX_BS:
            steps[min(b for b in steps if b >= batch)] += 1
    return steps


def test_expected_bucket_steps_of_the_test_requests():
    # 5 steps of batch 5 (eager), then 4, 4, 3, 3 (bucket 4), 2, 2, 1, 1.
    assert expected_bucket_steps(OUTPUT_LENS) == {4: 4, 2: 2, 1: 2}


def test_single_request_and_full_bucket(engines):
    """Exactly a bucket's size (no padding) and one request alone."""
    for prompts, lens in (([[7, 8, 9]], [9]), (PROMPTS[:MAX_BS], [7] * MAX_BS)):
        assert generate(engines[True], prompts, lens) == generate(engines[False], prompts, lens)


class KVRecorder:
    """Per-layer KV hook: what each decode step wrote, read back from the pool right away."""

    def __init__(self):
        self.writes = []

    def __call__(self, layer_id, fb):
        if not fb.is_decode:
            return
        pool, loc = fb.kv_pool, fb.out_cache_loc
        if hasattr(pool, "latent"):
            kv = (pool.latent[layer_id].view(pool.num_slots, -1)[loc].clone(),)
        else:
            page, off = loc // pool.page_size, loc % pool.page_size
            kv = (pool.k[layer_id][page, :, off].clone(), pool.v[layer_id][page, :, off].clone())
        self.writes.append((layer_id, fb.batch_size, loc.tolist(), fb.attn_metadata.stage.append, kv))


def test_kv_hook_and_staged_kv_see_the_eager_writes(engines):
    recorders = {}
    for compiled, engine in engines.items():
        runner = engine.scheduler.runner
        runner.layer_hook = recorders[compiled] = KVRecorder()
        impl = runner.backend.decode_attention_impl
        runner.backend.decode_attention_impl = "torch"  # the stage (the CPU decode kernel keeps none)
        try:
            generate(engine)
        finally:
            runner.layer_hook = None
            runner.backend.decode_attention_impl = impl
    eager, comp = recorders[False].writes, recorders[True].writes
    num_layers = engines[True].scheduler.model_config.num_layers
    assert len(comp) == len(eager) == num_layers * (OUTPUT_LENS[0] - 1)
    for (layer, bs, loc, append, kv), (layer_e, bs_e, loc_e, append_e, kv_e) in zip(comp, eager):
        # Same layer order, real batch size (never the bucket), slots and stage decisions.
        assert (layer, bs, loc, append) == (layer_e, bs_e, loc_e, append_e)
        for got, want in zip(kv, kv_e):
            # Inductor fuses the float32 norms/rotary, so the KV agrees to rounding (the project's
            # 1e-4 float32 bound), not bit for bit; the tokens above agree exactly.
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # The staged decode KV kept appending across compiled steps (rebuilt only when the batch changed).
    assert sum(w[3] for w in comp) > len(comp) // 2
