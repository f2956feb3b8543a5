"""DeepSeek-V3.2's indexer score + top-k as one CPU kernel in plain C (``index_topk_cpu.c``): each
query reads its visible index keys once, by slot, from the paged pool, and keeps its top k while
scoring (no gathered keys, no [B, Hi, L] scores). Twin: the torch_native backend's
``select_top_tokens`` (the same picks, ties at the cut from the lowest position, positions ascending).

Built on first use like every plain-C kernel (``cpu_build``); ``load()`` is None where no compiler
exists or the build fails (said once in the log): callers then run the twin.

Legend: T query rows, B requests, L kv_slots' width, Hi/Di index heads and head dim, P pages,
S page size, k picks.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from pdserve_kernels.cpu_build import CLibrary, check_tensor, compiler  # noqa: F401  (compiler: the tests name it here)

logger = logging.getLogger(__name__)

# Query rows of one request scored together (an extend): one read of each key serves them all while
# their [Hi, Di] queries and k-long heaps stay in cache.
BLOCK_BYTES = 1 << 15

# Return codes of pdserve_index_topk_f32
OK, NON_FINITE, BAD_SLOT, NO_MEMORY, BAD_REQ, BAD_VIS = 0, 1, 2, 3, 4, 5


class KernelUnavailable(RuntimeError):
    """The kernel cannot run these inputs as it is (non-finite scores): the caller runs the twin."""


def _declare(lib: ctypes.CDLL) -> None:
    fn = lib.pdserve_index_topk_f32
    i64, p = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [p, p, p, i64, p, i64, i64, i64, p, p, i64, i64, i64, ctypes.c_double, i64, i64, p]
    fn.restype = ctypes.c_int


LIBRARY = CLibrary(Path(__file__).with_name("index_topk_cpu.c"), _declare, "indexer top-k", log=logger,
                   headers=(Path(__file__).with_name("cpu_simd.h"),))
SOURCE = LIBRARY.source
build = LIBRARY.build


def load() -> ctypes.CDLL | None:
    """The kernel's library, built on first use with ``compiler()``; None where that fails."""
    return LIBRARY.load()


def _check(name: str, t: torch.Tensor, dtype: torch.dtype, dim: int) -> None:
    check_tensor(name, t, "CPU indexer kernel", dtype, dim)


def _check_shapes(q, weights, index_k, kv_slots, req, vis) -> None:
    T, Hi, Di = q.shape
    if tuple(weights.shape) != (T, Hi):
        raise ValueError(f"weights: expected shape {(T, Hi)} (q's rows and heads), got {tuple(weights.shape)}")
    if index_k.shape[-1] != Di:
        raise ValueError(f"index_k: rows of {index_k.shape[-1]} values, but q's head dim is {Di}")
    for name, t in (("req", req), ("vis", vis)):
        if t.shape[0] != T:
            raise ValueError(f"{name}: {t.shape[0]} entries for {T} query rows")


def index_topk(q: torch.Tensor, weights: torch.Tensor, index_k: torch.Tensor, kv_slots: torch.Tensor,
               req: torch.Tensor, vis: torch.Tensor, scale: float, topk: int) -> torch.Tensor:
    """q [T, Hi, Di] float32, weights [T, Hi] float32, index_k one layer's pool [P, S, Di] float32,
    kv_slots [B, L] int64, req [T] int64 (row of kv_slots), vis [T] int64 (tokens seen), scale > 0
    -> [T, k] int64 positions (k = min(topk, L)), ascending: each row's k best by
    ``sum_h weights[h] * relu(scale * q[h] . key_j)`` over j < vis, ties at the cut from the lowest
    position; a row seeing at most k tokens keeps positions 0 .. k-1. Raises KernelUnavailable
    where a score is NaN or infinite, ValueError/TypeError naming the argument on bad input."""
    lib = load()
    if lib is None:
        raise KernelUnavailable("the CPU indexer kernel could not be built (see the log)")
    for name, t, dtype, dim in (("q", q, torch.float32, 3), ("weights", weights, torch.float32, 2),
                                ("index_k", index_k, torch.float32, 3), ("kv_slots", kv_slots, torch.int64, 2),
                                ("req", req, torch.int64, 1), ("vis", vis, torch.int64, 1)):
        _check(name, t, dtype, dim)
    if not scale > 0:
        raise ValueError(f"scale: must be > 0 (it is moved past the ReLU), got {scale}")
    if topk < 0:
        raise ValueError(f"topk: must be >= 0, got {topk}")
    _check_shapes(q, weights, index_k, kv_slots, req, vis)
    T, Hi, Di = q.shape
    k = min(topk, kv_slots.shape[1])
    out = torch.empty(T, k, dtype=torch.int64)
    if T == 0:
        return out
    block = max(1, BLOCK_BYTES // (4 * Hi * Di + 16 * k))
    slots = index_k.numel() // max(Di, 1)  # N
    rc = lib.pdserve_index_topk_f32(q.data_ptr(), weights.data_ptr(), index_k.data_ptr(), slots, kv_slots.data_ptr(),
                                    *kv_slots.shape, kv_slots.stride(0), req.data_ptr(), vis.data_ptr(), T, Hi, Di,
                                    float(scale), k, block, out.data_ptr())
    if rc == NON_FINITE:
        raise KernelUnavailable("index scores: a NaN or infinite score")
    if rc == BAD_SLOT:
        raise ValueError(f"kv_slots: a visible slot lies outside the pool's {slots} slots")
    if rc == BAD_REQ:
        raise ValueError(f"req: rows must lie in [0, {kv_slots.shape[0]}) (kv_slots' rows)")
    if rc == BAD_VIS:
        raise ValueError(f"vis: counts must lie in [0, {kv_slots.shape[1]}] (kv_slots' width)")
    if rc != OK:
        raise MemoryError("the CPU indexer kernel could not allocate its heaps")
    return out
