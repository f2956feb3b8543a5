"""Attention backend contract: attention over the paged KV pool for one ForwardBatch.

Backends are chosen by name through ``layers.attention.registry`` and imported
lazily, so a GPU-only backend (flashinfer) never loads on a CPU host.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TypeVar

import torch

from pdserve.layers.forward_batch import ForwardBatch


@dataclass(frozen=True)
class AttentionMetadata:
    """Base of every backend's per-forward metadata (page tables, masks, index maps, plans).

    Each backend subclasses it with the typed fields its kernels read; nothing in it may
    depend on the layer, because one instance serves every layer of the forward.
    """


M = TypeVar("M", bound=AttentionMetadata)


@dataclass(frozen=True)
class SparseIndex:
    """DeepSeek-V3.2's lightning indexer for one layer's tokens (DSA): which earlier tokens each
    query attends to. Token j's score for query t is ``sum_h weights[t, h] * relu(scale * q[t, h] . k_j)``
    over every visible j (the k_j of earlier tokens are read back from the pool's ``index_k``);
    the query keeps its ``topk`` best, or every visible token when it sees fewer.
    Legend: T tokens, Hi index heads, Di index head dim.
    """

    q: torch.Tensor  # [T, Hi, Di] rotated index queries
    weights: torch.Tensor  # [T, Hi] float32 per-head weights (already times Hi^-0.5)
    k: torch.Tensor  # [T, Di] this step's index keys (normed, rotated), stored beside the latent
    scale: float  # Di^-0.5, applied before the ReLU
    topk: int  # index_topk


class AttentionBackend(ABC):
    """Contract shared by every backend (torch_native here; flashinfer and Triton plug in here).

    Per forward, in this order:

    1. ``prepare(fb)`` is called exactly ONCE by the model runner, after the ForwardBatch
       is built and before the first layer; the runner stores the result in
       ``fb.attn_metadata``. Everything that depends only on the batch is computed here
       (a flashinfer backend would ``plan`` its wrappers here). It may advance state the
       backend keeps across forwards (the torch_native decode stage), so it must not be
       called twice for one forward, and forwards must reach the backend in the order
       they were prepared.
    2. Each layer calls ``forward_gqa`` / ``forward_mla``, which first write this step's
       new KV into ``fb.kv_pool`` at ``fb.out_cache_loc`` (the only mutation of the
       pool), then call ``fb.kv_written(layer_id)`` (the disaggregation hook: KV of that
       layer may be streamed from then on), then attend: each new token sees its
       request's prefix plus the new tokens up to itself (causal). They read
       ``fb.attn_metadata`` and never rebuild it.

    The pool stays the source of truth: a backend may keep copies of KV across forwards
    (to avoid re-gathering pages) only if it can tell, from ``fb.req_uids`` and the
    lengths, that the copy still describes the same requests.
    """

    name: str = "base"
    # CUDA graphs (engine/cuda_graph.py): True when ``prepare`` of a decode batch reads only the
    # ForwardBatch's tensors and fixed host values (no sync, no state across forwards), so a
    # captured forward replays correctly after the runner refills those tensors in place.
    supports_cuda_graph: bool = False

    def describe(self) -> dict:
        """What runs, for /get_server_info: the backend's name and any kernel choice it made."""
        return {"attention_backend": self.name}

    @abstractmethod
    def prepare(self, fb: ForwardBatch) -> AttentionMetadata:
        """The metadata every layer of this forward reads (see the class docstring)."""

    # CUDA graphs (engine/cuda_graph.py). A backend whose plan is fixed by the batch's tensors
    # keeps these defaults; one whose kernels read plan buffers it fills on the host (flashinfer)
    # sizes them once, plans a graph's batch into them at capture, and again before each replay.
    def init_cuda_graph(self, max_bs: int, max_pages: int, device: torch.device) -> None:
        """Graphs of up to ``max_bs`` rows and ``max_pages`` KV pages in all will be captured."""
        return None

    def graph_metadata(self, fb: ForwardBatch, bs: int) -> AttentionMetadata:
        """The metadata a graph of ``bs`` rows is captured with (``fb``: the runner's fixed inputs)."""
        return self.prepare(fb)

    def before_replay(self, fb: ForwardBatch, bs: int) -> None:
        """``fb`` (the runner's fixed inputs, refilled for this step) is about to be replayed."""
        return None

    @abstractmethod
    def forward_gqa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                    scale: float, fb: ForwardBatch) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]."""

    @abstractmethod
    def forward_mla(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                    k_pe: torch.Tensor, w_kc: torch.Tensor, w_vc: torch.Tensor, layer_id: int,
                    scale: float, fb: ForwardBatch, absorbed: bool | None = None) -> torch.Tensor:
        """MLA over the latent pool.

        q_nope [T, H, Dn], q_pe [T, H, R] (rotated), latent [T, C] (normed),
        k_pe [T, R] (rotated), w_kc [H, Dn, C], w_vc [H, C, Dv] -> [T, H, Dv].
        ``absorbed=None`` picks absorbed for decode and non-absorbed for extend.
        """

    def forward_mla_sparse(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                           k_pe: torch.Tensor, w_kc: torch.Tensor, w_vc: torch.Tensor, layer_id: int,
                           scale: float, index: SparseIndex, fb: ForwardBatch) -> torch.Tensor:
        """MLA over the latent pool attending only to the tokens ``index`` selects (DeepSeek-V3.2).

        Writes the latent and ``index.k`` at ``fb.out_cache_loc`` (the same slots: two regions of
        one page), then ``fb.kv_written``, then attends; shapes as ``forward_mla``. Backends
        without sparse kernels keep this default; the server refuses them for V3.2 at start-up.
        """
        raise NotImplementedError(f"attention_backend: {self.name} has no sparse MLA (DeepSeek-V3.2) kernels")

    @staticmethod
    def metadata_of(fb: ForwardBatch, kind: type[M]) -> M:
        """``fb.attn_metadata`` (the calling backend's ``kind``), or a clear error when ``prepare``
        was never called or another backend prepared the batch."""
        if fb.attn_metadata is None:
            raise RuntimeError("ForwardBatch.attn_metadata is not set: call attn_backend.prepare(fb) once "
                               "before the forward (ModelRunner.forward does)")
        if not isinstance(fb.attn_metadata, kind):
            raise TypeError(f"ForwardBatch.attn_metadata is a {type(fb.attn_metadata).__name__}, not the "
                            f"{kind.__name__} this backend prepares")
        return fb.attn_metadata
