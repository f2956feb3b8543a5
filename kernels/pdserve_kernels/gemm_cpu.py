"""Small-M float32 GEMM for CPU decode in plain C (``gemm_cpu.c``): ``out = x @ W^T (+ bias)`` on a weight
packed once into panels of ``PANEL`` columns, with the kernel's own helper threads sharing a call's panels
(``cpu_threads.h``, the decode attention kernel's pool). Twin: ``reference`` (``F.linear``).

Why not torch's GEMM on two threads: oneDNN runs decode shapes near the core's peak on one thread, but
torch's OpenMP team is woken per op and loses at decode sizes; these helpers poll between the calls
of a step, so the second core pays from a few hundred microseconds of work.

Every output element is summed over K in the same order whichever thread computes it, so any
``threads`` gives the same bits as one.

Built on first use like every plain-C kernel (``cpu_build``); ``load()`` is None where no compiler
exists or the build fails (said once in the log): callers then run ``F.linear`` or oneDNN.

Legend: M rows (tokens), K in features, N out features, P = ceil(N / PANEL) panels.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from pdserve_kernels.cpu_build import FLAGS, CLibrary, check_tensor, compiler  # noqa: F401  (compiler: the tests name it here)

logger = logging.getLogger(__name__)

PANEL = 32  # columns per packed panel (gemm_cpu.c's PANEL): two 16-lane vectors
# A call shares its panels with helper threads only from this much work (M x N x K multiply-adds):
# below it, a helper's wake-up and the split's imbalance outweigh its share. Measured with a polling
# helper: 2^16 (one row of 256 x 256) 8.9 -> 8.4 us, 2^18 (two rows of 512 x 256) 13.9 -> 10.8 us.
PARALLEL_MIN_WORK = 1 << 18
# Units of panels per thread: threads claim them one at a time, so a preempted thread leaves the rest.
UNITS_PER_THREAD = 4

_threads = 1  # set_threads: the threads a call may use (the scheduler's thread layout)


class KernelUnavailable(RuntimeError):
    """The kernel could not be built here: the caller runs its torch path."""


def _declare(lib: ctypes.CDLL) -> None:
    fn = lib.pdserve_gemm_f32
    i64, p = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [p, i64, i64, p, i64, p, p, i64, i64]
    fn.restype = None
    lib.pdserve_gemm_panel.argtypes = []
    lib.pdserve_gemm_panel.restype = ctypes.c_int


LIBRARY = CLibrary(Path(__file__).with_name("gemm_cpu.c"), _declare, "small-M GEMM", flags=(*FLAGS, "-pthread"),
                   log=logger, headers=(Path(__file__).with_name("cpu_threads.h"),))
SOURCE = LIBRARY.source


def load() -> ctypes.CDLL | None:
    """The kernel's library, built on first use with ``compiler()``; None where that fails."""
    return LIBRARY.load()


def set_threads(n: int) -> None:
    """The threads a call may use from now on (the caller and n - 1 helpers), where it is big enough."""
    global _threads
    if n < 1:
        raise ValueError(f"threads: must be >= 1, got {n}")
    _threads = n


def threads() -> int:
    return _threads


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] float32 -> its panels [P, K, PANEL]: panel p holds columns p*PANEL .. of the output,
    k-major, the columns past N zero."""
    _check("weight", weight, 2, contiguous=False)
    N, K = weight.shape
    P = -(-N // PANEL)
    padded = weight.new_zeros(P * PANEL, K)
    padded[:N] = weight.detach()
    return padded.view(P, PANEL, K).transpose(1, 2).contiguous()  # [P, K, PANEL]


def _check(name: str, t: torch.Tensor, dim: int, contiguous: bool = True) -> None:
    check_tensor(name, t, "CPU GEMM kernel", dim=dim, layout="contiguous" if contiguous else "any")


def _check_all(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> None:
    _check("x", x, 2)
    _check("packed", packed, 3)
    K = x.shape[1]
    if packed.shape[1:] != (K, PANEL):
        raise ValueError(f"packed: expected panels [P, {K}, {PANEL}] for x's {K} features, got {tuple(packed.shape)}")
    P = packed.shape[0]
    if not (P - 1) * PANEL < n <= P * PANEL:
        raise ValueError(f"n: {P} panels hold {(P - 1) * PANEL + 1} to {P * PANEL} columns, got {n}")
    if bias is not None:
        _check("bias", bias, 1)
        if bias.shape[0] != n:
            raise ValueError(f"bias: expected {n} values (n), got {bias.shape[0]}")


def linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None,
           threads: int | None = None) -> torch.Tensor:
    """x [M, K] float32 contiguous, packed [P, K, PANEL] (``pack`` of a weight [n, K]), bias [n] or None
    -> [M, n] = x @ W^T (+ bias). ``threads`` (default ``set_threads``'s) > 1: the kernel's helper
    threads take groups of panels beside the caller where M x n x K >= ``PARALLEL_MIN_WORK``; the
    same bits as one thread. Raises KernelUnavailable where the library could not be built,
    ValueError/TypeError naming the argument on bad input."""
    lib = load()
    if lib is None:
        raise KernelUnavailable("the CPU GEMM kernel could not be built (see the log)")
    _check_all(x, packed, n, bias)
    threads = _threads if threads is None else threads
    if threads < 1:
        raise ValueError(f"threads: must be >= 1, got {threads}")
    return run(lib, x, packed, n, bias, threads)


def run(lib: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None,
        threads: int) -> torch.Tensor:
    """``linear`` without its checks, for a caller that guarantees them per call cheaper (PackedLinear:
    its own panels and bias, float32 contiguous rows of its width): the C call alone -> [M, n]."""
    M, K = x.shape
    out = torch.empty(M, n, dtype=torch.float32)
    if M == 0:
        return out
    P = packed.shape[0]
    if threads > 1 and M * n * K < PARALLEL_MIN_WORK:
        threads = 1  # too little to share: waking a helper costs more than it saves
    per_unit = max(1, P // (threads * UNITS_PER_THREAD)) if threads > 1 else P
    lib.pdserve_gemm_f32(x.data_ptr(), M, K, packed.data_ptr(), n, None if bias is None else bias.data_ptr(),
                         out.data_ptr(), threads, per_unit)
    return out


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``linear``'s twin: the plain weight [N, K] through F.linear -> [M, N]."""
    return F.linear(x, weight, bias)
