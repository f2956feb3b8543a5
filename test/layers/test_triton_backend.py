"""The triton backend (kernels under the interpreter on CPU) vs the contiguous references over
prefix + extend + decode steps, and vs torch_native through the Engine on the tiny presets."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
pytest.importorskip("triton")

from fixtures.paged_batches import cat_spans as _cat  # noqa: E402
from fixtures.paged_batches import walk_steps  # noqa: E402
from pdserve.layers.attention.reference import gqa_reference, mla_reference  # noqa: E402
from pdserve.layers.attention.registry import create_backend  # noqa: E402
from pdserve.mem.kv_pool import GQAKVPool, MLAKVPool  # noqa: E402

LENGTHS = (21, 7, 17)
STEPS = [[(0, 11), (2, 16)], [(0, 9), (1, 5), (2, 1)], [(0, 1), (1, 1)], [(1, 1)]]  # extends, then decodes


def _walk(pool, run_step, check):
    walk_steps(pool, create_backend("triton"), LENGTHS, STEPS, run_step, check)


@pytest.mark.parametrize("page_size", [1, 16])
def test_triton_gqa_matches_reference(page_size):
    Hq, Hkv, D, scale = 9, 3, 16, 0.3
    g = torch.Generator().manual_seed(0)
    q, k, v = ([torch.randn(n, h, D, generator=g) for n in LENGTHS] for h in (Hq, Hkv, Hkv))
    pool = GQAKVPool(48 // page_size + 4, page_size, 2, Hkv, D, torch.float32)

    def check(r, start, n, out):
        want = gqa_reference(q[r][start:start + n], k[r][:start + n], v[r][:start + n], scale)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)

    _walk(pool, lambda fb, sp: fb.attn_backend.forward_gqa(_cat(q, sp), _cat(k, sp), _cat(v, sp), 1, scale, fb),
          check)


@pytest.mark.parametrize("page_size", [1, 16])
def test_triton_mla_matches_reference(page_size):
    H, Dn, R, Dv, C, scale = 3, 16, 8, 12, 16, 0.2
    g = torch.Generator().manual_seed(1)
    q_nope, q_pe = ([torch.randn(n, H, d, generator=g) for n in LENGTHS] for d in (Dn, R))
    latent, k_pe = ([torch.randn(n, d, generator=g) for n in LENGTHS] for d in (C, R))
    w_kc, w_vc = torch.randn(H, Dn, C, generator=g) * 0.2, torch.randn(H, C, Dv, generator=g) * 0.2
    pool = MLAKVPool(48 // page_size + 4, page_size, 2, C, R, torch.float32)

    def run(fb, sp):
        return fb.attn_backend.forward_mla(_cat(q_nope, sp), _cat(q_pe, sp), _cat(latent, sp), _cat(k_pe, sp),
                                           w_kc, w_vc, 0, scale, fb)

    def check(r, start, n, out):
        want = mla_reference(q_nope[r][start:start + n], q_pe[r][start:start + n], latent[r][:start + n],
                             k_pe[r][:start + n], w_kc, w_vc, scale)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)

    _walk(pool, run, check)


PROMPTS = ["The capital of France is", "1 2 3 4", "Hello"]


def _generate(preset: str, backend: str) -> list[list[int]]:
    from pdserve import Engine

    with Engine(preset, attention_backend=backend, page_size=4, max_total_tokens=256) as engine:
        outs = engine.generate(PROMPTS, sampling_params={"max_new_tokens": 4, "temperature": 0.0,
                                                          "ignore_eos": True})
    return [o["output_ids"] for o in outs]


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-deepseek"])
def test_engine_serves_presets_token_identically_to_torch_native(preset):
    """Greedy, fp32: the same tokens through ``pdserve.Engine`` with either backend."""
    assert _generate(preset, "triton") == _generate(preset, "torch_native")
