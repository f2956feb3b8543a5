"""``--enable-torch-compile``: decode steps run inductor-compiled decoder layers, per batch-size bucket.

Legend: B requests (= tokens) in a decode step, Bp its bucket (the padded batch size), H hidden.

What is compiled: the model's layer stack (``DecoderStack.layers_forward``: every layer's norms,
projections, rotary, attention and MLP/MoE, then the final norm), one graph per bucket, for decode
steps whose batch fits a bucket (``CompileConfig.buckets``); extend steps and larger decode batches
run the very same layers eagerly. One graph for the stack, not one per layer: a custom op
specialises its int arguments (``layer_id``), so per-layer graphs could not be shared, and each
compiled call costs a guard check (a cache lookup that grows with the graphs held). The GEMMs
keep their oneDNN-packed weights through the custom op ``pdserve::packed_linear`` (layers/cpu_gemm.py).

Attention is a custom op too (``pdserve::bucket_gqa`` / ``pdserve::bucket_mla``), opaque to
inductor, so no graph break is left around it. The op runs the real
backend eagerly on the real batch: its pool write, the per-layer KV hook
(``ForwardBatch.kv_written``, which disaggregation streams from) and torch_native's staged decode
KV all happen exactly as without compile. It declares that it mutates the pool's page buffers
(``KVPool.page_buffers``), which the graph passes it, so the compiler orders it as the writer of
the pool it is (inductor re-inplaces: the buffers are never copied). What else it touches is the
backend's own cache of the pool (the decode stage) and the hook, neither visible to the graph.
The op finds its ``BucketAttention`` (the step's real batch) by a handle, since a custom op takes
tensors and numbers only. DeepSeek-V3.2's sparse MLA stays eager behind a graph break.

Padding: the dense parts run on Bp rows, so each bucket compiles once with static shapes.
The model gets a padded ForwardBatch (``input_ids`` and ``positions`` padded with zeros)
whose ``attn_backend`` is a ``BucketAttention``: it hands the real backend the first B rows
of its inputs together with the real ForwardBatch, and pads the output back to Bp rows.
Padded rows are computed and dropped; they never reach the pool, the hook or the sampler.

Routed MoE experts stay eager (``torch._grouped_mm`` has no float32 CPU kernel dynamo can
trace, and their sort and bincount are data-dependent); the router and shared experts compile.

Warm-up compiles one graph per bucket (a larger one on deeper models: the loop is unrolled).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from collections import Counter
from typing import TYPE_CHECKING

import torch
from torch import nn

from pdserve.config import CompileConfig
from pdserve.layers.attention.base import AttentionBackend, AttentionMetadata
from pdserve.layers.forward_batch import ForwardBatch, ForwardMode
from pdserve.layers.moe.experts import Experts

if TYPE_CHECKING:
    from pdserve.models.base import CausalLM
    from pdserve.models.decoder import DecoderStack

logger = logging.getLogger(__name__)

# Modules that run eagerly inside the compiled layers (see the module docstring).
EAGER_MODULES = (Experts,)


def dynamo_config(config: CompileConfig, warm_up: bool = False) -> dict:
    """Dynamo settings for the compiled layers, applied around each compiled forward.

    nested_graph_breaks: where a layer still breaks (DeepSeek-V3.2's sparse attention, MoE experts),
    the break inside the module does not also split the layer around its call.
    recompile_limit: the stack's code holds a graph per bucket of every compiled model in the
    process (and, past a graph break, each resumed piece one per bucket): more than dynamo's
    default of 8. Past the limit dynamo would silently run that code
    eagerly, so warm-up (``warm_up``) fails loudly instead.
    """
    return {"nested_graph_breaks": True,
            "recompile_limit": max(64, 8 * len(config.buckets)), "accumulated_recompile_limit": 4096,
            "fail_on_recompile_limit_hit": warm_up}


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """[B, ...] -> contiguous [rows, ...], zero rows appended.

    Always contiguous: the attention ops' fake outputs are (inductor checks a custom op's strides),
    and after a graph break (sparse MLA) dynamo guards on them.
    """
    if x.shape[0] == rows:
        return x.contiguous()
    return torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])])


class BucketAttention(AttentionBackend):
    """What the compiled layers see as ``fb.attn_backend``: the real backend on the real rows.

    ``real`` is the ForwardBatch of the step being run (set by ``CompiledDecode`` around
    the forward, None outside it); with ``real`` None (warm-up) it returns zeros of the
    right shape and touches nothing, so compiling never writes the pool or calls the hook.
    One instance serves the runner's life, so dynamo's guards on it hold from step to step.
    ``forward_*`` are traced into the graph as the custom ops; ``run_*`` are their bodies.
    """

    name = "bucket"

    def __init__(self, inner: AttentionBackend):
        self.inner = inner
        self.real: ForwardBatch | None = None
        self.handle = id(self)  # how the custom ops find this instance (_LIVE)
        _LIVE[self.handle] = self

    def prepare(self, fb: ForwardBatch) -> AttentionMetadata:
        raise RuntimeError("BucketAttention is never prepared: the real backend prepares the real batch")

    def forward_gqa(self, q, k, v, layer_id, scale, fb):
        return bucket_gqa(q, k, v, _pool_buffers(fb), layer_id, scale, self.handle)  # [Bp, Hq, D]

    def forward_mla(self, q_nope, q_pe, latent, k_pe, w_kc, w_vc, layer_id, scale, fb, absorbed=None):
        return bucket_mla(q_nope, q_pe, latent, k_pe, w_kc, w_vc, _pool_buffers(fb), layer_id, scale, absorbed,
                          self.handle)  # [Bp, H, Dv]

    def run_gqa(self, q, k, v, layer_id, scale):
        if self.real is None:
            return q.new_zeros(q.shape)  # [Bp, Hq, D]
        B = self.real.batch_size
        o = self.inner.forward_gqa(q[:B], k[:B], v[:B], layer_id, scale, self.real)  # [B, Hq, D]
        return _pad_rows(o, q.shape[0])  # [Bp, Hq, D]

    def run_mla(self, q_nope, q_pe, latent, k_pe, w_kc, w_vc, layer_id, scale, absorbed):
        if self.real is None:
            return q_nope.new_zeros(q_nope.shape[0], q_nope.shape[1], w_vc.shape[-1])  # [Bp, H, Dv]
        B = self.real.batch_size
        o = self.inner.forward_mla(q_nope[:B], q_pe[:B], latent[:B], k_pe[:B], w_kc, w_vc, layer_id, scale,
                                   self.real, absorbed)  # [B, H, Dv]
        return _pad_rows(o, q_nope.shape[0])  # [Bp, H, Dv]

    @torch.compiler.disable
    def forward_mla_sparse(self, q_nope, q_pe, latent, k_pe, w_kc, w_vc, layer_id, scale, index, fb):
        # DeepSeek-V3.2: the indexer's projections compile with the layer; its scoring, top-k and
        # the sparse MLA run eagerly here, on the real rows, like dense attention.
        if self.real is None:
            return q_nope.new_zeros(q_nope.shape[0], q_nope.shape[1], w_vc.shape[-1])  # [Bp, H, Dv]
        B = self.real.batch_size
        real = dataclasses.replace(index, q=index.q[:B], weights=index.weights[:B], k=index.k[:B])
        o = self.inner.forward_mla_sparse(q_nope[:B], q_pe[:B], latent[:B], k_pe[:B], w_kc, w_vc, layer_id, scale,
                                          real, self.real)  # [B, H, Dv]
        return _pad_rows(o, q_nope.shape[0])  # [Bp, H, Dv]


# handle -> live BucketAttention, for the custom ops below (weak: a dropped runner takes its entry along)
_LIVE: weakref.WeakValueDictionary[int, BucketAttention] = weakref.WeakValueDictionary()


def _pool_buffers(fb: ForwardBatch) -> list[torch.Tensor]:
    """The pool tensors attention writes, each [N, P, ...]: what the ops declare they mutate."""
    return [t for _, t in fb.kv_pool.page_buffers()]


@torch.library.custom_op("pdserve::bucket_gqa", mutates_args=("kv_buffers",))
def bucket_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_buffers: list[torch.Tensor], layer_id: int,
               scale: float, handle: int) -> torch.Tensor:
    """q [Bp, Hq, D], k/v [Bp, Hkv, D] -> [Bp, Hq, D]: BucketAttention.run_gqa; writes the pool."""
    return _LIVE[handle].run_gqa(q, k, v, layer_id, scale)


@bucket_gqa.register_fake
def _(q, k, v, kv_buffers, layer_id, scale, handle):
    return q.new_empty(q.shape)  # contiguous, as _pad_rows returns it


@torch.library.custom_op("pdserve::bucket_mla", mutates_args=("kv_buffers",))
def bucket_mla(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
               w_kc: torch.Tensor, w_vc: torch.Tensor, kv_buffers: list[torch.Tensor], layer_id: int, scale: float,
               absorbed: bool | None, handle: int) -> torch.Tensor:
    """Shapes as AttentionBackend.forward_mla, on Bp rows: BucketAttention.run_mla; writes the pool."""
    return _LIVE[handle].run_mla(q_nope, q_pe, latent, k_pe, w_kc, w_vc, layer_id, scale, absorbed)


@bucket_mla.register_fake
def _(q_nope, q_pe, latent, k_pe, w_kc, w_vc, kv_buffers, layer_id, scale, absorbed, handle):
    return q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], w_vc.shape[-1])


class CompiledDecode:
    """Owns the compiled layer stack of one model and runs padded decode steps through it.

    Installing replaces the stack's ``layers_forward`` (every layer, then the final norm) with a
    dispatcher: the compiled one when called with a ``BucketAttention`` batch (a step run by
    ``__call__``), the original one otherwise. The model's weights and structure are untouched.
    """

    def __init__(self, model: CausalLM, backend: AttentionBackend, config: CompileConfig):
        self.model = model
        self.config = config
        self.attention = BucketAttention(backend)
        self.dynamo_config = dynamo_config(config)
        self.warmup_s = 0.0
        self.steps: Counter[int] = Counter()  # decode steps run per bucket (observable in tests)
        _install(model.model)
        for module in model.modules():
            if isinstance(module, EAGER_MODULES):
                _run_eagerly(module)

    def accepts(self, fb: ForwardBatch) -> bool:
        return fb.is_decode and self.config.bucket_for(fb.batch_size) is not None

    def __call__(self, fb: ForwardBatch) -> torch.Tensor:
        """The model's hidden states [B, H] for a decode batch the runner has prepared."""
        Bp = self.config.bucket_for(fb.batch_size)
        if Bp is None:
            raise RuntimeError(f"torch.compile: no bucket holds a batch of {fb.batch_size} (check accepts first)")
        self.steps[Bp] += 1
        padded = dataclasses.replace(fb, input_ids=_pad_rows(fb.input_ids, Bp),
                                     positions=_pad_rows(fb.positions, Bp), attn_backend=self.attention)
        self.attention.real = fb
        try:
            with torch._dynamo.config.patch(self.dynamo_config):
                hidden = self.model(padded)  # [Bp, H]
        finally:
            self.attention.real = None
        return hidden[:fb.batch_size]  # [B, H]

    def warm_up(self, pool, device: torch.device) -> float:
        """Compile every bucket now (start-up), without touching the pool; returns the seconds taken."""
        t0 = time.perf_counter()
        for Bp in self.config.buckets:
            zeros = torch.zeros(Bp, dtype=torch.int64, device=device)
            ones = torch.ones(Bp, dtype=torch.int64, device=device)
            fb = ForwardBatch(ForwardMode.DECODE, zeros, zeros, zeros, zeros, ones, ones, zeros[:, None],
                              pool, self.attention)
            with torch.inference_mode(), torch._dynamo.config.patch(dynamo_config(self.config, warm_up=True)):
                self.model(fb)
            logger.debug("torch.compile: decode bucket %d compiled after %.1f s", Bp, time.perf_counter() - t0)
        self.warmup_s = time.perf_counter() - t0
        logger.info("torch.compile: decode buckets %s compiled in %.1f s", list(self.config.buckets), self.warmup_s)
        return self.warmup_s


def _run_eagerly(module: nn.Module) -> None:
    module.forward = torch.compiler.disable(module.forward)


def _install(stack: DecoderStack) -> None:
    eager = stack.layers_forward
    compiled = torch.compile(eager, dynamic=False)

    def layers_forward(hidden, rotation, fb: ForwardBatch):
        run = compiled if isinstance(fb.attn_backend, BucketAttention) else eager
        return run(hidden, rotation, fb)

    stack.layers_forward = layers_forward  # type: ignore[method-assign]
