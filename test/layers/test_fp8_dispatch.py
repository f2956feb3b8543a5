"""layers/quant/fp8_kernels: the backend order, the CPU path (the twins, no GPU package imported),
errors that name the tensor, and on a GPU every installed backend against the twin."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve.layers.quant import fp8_kernels
from pdserve_kernels import fp8_ref

ROOT = Path(__file__).resolve().parents[2]
FP8 = torch.float8_e4m3fn
B128 = (128, 128)


def _weight(n: int, k: int, seed: int, lead: tuple[int, ...] = ()):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(*lead, n, k, generator=g) * 64).clamp(-448, 448).to(FP8)
    return w, 2.0 ** (torch.rand(*lead, -(-n // 128), -(-k // 128), generator=g) * 2 - 11)


@pytest.mark.parametrize("cap,dtype,n,k,have,expected", [
    (None, torch.bfloat16, 256, 512, {"deep_gemm", "flashinfer"}, "torch"),
    ((9, 0), torch.bfloat16, 256, 512, {"deep_gemm", "flashinfer"}, "deep_gemm"),
    ((9, 0), torch.bfloat16, 256, 512, {"flashinfer"}, "triton"),  # flashinfer's is Blackwell-only
    ((10, 0), torch.bfloat16, 256, 512, {"deep_gemm", "flashinfer"}, "flashinfer"),
    ((9, 0), torch.float32, 256, 512, {"deep_gemm"}, "triton"),  # DeepGEMM writes bf16 only
    ((9, 0), torch.bfloat16, 576, 192, {"deep_gemm"}, "triton"),  # K not a multiple of 128
    ((8, 0), torch.bfloat16, 256, 512, {"deep_gemm", "flashinfer"}, "triton"),
])
def test_gemm_backend_order(cap, dtype, n, k, have, expected):
    assert fp8_kernels.select_gemm_backend(cap, dtype, n, k, B128, installed=have.__contains__) == expected


def test_cpu_calls_run_the_twins_and_import_no_gpu_package():
    code = """
import sys, torch
from pdserve.layers.quant import fp8_kernels as f
w = torch.randn(80, 192).to(torch.float8_e4m3fn)
s = torch.rand(1, 2)
y = f.w8a8_block_matmul(torch.randn(3, 192), w, s)
w13, s13 = torch.randn(2, 128, 192).to(torch.float8_e4m3fn), torch.rand(2, 1, 2)
w2, s2 = torch.randn(2, 192, 64).to(torch.float8_e4m3fn), torch.rand(2, 2, 1)
m = f.fused_moe_fp8(torch.randn(3, 192), w13, s13, w2, s2, torch.rand(3, 1), torch.tensor([[0], [1], [1]]))
assert y.shape == (3, 80) and m.shape == (3, 192)
print(sorted({"triton", "deep_gemm", "flashinfer"} & set(sys.modules)))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{ROOT / 'python'}:{ROOT / 'kernels'}",
                              "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_cpu_results_equal_the_twins():
    w, s = _weight(80, 192, seed=0)
    x = torch.randn(4, 192, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    assert torch.equal(fp8_kernels.w8a8_block_matmul(x, w, s), fp8_ref.w8a8_block_matmul_ref(x, w, s, B128))
    w13, s13 = _weight(128, 192, seed=2, lead=(3,))
    w2, s2 = _weight(192, 64, seed=3, lead=(3,))
    tw, ids = torch.rand(4, 2), torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1]])
    got = fp8_kernels.fused_moe_fp8(x, w13, s13, w2, s2, tw, ids, B128)
    assert torch.equal(got, fp8_ref.fused_moe_fp8_ref(x, w13, s13, w2, s2, tw, ids, B128))


def test_errors_name_the_tensor():
    w, s = _weight(80, 192, seed=0)
    x = torch.randn(2, 192)
    with pytest.raises(ValueError, match=r"w_fp8_scale_inv: .*\(2, 1\), expected float32 \(1, 2\)"):
        fp8_kernels.w8a8_block_matmul(x, w, s.T.contiguous())
    with pytest.raises(ValueError, match="w_fp8: dtype torch.float32"):
        fp8_kernels.w8a8_block_matmul(x, w.float(), s)
    with pytest.raises(ValueError, match=r"x: shape \(2, 128\)"):
        fp8_kernels.w8a8_block_matmul(x[:, :128], w, s)
    w13, s13 = _weight(128, 192, seed=2, lead=(3,))
    w2, s2 = _weight(192, 64, seed=3, lead=(3,))
    with pytest.raises(ValueError, match="w13_fp8_scale_inv"):  # w2 passed where w13's scales go
        fp8_kernels.fused_moe_fp8(x, w13, w2, s13, s2, torch.rand(2, 1), torch.zeros(2, 1, dtype=torch.long))


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(256, 512), (576, 7168 // 4), (80, 192)])
def test_every_installed_gemm_backend_matches_the_twin_on_gpu(n, k):
    w, s = _weight(n, k, seed=4)
    x = torch.randn(33, k, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    ref = fp8_ref.w8a8_block_matmul_ref(x, w, s, B128).float()
    cap = torch.cuda.get_device_capability()
    auto = fp8_kernels.select_gemm_backend(cap, x.dtype, n, k, B128)
    for backend in sorted({"triton", auto}):
        got = fp8_kernels.w8a8_block_matmul(x.cuda(), w.cuda(), s.cuda(), B128, backend=backend).cpu().float()
        torch.testing.assert_close(got, ref, atol=3e-2 * ref.abs().max().item(), rtol=3e-2, msg=backend)
