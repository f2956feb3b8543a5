"""A decode step's element-wise ops as plain-C CPU kernels (``fused_cpu.c``), one call and one pass
each instead of a few torch ops: residual add + RMSNorm, rotary (neox and interleaved), SiLU x mul.
float32, single-threaded. Twins, the torch paths beside their callers: ``layers/norm.py``'s
``rms_norm_torch``, ``layers/rotary.py``'s ``rotate_halves`` / ``RotaryEmbedding.rotate``,
``layers/activation.py``'s ``silu_and_mul_torch``.

Built on first use like every plain-C kernel (``cpu_build``); ``load()`` is None where no compiler
exists or the build fails (said once in the log): callers then run the twin. A ctypes call costs
~1-3 us, so the wrappers do no more Python than their checks; ``takes`` is the callers' gate.

Legend: T rows, H heads, X normalised width, D head dim, R rotary dim, F = R / 2, I intermediate size.
"""

from __future__ import annotations

import ctypes
import logging
import math
from pathlib import Path

import torch

from pdserve_kernels.cpu_build import FLAGS, CLibrary, check_tensor, compiler  # noqa: F401  (compiler: the tests name it here)

logger = logging.getLogger(__name__)

# Above these many input elements a layer's call leaves the kernel for torch, whose ops spread over
# the intra-op threads (``python benchmark/bench_cpu_ops.py --parts fused``, 2 threads, docs/cpu.md):
# add + RMSNorm and rotary still won at 2048 rows of the benchmark models (1.6-7x), so their line
# only guards wider shapes on more cores. SiLU x mul on the helper threads, as many as torch's, beat
# torch's silu + mul at every size measured, 16 to 4096 rows of 2 x 688 and 2 x 1376, on 1 and 2
# threads (docs/cpu.md "Prefill attention and SiLU in C"); its line lies past the largest measured.
MAX_ELEMENTS = 1 << 21
SILU_MAX_ELEMENTS = 1 << 24
# SiLU x mul shares its rows with the helper threads (cpu_threads.h) from this many outputs: below it a
# helper's wake-up costs more than its share. Units of rows per thread: a late helper leaves the rest.
SILU_PARALLEL_MIN_ELEMENTS = 1 << 15
SILU_UNITS_PER_THREAD = 4

def _declare(lib: ctypes.CDLL) -> None:
    i64, p, f = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    lib.pdserve_rmsnorm_f32.argtypes = [p, i64, i64, i64, i64, i64, p, i64, i64, p, f, p, p]
    lib.pdserve_rotary_f32.argtypes = [p, i64, i64, i64, i64, i64, p, i64, p, i64, i64, ctypes.c_int, p]
    lib.pdserve_rotary_pair_f32.argtypes = [p, i64, i64, i64, i64, p, p, i64, i64, i64, i64, p, i64, p, i64, p, i64,
                                            i64, ctypes.c_int]
    lib.pdserve_silu_mul_f32.argtypes = [p, i64, i64, i64, p]
    lib.pdserve_silu_mul_threads_f32.argtypes = [p, i64, i64, i64, p, i64, i64]
    lib.pdserve_silu_mul_threads_f32.restype = None
    for fn in (lib.pdserve_rmsnorm_f32, lib.pdserve_rotary_f32, lib.pdserve_rotary_pair_f32, lib.pdserve_silu_mul_f32):
        fn.restype = None


# No FMA contraction: the kernels then round each product and sum as torch's separate ops do.
LIBRARY = CLibrary(Path(__file__).with_name("fused_cpu.c"), _declare, "fused element-wise ops",
                   flags=FLAGS + ("-ffp-contract=off", "-pthread"), log=logger,
                   headers=(Path(__file__).with_name("cpu_threads.h"),))
SOURCE = LIBRARY.source
build = LIBRARY.build


def load() -> ctypes.CDLL | None:
    """The kernels' library, built on first use with ``compiler()``; None where that fails."""
    return LIBRARY.load()


def takes(x: torch.Tensor, limit: int = MAX_ELEMENTS) -> bool:
    """Whether a layer should run ``x`` through these kernels: a CPU float32 tensor of at most
    ``limit`` elements, eagerly (under torch.compile inductor fuses the twin itself), the library loaded."""
    # is_compiling first: dynamo then sees no size test it would guard on
    return (not torch.compiler.is_compiling() and x.dtype == torch.float32 and x.is_cpu and x.numel() <= limit
            and LIBRARY.load() is not None)


class KernelUnavailable(RuntimeError):
    """The library could not be built: the caller runs the twin."""


def _lib() -> ctypes.CDLL:
    lib = LIBRARY.load()
    if lib is None:
        raise KernelUnavailable("the fused CPU kernels could not be built (see the log)")
    return lib


def _check(name: str, t: torch.Tensor) -> None:
    check_tensor(name, t, "fused CPU kernel", layout="any")
    if t.dim() == 0:
        raise ValueError(f"{name}: expected at least one dimension, got a scalar")


def _rows(t: torch.Tensor, dims: int) -> tuple[torch.Tensor, tuple[int, ...]]:
    """t [..., X] with its last dimension contiguous and up to ``dims`` dimensions in all read by
    their strides: (t, its leading dims' strides). Any other layout is copied contiguous first (the
    layers' views, column slices of a fused projection, need no copy)."""
    strides = t.stride()
    if t.dim() <= dims and (strides[-1] == 1 or t.shape[-1] <= 1):
        return t, strides[:-1]
    if (strides[-1] != 1 and t.shape[-1] > 1) or not t.is_contiguous():
        t = t.contiguous()
    if t.dim() > dims:
        t = t.view(math.prod(t.shape[:-dims + 1]), *t.shape[-dims + 1:])
    return t, t.stride()[:-1]


def _as_3d(t: torch.Tensor, strides: tuple[int, ...]) -> tuple[int, int, int, int]:
    """A 1-3 dimensional t [..., X] (from _rows) as [A, B, X] at strides (sa, sb, 1)."""
    if len(strides) == 1:
        return t.shape[0], 1, strides[0], 0
    if len(strides) == 2:
        return t.shape[0], t.shape[1], strides[0], strides[1]
    return 1, 1, 0, 0


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """x [..., X] -> (s * rsqrt(mean(s^2) + eps)) * weight [..., X] with s = x (+ residual): with a
    residual, returns (normed, s), RMSNorm.forward's contract (new contiguous tensors; inputs unchanged)."""
    lib = _lib()
    _check("x", x)
    _check("weight", weight)
    X = x.shape[-1]
    if weight.dim() != 1 or weight.shape[0] != X:
        raise ValueError(f"weight: expected shape ({X},) (x's last dimension), got {tuple(weight.shape)}")
    if not eps >= 0:
        raise ValueError(f"eps: must be >= 0, got {eps}")
    weight = weight if weight.is_contiguous() else weight.contiguous()
    out = torch.empty(*x.shape, dtype=torch.float32)
    x3, strides = _rows(x, 3)
    A, B, sa, sb = _as_3d(x3, strides)
    if residual is None:
        lib.pdserve_rmsnorm_f32(x3.data_ptr(), A, B, X, sa, sb, None, 0, 0, weight.data_ptr(), eps, out.data_ptr(),
                                None)
        return out
    _check("residual", residual)
    if residual.shape != x.shape:
        raise ValueError(f"residual: expected x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    total = torch.empty(*x.shape, dtype=torch.float32)
    r3, r_strides = _rows(residual, 3)
    _, _, ra, rb = _as_3d(r3, r_strides)
    lib.pdserve_rmsnorm_f32(x3.data_ptr(), A, B, X, sa, sb, r3.data_ptr(), ra, rb, weight.data_ptr(), eps,
                            out.data_ptr(), total.data_ptr())
    return out, total


def _rotary_inputs(name: str, x: torch.Tensor, rotary_dim: int) -> tuple[torch.Tensor, int, int]:
    """x [T, H, D] checked against rotary_dim: (x readable by strides, its row and head strides)."""
    _check(name, x)
    if x.dim() != 3:
        raise ValueError(f"{name}: expected [T, H, D], got shape {tuple(x.shape)}")
    D = x.shape[2]
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > D:
        raise ValueError(f"rotary_dim: must be even and in [2, {D}] ({name}'s head dim), got {rotary_dim}")
    x, (st, sh) = _rows(x, 3)
    return x, st, sh


def _angles(cos: torch.Tensor, sin: torch.Tensor, T: int, F: int) -> tuple[torch.Tensor, int, torch.Tensor, int]:
    """cos, sin [T, 1, F] or [T, F]: (cos, its row stride, sin, its row stride)."""
    for name, t in (("cos", cos), ("sin", sin)):
        _check(name, t)
        if t.dim() not in (2, 3) or t.shape[0] != T or t.shape[-1] != F or t.numel() != T * F:
            raise ValueError(f"{name}: expected [{T}, 1, {F}] (x's rows, rotary_dim / 2), got {tuple(t.shape)}")
    cos, (sc, *_) = _rows(cos, 3)
    sin, (ss, *_) = _rows(sin, 3)
    return cos, sc, sin, ss


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, interleaved: bool) -> torch.Tensor:
    """x [T, H, D], cos and sin [T, 1, F] or [T, F] -> [T, H, D] (new, contiguous): each head's first
    R = rotary_dim dims rotated, neox pairs (x[f], x[f + F]) or interleaved ones (x[2f], x[2f + 1])
    written de-interleaved (RotaryEmbedding.rotate's layout); dims past R copied."""
    lib = _lib()
    x, st, sh = _rotary_inputs("x", x, rotary_dim)
    T, H, D = x.shape
    cos, sc, sin, ss = _angles(cos, sin, T, rotary_dim // 2)
    out = torch.empty(T, H, D, dtype=torch.float32)
    lib.pdserve_rotary_f32(x.data_ptr(), T, H, D, st, sh, cos.data_ptr(), sc, sin.data_ptr(), ss, rotary_dim,
                           int(interleaved), out.data_ptr())
    return out


def rotate_pair(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int,
                interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``rotate`` of q [T, Hq, Dq] and k [T, Hk, Dk] by the same angles, in one call."""
    lib = _lib()
    q, sqt, sqh = _rotary_inputs("q", q, rotary_dim)
    k, skt, skh = _rotary_inputs("k", k, rotary_dim)
    T = q.shape[0]
    if k.shape[0] != T:
        raise ValueError(f"k: {k.shape[0]} rows, but q has {T}")
    cos, sc, sin, ss = _angles(cos, sin, T, rotary_dim // 2)
    qo, ko = torch.empty(q.shape, dtype=torch.float32), torch.empty(k.shape, dtype=torch.float32)
    lib.pdserve_rotary_pair_f32(q.data_ptr(), q.shape[1], q.shape[2], sqt, sqh, qo.data_ptr(), k.data_ptr(),
                                k.shape[1], k.shape[2], skt, skh, ko.data_ptr(), T, cos.data_ptr(), sc,
                                sin.data_ptr(), ss, rotary_dim, int(interleaved))
    return qo, ko


def silu_and_mul(x: torch.Tensor, threads: int = 1) -> torch.Tensor:
    """x [..., 2I] = [gate | up] -> gate / (1 + exp(-gate)) * up [..., I] (new, contiguous). ``threads`` > 1:
    from ``SILU_PARALLEL_MIN_ELEMENTS`` elements, the kernel's helper threads take units of rows beside
    the caller (each row computed as one thread computes it: the same bits)."""
    lib = _lib()
    _check("x", x)
    if x.shape[-1] % 2:
        raise ValueError(f"x: the last dimension holds [gate | up] and must be even, got {x.shape[-1]}")
    I = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], I, dtype=torch.float32)
    x2, strides = _rows(x, 2)
    T, sx = (x2.shape[0], strides[0]) if x2.dim() == 2 else (1, 0)
    if threads < 1:
        raise ValueError(f"threads: must be >= 1, got {threads}")
    if threads > 1 and T > 1 and T * I >= SILU_PARALLEL_MIN_ELEMENTS:
        per_unit = -(-T // (threads * SILU_UNITS_PER_THREAD))
        lib.pdserve_silu_mul_threads_f32(x2.data_ptr(), T, I, sx, out.data_ptr(), threads, per_unit)
    else:
        lib.pdserve_silu_mul_f32(x2.data_ptr(), T, I, sx, out.data_ptr())
    return out
