"""DeepSeek-V3.2's sparse attention on the triton backend (kernels under the interpreter on CPU):
the same outputs as torch_native's over prefix + extend + decode steps, and the same greedy
tokens as transformers through the Engine on a tiny checkpoint whose index_topk cuts; and
torch_native's long extends in query blocks giving what one block gives."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
pytest.importorskip("triton")

from fixtures.paged_batches import cat_spans as _cat  # noqa: E402
from fixtures.paged_batches import walk_steps  # noqa: E402
from fixtures.tiny_models import greedy_continuation, make_hf_model_and_dir  # noqa: E402
from pdserve.layers.attention.base import SparseIndex  # noqa: E402
from pdserve.layers.attention.registry import create_backend  # noqa: E402
from pdserve.mem.kv_pool import MLAKVPool  # noqa: E402

LENGTHS = (21, 7, 17)
STEPS = [[(0, 11), (2, 16)], [(0, 9), (1, 5), (2, 1)], [(0, 1), (1, 1)], [(1, 1)]]  # extends, then decodes
TOPK = 6  # below most lengths: the selection cuts


def _inputs(seed: int):
    H, Dn, R, Dv, C, Hi, Di = 3, 16, 8, 12, 16, 2, 16
    g = torch.Generator().manual_seed(seed)
    per_token = {"q_nope": (H, Dn), "q_pe": (H, R), "latent": (C,), "k_pe": (R,), "iq": (Hi, Di), "iw": (Hi,),
                 "ik": (Di,)}
    xs = {name: [torch.randn(n, *shape, generator=g) for n in LENGTHS] for name, shape in per_token.items()}
    w_kc, w_vc = torch.randn(H, Dn, C, generator=g) * 0.2, torch.randn(H, C, Dv, generator=g) * 0.2
    return xs, w_kc, w_vc, C, R, Di


def _outputs(backend_name: str, page_size: int, index_cache_dtype: str = "model") -> list[torch.Tensor]:
    """Every request's rows, in the order the steps produced them."""
    xs, w_kc, w_vc, C, R, Di = _inputs(seed=page_size)
    pool = MLAKVPool(48 // page_size + 4, page_size, 2, C, R, torch.float32, index_head_dim=Di,
                     index_cache_dtype=index_cache_dtype)
    outs: list[torch.Tensor] = []

    def run(fb, sp):
        index = SparseIndex(_cat(xs["iq"], sp), _cat(xs["iw"], sp), _cat(xs["ik"], sp), Di ** -0.5, TOPK)
        return fb.attn_backend.forward_mla_sparse(_cat(xs["q_nope"], sp), _cat(xs["q_pe"], sp),
                                                  _cat(xs["latent"], sp), _cat(xs["k_pe"], sp), w_kc, w_vc, 1,
                                                  0.2, index, fb)

    walk_steps(pool, create_backend(backend_name), LENGTHS, STEPS, run, lambda r, start, n, o: outs.append(o))
    return outs


@pytest.mark.parametrize("page_size", [1, 16])
def test_triton_sparse_mla_matches_torch_native(page_size):
    got, want = _outputs("triton", page_size), _outputs("torch_native", page_size)
    assert len(got) == len(want) == sum(len(step) for step in STEPS)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_triton_and_torch_native_agree_on_fp8_index_keys():
    """An FP8 index cache (e4m3 keys, a scale each): both backends score the same dequantized keys."""
    got, want = _outputs("triton", 4, "fp8_e4m3"), _outputs("torch_native", 4, "fp8_e4m3")
    assert len(got) == len(want) == sum(len(step) for step in STEPS)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_torch_native_query_blocks_change_nothing(monkeypatch):
    """An extend split into blocks of 2 queries (the bound on scores and gathered rows) gives the
    same rows as one block."""
    from pdserve.layers.attention import torch_native

    whole = _outputs("torch_native", 4)
    monkeypatch.setattr(torch_native, "SPARSE_CHUNK_ELEMENTS", 2 * TOPK * 24)  # k * (C+R) per query: 2 queries
    assert torch_native._query_chunk(11, 21, 2, TOPK, 24) == 2
    for got, want in zip(_outputs("torch_native", 4), whole):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.fixture(scope="module")
def tiny_v32(tmp_path_factory):
    return make_hf_model_and_dir("DeepseekV32ForCausalLM", tmp_path_factory.mktemp("v32_triton"))


@pytest.mark.slow
def test_engine_triton_decodes_v32_token_identically_to_transformers(tiny_v32):
    """Prompts shorter and several times longer than index_topk (8), prefilled in chunks."""
    from pdserve import Engine

    hf, path = tiny_v32
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 400, (n,), generator=g).tolist() for n in (5, 3 * 8 + 1)]
    params = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    with Engine(model_path=path, attention_backend="triton", page_size=4, chunked_prefill_size=16) as engine:
        outs = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
    assert outs == [greedy_continuation(hf, p, 6) for p in prompts]


@pytest.mark.slow
def test_engine_triton_on_fp8_index_keys_decodes_as_transformers_with_them(tiny_v32):
    """--index-cache-dtype fp8_e4m3 (CUDA's default) through the Triton score kernel: transformers' tokens
    with its indexer's keys through the same quantization."""
    from fixtures.fp8_index_keys import fp8_index_keys
    from pdserve import Engine

    hf, path = tiny_v32
    g = torch.Generator().manual_seed(12)
    prompts = [torch.randint(3, 400, (n,), generator=g).tolist() for n in (5, 4 * 8 + 5)]
    params = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    with Engine(model_path=path, attention_backend="triton", page_size=4, index_cache_dtype="fp8_e4m3") as engine:
        assert engine.scheduler.runner.pool.index_k.dtype == torch.float8_e4m3fn
        outs = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
    with fp8_index_keys(hf) as oracle:
        assert outs == [greedy_continuation(oracle, p, 6) for p in prompts]


def test_sparse_benchmark_times_the_triton_indexer():
    """benchmark/bench_sparse.py on this backend: its indexer (index_topk) is found and timed."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))
    import bench_sparse

    rows = bench_sparse.run(bench_sparse.MODELS[:2], [24], batch_size=1, warmup=1, steps=1, repeats=1, page_size=16,
                            backend="triton")
    dense, sparse = rows
    assert dense["indexer_share"] == 0.0 and 0.0 < sparse["indexer_share"] < 1.0
    assert 0.0 < sparse["attention_ms"] < sparse["step_ms"]
