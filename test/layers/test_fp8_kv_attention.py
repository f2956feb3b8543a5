"""Every CPU attention backend over FP8 pools (float8_e4m3fn, per-tensor scales that are not
1.0, so a reader that forgets the scale is wrong by that factor) against the contiguous
references fed the same KV as the pool holds it (``round_trip_*``): torch_native (gathered and
staged decode KV, MLA absorbed and expanded) and triton (kernels under the interpreter).
Some keys are pushed past e4m3's range so saturation is exercised too."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

from fixtures.paged_batches import cat_spans as _cat  # noqa: E402
from fixtures.paged_batches import walk_steps  # noqa: E402
from pdserve.layers.attention.reference import gqa_reference, mla_reference  # noqa: E402
from pdserve.layers.attention.registry import create_backend  # noqa: E402
from pdserve.mem.kv_pool import FP8_DTYPE, GQAKVPool, MLAKVPool  # noqa: E402

LENGTHS = (22, 8, 17)
# extends (one with a prefix), then decode steps through the staged KV (built, appended, rebuilt)
STEPS = [[(0, 11), (2, 16)], [(0, 9), (1, 5), (2, 1)], [(0, 1), (1, 1)], [(0, 1), (1, 1)], [(1, 1)]]
K_SCALE, V_SCALE, LATENT_SCALE = 0.02, 0.05, 0.03  # stored = x / scale: |x| > 448 * scale saturates
BACKENDS = ("torch_native", "triton")


def _walk(pool, backend, run_step, check):
    if backend == "triton":
        pytest.importorskip("triton")
    walk_steps(pool, create_backend(backend), LENGTHS, STEPS, run_step, check)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [1, 16])
def test_gqa_over_an_fp8_pool_matches_the_reference_on_the_stored_kv(backend, page_size):
    Hq, Hkv, D, scale = 4, 2, 16, 0.3
    g = torch.Generator().manual_seed(0)
    q, k, v = ([torch.randn(n, h, D, generator=g) for n in LENGTHS] for h in (Hq, Hkv, Hkv))
    k[0][3, 0, :4] = 40.0  # > 448 * K_SCALE: saturates to 8.96 (never NaN or inf)
    pool = GQAKVPool(48 // page_size + 4, page_size, 2, Hkv, D, FP8_DTYPE, compute_dtype=torch.float32,
                     k_scale=K_SCALE, v_scale=V_SCALE)
    stored = [pool.round_trip_kv(a, b) for a, b in zip(k, v)]
    assert stored[0][0][3, 0, 0] == pytest.approx(448 * K_SCALE)

    def check(r, start, n, out):
        ks, vs = stored[r]
        want = gqa_reference(q[r][start:start + n], ks[:start + n], vs[:start + n], scale)
        torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)

    _walk(pool, backend, lambda fb, sp: fb.attn_backend.forward_gqa(_cat(q, sp), _cat(k, sp), _cat(v, sp), 1,
                                                                    scale, fb), check)


@pytest.mark.parametrize("backend,absorbed", [("torch_native", None), ("torch_native", True),
                                              ("torch_native", False), ("triton", None)])
@pytest.mark.parametrize("page_size", [1, 16])
def test_mla_over_an_fp8_pool_matches_the_reference_on_the_stored_latent(backend, absorbed, page_size):
    H, Dn, R, Dv, C, scale = 3, 16, 8, 12, 16, 0.2
    g = torch.Generator().manual_seed(1)
    q_nope, q_pe = ([torch.randn(n, H, d, generator=g) for n in LENGTHS] for d in (Dn, R))
    latent, k_pe = ([torch.randn(n, d, generator=g) for n in LENGTHS] for d in (C, R))
    latent[2][5, :3] = -30.0  # saturates at -448 * LATENT_SCALE
    w_kc, w_vc = torch.randn(H, Dn, C, generator=g) * 0.2, torch.randn(H, C, Dv, generator=g) * 0.2
    pool = MLAKVPool(48 // page_size + 4, page_size, 2, C, R, FP8_DTYPE, compute_dtype=torch.float32,
                     latent_scale=LATENT_SCALE)
    stored = [pool.round_trip_latent(torch.cat([a, b], -1)) for a, b in zip(latent, k_pe)]  # [L, C+R]

    def run(fb, sp):
        return fb.attn_backend.forward_mla(_cat(q_nope, sp), _cat(q_pe, sp), _cat(latent, sp), _cat(k_pe, sp),
                                           w_kc, w_vc, 0, scale, fb, absorbed=absorbed)

    def check(r, start, n, out):
        s = stored[r][:start + n]
        want = mla_reference(q_nope[r][start:start + n], q_pe[r][start:start + n], s[:, :C], s[:, C:],
                             w_kc, w_vc, scale)
        torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)

    _walk(pool, backend, run, check)
