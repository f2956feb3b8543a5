"""The flashinfer backend's plan (plain torch) against torch_native's view of the same batches;
flashinfer itself runs only on a GPU (gpu-marked)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from fixtures.paged_batches import PagedRequests
from pdserve.layers.attention.flashinfer import build_plan, import_flashinfer
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


@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is not None, reason="flashinfer is installed")
def test_missing_flashinfer_is_one_clear_line():
    with pytest.raises(ValueError, match="^attention_backend: 'flashinfer' needs the flashinfer-python package"):
        import_flashinfer()


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-deepseek"])
def test_flashinfer_serves_like_torch_native_on_gpu(preset):
    """bf16 on a GPU: greedy tokens of the two backends agree on the tiny presets."""
    from pdserve import Engine

    outs = {}
    for backend in ("flashinfer", "torch_native"):
        with Engine(preset, device="cuda", attention_backend=backend, dtype="float32", page_size=16,
                    max_total_tokens=1024, disable_cuda_graph=True) as engine:
            res = engine.generate(["The capital of France is", "1 2 3"],
                                  sampling_params={"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True})
            outs[backend] = [r["output_ids"] for r in res]
    assert outs["flashinfer"] == outs["torch_native"]
