"""The block-scaled FP8 kernels the model layers call: a W8A8 GEMM and the fused MoE, one interface
each, the backend chosen per call from the device and what is installed. Nothing here imports a
GPU package at import time, and a CPU call imports none: importing pdserve stays CPU-safe.

Legend: T tokens, K in-features, N out-features, bn x bk the weight scale block, E experts,
H hidden, I intermediate, k experts per token.

GEMM backends, first that applies: ``deep_gemm`` (Hopper, bf16 out, K a multiple of 128,
128 x 128 blocks), ``flashinfer`` (its block-scaled FP8 GEMM runs on Blackwell only; same
limits), ``triton`` (pdserve_kernels.fp8_gemm, any CUDA GPU), ``torch`` (the twin, off CUDA).
The MoE runs pdserve_kernels.fp8_moe on CUDA and its twin elsewhere: DeepGEMM's grouped GEMMs
want every expert's rows padded to 128, a layout pdserve's sorted pairs do not use.
"""

from __future__ import annotations

import importlib.util
from functools import cache

import torch

GEMM_BACKENDS = ("auto", "deep_gemm", "flashinfer", "triton", "torch")


@cache
def _installed(module: str) -> bool:
    """Whether ``module`` could be imported, without importing it (no CUDA init on a CPU host)."""
    return importlib.util.find_spec(module) is not None


def select_gemm_backend(capability: tuple[int, int] | None, dtype: torch.dtype, n: int, k: int,
                        block_size: tuple[int, int], installed=_installed) -> str:
    """The GEMM backend for x of ``dtype`` against an [n, k] weight, on a CUDA device of
    ``capability`` (None: not CUDA)."""
    if capability is None:
        return "torch"
    fast_shape = dtype == torch.bfloat16 and tuple(block_size) == (128, 128) and k % 128 == 0 and n % 64 == 0
    if fast_shape and capability[0] == 9 and installed("deep_gemm"):
        return "deep_gemm"  # its sm90 kernels take float32 scales; sm100 wants packed UE8M0 ones
    if fast_shape and capability[0] == 10 and installed("flashinfer"):
        return "flashinfer"
    return "triton"


def w8a8_block_matmul(x: torch.Tensor, w_fp8: torch.Tensor, w_scale_inv: torch.Tensor,
                      block_size: tuple[int, int] = (128, 128), *, backend: str = "auto") -> torch.Tensor:
    """x [T, K] -> x @ dequant(w).T [T, N] in x.dtype; w_fp8 [N, K] float8_e4m3fn, w_scale_inv
    [ceil(N/bn), ceil(K/bk)] float32 (weight ~= fp8 * scale_inv per block). x is quantized per
    token and group of bk along K (e4m3, scale = amax / 448) before the GEMM."""
    _check_weight("w_fp8", w_fp8, w_scale_inv, block_size)
    if x.dim() != 2 or x.shape[1] != w_fp8.shape[1]:
        raise ValueError(f"x: shape {tuple(x.shape)}, expected [T, {w_fp8.shape[1]}] (w_fp8's K)")
    N, K = w_fp8.shape
    if backend == "auto":
        cap = torch.cuda.get_device_capability(x.device) if x.is_cuda else None
        backend = select_gemm_backend(cap, x.dtype, N, K, block_size)
    if backend not in GEMM_BACKENDS:
        raise ValueError(f"backend: {backend!r}, expected one of {GEMM_BACKENDS}")
    x = x.contiguous()
    if x.shape[0] == 0:  # an empty batch: no backend need take m = 0
        return x.new_empty(0, N)
    if backend == "torch":
        from pdserve_kernels.fp8_ref import w8a8_block_matmul_ref

        return w8a8_block_matmul_ref(x, w_fp8, w_scale_inv, block_size)
    from pdserve_kernels import fp8_gemm

    if backend == "triton":
        return fp8_gemm.w8a8_block_matmul(x, w_fp8, w_scale_inv, block_size)
    q, a_scale = fp8_gemm.per_token_group_quant(x, block_size[1])  # [T, K] fp8, [T, K/128]
    out = torch.empty(x.shape[0], N, dtype=torch.bfloat16, device=x.device)
    if backend == "deep_gemm":
        _deep_gemm_nt(q, a_scale, w_fp8, w_scale_inv, out)
    else:
        _flashinfer_nt(q, a_scale, w_fp8, w_scale_inv, out)
    return out.to(x.dtype)  # both write bf16; "auto" picks them for bf16 x only


def _deep_gemm_nt(q, a_scale, w, w_scale_inv, out) -> None:
    import deep_gemm

    # DeepGEMM 2.x names it fp8_gemm_nt, 1.x gemm_fp8_fp8_bf16_nt; both take ((a, sfa), (b, sfb), d)
    # and lay the scales out for TMA themselves. Not run here (no GPU was lent): gpu_check.sh's
    # gpu-marked test_fp8_dispatch compares it with the Triton kernel.
    gemm = getattr(deep_gemm, "fp8_gemm_nt", None) or deep_gemm.gemm_fp8_fp8_bf16_nt
    gemm((q, a_scale), (w, w_scale_inv), out)


def _flashinfer_nt(q, a_scale, w, w_scale_inv, out) -> None:
    from flashinfer.gemm import gemm_fp8_nt_blockscaled

    # scale_major_mode "K": a_scale [T, K/128], b_scale [N/128, K/128], the checkpoint's own
    # layouts. Unverified here (Blackwell only, no GPU was lent); see _deep_gemm_nt.
    gemm_fp8_nt_blockscaled(q, w, a_scale, w_scale_inv, scale_major_mode="K", out=out, out_dtype=out.dtype)


def fused_moe_fp8(x: torch.Tensor, w13_fp8: torch.Tensor, w13_scale_inv: torch.Tensor, w2_fp8: torch.Tensor,
                  w2_scale_inv: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  block_size: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """x [T, H], w13_fp8 [E, 2I, H] (gate | up rows) with w13_scale_inv [E, ceil(2I/bn), ceil(H/bk)],
    w2_fp8 [E, H, I] with w2_scale_inv [E, ceil(H/bn), ceil(I/bk)], topk_weights [T, k] float32,
    topk_ids [T, k] -> sum_k topk_weights * down(silu(gate) * up) [T, H] in x.dtype.

    Routing weights multiply the expert outputs (after the down projection) in float32, as the
    bf16 Experts do. Every expert must be here (no EP): ids index w13_fp8's first dim."""
    _check_weight("w13_fp8", w13_fp8, w13_scale_inv, block_size)
    _check_weight("w2_fp8", w2_fp8, w2_scale_inv, block_size)
    E, I2, H = w13_fp8.shape
    if x.dim() != 2 or x.shape[1] != H or w2_fp8.shape != (E, H, I2 // 2):
        raise ValueError(f"x {tuple(x.shape)}, w13_fp8 {tuple(w13_fp8.shape)}, w2_fp8 {tuple(w2_fp8.shape)}: "
                         "expected x [T, H], w13_fp8 [E, 2I, H], w2_fp8 [E, H, I]")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)}, topk_weights {tuple(topk_weights.shape)}: "
                         f"expected both [T={x.shape[0]}, k]")
    if x.is_cuda:
        from pdserve_kernels.fp8_moe import fused_moe_fp8 as fused

        return fused(x.contiguous(), w13_fp8, w13_scale_inv, w2_fp8, w2_scale_inv, topk_weights, topk_ids,
                     block_size)
    from pdserve_kernels.fp8_ref import fused_moe_fp8_ref

    return fused_moe_fp8_ref(x, w13_fp8, w13_scale_inv, w2_fp8, w2_scale_inv, topk_weights, topk_ids, block_size)


def _check_weight(name: str, w: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int]) -> None:
    """w [..., rows, cols] float8_e4m3fn with scale_inv [..., ceil(rows/bn), ceil(cols/bk)] float32."""
    bn, bk = block_size
    if w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name}: dtype {w.dtype}, expected torch.float8_e4m3fn")
    if bk & (bk - 1) or bk < 16:
        raise ValueError(f"block_size: {tuple(block_size)}, its K block (the activation group) must be a power "
                         "of two >= 16")
    grid = (*w.shape[:-2], -(-w.shape[-2] // bn), -(-w.shape[-1] // bk))
    if scale_inv.dtype != torch.float32 or tuple(scale_inv.shape) != grid:
        raise ValueError(f"{name}_scale_inv: {scale_inv.dtype} {tuple(scale_inv.shape)}, expected float32 {grid} "
                         f"for {name} {tuple(w.shape)} in {bn}x{bk} blocks")
