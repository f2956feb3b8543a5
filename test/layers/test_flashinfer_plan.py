"""The flashinfer backend's plan (plain torch) against torch_native's view of the same batches;
flashinfer itself runs only on a GPU (gpu-marked)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from fixtures.paged_batches import PagedRequests
from pdserve.layers.attention.flashinfer import GraphPlanBuffers, build_plan, import_flashinfer
from pdserve.mem.kv_pool import GQAKVPool

STEPS = [[(0, 11), (2, 16)], [(0, 5), (1, 17), (2, 1)], [(0, 1), (1, 1), (2, 1)]]


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_plan_equals_torch_native_metadata(page_size):
    pool = GQAKVPool(80 // page_size + 8, page_size, 1, 2, 8, torch.float32)
    paged = PagedRequests(pool, seed=page_size)
    done = [0, 0, 0]
    for step in STEPS:
        decode = all(n == 1 for _, n in step) and all(done[r] for r, _ in step)
        fb = paged.batch([(r, [0] * n) for r, n in step], decode=decode)
        md, plan = fb.attn_metadata, build_plan(fb)  # md: torch_native's view
        for t in (plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.kv_last_page_len, plan.kv_lens):
            assert t.dtype == torch.int32
        assert plan.qo_indptr.tolist() == [0, *torch.cumsum(fb.extend_lens, 0).tolist()]
        for b, (r, n) in enumerate(step):
            done[r] += n
            pages = -(-done[r] // page_size)
            lo, hi = plan.kv_indptr[b].item(), plan.kv_indptr[b + 1].item()
            assert hi - lo == pages
            assert plan.kv_indices[lo:hi].tolist() == md.pages[b, :pages].tolist()
            assert plan.kv_last_page_len[b].item() == done[r] - (pages - 1) * page_size
            assert plan.kv_lens[b].item() == done[r]
            # The plan addresses exactly the slots torch_native reads.
            p = torch.arange(done[r])
            slots = plan.kv_indices[lo:hi].long()[p // page_size] * page_size + p % page_size
            assert torch.equal(slots, fb.kv_slots[b, :done[r]])


def _padded(fb, bs: int):
    """``fb`` padded to ``bs`` rows as the CUDA graph runner pads: rows B.. repeat row 0."""
    import dataclasses

    def pad(t):
        return torch.cat([t, t[:1].expand(bs - t.shape[0], *t.shape[1:])])

    return dataclasses.replace(fb, input_ids=pad(fb.input_ids), positions=pad(fb.positions),
                               out_cache_loc=pad(fb.out_cache_loc), prefix_lens=pad(fb.prefix_lens),
                               extend_lens=pad(fb.extend_lens), seq_lens=pad(fb.seq_lens), kv_slots=pad(fb.kv_slots))


def test_graph_plan_buffers_refilled_equal_a_fresh_plan():
    """Decode graphs read fixed plan buffers: refilled for each step (a bigger batch first, so stale
    entries sit beyond the smaller ones), their views equal the plan built afresh for that padded
    batch, and stay views of the same storage; a batch past the buffers is refused."""
    page_size = 4
    pool = GQAKVPool(64, page_size, 1, 2, 8, torch.float32)
    paged = PagedRequests(pool, seed=3)
    for r, n in enumerate((13, 4, 9, 1)):
        paged.batch([(r, [0] * n)])
    bufs = GraphPlanBuffers(max_bs=8, max_pages=8 * 8)
    addrs = {t.data_ptr() for t in (bufs.qo_indptr, bufs.kv_indptr, bufs.kv_indices, bufs.kv_last_page_len)}
    for rows, bs in (([0, 1, 2, 3], 8), ([1, 3], 2), ([2], 4), ([0, 2, 3], 4)):
        fb = _padded(paged.batch([(r, [0]) for r in rows], decode=True), bs)
        fresh, got = build_plan(fb), bufs.refill(build_plan(fb), bs)
        for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len", "kv_lens"):
            assert torch.equal(getattr(got, name), getattr(fresh, name)), name
        assert got.graph_bs == bs and got.page_size == page_size
        assert {t.data_ptr() for t in (got.qo_indptr, got.kv_indptr, got.kv_indices, got.kv_last_page_len)} == addrs
    with pytest.raises(ValueError, match="cuda graph plan: 2 rows"):
        bufs.refill(build_plan(paged.batch([(0, [0]), (1, [0])], decode=True)), 4)
    with pytest.raises(ValueError, match="do not fit"):
        GraphPlanBuffers(max_bs=8, max_pages=2).refill(fresh, 4)


@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is not None, reason="flashinfer is installed")
def test_missing_flashinfer_is_one_clear_line():
    with pytest.raises(ValueError, match="^attention_backend: 'flashinfer' needs the flashinfer-python package"):
        import_flashinfer()


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-deepseek"])
def test_flashinfer_serves_like_torch_native_on_gpu(preset, kv_cache_dtype):
    """bf16 on a GPU: greedy tokens of the two backends agree on the tiny presets (with fp8 KV
    both read the same e4m3 pages)."""
    from pdserve import Engine

    outs = {}
    for backend in ("flashinfer", "torch_native"):
        with Engine(preset, device="cuda", attention_backend=backend, dtype="float32", page_size=16,
                    max_total_tokens=1024, disable_cuda_graph=True, kv_cache_dtype=kv_cache_dtype) as engine:
            res = engine.generate(["The capital of France is", "1 2 3"],
                                  sampling_params={"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True})
            outs[backend] = [r["output_ids"] for r in res]
    assert outs["flashinfer"] == outs["torch_native"]


class _FakeWrapper:
    """Records plan/run arguments as flashinfer's wrappers receive them; run returns ones."""

    def __init__(self, calls: list, kind: str, *args, **kwargs):
        self.calls, self.kind = calls, kind

    def plan(self, *args, **kwargs):
        self.calls.append((self.kind, "plan", args, kwargs))

    def run(self, q, *args, **kwargs):
        self.calls.append((self.kind, "run", args, kwargs))
        return torch.ones_like(q)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    """A stand-in ``flashinfer`` module (CPU), so the arguments the backend passes are checked
    where no GPU is; the real kernels run in the gpu-marked tests."""
    import sys
    import types

    calls: list = []
    fi = types.ModuleType("flashinfer")
    fi.BatchDecodeWithPagedKVCacheWrapper = lambda *a, **k: _FakeWrapper(calls, "decode")
    fi.BatchPrefillWithPagedKVCacheWrapper = lambda *a, **k: _FakeWrapper(calls, "prefill")
    fi.mla = types.SimpleNamespace(BatchMLAPagedAttentionWrapper=lambda *a, **k: _FakeWrapper(calls, "mla"))
    monkeypatch.setitem(sys.modules, "flashinfer", fi)
    monkeypatch.setattr("pdserve.layers.attention.flashinfer.WORKSPACE_BYTES", 16)
    return calls


def test_flashinfer_plans_fp8_pools_with_their_dtype_and_scales(fake_flashinfer):
    """An fp8 GQA pool: plans name float8_e4m3fn as kv_data_type (the query stays float32) and runs
    get the pool's k_scale/v_scale; an fp8 MLA pool: the latent scale is folded into sm_scale and
    into the latent output (the MLA wrapper takes no scales)."""
    from pdserve.layers.attention.flashinfer import FlashInferBackend
    from pdserve.mem.kv_pool import FP8_DTYPE, MLAKVPool

    pool = GQAKVPool(16, 4, 1, 2, 8, FP8_DTYPE, compute_dtype=torch.float32, k_scale=0.25, v_scale=0.5)
    paged = PagedRequests(pool, backend=FlashInferBackend())
    for decode, n in ((False, 6), (True, 1)):
        fb = paged.batch([(0, [0] * n)], decode=decode)
        x = torch.randn(n, 2, 8)
        fb.attn_backend.forward_gqa(torch.randn(n, 4, 8), x, x, 0, 0.3, fb)
    (_, _, _, prefill_plan), (_, _, run_args, prefill_run), (_, _, _, decode_plan), (_, _, _, decode_run) = \
        fake_flashinfer
    for plan in (prefill_plan, decode_plan):
        assert plan["kv_data_type"] == FP8_DTYPE and plan["q_data_type"] == torch.float32 and plan["sm_scale"] == 0.3
    for run in (prefill_run, decode_run):
        assert run == {"k_scale": 0.25, "v_scale": 0.5}
    assert run_args[0][0].dtype == FP8_DTYPE  # the pool's own pages, read in place
    fake_flashinfer.clear()

    H, Dn, R, Dv, C = 2, 4, 4, 3, 8
    mla = MLAKVPool(16, 4, 1, C, R, FP8_DTYPE, compute_dtype=torch.float32, latent_scale=0.125)
    fb = PagedRequests(mla, backend=FlashInferBackend()).batch([(0, [0] * 5)])
    w_vc = torch.randn(H, C, Dv)
    out = fb.attn_backend.forward_mla(torch.randn(5, H, Dn), torch.randn(5, H, R), torch.randn(5, C),
                                      torch.randn(5, R), torch.randn(H, Dn, C), w_vc, 0, 0.4, fb)
    (_, _, plan_args, _), (_, _, run_args, _) = fake_flashinfer
    assert plan_args[9] == pytest.approx(0.4 * 0.125) and plan_args[11] == FP8_DTYPE
    assert run_args[1].dtype == FP8_DTYPE
    torch.testing.assert_close(out, torch.einsum("thc,hcv->thv", torch.full((5, H, C), 0.125), w_vc))
