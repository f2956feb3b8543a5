"""Batched sampling: greedy, temperature, top-k, top-p, min-p, penalties, per-request seeds.

Legend: B requests, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from pdserve.engine.request import SamplingParams

TopLogprobs = list[tuple[float, int]]  # (logprob, token id), most likely first


@dataclass
class SampleResult:
    tokens: list[int]
    logprobs: list[float] | None  # log-softmax of the raw logits at the chosen token
    top_logprobs: list[TopLogprobs] | None = None  # [B] the top_logprobs_nums[b] most likely, per row


def token_logprobs(logits: torch.Tensor, token_ids, top_ks: list[int] | None = None
                   ) -> tuple[list[float], list[TopLogprobs] | None]:
    """Log-softmax of ``logits`` [N, V] at ``token_ids`` [N], and row n's ``top_ks[n]`` best
    (logprob, id) pairs (None if no row wants any). Raw logits in: OpenAI and SGLang report
    logprobs before penalties and temperature."""
    logp = torch.log_softmax(logits.float(), -1)  # [N, V]
    ids = torch.as_tensor(token_ids, dtype=torch.int64)
    chosen = logp.gather(1, ids[:, None]).squeeze(1).tolist()
    k = max(top_ks or [0])
    if k == 0:
        return chosen, None
    assert top_ks is not None  # k > 0 implies some row asked for top logprobs
    top_vals, top_idx = logp.topk(k, dim=-1)  # [N, k]
    vals, idx = top_vals.tolist(), top_idx.tolist()
    return chosen, [list(zip(v[:kn], i[:kn])) for v, i, kn in zip(vals, idx, top_ks)]


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams], outputs: list[list[int]]) -> torch.Tensor:
    """OpenAI-style frequency/presence penalties over each request's generated tokens."""
    rows = [i for i, p in enumerate(params) if (p.frequency_penalty or p.presence_penalty) and outputs[i]]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:
        ids = torch.tensor(outputs[i], dtype=torch.int64)
        ones = torch.ones_like(ids, dtype=logits.dtype)
        counts = torch.zeros(logits.shape[1], dtype=logits.dtype).scatter_add_(0, ids, ones)
        p = params[i]
        logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted probabilities after temperature, top-k, top-p and min-p; returns (probs, order) [B, V]."""
    temps = torch.tensor([max(p.temperature, 1e-6) for p in params], dtype=logits.dtype)
    probs = torch.softmax(logits / temps[:, None], dim=-1)
    probs, order = probs.sort(dim=-1, descending=True)  # [B, V]
    V = logits.shape[1]
    rank = torch.arange(V)[None, :]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else V for p in params])
    top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype)
    min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype)
    drop = rank >= top_k[:, None]
    # keep a token if the mass strictly before it is below top_p (so the first always stays)
    drop |= (probs.cumsum(-1) - probs) >= top_p[:, None]
    drop |= probs < (min_p * probs[:, 0])[:, None]
    drop[:, 0] = False
    return probs.masked_fill(drop, 0.0), order


class SampleFn(Protocol):
    """What the scheduler samples with: a ``Sampler``, or a wrapper that shares one rank's result."""

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], generators: list,
                 outputs: list[list[int]], want_logprobs: bool = False,
                 top_logprobs_nums: list[int] | None = None) -> SampleResult: ...


class Sampler:
    """Picks one token per row. Greedy rows never consume randomness, so a greedy
    request's output does not depend on what it is batched with."""

    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], generators: list,
                 outputs: list[list[int]], want_logprobs: bool = False,
                 top_logprobs_nums: list[int] | None = None) -> SampleResult:
        logits = logits.float()  # [B, V]
        raw = logits
        logits = apply_penalties(logits, params, outputs)
        tokens = logits.argmax(dim=-1)  # [B]
        stochastic = [i for i, p in enumerate(params) if not p.is_greedy]
        if stochastic:
            idx = torch.tensor(stochastic)
            sub = [params[i] for i in stochastic]
            probs, order = _filtered_probs(logits[idx], sub)
            u = torch.stack([torch.rand((), generator=generators[i] or self.generator) for i in stochastic])
            cdf = probs.cumsum(-1)
            pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).clamp(max=probs.shape[1] - 1)
            tokens[idx] = order.gather(1, pick).squeeze(1)
        if not want_logprobs:
            return SampleResult(tokens.tolist(), None)
        logprobs, top = token_logprobs(raw, tokens, top_logprobs_nums)
        return SampleResult(tokens.tolist(), logprobs, top)
