"""Kernel tests run every Triton kernel beside its torch twin: on a GPU when there is one, else
on CPU under the Triton interpreter, which must be switched on before triton is imported."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="the kernels are Triton (pip install triton)")  # after the switch

DEVICES = [pytest.param("cpu", id="interp"), pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")]
# (dtype, atol): fp32 tight; bf16 rounds inputs and the softmax weights to 8 mantissa bits.
DTYPES = [pytest.param((torch.float32, 2e-5), id="fp32"), pytest.param((torch.bfloat16, 3e-2), id="bf16")]


@pytest.fixture(params=DEVICES)
def device(request):
    if request.param == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors need the Triton interpreter (TRITON_INTERPRET=1)")
    return request.param


@pytest.fixture(params=DTYPES)
def dtype_tol(request):
    return request.param
