"""Fused RMSNorm + residual, in-place rotary, fused MoE and HND head-range pack/unpack vs their
torch twins."""

from __future__ import annotations

import pytest
import torch

from pdserve_kernels import kv_pack, moe, rmsnorm, rotary


def test_rmsnorm_with_residual_matches_twin(device, dtype_tol):
    dtype, atol = dtype_tol
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(7, 48, generator=g).to(dtype) for _ in range(2))
    w = torch.randn(48, generator=g).to(dtype)
    y_ref, r_ref = rmsnorm.rmsnorm_ref(x, w, 1e-6, r.clone())
    y, r_out = rmsnorm.rmsnorm(x.to(device), w.to(device), 1e-6, r.to(device).clone())
    # fp32: the same sum exactly; bf16: one rounding (the interpreter's casts may truncate)
    torch.testing.assert_close(r_out.cpu().float(), r_ref.float(), atol=atol if dtype != torch.float32 else 0,
                               rtol=atol if dtype != torch.float32 else 0)
    torch.testing.assert_close(y.cpu().float(), y_ref.float(), atol=atol, rtol=atol)
    torch.testing.assert_close(rmsnorm.rmsnorm(x.to(device), w.to(device), 1e-6).cpu().float(),
                               rmsnorm.rmsnorm_ref(x, w, 1e-6).float(), atol=atol, rtol=atol)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_in_place_matches_twin(device, dtype_tol, interleaved):
    dtype, atol = dtype_tol
    g = torch.Generator().manual_seed(1)
    cos_sin = torch.randn(40, 8, generator=g)  # R = 8 of D = 12 dims rotated
    x = torch.randn(5, 3, 12, generator=g).to(dtype)
    pos = torch.tensor([0, 39, 7, 7, 2])
    ref = rotary.rotary_ref(x.clone(), pos, cos_sin, interleaved)
    y = x.to(device)
    out = rotary.rotary_(y, pos.to(device), cos_sin.to(device), interleaved)
    assert out.data_ptr() == y.data_ptr()
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=atol, rtol=atol)


def test_sort_pairs_groups_and_pads_by_expert():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])
    sp = moe.sort_pairs(ids, num_experts=4, block_m=2)
    N = 6
    assert sp.block_expert[:4].tolist() == [0, 1, 2, 2]  # expert 3 has no pairs, hence no block
    assert sp.pair_ids[:8].tolist() == [1, 4, 3, N, 0, 2, 5, N]
    assert (sp.pair_ids[8:] == N).all()  # the worst case's spare blocks hold only padding


def test_fused_moe_matches_per_expert_loop(device, dtype_tol):
    dtype, atol = dtype_tol
    T, K, E, H, I = 9, 2, 5, 40, 24
    g = torch.Generator().manual_seed(2)
    x = torch.randn(T, H, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / 6).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) / 5).to(dtype)
    ids = torch.randint(0, E, (T, K), generator=g)
    weights = torch.rand(T, K, generator=g)
    ref = moe.fused_experts_ref(x, w13, w2, weights, ids)
    out = moe.fused_experts(*(t.to(device) for t in (x, w13, w2, weights, ids)))
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=atol, rtol=atol)


def test_head_range_pack_unpack_round_trips(device, dtype_tol):
    dtype, _ = dtype_tol
    src = torch.randn(2, 9, 5, 16, 4).to(dtype)  # [N, P, H, S, D], odd heads
    pages = torch.tensor([8, 0, 3])
    buf = kv_pack.pack_heads(src.to(device), pages.to(device), 1, 4)
    assert torch.equal(buf.cpu(), kv_pack.pack_heads_ref(src, pages, 1, 4))
    # A decode rank with 3 heads per page receives them at offset 0 of other pages.
    dst = torch.zeros(2, 6, 3, 16, 4, dtype=dtype, device=device)
    dst_pages = torch.tensor([5, 1, 2], device=device)
    kv_pack.unpack_heads(buf, dst, dst_pages, 0)
    assert torch.equal(dst.cpu()[:, dst_pages.cpu()], src[:, pages, 1:4])
    assert not dst.cpu()[:, [0, 3, 4]].any()
