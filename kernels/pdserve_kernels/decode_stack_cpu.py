"""A float32 GQA decode step's decoder layers as ONE plain-C call (``decode_stack_cpu.c``): per layer
[residual add +] RMSNorm, qkv GEMM (+ bias), rotary, the KV write into the paged pool, decode attention by
slot, o GEMM (+ bias), residual add + RMSNorm, gate_up GEMM, SiLU x mul, down GEMM. Its slow twin is the
layer-by-layer path (``models/decoder.py``); ``pdserve.models.fused_decode`` decides when a step takes it.

The C file includes the kernels it runs (``gemm_cpu.c``, ``decode_attention_cpu.c``, ``fused_cpu.c``), so
each phase is the same code as the layer-by-layer C path, and one helper pool serves every parallel
phase. Per-layer pointers live in a ctypes array built once (``DecodeStack``); a step passes only its
own tensors.

Built on first use like every plain-C kernel (``cpu_build``); ``load()`` is None where no compiler
exists or the build fails (said once in the log): callers then run the layers one by one.

Legend: B requests (rows), H hidden, Hq / Hkv query / KV heads, D head dim, R rotary dim, F = R / 2,
I intermediate size, Wqkv = (Hq + 2 Hkv) D, L kv_slots' width, P pages, S page size.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve_kernels import decode_attention_cpu, gemm_cpu
from pdserve_kernels.cpu_build import FLAGS, CLibrary, check_tensor, compiler  # noqa: F401  (compiler: the tests name it here)

logger = logging.getLogger(__name__)

# Return codes of pdserve_decode_stack_f32 (decode attention's)
OK, BAD_SLOT, BAD_LEN = 0, 1, 2

_HERE = Path(__file__).parent
_INCLUDED = ("gemm_cpu.c", "decode_attention_cpu.c", "fused_cpu.c", "cpu_threads.h", "cpu_simd.h")


class KernelUnavailable(RuntimeError):
    """The library could not be built here: the caller runs the layers one by one."""


class StackDims(ctypes.Structure):
    """decode_stack_cpu.c's stack_dims_t."""

    _fields_ = [(n, ctypes.c_int64) for n in ("layers", "H", "Hq", "Hkv", "D", "I", "R", "interleaved", "P", "S",
                                              "k_page", "k_head", "k_token", "v_page", "v_head", "v_token")]
    _fields_ += [("scale", ctypes.c_double), ("gemm_min_work", ctypes.c_int64), ("units_per_thread", ctypes.c_int64)]


class StackLayer(ctypes.Structure):
    """decode_stack_cpu.c's stack_layer_t."""

    p = ctypes.c_void_p
    _fields_ = [("input_norm", p), ("post_norm", p), ("input_eps", ctypes.c_double), ("post_eps", ctypes.c_double),
                ("qkv", p), ("qkv_bias", p), ("o", p), ("o_bias", p), ("gate_up", p), ("down", p),
                ("k_cache", p), ("v_cache", p)]


def _declare(lib: ctypes.CDLL) -> None:
    i64, p = ctypes.c_int64, ctypes.c_void_p
    fn = lib.pdserve_decode_stack_f32
    fn.argtypes = [p, p, p, i64, p, i64, p, i64, p, p, i64, i64, p, p, p, p, i64, i64, i64]
    fn.restype = ctypes.c_int
    lib.pdserve_decode_stack_work_floats.argtypes = [p, i64]
    lib.pdserve_decode_stack_work_floats.restype = i64


LIBRARY = CLibrary(_HERE / "decode_stack_cpu.c", _declare, "decode stack", flags=(*FLAGS, "-pthread"), log=logger,
                   headers=tuple(_HERE / h for h in _INCLUDED))
SOURCE = LIBRARY.source
build = LIBRARY.build


def load() -> ctypes.CDLL | None:
    """The library, built on first use with ``compiler()``; None where that fails."""
    return LIBRARY.load()


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer as the call reads it: GEMM weights as ``gemm_cpu.pack`` panels [ceil(N / 32), K, 32]
    (qkv [Wqkv, H], o [H, Hq D], gate_up [2I, H] (gate rows first), down [H, I]), biases [N] or None, norm
    weights [H], and the layer's pool buffers k_cache, v_cache [P, Hkv, S, D] (rows contiguous)."""

    input_norm: torch.Tensor
    input_eps: float
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    post_eps: float
    gate_up: torch.Tensor
    down: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor


@dataclass(frozen=True)
class StackShape:
    """What every layer shares: hidden H, heads Hq / Hkv of width D, intermediate I, the rotary dims
    R (even, <= D) and layout, the softmax scale."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    rotary_dim: int
    interleaved: bool
    scale: float

    def __post_init__(self):
        if min(self.hidden, self.heads, self.kv_heads, self.head_dim, self.intermediate) < 1:
            raise ValueError(f"StackShape: sizes must be >= 1, got {self}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads: {self.heads} do not split evenly over {self.kv_heads} kv_heads")
        if self.rotary_dim < 2 or self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ValueError(f"rotary_dim: must be even and in [2, {self.head_dim}], got {self.rotary_dim}")


def _panels_of(name: str, t: torch.Tensor, n: int, k: int) -> None:
    check_tensor(name, t, "CPU decode stack kernel", dim=3)
    P = -(-n // gemm_cpu.PANEL)
    if tuple(t.shape) != (P, k, gemm_cpu.PANEL):
        raise ValueError(f"{name}: expected panels {(P, k, gemm_cpu.PANEL)} of a [{n}, {k}] weight, got "
                         f"{tuple(t.shape)}")


def _vector(name: str, t: torch.Tensor | None, n: int) -> None:
    if t is None:
        return
    check_tensor(name, t, "CPU decode stack kernel", dim=1)
    if t.shape[0] != n:
        raise ValueError(f"{name}: expected {n} values, got {t.shape[0]}")


def _check_layer(i: int, w: LayerWeights, s: StackShape, pool_shape: tuple[int, ...]) -> None:
    H, QD, I = s.hidden, s.heads * s.head_dim, s.intermediate
    wqkv = (s.heads + 2 * s.kv_heads) * s.head_dim
    for name, t, n, k in (("qkv", w.qkv, wqkv, H), ("o", w.o, H, QD), ("gate_up", w.gate_up, 2 * I, H),
                          ("down", w.down, H, I)):
        _panels_of(f"layers[{i}].{name}", t, n, k)
    for name, v, n in (("qkv_bias", w.qkv_bias, wqkv), ("o_bias", w.o_bias, H), ("input_norm", w.input_norm, H),
                       ("post_norm", w.post_norm, H)):
        _vector(f"layers[{i}].{name}", v, n)
    for name, c in (("k_cache", w.k_cache), ("v_cache", w.v_cache)):
        check_tensor(f"layers[{i}].{name}", c, "CPU decode stack kernel", dim=4, layout="rows")
        if tuple(c.shape) != pool_shape or c.stride() != w.k_cache.stride():
            raise ValueError(f"layers[{i}].{name}: expected [P, {s.kv_heads}, S, {s.head_dim}] like layer 0's "
                             f"{pool_shape} with its strides, got {tuple(c.shape)} at {c.stride()}")


class DecodeStack:
    """Every decoder layer of one model bound to one pool, as the C call reads them: the per-layer
    pointers are a ctypes array built here, once (the tensors are held, so the pointers stay valid)."""

    def __init__(self, shape: StackShape, layers: list[LayerWeights]):
        if not layers:
            raise ValueError("layers: at least one layer")
        P, Hkv, S, D = layers[0].k_cache.shape
        if (Hkv, D) != (shape.kv_heads, shape.head_dim):
            raise ValueError(f"layers[0].k_cache: expected [P, {shape.kv_heads}, S, {shape.head_dim}], "
                             f"got {tuple(layers[0].k_cache.shape)}")
        for i, w in enumerate(layers):
            _check_layer(i, w, shape, (P, Hkv, S, D))
        self.shape, self.layers = shape, layers
        ks, vs = layers[0].k_cache.stride(), layers[0].v_cache.stride()
        self.pages, self.page_size = P, S
        self.dims = StackDims(len(layers), shape.hidden, shape.heads, Hkv, D, shape.intermediate, shape.rotary_dim,
                              int(shape.interleaved), P, S, *ks[:3], *vs[:3], float(shape.scale),
                              gemm_cpu.PARALLEL_MIN_WORK, gemm_cpu.UNITS_PER_THREAD)
        ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        self.array = (StackLayer * len(layers))(*(
            StackLayer(ptr(w.input_norm), ptr(w.post_norm), float(w.input_eps), float(w.post_eps), ptr(w.qkv),
                       ptr(w.qkv_bias), ptr(w.o), ptr(w.o_bias), ptr(w.gate_up), ptr(w.down), ptr(w.k_cache),
                       ptr(w.v_cache)) for w in layers))
        self._work = torch.empty(0, dtype=torch.float32)

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out_cache_loc: torch.Tensor,
                 kv_slots: torch.Tensor, seq_lens: torch.Tensor, threads: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [B, H] float32 (the embedded tokens, not written); cos, sin [B, 1, F] or [B, F] (row b:
        request b's new position, as ``Rotation`` holds them); out_cache_loc [B] int64 (each request's new
        slot, the last of its kv_slots row); kv_slots [B, L] int64; seq_lens [B] int64 in [1, L] ->
        (hidden, residual) [B, H] each after the last layer (the final norm is the caller's). Writes each
        layer's new k and v rows into its pool. ``threads`` > 1: helper threads share the GEMMs' panels and
        attention's requests where big enough (the policies of gemm_cpu and decode_attention_cpu); the same
        bits as one thread. Raises ValueError/TypeError naming the argument on bad input (slots, lengths:
        before anything is written), KernelUnavailable where the library could not be built."""
        lib = load()
        if lib is None:
            raise KernelUnavailable("the CPU decode stack kernel could not be built (see the log)")
        B = self._check_step(hidden, cos, sin, out_cache_loc, kv_slots, seq_lens, threads)
        H = self.shape.hidden
        out, residual = torch.empty(B, H, dtype=torch.float32), torch.empty(B, H, dtype=torch.float32)
        if B == 0:
            return out, residual
        need = lib.pdserve_decode_stack_work_floats(ctypes.byref(self.dims), B)
        if self._work.numel() < need:
            self._work = torch.empty(need, dtype=torch.float32)
        L, Hkv = kv_slots.shape[1], self.shape.kv_heads
        attn_threads = threads
        if threads > 1 and B > 1 and B * L * Hkv < decode_attention_cpu.PARALLEL_MIN_ROWS:
            attn_threads = 1  # decode_attention_cpu's policy: too little to share
        per_unit = max(1, B // (attn_threads * decode_attention_cpu.UNITS_PER_THREAD)) if attn_threads > 1 else B
        rc = lib.pdserve_decode_stack_f32(ctypes.byref(self.dims), self.array, hidden.data_ptr(), B, cos.data_ptr(),
                                          cos.stride(0), sin.data_ptr(), sin.stride(0), out_cache_loc.data_ptr(),
                                          kv_slots.data_ptr(), L, kv_slots.stride(0), seq_lens.data_ptr(),
                                          out.data_ptr(), residual.data_ptr(), self._work.data_ptr(), threads,
                                          attn_threads, per_unit)
        if rc == BAD_LEN:
            raise ValueError(f"seq_lens: lengths must lie in [1, {L}] (kv_slots' width)")
        if rc == BAD_SLOT:
            raise ValueError(f"kv_slots / out_cache_loc: a slot lies outside the pool's {self.pages * self.page_size} "
                             "slots")
        return out, residual

    def _check_step(self, hidden, cos, sin, out_cache_loc, kv_slots, seq_lens, threads) -> int:
        what = "CPU decode stack kernel"
        check_tensor("hidden", hidden, what, dim=2)
        B, H = hidden.shape
        if H != self.shape.hidden:
            raise ValueError(f"hidden: expected rows of {self.shape.hidden}, got {H}")
        F = self.shape.rotary_dim // 2
        for name, t in (("cos", cos), ("sin", sin)):
            check_tensor(name, t, what, layout="rows")
            if t.dim() not in (2, 3) or t.shape[0] != B or t.shape[-1] != F or t.numel() != B * F:
                raise ValueError(f"{name}: expected [{B}, 1, {F}] (hidden's rows, rotary_dim / 2), got "
                                 f"{tuple(t.shape)}")
        check_tensor("out_cache_loc", out_cache_loc, what, torch.int64, 1)
        check_tensor("kv_slots", kv_slots, what, torch.int64, 2, layout="rows")
        check_tensor("seq_lens", seq_lens, what, torch.int64, 1)
        for name, n in (("out_cache_loc", out_cache_loc.shape[0]), ("kv_slots", kv_slots.shape[0]),
                        ("seq_lens", seq_lens.shape[0])):
            if n != B:
                raise ValueError(f"{name}: {n} rows for hidden's {B}")
        if threads < 1:
            raise ValueError(f"threads: must be >= 1, got {threads}")
        return B
