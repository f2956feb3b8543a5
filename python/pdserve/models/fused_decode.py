"""A float32 GQA decode step's decoder layers in one plain-C call (``pdserve_kernels.decode_stack_cpu``),
where the step is one the call computes as the layers would; every other step goes layer by layer.

The call runs when ALL hold: the runner packed the CPU linears (``DecoderStack.pack_cpu``: not
``--cpu-gemm plain``), eager (not under torch.compile), a decode step (one token per request) with no
layer hook (P/D's per-layer announcements: the call writes every layer's KV before any could be
announced) on one rank (no TP, no DP attention), every layer a plain ``DecoderLayer`` of ``GQAAttention`` (no q/k norm)
and a SiLU ``GatedMLP`` with float32 CPU weights, the torch_native backend's CPU decode attention kernel
chosen (``TorchNativeMetadata.decode_kernel``) on a plain float32 ``GQAKVPool``, and the library built
(``PDSERVE_CC=false``: the layers). The layers' checks fail once per stack (logged), the step's per step.
``PDSERVE_DECODE_STACK=layers`` (read when the runner packs the linears) keeps the layers, for A/B runs
and for tests of the per-op kernels.

Panels: a linear the runner packed for the C small-M GEMM (``PackedLinear.panels``) lends its own;
the others (o_proj on the tiny models, below the pack policy) are packed here, once.

Legend: T tokens, B requests (T = B in decode), H hidden.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import torch

from pdserve.layers.attention.torch_native import TorchNativeBackend, TorchNativeMetadata
from pdserve.layers.forward_batch import ForwardBatch
from pdserve.layers.linear import RowParallelLinear, _Fp8Capable
from pdserve.layers.mlp import GatedMLP
from pdserve.layers.norm import RMSNorm
from pdserve.layers.rotary import RotaryEmbedding, Rotation
from pdserve.mem.kv_pool import GQAKVPool
from pdserve_kernels import decode_stack_cpu, gemm_cpu

if TYPE_CHECKING:  # decoder.py imports this module
    from pdserve.models.decoder import DecoderLayer, DecoderStack, GQAAttention

logger = logging.getLogger(__name__)


class FusedDecode:
    """One DecoderStack's layers as the C call reads them, bound to one pool (rebound when the pool
    changes). ``refusal`` says why the layers cannot take it (None: they can)."""

    def __init__(self, stack: DecoderStack):
        self.stack = stack
        self.refusal = _refusal(stack)
        self.parts = [] if self.refusal is not None else [_parts(layer) for layer in stack.layers]
        self._panels: dict[int, torch.Tensor] = {}  # id(linear) -> its panels, packed here
        self._bound: tuple[int, int, decode_stack_cpu.DecodeStack] | None = None  # (k ptr, v ptr, call)
        if self.refusal is not None:
            logger.info("decode stack: layer by layer (%s)", self.refusal)
        else:
            logger.info("decode stack: a float32 decode step on the torch_native backend runs its %d layers in one "
                        "plain-C call (PDSERVE_DECODE_STACK=layers: one by one)", len(stack.layers))

    def takes(self, hidden: torch.Tensor, fb: ForwardBatch) -> bool:
        """Whether this step goes through the call (the per-step half of the module's conditions)."""
        if self.refusal is not None or torch.compiler.is_compiling():
            return False
        md, pool = fb.attn_metadata, fb.kv_pool
        # a layer hook (P/D's layer-by-layer send) wants each layer's KV announced as it lands, before the
        # next layer's is written: the one call writes them all first, so such a step keeps the layers
        return (fb.is_decode and fb.num_tokens == fb.batch_size and fb.dp_num_tokens is None and fb.layer_hook is None
                and hidden.dtype == torch.float32 and hidden.device.type == "cpu" and hidden.is_contiguous()
                and isinstance(fb.attn_backend, TorchNativeBackend)
                and isinstance(md, TorchNativeMetadata) and md.decode_kernel
                and type(pool) is GQAKVPool and pool.dtype == torch.float32 and pool.k_scale == pool.v_scale == 1.0)

    def forward(self, hidden: torch.Tensor, rotation: Rotation, fb: ForwardBatch
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """hidden [B, H] (embedded) -> (hidden, residual) [B, H] after the last layer, every layer's new
        KV written as the layers would (no layer hook listens: ``takes``); None where the step does not
        take the call (``takes``): the caller runs the layers. A decode step on the torch_native
        backend says which it was there (``describe()``'s ``decode_stack``)."""
        backend = fb.attn_backend
        if not self.takes(hidden, fb):
            if fb.is_decode and isinstance(backend, TorchNativeBackend):
                backend.note_decode_stack("layers")
            return None
        assert isinstance(backend, TorchNativeBackend) and isinstance(fb.kv_pool, GQAKVPool)  # takes()
        call = self._bind(fb.kv_pool)
        out = call(hidden, rotation.cos, rotation.sin, fb.out_cache_loc, fb.kv_slots, fb.seq_lens,
                   threads=backend.decode_threads)
        backend.note_decode_stack("cpu_kernel")
        return out

    def _bind(self, pool: GQAKVPool) -> decode_stack_cpu.DecodeStack:
        ptrs = (pool.k.data_ptr(), pool.v.data_ptr())
        if self._bound is None or self._bound[:2] != ptrs:
            self._bound = (*ptrs, self._build(pool))
        return self._bound[2]

    def _build(self, pool: GQAKVPool) -> decode_stack_cpu.DecodeStack:
        _, attn, mlp = self.parts[0]
        rope = self.stack.rotary_emb
        assert isinstance(rope, RotaryEmbedding)  # _refusal
        shape = decode_stack_cpu.StackShape(attn.o_proj.out_features, attn.num_heads, attn.num_kv_heads,
                                            attn.head_dim, mlp.down_proj.in_features, rope.rotary_dim,
                                            rope.interleaved, attn.scale)
        return decode_stack_cpu.DecodeStack(shape, [self._weights(*part, pool) for part in self.parts])

    def _weights(self, layer: DecoderLayer, a: GQAAttention, m: GatedMLP,
                 pool: GQAKVPool) -> decode_stack_cpu.LayerWeights:
        i = a.layer_id
        return decode_stack_cpu.LayerWeights(
            layer.input_layernorm.weight, layer.input_layernorm.eps, self._panels_of(a.qkv_proj), a.qkv_proj.bias,
            self._panels_of(a.o_proj), a.o_proj.bias, layer.post_attention_layernorm.weight,
            layer.post_attention_layernorm.eps, self._panels_of(m.gate_up_proj), self._panels_of(m.down_proj),
            pool.k[i], pool.v[i])

    def _panels_of(self, linear: _Fp8Capable) -> torch.Tensor:
        packed = linear.packed
        if packed is not None and packed.panels is not None:
            return packed.panels
        if id(linear) not in self._panels:
            self._panels[id(linear)] = gemm_cpu.pack(linear.weight)
        return self._panels[id(linear)]


def _parts(layer: torch.nn.Module) -> tuple[DecoderLayer, GQAAttention, GatedMLP]:
    """A layer _refusal passed, with its attention and MLP, typed."""
    from pdserve.models.decoder import DecoderLayer, GQAAttention

    a, m = layer.self_attn, layer.mlp
    assert isinstance(layer, DecoderLayer) and isinstance(a, GQAAttention) and isinstance(m, GatedMLP)
    return layer, a, m


def _refusal(stack: DecoderStack) -> str | None:
    """Why these layers cannot take the call, or None."""
    from pdserve.models.decoder import DecoderLayer, GQAAttention

    if os.environ.get("PDSERVE_DECODE_STACK", "cpu_kernel") == "layers":
        return "PDSERVE_DECODE_STACK=layers"
    rope = stack.rotary_emb
    if not isinstance(rope, RotaryEmbedding) or rope.dtype != torch.float32:
        return "not a float32 rotary embedding"
    if not isinstance(stack.norm, RMSNorm) or len(stack.layers) == 0:
        return "not an RMSNorm stack of layers"
    for layer in stack.layers:
        if type(layer) is not DecoderLayer or layer.dp is not None:
            return f"{type(layer).__name__} is not a plain DecoderLayer on one attention group"
        a, m = layer.self_attn, layer.mlp
        if type(a) is not GQAAttention or a.q_norm is not None:
            return f"{type(a).__name__} is not a GQAAttention without q/k norm"
        if type(m) is not GatedMLP:
            return f"{type(m).__name__} is not a GatedMLP"
        linears = (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)
        for lin in linears:
            if lin.fp8_block is not None or lin.weight.dtype != torch.float32 or lin.weight.device.type != "cpu":
                return "a linear is not float32 on the CPU"
        if any(isinstance(lin, RowParallelLinear) and lin.parallel.tp_size != 1 for lin in linears):
            return "tensor parallel"
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        if any(w.dtype != torch.float32 for w in norms):
            return "a norm is not float32"
    if decode_stack_cpu.load() is None or gemm_cpu.load() is None:  # last: a model refused above builds nothing
        return "the plain-C library is not built"
    return None
