"""Routing: which K of the E experts each token visits, and with what weight.

Legend: T tokens, H hidden, E routed experts, K experts per token, G groups, g = E/G.

All scoring runs in float32 (DeepSeek keeps its gate in float32 for the same
reason: bf16 scores reorder near-ties). Outputs: weights [T, K] float32 and
ids [T, K] int64; the order of the K slots carries no meaning.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.layers.weights import WeightEntry, direct_entries


def softmax_topk(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen-MoE / DeepSeek-V2 "greedy": top-k of softmax(logits); logits [T, E]."""
    scores = logits.softmax(dim=-1, dtype=torch.float32)  # [T, E]
    weights, ids = torch.topk(scores, k, dim=-1)  # [T, K]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _mask_to_top_groups(scores: torch.Tensor, group_scores: torch.Tensor, topk_group: int,
                        fill: float) -> torch.Tensor:
    """scores [T, E], group_scores [T, G] -> scores with experts outside the best groups set to fill."""
    T, G = group_scores.shape
    top_groups = torch.topk(group_scores, topk_group, dim=-1, sorted=False)[1]  # [T, topk_group]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, top_groups, True)  # [T, G]
    keep = keep.unsqueeze(-1).expand(T, G, scores.shape[-1] // G).reshape(T, scores.shape[-1])  # [T, E]
    return scores.masked_fill(~keep, fill)


def grouped_softmax_topk(logits: torch.Tensor, k: int, n_group: int, topk_group: int,
                         renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2 "group_limited_greedy": a group scores by its best expert; top-k within the
    ``topk_group`` best groups. Bounds how many devices a token's experts span under EP."""
    scores = logits.softmax(dim=-1, dtype=torch.float32)  # [T, E]
    group_scores = scores.view(scores.shape[0], n_group, scores.shape[1] // n_group).max(dim=-1).values  # [T, G]
    masked = _mask_to_top_groups(scores, group_scores, topk_group, 0.0)
    weights, ids = torch.topk(masked, k, dim=-1)  # [T, K]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def biased_grouped_topk(logits: torch.Tensor, bias: torch.Tensor, k: int, n_group: int, topk_group: int,
                        renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 "noaux_tc": sigmoid scores; the correction bias steers *which* experts are picked
    (load balancing without an aux loss) but the weights are the unbiased scores. A group scores
    by the sum of its two best biased experts."""
    scores = logits.float().sigmoid()  # [T, E]
    choice = scores + bias  # [T, E]
    T, E = choice.shape  # explicit sizes: an EP rank may route no tokens at all (T = 0)
    group_scores = choice.view(T, n_group, E // n_group).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
    masked = _mask_to_top_groups(choice, group_scores, topk_group, float("-inf"))
    ids = torch.topk(masked, k, dim=-1, sorted=False)[1]  # [T, K]
    weights = scores.gather(1, ids)  # [T, K]
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights, ids


@dataclass(frozen=True)
class RoutingConfig:
    """The routing rule a checkpoint was trained with, read off its HF config."""

    num_experts: int
    top_k: int
    method: str  # "softmax" | "group_limited_greedy" | "noaux_tc"
    renormalize: bool
    scaling: float = 1.0  # routed_scaling_factor, applied to the weights
    n_group: int = 1
    topk_group: int = 1
    gate_fp32: bool = False  # gate weight kept and applied in float32 (DeepSeek)

    @classmethod
    def qwen_moe(cls, c) -> RoutingConfig:
        return cls(c.num_experts, c.num_experts_per_tok, "softmax", bool(c.norm_topk_prob))

    @classmethod
    def deepseek_v2(cls, c) -> RoutingConfig:
        method = getattr(c, "topk_method", None) or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"topk_method: {method!r} is not supported for DeepSeek-V2 "
                             f"(supported: greedy, group_limited_greedy)")
        return cls(c.n_routed_experts, c.num_experts_per_tok,
                   "softmax" if method == "greedy" else method, bool(getattr(c, "norm_topk_prob", False)),
                   float(c.routed_scaling_factor), c.n_group or 1, c.topk_group or 1, gate_fp32=True)

    @classmethod
    def deepseek_v3(cls, c) -> RoutingConfig:
        return cls(c.n_routed_experts, c.num_experts_per_tok, "noaux_tc", bool(c.norm_topk_prob),
                   float(c.routed_scaling_factor), c.n_group or 1, c.topk_group or 1, gate_fp32=True)

    def __post_init__(self):
        if self.num_experts % self.n_group:
            raise ValueError(f"n_group: {self.n_group} does not divide n_routed_experts={self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok: {self.top_k} outside [1, {self.num_experts}]")


class TopKRouter(nn.Module):
    """Gate projection + routing rule. Replicated on every rank (E x H is small).

    Checkpoint keys: ``{prefix}.weight`` [E, H] and, for noaux_tc,
    ``{prefix}.e_score_correction_bias`` [E].
    """

    e_score_correction_bias: torch.Tensor  # a buffer, registered for noaux_tc only

    def __init__(self, hidden: int, cfg: RoutingConfig, dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        gate_dtype = torch.float32 if cfg.gate_fp32 else dtype
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, hidden, dtype=gate_dtype), requires_grad=False)
        if cfg.method == "noaux_tc":
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> weights [T, K] float32, ids [T, K] int64."""
        cfg = self.cfg
        xin = x if x.dtype == self.weight.dtype else x.to(self.weight.dtype)
        logits = F.linear(xin, self.weight)  # [T, E]
        if cfg.method == "softmax":
            w, ids = softmax_topk(logits, cfg.top_k, cfg.renormalize)
        elif cfg.method == "group_limited_greedy":
            w, ids = grouped_softmax_topk(logits, cfg.top_k, cfg.n_group, cfg.topk_group, cfg.renormalize)
        else:
            w, ids = biased_grouped_topk(logits, self.e_score_correction_bias, cfg.top_k, cfg.n_group,
                                         cfg.topk_group, cfg.renormalize)
        return (w * cfg.scaling if cfg.scaling != 1.0 else w), ids

    def weight_entries(self, prefix: str) -> Iterator[WeightEntry]:
        yield from direct_entries(self, prefix)
