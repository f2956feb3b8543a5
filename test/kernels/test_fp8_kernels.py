"""Block-scaled FP8 (DeepSeek-V3's format): the per-token-group quantizer, the W8A8 GEMM and the
fused MoE vs their torch twins, and the twins vs plain dequantize-then-matmul. Partial edge
blocks everywhere (N=80, K=192 in 128-blocks); scale grids square enough that a transposed
scale would be caught."""

from __future__ import annotations

import pytest
import torch

from pdserve_kernels import fp8_gemm, fp8_moe, fp8_ref

FP8 = torch.float8_e4m3fn


def _weight(n: int, k: int, block: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp8 [n, k] weight (values ~64) and scale_inv [ceil(n/bn), ceil(k/bk)] spread over
    2^-11..2^-9, so the dequantized weight is ~N(0, 1/k) and outputs stay near 1."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 64).clamp(-448, 448).to(FP8)
    grid = (-(-n // block[0]), -(-k // block[1]))
    return w, 2.0 ** (torch.rand(grid, generator=g) * 2 - 11)


def _dequant(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Block by block, as the format is defined (not the twins' repeat_interleave), in float64."""
    out = w.double()
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            out[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] *= scale_inv[i, j].item()
    return out


def _qdq(x: torch.Tensor, group: int) -> torch.Tensor:
    """Activations quantized and dequantized one (token, group) at a time, in float64."""
    out = torch.empty(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for c in range(0, x.shape[1], group):
            seg = x[t, c:c + group].float()
            s = max(seg.abs().max().item(), 1e-10) / 448.0
            out[t, c:c + group] = (seg / s).clamp(-448, 448).to(FP8).double() * s
    return out


def _x(t: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g) * torch.rand(t, 1, generator=g) * 4
    if t > 2:
        x[2] = 0  # an all-zero token: its scale is the floor, its q all zeros
    return x.to(dtype)


# ------------------------------------------------------------------ quantizer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_group_quant_matches_twin_bit_for_bit(device, dtype):
    x = _x(5, 192, dtype, seed=0)  # 192 = one full group of 128 and a partial one
    q_ref, s_ref = fp8_ref.per_token_group_quant_ref(x, 128)
    q, s = fp8_gemm.per_token_group_quant(x.to(device), 128)
    assert q.dtype == FP8 and s.shape == (5, 2)
    assert torch.equal(s.cpu(), s_ref)
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))
    # what it means: each group's largest value maps to 448 and the round trip stays within e4m3's step
    assert q_ref.float().abs().amax(1)[[0, 1, 3, 4]].eq(448).all()
    torch.testing.assert_close(q_ref.float().view(5, -1)[:, :128] * s_ref[:, :1], x[:, :128].float(),
                               atol=0, rtol=2 ** -4)


# ------------------------------------------------------------------ W8A8 GEMM

SHAPES = [  # (N, K, block): partial edge blocks; a 2x2 scale grid; a 2x3 grid in 64-blocks
    pytest.param(80, 192, (128, 128), id="N80-K192"),
    pytest.param(200, 256, (128, 128), id="N200-K256"),
    pytest.param(80, 192, (64, 64), id="N80-K192-b64"),
]


@pytest.mark.parametrize("n,k,block", SHAPES)
def test_gemm_twin_equals_dequantized_matmul(n, k, block):
    w, s = _weight(n, k, block, seed=1)
    x = _x(7, k, torch.float32, seed=2)
    ref = _qdq(x, block[1]) @ _dequant(w, s, block).T  # [7, n] float64
    out = fp8_ref.w8a8_block_matmul_ref(x, w, s, block)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    if s.shape[0] == s.shape[1]:  # the same weight with its scale grid transposed is another matrix
        assert (fp8_ref.w8a8_block_matmul_ref(x, w, s.T.contiguous(), block).double() - ref).abs().max() > 0.1


@pytest.mark.parametrize("t", [0, 1, 5, 33])
@pytest.mark.parametrize("n,k,block", SHAPES)
def test_gemm_matches_twin(device, dtype_tol, t, n, k, block):
    dtype, atol = dtype_tol
    w, s = _weight(n, k, block, seed=3)
    x = _x(t, k, dtype, seed=4 + t)
    ref = fp8_ref.w8a8_block_matmul_ref(x, w, s, block)
    out = fp8_gemm.w8a8_block_matmul(x.to(device), w.to(device), s.to(device), block)
    assert out.dtype == dtype and out.shape == (t, n)
    if device == "cuda" and t:
        # fp8 tensor cores accumulate a K-block in reduced precision (~14 bits on Hopper, the
        # DeepSeek-V3 report); the interpreter's float32 dots are exact
        atol = max(atol, 4e-3 * ref.float().abs().max().item())
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=atol, rtol=atol)


# ------------------------------------------------------------------ fused MoE


def _experts(E: int, H: int, I: int, block: tuple[int, int], seed: int):
    w13 = [_weight(2 * I, H, block, seed + e) for e in range(E)]
    w2 = [_weight(H, I, block, seed + 100 + e) for e in range(E)]
    return (torch.stack([w for w, _ in w13]), torch.stack([s for _, s in w13]),
            torch.stack([w for w, _ in w2]), torch.stack([s for _, s in w2]))


def _routing(T: int, K: int, E: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(T, K, dtype=torch.long)
    for t in range(T):
        ids[t] = torch.randperm(E - 1, generator=g)[:K]  # distinct experts; expert E-1 gets nothing
    return torch.rand(T, K, generator=g), ids


def test_moe_twin_equals_dequantized_experts():
    E, H, I, block = 4, 192, 64, (128, 128)
    w13, s13, w2, s2 = _experts(E, H, I, block, seed=10)
    x = _x(6, H, torch.float32, seed=11)
    weights, ids = _routing(6, 2, E, seed=12)
    ref = torch.zeros(6, H, dtype=torch.float64)
    for t in range(6):
        for j in range(2):
            e = ids[t, j].item()
            g, u = (_qdq(x[t:t + 1], 128) @ _dequant(w13[e], s13[e], block).T).chunk(2, dim=-1)
            inter = torch.nn.functional.silu(g) * u  # [1, I]
            ref[t] += weights[t, j].item() * (_qdq(inter.float(), 128) @ _dequant(w2[e], s2[e], block).T)[0]
    out = fp8_ref.fused_moe_fp8_ref(x, w13, s13, w2, s2, weights, ids, block)
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("t", [0, 1, 6])
def test_fused_moe_matches_twin(device, dtype_tol, t):
    dtype, atol = dtype_tol
    E, K, H, I, block = 4, 2, 192, 64, (128, 128)  # w2's K (I=64) and H's last block are partial
    w13, s13, w2, s2 = _experts(E, H, I, block, seed=20)
    x = _x(t, H, dtype, seed=21)
    weights, ids = _routing(t, K, E, seed=22)
    ref = fp8_ref.fused_moe_fp8_ref(x, w13, s13, w2, s2, weights, ids, block)
    out = fp8_moe.fused_moe_fp8(*(a.to(device) for a in (x, w13, s13, w2, s2, weights, ids)), block)
    assert out.dtype == dtype and out.shape == (t, H)
    if (dtype == torch.bfloat16 or device == "cuda") and t:
        # The gate/up output is rounded to bf16 (or, on CUDA, accumulated inexactly by the fp8
        # tensor cores) before it is quantized again, so a one-ulp difference can move a group's
        # amax and re-round the whole group: the outputs then agree to about one e4m3 step (2^-4)
        # of their scale. fp32 under the interpreter stays exact up to float32 rounding.
        atol = 2 ** -4 * ref.float().abs().max().item()
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=atol, rtol=atol)
