"""Decode attention (one query row per request) as one CPU kernel in plain C (``decode_attention_cpu.c``):
each request's keys and values are read by slot straight from the paged pool, with an online softmax,
so a decode step needs no gathered or staged copy of the batch's KV, no padded mask and no permutes.
Twin: ``reference`` (the same attention over a gathered copy, in torch).

One call serves GQA (the pool's HND layer buffers ``[P, Hkv, S, D]``, query head h reading KV head
h // (Hq / Hkv)) and DeepSeek's absorbed MLA decode (the latent ``[P, S, C+R]`` viewed as one KV head
``[P, 1, S, C+R]``, values the first C columns of the same rows: ``v_width=C``).

Built on first use like every plain-C kernel (``cpu_build``); ``load()`` is None where no compiler
exists or the build fails (said once in the log): callers then run the torch path.

Legend: B requests, Hq/Hkv query and KV heads, Dk key width, Dv value width, P pages, S page size,
L kv_slots' width.
"""

from __future__ import annotations

import ctypes
import logging
import math
from pathlib import Path

import torch

from pdserve_kernels.cpu_build import FLAGS, CLibrary, check_tensor, compiler  # noqa: F401  (compiler: the tests name it here)

logger = logging.getLogger(__name__)

# Return codes of pdserve_decode_attention_f32
OK, BAD_SLOT, BAD_LEN, NO_MEMORY = 0, 1, 2, 3


class KernelUnavailable(RuntimeError):
    """The kernel could not be built here: the caller runs the torch path."""


# A call shares its requests with helper threads only from this many key rows (B x L x Hkv): below
# it, a helper's wake-up (microseconds when polling, tens of them from sleep) outweighs its share.
PARALLEL_MIN_ROWS = 8192
# Units of requests per thread: threads claim them one at a time, so a slow thread (preempted, or
# given the long requests) leaves the rest to the others.
UNITS_PER_THREAD = 4


def _declare(lib: ctypes.CDLL) -> None:
    fn = lib.pdserve_decode_attention_f32
    i64, p = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [p, i64, i64, i64, p, p, i64, i64, i64, i64, i64, i64, i64, i64, i64, i64, p, i64, i64, p,
                   ctypes.c_double, p, i64, i64]
    fn.restype = ctypes.c_int


LIBRARY = CLibrary(Path(__file__).with_name("decode_attention_cpu.c"), _declare, "decode attention",
                   flags=(*FLAGS, "-pthread"), log=logger,
                   headers=tuple(Path(__file__).with_name(h) for h in ("cpu_threads.h", "cpu_simd.h",
                                                                       "cpu_attention.h")))
SOURCE = LIBRARY.source
build = LIBRARY.build


def load() -> ctypes.CDLL | None:
    """The kernel's library, built on first use with ``compiler()``; None where that fails."""
    return LIBRARY.load()


def _check(name: str, t: torch.Tensor, dtype: torch.dtype, dim: int, contiguous: bool = True) -> None:
    check_tensor(name, t, "CPU decode attention kernel", dtype, dim, "contiguous" if contiguous else "rows")


def check_pool_shapes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """q [.., Hq, Dk] against one layer's paged pool k_cache [P, Hkv, S, Dk], v_cache [P, Hkv, S, X]
    (the decode and extend kernels' common checks), naming the argument."""
    Hq, Dk = q.shape[-2:]
    P, Hkv, S, _ = k_cache.shape
    if k_cache.shape[-1] != Dk:
        raise ValueError(f"k_cache: rows of {k_cache.shape[-1]} values, but q's head dim is {Dk}")
    if tuple(v_cache.shape[:3]) != (P, Hkv, S):
        raise ValueError(f"v_cache: pages, heads and page size {tuple(v_cache.shape[:3])} differ from "
                         f"k_cache's {(P, Hkv, S)}")
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"q: {Hq} heads do not split evenly over k_cache's {Hkv} KV heads")


def _check_shapes(q, k_cache, v_cache, kv_slots, seq_lens, v_width) -> None:
    B = q.shape[0]
    check_pool_shapes(q, k_cache, v_cache)
    if not 0 < v_width <= v_cache.shape[-1]:
        raise ValueError(f"v_width: must lie in [1, {v_cache.shape[-1]}] (v_cache's rows), got {v_width}")
    if kv_slots.shape[0] != B:
        raise ValueError(f"kv_slots: {kv_slots.shape[0]} rows for {B} requests")
    if tuple(seq_lens.shape) != (B,):
        raise ValueError(f"seq_lens: expected shape {(B,)}, got {tuple(seq_lens.shape)}")


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_slots: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, v_width: int | None = None,
                     threads: int = 1) -> torch.Tensor:
    """q [B, Hq, Dk] float32 (one query row per request); k_cache [P, Hkv, S, Dk] and v_cache
    [P, Hkv, S, X] float32, one layer's pool (rows contiguous; v_cache may be k_cache); kv_slots [B, L]
    int64 (request b's keys are its first seq_lens[b] slots); seq_lens [B] int64, each in [1, L];
    scale finite -> [B, Hq, Dv] float32 (Dv = v_width, default X: values are the first Dv columns of
    v_cache's rows): ``softmax(scale * q . k) @ v`` per request, query head h over KV head h // (Hq / Hkv).
    ``threads`` > 1: the kernel's own helper threads (started once, then polling briefly between
    calls and sleeping) take groups of requests beside the caller, where the call reads at least
    ``PARALLEL_MIN_ROWS`` key rows; each request is still computed whole by one thread, so the
    result is the same bits. Raises KernelUnavailable where the library could not be built,
    ValueError/TypeError naming the argument on bad input."""
    lib = load()
    if lib is None:
        raise KernelUnavailable("the CPU decode attention kernel could not be built (see the log)")
    for name, t, dtype, dim, contiguous in (("q", q, torch.float32, 3, True),
                                            ("k_cache", k_cache, torch.float32, 4, False),
                                            ("v_cache", v_cache, torch.float32, 4, False),
                                            ("kv_slots", kv_slots, torch.int64, 2, False),
                                            ("seq_lens", seq_lens, torch.int64, 1, True)):
        _check(name, t, dtype, dim, contiguous)
    if not math.isfinite(scale):
        raise ValueError(f"scale: must be finite, got {scale}")
    Dv = v_cache.shape[-1] if v_width is None else v_width
    _check_shapes(q, k_cache, v_cache, kv_slots, seq_lens, Dv)
    B, Hq, Dk = q.shape
    P, Hkv, S, _ = k_cache.shape
    out = torch.empty(B, Hq, Dv, dtype=torch.float32)
    if B == 0:
        return out
    if threads < 1:
        raise ValueError(f"threads: must be >= 1, got {threads}")
    if threads > 1 and B > 1 and B * kv_slots.shape[1] * Hkv < PARALLEL_MIN_ROWS:
        threads = 1  # too little to share: waking a helper costs more than it saves
    per_unit = max(1, B // (threads * UNITS_PER_THREAD)) if threads > 1 else B
    rc = lib.pdserve_decode_attention_f32(q.data_ptr(), B, Hq, Dk, k_cache.data_ptr(), v_cache.data_ptr(), P * S, S,
                                          Hkv, *k_cache.stride()[:3], *v_cache.stride()[:3], Dv, kv_slots.data_ptr(),
                                          kv_slots.shape[1], kv_slots.stride(0), seq_lens.data_ptr(), float(scale),
                                          out.data_ptr(), threads, per_unit)
    if rc == BAD_LEN:
        raise ValueError(f"seq_lens: lengths must lie in [1, {kv_slots.shape[1]}] (kv_slots' width)")
    if rc == BAD_SLOT:
        raise ValueError(f"kv_slots: a slot a request reads lies outside the pool's {P * S} slots")
    if rc != OK:
        raise MemoryError("the CPU decode attention kernel could not allocate its scores")
    return out


def reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_slots: torch.Tensor,
              seq_lens: torch.Tensor, scale: float, v_width: int | None = None) -> torch.Tensor:
    """``decode_attention``'s twin in torch: each request's KV gathered by slot, then masked softmax
    attention in float32 -> [B, Hq, Dv]."""
    B, Hq, Dk = q.shape
    P, Hkv, S, _ = k_cache.shape
    Dv = v_cache.shape[-1] if v_width is None else v_width
    L = kv_slots.shape[1]
    page, off = torch.div(kv_slots, S, rounding_mode="floor"), kv_slots % S  # [B, L]
    k = k_cache[page, :, off].float()  # [B, L, Hkv, Dk]
    v = v_cache[page, :, off, :Dv].float()  # [B, L, Hkv, Dv]
    G = Hq // Hkv
    s = torch.einsum("bhgd,blhd->bhgl", q.float().view(B, Hkv, G, Dk), k) * scale  # [B, Hkv, G, L]
    visible = torch.arange(L) < seq_lens[:, None]  # [B, L]
    s = s.masked_fill(~visible[:, None, None], float("-inf"))
    return torch.einsum("bhgl,blhd->bhgd", torch.softmax(s, dim=-1), v).reshape(B, Hq, Dv)
