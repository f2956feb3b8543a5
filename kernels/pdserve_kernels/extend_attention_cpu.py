"""Extend (prefill) attention of a ragged batch as one CPU kernel in plain C (``extend_attention_cpu.c``):
causal, every request's new queries over its prefix and its new keys, read by slot straight from the
GQA pool's HND layer buffers ``[P, Hkv, S, D]`` (query head h over KV head h // (Hq / Hkv)), tiled and
shared over the kernel's own helper threads. Twin: ``reference`` (SDPA per request over a gathered copy).

Built on first use like every plain-C kernel (``cpu_build``); ``load()`` is None where no compiler
exists or the build fails (said once in the log): callers then run the torch path.

Legend: T new tokens, B requests, Hq/Hkv query and KV heads, Dk key width, Dv value width, P pages,
S page size, L kv_slots' width.
"""

from __future__ import annotations

import ctypes
import logging
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from pdserve_kernels.cpu_build import FLAGS, CLibrary, check_tensor, compiler  # noqa: F401  (compiler: the tests name it here)
from pdserve_kernels.decode_attention_cpu import check_pool_shapes

logger = logging.getLogger(__name__)

# Return codes of pdserve_extend_attention_f32
OK, BAD_SLOT, BAD_PREFIX, NO_MEMORY, BAD_EXT, BAD_TOTAL = 0, 1, 2, 3, 4, 5

# A call shares its units with helper threads only from this many query-key pairs (x Hq): below it
# (a short prompt's layer, tens of microseconds) a helper's wake-up outweighs its share.
PARALLEL_MIN_SCORES = 1 << 16


class KernelUnavailable(RuntimeError):
    """The kernel could not be built here: the caller runs the torch path."""


def _declare(lib: ctypes.CDLL) -> None:
    fn = lib.pdserve_extend_attention_f32
    i64, p = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [p, i64, i64, i64, p, p, i64, i64, i64, i64, i64, i64, i64, i64, i64, i64, p, i64, i64, p, p, i64,
                   ctypes.c_double, p, i64, i64]
    fn.restype = ctypes.c_int


LIBRARY = CLibrary(Path(__file__).with_name("extend_attention_cpu.c"), _declare, "extend attention",
                   flags=(*FLAGS, "-pthread"), log=logger,
                   headers=tuple(Path(__file__).with_name(h) for h in ("cpu_threads.h", "cpu_simd.h",
                                                                       "cpu_attention.h")))
SOURCE = LIBRARY.source
build = LIBRARY.build


def load() -> ctypes.CDLL | None:
    """The kernel's library, built on first use with ``compiler()``; None where that fails."""
    return LIBRARY.load()


def _check_shapes(q, k_cache, v_cache, kv_slots, prefix_lens, ext_lens) -> None:
    B = kv_slots.shape[0]
    check_pool_shapes(q, k_cache, v_cache)
    for name, t in (("prefix_lens", prefix_lens), ("ext_lens", ext_lens)):
        if tuple(t.shape) != (B,):
            raise ValueError(f"{name}: expected shape {(B,)} (kv_slots' rows), got {tuple(t.shape)}")


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_slots: torch.Tensor,
                     prefix_lens: torch.Tensor, ext_lens: torch.Tensor, scale: float,
                     threads: int = 1) -> torch.Tensor:
    """q [T, Hq, Dk] float32 (request b's ext_lens[b] rows after those of the requests before it);
    k_cache [P, Hkv, S, Dk] and v_cache [P, Hkv, S, Dv] float32, one layer's pool (rows contiguous),
    already holding this step's rows; kv_slots [B, L] int64 (request b's keys are its first
    prefix_lens[b] + ext_lens[b] slots); prefix_lens, ext_lens [B] int64 (ext in [1, L], prefix in
    [0, L - ext], the ext summing to T); scale finite -> [T, Hq, Dv] float32: new token i of request b
    attends causally to keys [0, prefix + i]. ``threads`` > 1: the kernel's own helper threads take
    units (request, KV head, query tile) beside the caller; each unit is computed whole by one thread,
    so the result is the same bits. Raises KernelUnavailable where the library could not be built,
    ValueError/TypeError naming the argument on bad input."""
    lib = load()
    if lib is None:
        raise KernelUnavailable("the CPU extend attention kernel could not be built (see the log)")
    for name, t, dtype, dim, layout in (("q", q, torch.float32, 3, "contiguous"),
                                        ("k_cache", k_cache, torch.float32, 4, "rows"),
                                        ("v_cache", v_cache, torch.float32, 4, "rows"),
                                        ("kv_slots", kv_slots, torch.int64, 2, "rows"),
                                        ("prefix_lens", prefix_lens, torch.int64, 1, "contiguous"),
                                        ("ext_lens", ext_lens, torch.int64, 1, "contiguous")):
        check_tensor(name, t, "CPU extend attention kernel", dtype, dim, layout)
    if not math.isfinite(scale):
        raise ValueError(f"scale: must be finite, got {scale}")
    if threads < 1:
        raise ValueError(f"threads: must be >= 1, got {threads}")
    _check_shapes(q, k_cache, v_cache, kv_slots, prefix_lens, ext_lens)
    T, Hq, Dk = q.shape
    P, Hkv, S, Dv = v_cache.shape
    B, L = kv_slots.shape
    out = torch.empty(T, Hq, Dv, dtype=torch.float32)
    rc = lib.pdserve_extend_attention_f32(q.data_ptr(), T, Hq, Dk, k_cache.data_ptr(), v_cache.data_ptr(), P * S, S,
                                          Hkv, *k_cache.stride()[:3], *v_cache.stride()[:3], Dv, kv_slots.data_ptr(),
                                          L, kv_slots.stride(0), prefix_lens.data_ptr(), ext_lens.data_ptr(), B,
                                          float(scale), out.data_ptr(), threads, PARALLEL_MIN_SCORES)
    if rc == BAD_EXT:
        raise ValueError(f"ext_lens: every request needs at least one new token, got {ext_lens.tolist()}")
    if rc == BAD_PREFIX:
        raise ValueError(f"prefix_lens: each must lie in [0, {L} - ext_lens] (kv_slots' width), "
                         f"got {prefix_lens.tolist()} with ext_lens {ext_lens.tolist()}")
    if rc == BAD_TOTAL:
        raise ValueError(f"ext_lens: they sum to {int(ext_lens.sum())}, but q has {T} rows")
    if rc == BAD_SLOT:
        raise ValueError(f"kv_slots: a slot a request reads lies outside the pool's {P * S} slots")
    if rc != OK:
        raise MemoryError("the CPU extend attention kernel could not allocate its scratch")
    return out


def reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_slots: torch.Tensor,
              prefix_lens: torch.Tensor, ext_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """``extend_attention``'s twin in torch: each request's keys gathered by slot, then SDPA with its
    causal mask (query i sees keys j <= prefix + i) -> [T, Hq, Dv]."""
    S = k_cache.shape[2]
    outs, start = [], 0
    for b, (pre, ext) in enumerate(zip(prefix_lens.tolist(), ext_lens.tolist())):
        slots = kv_slots[b, :pre + ext]
        page, off = torch.div(slots, S, rounding_mode="floor"), slots % S
        k = k_cache[page, :, off].transpose(0, 1)[None]  # [1, Hkv, n, Dk]
        v = v_cache[page, :, off].transpose(0, 1)[None]  # [1, Hkv, n, Dv]
        qb = q[start:start + ext].transpose(0, 1)[None]  # [1, Hq, ext, Dk]
        mask = torch.arange(pre + ext)[None, :] <= pre + torch.arange(ext)[:, None]  # [ext, n]
        o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
        outs.append(o[0].transpose(0, 1))  # [ext, Hq, Dv]
        start += ext
    return torch.cat(outs) if outs else q.new_empty(0, q.shape[1], v_cache.shape[-1])
