"""DeepSeek-V3.2's kernels (indexer top-k over the paged index keys, sparse MLA over the picked
latent rows) vs their torch twins: ragged requests with prefixes, page sizes 1 and 16, queries
that see fewer tokens than index_topk (padding picks) and many more."""

from __future__ import annotations

import pytest
import torch

from fixtures.kernel_inputs import paged_slots
from pdserve_kernels import sparse_mla as sm
from pdserve_kernels import sparse_mla_ref as ref

PREFIX, EXTEND = [0, 30, 3], [5, 2, 4]  # request 0 a prefill, 1 a long-context extend, 2 a short one
TOPK = 6


def _batch(page_size: int, seed: int):
    seqs = [p + e for p, e in zip(PREFIX, EXTEND)]
    P = sum(-(-n // page_size) for n in seqs) + 3
    slots = paged_slots(seqs, page_size, P, seed=seed)
    req, vis = sm.token_rows(torch.tensor(PREFIX), torch.tensor(EXTEND), sum(EXTEND))
    return P, slots, req, vis


def test_token_rows_flatten_the_batch():
    req, vis = sm.token_rows(torch.tensor(PREFIX), torch.tensor(EXTEND), sum(EXTEND))
    assert req.tolist() == [0] * 5 + [1] * 2 + [2] * 4
    assert vis.tolist() == [1, 2, 3, 4, 5, 31, 32, 4, 5, 6, 7]


@pytest.mark.parametrize("page_size", [1, 16])
def test_index_topk_matches_twin(device, page_size):
    Hi, Di = 3, 24  # neither a power of two: masked lanes
    P, slots, req, vis = _batch(page_size, seed=page_size)
    g = torch.Generator().manual_seed(4)
    index_k = torch.randn(P, page_size, Di, generator=g)
    q, w = torch.randn(len(req), Hi, Di, generator=g), torch.randn(len(req), Hi, generator=g)
    want = ref.index_topk_ref(q, w, index_k, slots, req, vis, 0.3, TOPK)
    got = sm.index_topk(*(t.to(device) for t in (q, w, index_k, slots, req, vis)), 0.3, TOPK).cpu()
    assert got.shape == want.shape == (len(req), TOPK)
    # unordered picks: the same set per query, and as many padding picks as the query sees too few tokens
    assert got.sort(dim=1).values.tolist() == want.sort(dim=1).values.tolist()
    assert [int((r < 0).sum()) for r in got] == [max(0, TOPK - n) for n in vis.tolist()]


@pytest.mark.parametrize("Di", [32, 256])
def test_fp8_index_keys_score_and_pick_as_the_twin(device, Di):
    """e4m3 keys with a float32 scale per block (one block at 32, two at 256): the kernel's scores are the
    twin's over the dequantized keys, and its picks the twin's given the scales."""
    from pdserve.mem.kv_pool import dequantize_index_keys, quantize_index_keys

    P, slots, req, vis = _batch(4, seed=11)
    g = torch.Generator().manual_seed(6)
    keys, scale = quantize_index_keys(torch.randn(P, 4, Di, generator=g) * 5, min(128, Di))
    q, w = torch.randn(len(req), 2, Di, generator=g), torch.randn(len(req), 2, generator=g)
    dev = [t.to(device) for t in (q, w, keys, slots, req, vis)]
    got = sm.index_scores(*dev, 0.5, index_k_scale=scale.to(device)).cpu()
    want = sm.index_scores(*dev[:2], dequantize_index_keys(keys, scale, torch.float32).to(device), *dev[3:], 0.5).cpu()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    picks = sm.index_topk(*dev, 0.5, TOPK, index_k_scale=scale.to(device)).cpu()
    twin = ref.index_topk_ref(q, w, keys, slots, req, vis, 0.5, TOPK, scale)
    assert picks.sort(dim=1).values.tolist() == twin.sort(dim=1).values.tolist()
    unscaled = sm.index_scores(*dev, 0.5).cpu()  # the e4m3 values alone score something else
    assert not torch.allclose(unscaled.nan_to_num(neginf=0), got.nan_to_num(neginf=0))


def test_index_scores_are_the_relu_weighted_sum(device):
    """Each visible token's score, not only the ranking: sum_h w[h] relu(scale q[h] . k)."""
    P, slots, req, vis = _batch(4, seed=9)
    g = torch.Generator().manual_seed(5)
    index_k = torch.randn(P, 4, 8, generator=g)
    q, w = torch.randn(len(req), 2, 8, generator=g), torch.randn(len(req), 2, generator=g)
    got = sm.index_scores(*(t.to(device) for t in (q, w, index_k, slots, req, vis)), 0.5).cpu()
    for t, (b, n) in enumerate(zip(req.tolist(), vis.tolist())):
        keys = index_k.view(-1, 8)[slots[b, :n]]  # [n, Di]
        want = w[t] @ torch.relu(q[t] @ keys.T * 0.5)
        torch.testing.assert_close(got[t, :n], want, atol=1e-5, rtol=1e-5)
        assert torch.isneginf(got[t, n:]).all()


@pytest.mark.parametrize("page_size", [1, 16])
def test_sparse_mla_matches_twin(device, dtype_tol, page_size):
    dtype, atol = dtype_tol
    H, C, R = 5, 16, 8
    P, slots, req, vis = _batch(page_size, seed=page_size + 1)
    g = torch.Generator().manual_seed(6)
    latent = torch.randn(P, page_size, C + R, generator=g).to(dtype)
    picks = torch.full((len(req), TOPK), -1, dtype=torch.int64)
    for t, (b, n) in enumerate(zip(req.tolist(), vis.tolist())):  # random visible picks, padding interleaved
        chosen = slots[b, torch.randperm(n, generator=g)[:TOPK]]
        picks[t, torch.randperm(TOPK, generator=g)[:chosen.numel()]] = chosen
    q = torch.randn(len(req), H, C + R, generator=g).to(dtype)
    want = ref.sparse_mla_ref(q, latent, C, picks, 0.2)
    got = sm.sparse_mla(q.to(device), latent.to(device), C, picks.to(device), 0.2).cpu()
    assert got.dtype == want.dtype
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=atol)


def test_sparse_mla_reads_only_the_picks(device):
    """Rows that are not picked cannot move the output: poisoning them changes nothing."""
    H, C, R, S = 2, 16, 8, 4
    g = torch.Generator().manual_seed(7)
    latent = torch.randn(6, S, C + R, generator=g)
    picks = torch.tensor([[3, 9, -1, 17]])
    q = torch.randn(1, H, C + R, generator=g)
    before = sm.sparse_mla(q.to(device), latent.to(device), C, picks.to(device), 0.3).cpu()
    poisoned = latent.clone().view(-1, C + R)
    keep = poisoned[[3, 9, 17]].clone()
    poisoned.fill_(1e4)
    poisoned[[3, 9, 17]] = keep
    after = sm.sparse_mla(q.to(device), poisoned.view_as(latent).to(device), C, picks.to(device), 0.3).cpu()
    torch.testing.assert_close(after, before)


def test_attend_uses_triton_off_flashmla_shapes(device):
    """``attend`` (what the backend calls) is the Triton kernel wherever FlashMLA cannot serve the shapes."""
    H, C, R, S = 3, 16, 8, 4
    g = torch.Generator().manual_seed(8)
    latent = torch.randn(5, S, C + R, generator=g).to(device)
    picks = torch.tensor([[0, 7, -1], [4, 2, 11]]).to(device)
    q = torch.randn(2, H, C + R, generator=g).to(device)
    assert not sm.flashmla_usable(q, latent, C, 1.0)
    torch.testing.assert_close(sm.attend(q, latent, C, picks, 0.3), sm.sparse_mla(q, latent, C, picks, 0.3))


@pytest.mark.gpu
def test_flashmla_sparse_matches_twin():
    """FlashMLA's sparse kernel at DeepSeek's widths (C 512, R 64, bf16), heads and picks not
    multiples of its blocks (padded by the wrapper), padding picks included."""
    if not torch.cuda.is_available():
        pytest.skip("FlashMLA runs on CUDA")
    pytest.importorskip("flash_mla")
    H, C, R, S, k = 20, 512, 64, 64, 100
    g = torch.Generator().manual_seed(9)
    latent = (torch.randn(8, S, C + R, generator=g) * 0.5).to(torch.bfloat16)
    picks = torch.randint(0, 8 * S, (3, k), generator=g)
    picks[1, 40:] = -1  # a query that sees fewer than k tokens
    q = (torch.randn(3, H, C + R, generator=g) * 0.1).to(torch.bfloat16)
    want = ref.sparse_mla_ref(q, latent, C, picks, 576 ** -0.5)
    dev = [t.cuda() for t in (q, latent)]
    assert sm.flashmla_usable(dev[0], dev[1], C, 1.0)
    got = sm.attend(dev[0], dev[1], C, picks.cuda(), 576 ** -0.5).cpu()
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)


def test_ties_at_the_cut_are_taken_from_the_lowest_position():
    """A ReLU indexer scores many tokens exactly 0: which tied tokens are kept must not depend on
    the shape the scores were computed in (torch.topk's own choice among ties does)."""
    score = torch.tensor([[0.0, 0.0, 3.0, 0.0, 1.0, 0.0], [5.0, 4.0, 3.0, 2.0, 1.0, 0.0]])
    assert ref.topk_first_on_ties(score, 3).tolist() == [[0, 2, 4], [0, 1, 2]]
    assert ref.topk_first_on_ties(torch.tensor([[0.0, float("-inf"), float("-inf")]]), 3).tolist() == [[0, 1, 2]]
    wide = torch.zeros(3, 4096)
    wide[:, 4000] = 1.0
    assert ref.topk_first_on_ties(wide, 4).tolist() == [[0, 1, 2, 4000]] * 3
    x = torch.randn(4, 7, 100)
    assert torch.equal(ref.topk_first_on_ties(x, 10), x.topk(10, dim=-1).indices.sort(dim=-1).values)


@pytest.mark.parametrize("values", [3, 1000])  # few distinct scores (ties at the cut in most rows) or many
def test_topk_without_a_tie_at_the_cut_keeps_the_l_wide_rules_picks(values):
    """The CPU shortcut (topk's picks where nothing outside them ties the k-th largest) and the rule's
    L-wide passes agree, on rows with and without ties at the cut, -inf padding, one row or many."""
    g = torch.Generator().manual_seed(values)
    for L, k, shape in ((40, 7, (3, 5)), (300, 256, (2,)), (9, 9, (4,)), (64, 1, ()), (50, 49, (1, 1))):
        score = torch.randint(0, values, (*shape, L), generator=g).float()
        score[..., 5::11] = float("-inf")
        cut = score.topk(k, dim=-1).values.amin(dim=-1, keepdim=True)
        assert torch.equal(ref.topk_first_on_ties(score, k), ref.first_on_ties_at(score, cut, k))


def test_only_the_rows_tied_at_the_cut_take_the_rule(monkeypatch):
    """The shortcut is taken row by row: in a batch, only a row whose (k+1)-th largest equals its k-th
    looks for its tied scores; the other rows keep topk's picks."""
    calls = []
    rule = ref.first_on_ties_in_row
    monkeypatch.setattr(ref, "first_on_ties_in_row", lambda score, *a: calls.append(score.clone()) or rule(score, *a))
    distinct = torch.randperm(100, generator=torch.Generator().manual_seed(0)).float().view(2, 50)
    assert ref.topk_first_on_ties(distinct, 10).tolist() == distinct.topk(10).indices.sort().values.tolist()
    assert calls == []
    tied = distinct.clone()
    tied[1, tied[1].argsort()[-11]] = tied[1].sort().values[-10]  # row 1's 11th largest now equals its 10th
    got = ref.topk_first_on_ties(tied, 10)
    assert got[1].tolist() == sorted(tied[1].argsort(descending=True, stable=True)[:10].tolist())
    assert got[0].tolist() == distinct[0].topk(10).indices.sort().values.tolist()
    assert len(calls) == 1 and torch.equal(calls[0], tied[1])


@pytest.mark.parametrize("chunk", [1, 3, 4096])
def test_the_tie_scan_over_chunks_keeps_the_l_wide_rules_picks(monkeypatch, chunk):
    """A tied row's scan for its first tied scores, whatever the chunks it takes to find them (ties
    spread to the far end of a long row, few distinct scores, -inf), picks what the L-wide rule does."""
    monkeypatch.setattr(ref, "TIE_SCAN_CHUNK", chunk)
    wide = torch.full((2, 40000), -1.0)
    wide[:, ::97] = 0.0  # 413 zeros, 97 apart: row 0 at k 413 needs 410 of them, 4 chunks of 4096 doubling
    wide[0, [5, 700, 39999]] = 2.0
    wide[1, -1] = float("-inf")
    for k in (293, 413, 414):
        cut = wide.topk(k, dim=-1).values.amin(dim=-1, keepdim=True)
        assert torch.equal(ref.topk_first_on_ties(wide, k), ref.first_on_ties_at(wide, cut, k))
    g = torch.Generator().manual_seed(chunk)
    for L, k, shape in ((40, 7, (3, 5)), (300, 256, (2,)), (64, 1, ()), (1000, 100, (1, 4))):
        score = torch.randint(0, 3, (*shape, L), generator=g).float()
        score[..., 5::11] = float("-inf")
        cut = score.topk(k, dim=-1).values.amin(dim=-1, keepdim=True)
        assert torch.equal(ref.topk_first_on_ties(score, k), ref.first_on_ties_at(score, cut, k))


def test_a_nan_at_the_cut_is_an_error_not_a_hang():
    """NaN scores (an overflowed index score times a zero weight) leave a tied row's scan short of
    ties: it stops at the row's end and says why."""
    with pytest.raises(RuntimeError, match="NaN"):
        ref.topk_first_on_ties(torch.tensor([[float("nan"), float("nan"), 0.0, 1.0]]), 1)
