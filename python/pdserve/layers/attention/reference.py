"""Naive, contiguous (non-paged) attention for one sequence: the slow twins tests compare against.

Legend: L sequence length, H heads, D head dim, Dn/R/Dv MLA dims, C kv_lora_rank.
"""

from __future__ import annotations

import torch


def _causal_softmax_attend(scores: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """scores [H, Lq, Lk] for the last Lq of Lk positions; v [H, Lk, X] -> [Lq, H, X]."""
    Lq, Lk = scores.shape[-2:]
    i = torch.arange(Lq)[:, None] + (Lk - Lq)
    scores = scores.masked_fill(torch.arange(Lk)[None, :] > i, float("-inf"))
    return torch.einsum("hqk,hkx->qhx", scores.softmax(-1), v)


def gqa_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Lq, Hq, D] (the last Lq tokens), k/v [L, Hkv, D] -> [Lq, Hq, D]."""
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    return _causal_softmax_attend(scores, v.transpose(0, 1))


def mla_reference(q_nope, q_pe, latent, k_pe, w_kc, w_vc, scale) -> torch.Tensor:
    """MLA written the way the paper states it.

    q_nope [Lq, H, Dn], q_pe [Lq, H, R], latent [L, C], k_pe [L, R],
    w_kc [H, Dn, C], w_vc [H, C, Dv] -> [Lq, H, Dv].
    """
    k_nope = torch.einsum("lc,hdc->lhd", latent, w_kc)  # [L, H, Dn]
    v = torch.einsum("lc,hcv->hlv", latent, w_vc)  # [H, L, Dv]
    scores = (torch.einsum("qhd,khd->hqk", q_nope, k_nope)
              + torch.einsum("qhr,kr->hqk", q_pe, k_pe)) * scale  # [H, Lq, L]
    return _causal_softmax_attend(scores, v)
