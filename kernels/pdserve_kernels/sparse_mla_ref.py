"""The torch twins of ``sparse_mla`` (DeepSeek-V3.2's indexer top-k and sparse MLA), one query at
a time over plainly gathered rows; they import no triton.

Legend: T query tokens, L longest sequence, Hi/Di index heads and head dim, k picks, H heads,
C kv_lora_rank, R rope dim, S page size, n tokens a query sees.
"""

from __future__ import annotations

import torch


def _rows(pool_layer: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """pool_layer [P, S, X], slots [n] -> [n, X]."""
    S = pool_layer.shape[1]
    return pool_layer[torch.div(slots, S, rounding_mode="floor"), slots % S]


def topk_first_on_ties(score: torch.Tensor, k: int) -> torch.Tensor:
    """score [..., L] -> [..., k] positions of the k largest, in position order. Scores equal to the
    k-th largest are taken from the lowest position up, so the picks never depend on the batch's
    shape (``torch.topk`` breaks such ties as its partial sort happens to run: a ReLU indexer gives
    many exact zeros)."""
    L = score.shape[-1]
    if k == 0:
        return score.new_empty(*score.shape[:-1], 0, dtype=torch.int64)
    if k == L:  # every position is kept
        return torch.arange(L, device=score.device).expand(*score.shape[:-1], L).contiguous()
    # One pick more than kept: its two smallest are the (k+1)-th and the k-th largest (the cut).
    top = score.topk(k + 1, dim=-1, sorted=False)
    low = top.values.topk(2, dim=-1, largest=False)  # [..., 2], ascending
    if score.device.type != "cpu":  # a GPU graph cannot branch on a device value: the L-wide rule everywhere
        return first_on_ties_at(score, low.values[..., 1:], k)
    # Where the k-th largest is strictly above the (k+1)-th no score outside the picks ties it, so
    # topk's picks but that (k+1)-th one are the rule's: no L-wide pass, which is most of a decode
    # step's top-k at long contexts. Only the rows tied at the cut take the rule.
    clear = low.values[..., 0] < low.values[..., 1]  # [...]
    kept = top.indices.scatter(-1, low.indices[..., :1], L).sort(dim=-1).values[..., :k]  # [..., k]
    if bool(clear.all()):
        return kept
    kept = kept.contiguous()
    rows = kept.view(-1, k)  # the tied rows are rewritten through this view
    flat = score.reshape(-1, L)
    values, indices = top.values.reshape(-1, k + 1), top.indices.reshape(-1, k + 1)
    cut = low.values[..., 1].reshape(-1)
    for r in clear.reshape(-1).logical_not().nonzero()[:, 0].tolist():
        rows[r] = first_on_ties_in_row(flat[r], values[r], indices[r], cut[r], k)
    return kept


# First chunk of a row the tie scan compares with the cut; each later one is twice as long.
TIE_SCAN_CHUNK = 4096


def first_on_ties_in_row(score: torch.Tensor, values: torch.Tensor, indices: torch.Tensor, cut: torch.Tensor,
                         k: int) -> torch.Tensor:
    """One row's ``topk_first_on_ties`` given its k+1 largest (``values`` at ``indices``) and the k-th
    largest ``cut``: score [L] -> [k] positions, ascending. Every score above the cut is among the picks
    (fewer than k of them), so only the tied ones are looked for in the row, from position 0 and only
    until enough are found: in chunks, not in ``first_on_ties_at``'s L-wide passes."""
    L = score.shape[0]
    parts = [indices[values > cut]]  # every score above the cut
    need = k - parts[0].numel()  # the row holds at least this many scores equal to the cut
    start, size = 0, TIE_SCAN_CHUNK
    while need > 0 and start < L:
        stop = min(L, start + size)
        hits = (score[start:stop] == cut).nonzero()[:need, 0] + start  # ascending
        parts.append(hits)
        need -= hits.numel()
        start, size = stop, 2 * size
    if need > 0:  # only a NaN compares unequal to itself
        raise RuntimeError(f"index scores: the top-{k} cut is {cut.item()} (NaN in the scores)")
    return torch.cat(parts).sort().values


def first_on_ties_at(score: torch.Tensor, cut: torch.Tensor, k: int) -> torch.Tensor:
    """``topk_first_on_ties`` given the k-th largest ``cut`` [..., 1]: every score above it, then the
    tied ones from the lowest position up (L-wide passes, whatever the ties)."""
    above = score > cut
    tied = score == cut
    take = above | (tied & (tied.cumsum(dim=-1) <= k - above.sum(dim=-1, keepdim=True)))
    return take.nonzero()[:, -1].view(*score.shape[:-1], k)


def index_topk_ref(q, weights, index_k, kv_slots, req, vis, scale, topk, index_k_scale=None) -> torch.Tensor:
    """As ``sparse_mla.index_topk``: [T, min(topk, L)] slots, best first, -1 padding after them.
    ``index_k_scale`` [P, S, Di / block]: index_k is e4m3, each block of a key times its float32 scale."""
    k = min(topk, kv_slots.shape[1])
    out = torch.full((q.shape[0], k), -1, dtype=torch.int64, device=q.device)
    for t, (b, n) in enumerate(zip(req.tolist(), vis.tolist())):
        slots = kv_slots[b, :n]  # [n] the tokens query t sees
        keys = _rows(index_k, slots).float()  # [n, Di]
        if index_k_scale is not None:
            ks = _rows(index_k_scale, slots)  # [n, Di / block]
            keys = (keys.unflatten(-1, (ks.shape[-1], -1)) * ks.unsqueeze(-1)).flatten(-2)
        s = torch.relu(q[t].float() @ keys.T * scale)  # [Hi, n]
        score = weights[t].float() @ s  # [n]
        best = topk_first_on_ties(score, min(k, n))
        out[t, :best.numel()] = slots[best]
    return out


def sparse_mla_ref(q, latent_pool, kv_lora_rank, picks, scale, latent_scale=1.0) -> torch.Tensor:
    """As ``sparse_mla.sparse_mla``: [T, H, C], softmax over each query's picked rows only."""
    out = []
    for t in range(q.shape[0]):
        rows = _rows(latent_pool, picks[t][picks[t] >= 0]).float() * latent_scale  # [n, C+R]
        p = torch.softmax(q[t].float() @ rows.T * scale, dim=-1)  # [H, n]
        out.append(p @ rows[:, :kv_lora_rank])
    return torch.stack(out).to(q.dtype) if out else q.new_empty(q.shape[0], q.shape[1], kv_lora_rank)
