"""Paged decode (GQA, MLA with split-KV + merge) and extend attention kernels vs their torch
twins, reading pools in place: odd head counts, page sizes 1 and 16, ragged batches, prefixes."""

from __future__ import annotations

import pytest
import torch

from fixtures.kernel_inputs import paged_slots
from pdserve_kernels import decode_attention as da
from pdserve_kernels import extend_attention as ea

SEQS = [5, 33, 1]  # ragged; 33 crosses a 16-token page and a 32-key block


def _close(out, ref, atol):
    assert out.dtype == ref.dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=atol)


@pytest.mark.parametrize("page_size", [1, 16])
def test_gqa_decode_matches_twin(device, dtype_tol, page_size):
    dtype, atol = dtype_tol
    Hq, Hkv, D, P = 9, 3, 24, 64 // page_size + 4
    g = torch.Generator().manual_seed(1)
    k = torch.randn(P, Hkv, page_size, D, generator=g).to(dtype)
    v = torch.randn(P, Hkv, page_size, D, generator=g).to(dtype)
    slots, seq = paged_slots(SEQS, page_size, P), torch.tensor(SEQS)
    q = torch.randn(len(SEQS), Hq, D, generator=g).to(dtype)
    ref = da.decode_gqa_ref(q, k, v, slots, seq, 0.2)
    dev = [t.to(device) for t in (q, k, v, slots, seq)]
    for splits in (1, 3):  # split 3 of request 0 (5 keys) is empty: the merge must ignore it
        _close(da.decode_gqa(*dev, 0.2, num_splits=splits).cpu(), ref, atol)


@pytest.mark.parametrize("page_size", [1, 16])
def test_mla_decode_matches_twin(device, dtype_tol, page_size):
    dtype, atol = dtype_tol
    H, C, R, P = 5, 16, 8, 64 // page_size + 4
    g = torch.Generator().manual_seed(2)
    latent = torch.randn(P, page_size, C + R, generator=g).to(dtype)
    slots, seq = paged_slots(SEQS, page_size, P, seed=1), torch.tensor(SEQS)
    q = torch.randn(len(SEQS), H, C + R, generator=g).to(dtype)
    ref = da.decode_mla_ref(q, latent, C, slots, seq, 0.15)
    out = da.decode_mla(q.to(device), latent.to(device), C, slots.to(device), seq.to(device), 0.15, num_splits=4)
    _close(out.cpu(), ref, atol)


def test_merge_of_partials_matches_twin(device):
    g = torch.Generator().manual_seed(3)
    o = torch.randn(2, 3, 4, 8, generator=g)
    lse = torch.randn(2, 3, 4, generator=g)
    lse[0, :, 2:] = float("-inf")  # empty splits
    out = da.merge_partials(o.to(device), lse.to(device), torch.float32).cpu()
    _close(out, da.merge_partials_ref(o, lse, torch.float32), 1e-6)


@pytest.mark.parametrize("page_size", [1, 16])
def test_gqa_extend_with_prefix_matches_twin(device, dtype_tol, page_size):
    dtype, atol = dtype_tol
    Hq, Hkv, D = 6, 2, 16
    prefix, ext = torch.tensor([0, 17, 3]), torch.tensor([5, 2, 20])
    P = 64 // page_size + 4
    g = torch.Generator().manual_seed(4)
    k = torch.randn(P, Hkv, page_size, D, generator=g).to(dtype)
    v = torch.randn(P, Hkv, page_size, D, generator=g).to(dtype)
    slots = paged_slots((prefix + ext).tolist(), page_size, P, seed=2)
    q = torch.randn(int(ext.sum()), Hq, D, generator=g).to(dtype)
    ref = ea.extend_gqa_ref(q, k, v, slots, prefix, ext, 0.25)
    out = ea.extend_gqa(*(t.to(device) for t in (q, k, v, slots, prefix, ext)), 0.25)
    _close(out.cpu(), ref, atol)


def test_mla_extend_with_prefix_matches_twin(device, dtype_tol):
    dtype, atol = dtype_tol
    H, C, R, S = 3, 16, 8, 16
    prefix, ext = torch.tensor([16, 0]), torch.tensor([3, 18])
    g = torch.Generator().manual_seed(5)
    latent = torch.randn(6, S, C + R, generator=g).to(dtype)
    slots = paged_slots((prefix + ext).tolist(), S, 6, seed=3)
    q = torch.randn(int(ext.sum()), H, C + R, generator=g).to(dtype)
    ref = ea.extend_mla_ref(q, latent, C, slots, prefix, ext, 0.3)
    out = ea.extend_mla(*(t.to(device) for t in (q, latent)), C, *(t.to(device) for t in (slots, prefix, ext)), 0.3)
    _close(out.cpu(), ref, atol)


# ------------------------------------------------------------------ FP8 pools (--kv-cache-dtype fp8_e4m3)
def _fp8(shape, g, scale):
    """Random values stored as an fp8 pool stores them: x / scale in e4m3 (saturated)."""
    return (torch.randn(shape, generator=g) * 3).div(scale).clamp(-448, 448).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("page_size", [1, 16])
def test_gqa_kernels_read_fp8_pools_with_their_scales(device, dtype_tol, page_size):
    """Decode and extend over e4m3 K/V pages, k_scale and v_scale not 1: the kernels upcast the
    stored bytes and apply the scales exactly as the twins that dequantize every element."""
    dtype, atol = dtype_tol
    Hq, Hkv, D, P, ks, vs = 6, 2, 16, 64 // page_size + 4, 0.05, 0.2
    g = torch.Generator().manual_seed(6)
    k, v = _fp8((P, Hkv, page_size, D), g, ks), _fp8((P, Hkv, page_size, D), g, vs)
    slots, seq = paged_slots(SEQS, page_size, P, seed=4), torch.tensor(SEQS)
    q = torch.randn(len(SEQS), Hq, D, generator=g).to(dtype)
    ref = da.decode_gqa_ref(q, k, v, slots, seq, 0.2, k_scale=ks, v_scale=vs)
    dev = [t.to(device) for t in (q, k, v, slots, seq)]
    _close(da.decode_gqa(*dev, 0.2, num_splits=2, k_scale=ks, v_scale=vs).cpu(), ref, atol)
    prefix, ext = torch.tensor([0, 17, 3]), torch.tensor([5, 2, 20])
    slots = paged_slots((prefix + ext).tolist(), page_size, P, seed=5)
    q = torch.randn(int(ext.sum()), Hq, D, generator=g).to(dtype)
    ref = ea.extend_gqa_ref(q, k, v, slots, prefix, ext, 0.25, k_scale=ks, v_scale=vs)
    out = ea.extend_gqa(*(t.to(device) for t in (q, k, v, slots, prefix, ext)), 0.25, k_scale=ks, v_scale=vs)
    _close(out.cpu(), ref, atol)


def test_mla_kernels_read_fp8_latent_pools_with_their_scale(device, dtype_tol):
    dtype, atol = dtype_tol
    H, C, R, S, sc = 3, 16, 8, 16, 0.1
    g = torch.Generator().manual_seed(7)
    latent = _fp8((6, S, C + R), g, sc)
    slots, seq = paged_slots([19, 33], S, 6, seed=6), torch.tensor([19, 33])
    q = torch.randn(2, H, C + R, generator=g).to(dtype)
    ref = da.decode_mla_ref(q, latent, C, slots, seq, 0.15, latent_scale=sc)
    out = da.decode_mla(q.to(device), latent.to(device), C, slots.to(device), seq.to(device), 0.15, num_splits=2,
                        latent_scale=sc)
    _close(out.cpu(), ref, atol)
    prefix, ext = torch.tensor([16, 0]), torch.tensor([3, 18])
    slots = paged_slots((prefix + ext).tolist(), S, 6, seed=3)
    q = torch.randn(int(ext.sum()), H, C + R, generator=g).to(dtype)
    ref = ea.extend_mla_ref(q, latent, C, slots, prefix, ext, 0.3, latent_scale=sc)
    out = ea.extend_mla(*(t.to(device) for t in (q, latent)), C, *(t.to(device) for t in (slots, prefix, ext)), 0.3,
                        latent_scale=sc)
    _close(out.cpu(), ref, atol)
