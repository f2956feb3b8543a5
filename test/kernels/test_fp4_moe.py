"""FP4 experts (DeepSeek-V4's format): the fused MoE kernel, which dequantizes its weight tiles
in-kernel, against its torch twin; the twin against experts dequantized nibble by nibble in float64.
Tiny shapes: H 64 (two scale blocks per row of w13), I 32, 6 experts, some unused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve_kernels import fp4_moe, fp4_ref

E, H, I, K = 6, 64, 32, 2
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _fp4(rows: int, cols: int, g: torch.Generator, e: int = E) -> tuple[torch.Tensor, torch.Tensor]:
    """Random packed bytes (every code, -0 included) and ue8m0 scales around 2^-3, uint8."""
    packed = torch.randint(0, 256, (e, rows, cols // 2), generator=g, dtype=torch.uint8).view(torch.int8)
    return packed, torch.randint(122, 127, (e, rows, cols // 32), generator=g, dtype=torch.uint8)


def _dequant(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """One element at a time, as the format is defined, in float64."""
    rows, half = packed.shape
    out = torch.empty(rows, 2 * half, dtype=torch.float64)
    for r in range(rows):
        for j, byte in enumerate(packed[r].view(torch.uint8).tolist()):
            for c, code in ((2 * j, byte & 0xF), (2 * j + 1, byte >> 4)):
                v = E2M1[code & 7] * 2.0 ** (int(scale[r, c // 32]) - 127)
                out[r, c] = -v if code & 8 else v
    return out


def _case(t: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, H, generator=g) * 2).to(dtype)
    w13, s13 = _fp4(2 * I, H, g)
    w2, s2 = _fp4(H, I, g)
    ids = torch.stack([torch.randperm(E - 1, generator=g)[:K] for _ in range(t)])  # expert E-1 unused
    weights = torch.rand(t, K, generator=g)
    return x, w13, s13, w2, s2, weights, ids


def test_twin_equals_experts_dequantized_nibble_by_nibble():
    x, w13, s13, w2, s2, weights, ids = _case(5, torch.float32, seed=0)
    out = fp4_ref.fused_moe_fp4_ref(x, w13, s13, w2, s2, weights, ids, swiglu_limit=10.0)
    want = torch.zeros(5, H, dtype=torch.float64)
    for t in range(5):
        for k in range(K):
            e = int(ids[t, k])
            gate, up = (x[t].double() @ _dequant(w13[e], s13[e]).T).chunk(2)
            inter = F.silu(gate.clamp(max=10.0)) * up.clamp(-10.0, 10.0)
            want[t] += weights[t, k].double() * (inter @ _dequant(w2[e], s2[e]).T)
    assert torch.allclose(out.double(), want, atol=1e-4, rtol=1e-4)
    assert want.abs().max() > 1  # the check has something to compare


@pytest.mark.parametrize("t", [1, 7, 33])
def test_fused_moe_matches_twin(device, dtype_tol, t):
    dtype, tol = dtype_tol
    args = _case(t, dtype, seed=t)
    ref = fp4_ref.fused_moe_fp4_ref(*args, swiglu_limit=10.0)
    out = fp4_moe.fused_moe_fp4(*(a.to(device) for a in args), swiglu_limit=10.0)
    assert out.dtype == dtype and out.shape == (t, H)
    scale = ref.float().abs().max().item()
    assert torch.allclose(out.float().cpu(), ref.float(), atol=tol * max(1.0, scale), rtol=tol)


def test_kernel_reads_the_low_nibble_as_the_even_column(device):
    """One expert whose weight is 1 in column 0 (byte 0's low nibble) and 6 in column 1 (its high one)."""
    packed = torch.zeros(1, H, H // 2, dtype=torch.uint8)
    packed[0, :, 0] = 2 | 7 << 4
    scale = torch.full((1, H, H // 32), 127, dtype=torch.uint8)
    x = torch.zeros(1, H)
    x[0, 0], x[0, 1] = 1.0, 10.0
    sp = fp4_moe.sort_pairs(torch.zeros(1, 1, dtype=torch.long, device=device), 1, 16)
    out = fp4_moe.grouped_w4(x.to(device), packed.view(torch.int8).to(device), scale.to(device), sp, 1)
    assert out.cpu().eq(1.0 * 1 + 10.0 * 6).all()
