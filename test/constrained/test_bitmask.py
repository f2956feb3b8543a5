"""constrained/bitmask.py: the fast apply (xgrammar's kernel) and its torch twin agree with a
per-token loop, on every row or a few, with a padded vocabulary; bits set and cleared by id."""

from __future__ import annotations

import pytest
import torch

from pdserve.constrained import bitmask as bm


def _loop(logits: torch.Tensor, mask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    out = logits.clone()
    for r in rows:
        for t in range(logits.shape[1]):
            w, bit = divmod(t, 32)
            if w >= mask.shape[1] or not (int(mask[r, w]) >> bit) & 1:
                out[r, t] = float("-inf")
    return out


@pytest.mark.parametrize("vocab", [64, 70, 2048])
@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [1, 3], [2]])
def test_apply_matches_a_per_token_loop(vocab, rows):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(4, vocab, generator=g)
    mask = torch.randint(-2**31, 2**31 - 1, (4, bm.words(vocab)), dtype=torch.int32, generator=g)
    want = _loop(logits, mask, rows)
    for apply in (bm.apply_bitmask_, bm.apply_bitmask_torch):
        got = logits.clone()
        apply(got, mask, rows)
        assert torch.equal(got, want), apply.__name__


def test_a_mask_narrower_than_the_logits_disallows_the_rest():
    logits = torch.zeros(1, 40)
    bm.apply_bitmask_torch(logits, torch.full((1, 1), -1, dtype=torch.int32), [0])
    assert torch.isinf(logits[0, 32:]).all() and (logits[0, :32] == 0).all()


def test_allow_clear_and_read_back_by_token_id():
    mask = torch.zeros(2, bm.words(100), dtype=torch.int32)
    for t in (0, 31, 32, 63, 99):
        bm.allow(mask, 1, t)
    assert bm.allowed_tokens(mask, 1, 100) == [0, 31, 32, 63, 99] and bm.allowed_tokens(mask, 0, 100) == []
    full = bm.allocate(1, 100)
    assert bm.allowed_tokens(full, 0, 100) == list(range(100))
    bm.clear_from(full, 0, 45)
    assert bm.allowed_tokens(full, 0, 128) == list(range(45))
    bm.clear_from(full, 0, 32)
    assert bm.allowed_tokens(full, 0, 128) == list(range(32))
