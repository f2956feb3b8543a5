"""Token bitmasks (base.py's format): allocate, clear ids past a vocabulary, apply to logits.

Legend: B rows (requests or verify rows), V logits width (the model's vocabulary, padded),
W = ceil(V / 32) int32 words per row, R rows that carry a grammar.

``apply_bitmask_`` is the fast path (a table of additive biases per mask byte);
``apply_bitmask_torch`` its twin (bits unpacked into a boolean mask); tests check both against
a per-token loop.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# bit j of byte value b: the tokens one byte of a word covers (little-endian words: byte k of word
# w holds tokens 32w + 8k .. 32w + 8k + 7)
_BYTE_BITS = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool()  # [256, 8]
_BYTE_BIAS = torch.where(_BYTE_BITS, 0.0, float("-inf"))  # [256, 8] what adding a byte's tokens does to logits


def words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


def allocate(rows: int, vocab_size: int) -> torch.Tensor:
    """[rows, W] int32, every token allowed."""
    return torch.full((rows, words(vocab_size)), -1, dtype=torch.int32)


def clear_from(bitmask: torch.Tensor, row: int, first: int) -> None:
    """Disallow tokens ``first`` .. end of ``bitmask[row]`` (ids a backend's vocabulary lacks)."""
    w, bit = divmod(first, 32)
    if w >= bitmask.shape[1]:
        return
    if bit:
        bitmask[row, w] = int(bitmask[row, w]) & ((1 << bit) - 1)  # the low ``bit`` bits stay
        w += 1
    bitmask[row, w:] = 0


def allow(bitmask: torch.Tensor, row: int, token: int) -> None:
    """Allow ``token`` in ``bitmask[row]`` (no-op past the row's width)."""
    w, bit = divmod(token, 32)
    if w < bitmask.shape[1]:
        value = (int(bitmask[row, w]) & 0xFFFFFFFF) | (1 << bit)
        bitmask[row, w] = value - (1 << 32) if value >= 1 << 31 else value  # back to int32's range


def allowed_tokens(bitmask: torch.Tensor, row: int, vocab_size: int) -> list[int]:
    """The token ids ``bitmask[row]`` allows (tests and error messages)."""
    bits = _BYTE_BITS[bitmask[row].contiguous().view(torch.uint8).long()].view(-1)[:vocab_size]  # [V]
    return bits.nonzero().flatten().tolist()


@torch.inference_mode()  # logits come from an inference-mode forward: changed in place only inside one
def apply_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Set ``logits[r, t]`` [B, V] to -inf where row ``r`` of ``bitmask`` [B, W] disallows ``t``,
    for each ``r`` in ``rows``; other rows are untouched. Ids past 32 * W are disallowed."""
    if not rows:
        return
    V = logits.shape[1]
    idx = torch.tensor(list(rows), dtype=torch.int64)
    packed = bitmask[idx].contiguous().view(torch.uint8).long()  # [R, 4W]
    allowed = _BYTE_BITS[packed].view(len(idx), -1)  # [R, 32W]
    if allowed.shape[1] < V:
        allowed = torch.cat([allowed, allowed.new_zeros(len(idx), V - allowed.shape[1])], dim=1)
    logits[idx] = logits[idx].masked_fill(~allowed[:, :V], float("-inf"))


@torch.inference_mode()
def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """``apply_bitmask_torch``'s effect as one gather and one add: each byte of the mask picks 8
    additive biases (0 or -inf) from a 256-row table. Faster on CPU than unpacking bits into a
    boolean mask (and than xgrammar's CPU kernel, measured at [32, 2048])."""
    if not rows:
        return
    B, V = logits.shape
    every = len(rows) == B and list(rows) == list(range(B))
    idx = None if every else torch.tensor(list(rows), dtype=torch.int64)
    packed = (bitmask[:B] if every else bitmask[idx]).contiguous().view(torch.uint8).reshape(-1).long()  # [R * 4W]
    bias = _BYTE_BIAS.to(logits.dtype).index_select(0, packed).view(len(rows), -1)  # [R, 32W]
    if bias.shape[1] < V:
        bias = torch.cat([bias, bias.new_full((len(rows), V - bias.shape[1]), float("-inf"))], dim=1)
    if idx is None:
        logits.add_(bias[:, :V])
    else:
        logits[idx] += bias[:, :V]


def from_bools(allowed: torch.Tensor) -> torch.Tensor:
    """[R, V] bool -> [R, W] int32 bitmask rows (ids past V disallowed)."""
    rows, vocab = allowed.shape
    padded = torch.zeros(rows, words(vocab) * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.long()
    packed = (padded.view(rows, -1, 32) << torch.arange(32)).sum(-1)  # [R, W] in 0 .. 2^32 - 1
    return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)
