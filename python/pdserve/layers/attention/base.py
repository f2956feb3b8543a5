"""Attention backend contract: attention over the paged KV pool for one ForwardBatch.

Backends are chosen by name through ``layers.attention.registry`` and imported
lazily, so a GPU-only backend (flashinfer) never loads on a CPU host.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from pdserve.layers.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    """Contract shared by every backend.

    ``forward_gqa`` / ``forward_mla`` first write this step's new KV into
    ``fb.kv_pool`` at ``fb.out_cache_loc`` (the only mutation), then call
    ``fb.kv_written(layer_id)`` (the disaggregation hook), then attend: each new
    token sees its request's prefix plus the new tokens up to itself (causal).
    Per-step metadata is built once and cached in ``fb.attn_metadata``.
    """

    name: str = "base"

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
