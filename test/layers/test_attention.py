"""The paged torch_native backend vs the contiguous references, over prefix + extend + decode
steps with random page placement; MLA absorbed vs expanded vs the paper's formulation; the
staged decode KV when the decode batch changes under it."""

from __future__ import annotations

import pytest
import torch

from fixtures.paged_batches import PagedRequests
from pdserve.layers.attention.reference import gqa_reference, mla_reference
from pdserve.mem.kv_pool import GQAKVPool, MLAKVPool

LENGTHS = (31, 8, 17)
# Each step: (request, new tokens); the last four are decode steps. The fixture gives requests
# identities, so decodes use the backend's staged KV: built, appended to twice, rebuilt for a
# smaller batch.
STEPS = [[(0, 11), (2, 16)], [(0, 16), (1, 5), (2, 1)], [(0, 1), (1, 1)], [(0, 1), (1, 1)], [(0, 1), (1, 1)],
         [(0, 1)]]


def _walk(pool, run_step, check):
    """Feed STEPS through ``run_step(fb, [(request, start, n)])`` and ``check`` every output."""
    paged = PagedRequests(pool, seed=pool.page_size)
    done = [0] * len(LENGTHS)
    for step in STEPS:
        decode = all(n == 1 for _, n in step) and all(done[r] for r, _ in step)
        fb = paged.batch([(r, [0] * n) for r, n in step], decode=decode)
        spans = [(r, done[r], n) for r, n in step]
        out = run_step(fb, spans)
        for (r, start, n), o in zip(spans, out.split([n for _, n in step])):
            check(r, start, n, o)
            done[r] += n
    assert done == list(LENGTHS)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("Hq,Hkv", [(4, 2), (4, 4), (6, 1)])
def test_torch_native_gqa_matches_reference(page_size, Hq, Hkv):
    D, scale, layer = 16, 0.3, 1
    g = torch.Generator().manual_seed(0)
    q = [torch.randn(n, Hq, D, generator=g) for n in LENGTHS]
    k = [torch.randn(n, Hkv, D, generator=g) for n in LENGTHS]
    v = [torch.randn(n, Hkv, D, generator=g) for n in LENGTHS]
    pool = GQAKVPool(64, page_size, 2, Hkv, D, torch.float32)

    def run_step(fb, spans):
        cat = lambda xs: torch.cat([xs[r][s:s + n] for r, s, n in spans])  # noqa: E731
        return fb.attn_backend.forward_gqa(cat(q), cat(k), cat(v), layer, scale, fb)

    def check(r, start, n, out):
        want = gqa_reference(q[r][start:start + n], k[r][:start + n], v[r][:start + n], scale)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)

    _walk(pool, run_step, check)


@pytest.mark.parametrize("Hq,Hkv", [(4, 2), (6, 1)])
def test_torch_native_bf16_matches_reference(Hq, Hkv):
    """bfloat16 on CPU: decode steps take the grouped matmuls, extends SDPA; both against the
    float32 reference of the same (bf16-rounded) inputs, within bf16 rounding."""
    D, scale, layer = 16, 0.3, 0
    g = torch.Generator().manual_seed(1)
    q, k, v = ([torch.randn(n, H, D, generator=g).bfloat16() for n in LENGTHS] for H in (Hq, Hkv, Hkv))
    pool = GQAKVPool(64, 4, 1, Hkv, D, torch.bfloat16)

    def run_step(fb, spans):
        cat = lambda xs: torch.cat([xs[r][s:s + n] for r, s, n in spans])  # noqa: E731
        return fb.attn_backend.forward_gqa(cat(q), cat(k), cat(v), layer, scale, fb)

    def check(r, start, n, out):
        assert out.dtype == torch.bfloat16
        want = gqa_reference(q[r][start:start + n].float(), k[r][:start + n].float(), v[r][:start + n].float(), scale)
        torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)

    _walk(pool, run_step, check)


def test_grouped_decode_is_chosen_for_low_precision_decode_on_cpu():
    from pdserve.layers.attention.torch_native import _grouped_decode_pays

    decode, extend = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 5, 8)
    assert _grouped_decode_pays(decode.bfloat16()) and _grouped_decode_pays(decode.half())
    assert not _grouped_decode_pays(decode)  # float32 keeps SDPA and its exact numerics
    assert not _grouped_decode_pays(extend.bfloat16())


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("absorbed", [None, True, False])
def test_torch_native_mla_matches_reference(page_size, absorbed):
    H, Dn, R, Dv, C, scale, layer = 4, 16, 8, 12, 32, 0.2, 0
    g = torch.Generator().manual_seed(1)
    q_nope = [torch.randn(n, H, Dn, generator=g) for n in LENGTHS]
    q_pe = [torch.randn(n, H, R, generator=g) for n in LENGTHS]
    latent = [torch.randn(n, C, generator=g) for n in LENGTHS]
    k_pe = [torch.randn(n, R, generator=g) for n in LENGTHS]
    w_kc, w_vc = torch.randn(H, Dn, C, generator=g) * 0.2, torch.randn(H, C, Dv, generator=g) * 0.2
    pool = MLAKVPool(64, page_size, 2, C, R, torch.float32)

    def run_step(fb, spans):
        cat = lambda xs: torch.cat([xs[r][s:s + n] for r, s, n in spans])  # noqa: E731
        return fb.attn_backend.forward_mla(cat(q_nope), cat(q_pe), cat(latent), cat(k_pe), w_kc, w_vc,
                                           layer, scale, fb, absorbed=absorbed)

    def check(r, start, n, out):
        want = mla_reference(q_nope[r][start:start + n], q_pe[r][start:start + n], latent[r][:start + n],
                             k_pe[r][:start + n], w_kc, w_vc, scale)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)

    _walk(pool, run_step, check)


def test_layers_refuse_a_batch_the_backend_has_not_prepared():
    pool = GQAKVPool(8, 1, 1, 2, 4, torch.float32)
    fb = PagedRequests(pool).batch([(0, [1, 2, 3])])
    fb.attn_metadata = None
    x = torch.zeros(3, 2, 4)
    with pytest.raises(RuntimeError, match=r"prepare\(fb\)"):
        fb.attn_backend.forward_gqa(x, x, x, 0, 1.0, fb)


def test_staged_decode_rebuilds_when_the_batch_changes_but_lengths_line_up():
    """A and B (10 tokens) decode together; A finishes and a new request reusing A's key (as a
    client may reuse a rid) takes A's place with 14 tokens. The next decode batch has the old
    one's lengths plus one, in the same order under the same keys: only the requests' identities
    can tell the stage to rebuild."""
    Hq, Hkv, D, scale, layer = 4, 2, 16, 0.3, 0
    g = torch.Generator().manual_seed(7)
    seqs = {name: [torch.randn(n, H, D, generator=g) for H in (Hq, Hkv, Hkv)] for name, n in
            (("a", 14), ("b", 16), ("c", 16))}
    pool = GQAKVPool(64, 4, 1, Hkv, D, torch.float32)
    paged = PagedRequests(pool, seed=3)
    done = {"a": 0, "b": 0, "c": 0}

    def step(entries, decode):  # entries: (fixture key, sequence, new tokens)
        fb = paged.batch([(key, [0] * n) for key, _, n in entries], decode=decode)
        cat = lambda i: torch.cat([seqs[s][i][done[s]:done[s] + n] for _, s, n in entries])  # noqa: E731
        out = fb.attn_backend.forward_gqa(cat(0), cat(1), cat(2), layer, scale, fb)
        for (_, s, n), o in zip(entries, out.split([n for _, _, n in entries])):
            q, k, v = (x[:done[s] + n] for x in seqs[s])
            torch.testing.assert_close(o, gqa_reference(q[done[s]:], k, v, scale), atol=1e-5, rtol=1e-5)
            done[s] += n

    step([(0, "a", 10), (1, "b", 10)], decode=False)
    for _ in range(4):
        step([(0, "a", 1), (1, "b", 1)], decode=True)
    paged.finish(0)
    step([(0, "c", 14)], decode=False)
    for _ in range(2):
        step([(0, "c", 1), (1, "b", 1)], decode=True)
    assert done == {"a": 14, "b": 16, "c": 16}


def test_indexer_selection_shortcuts_pick_what_the_masked_scores_pick():
    """DeepSeek-V3.2's selection (torch_native): ``visible=None`` (a decode step whose queries see
    every key) picks as an all-True mask does, and a query that sees at most ``topk`` tokens keeps
    every visible one, as scoring them with k = L would."""
    from pdserve.layers.attention.torch_native import select_top_tokens

    g = torch.Generator().manual_seed(0)
    B, Q, Hi, Di, L = 2, 3, 2, 8, 40
    q, w, keys = torch.randn(B, Q, Hi, Di, generator=g), torch.randn(B, Q, Hi, generator=g), torch.randn(B, L, Di,
                                                                                                         generator=g)
    every = torch.ones(B, Q, L, dtype=torch.bool)
    for topk in (5, L - 1):
        chosen, valid = select_top_tokens(q, w, keys, None, 0.5, topk)
        want, want_valid = select_top_tokens(q, w, keys, every, 0.5, topk)
        assert chosen.shape == (B, Q, topk) and torch.equal(chosen, want) and valid.all() and want_valid.all()
    causal = torch.arange(L)[None, None, :] < torch.tensor([3, 20, L])[None, :, None].expand(B, Q, 1)  # [B, Q, L]
    for topk in (L, L + 7):
        chosen, valid = select_top_tokens(q, w, keys, causal, 0.5, topk)
        assert chosen.tolist() == [[list(range(L))] * Q] * B and torch.equal(valid, causal)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_without_prefixes_takes_is_causal_with_the_masks_bits(dtype):
    """An extend where no request has a prefix runs SDPA with is_causal (skipping the blocks above
    the diagonal); the mask it replaces gives the very same bits on every real row. With a prefix
    the mask is kept."""
    import dataclasses

    Hq, Hkv, D, scale, layer = 8, 4, 32, 32 ** -0.5, 0
    g = torch.Generator().manual_seed(5)
    pool = GQAKVPool(64, 16, 1, Hkv, D, dtype)
    paged = PagedRequests(pool, seed=1)
    lens = [70, 9, 33]
    fb = paged.batch([(r, [0] * n) for r, n in enumerate(lens)])
    md = fb.attn_metadata
    assert md.causal
    q, k, v = (torch.randn(sum(lens), H, D, generator=g).to(dtype) for H in (Hq, Hkv, Hkv))
    fast = fb.attn_backend.forward_gqa(q, k, v, layer, scale, fb)
    fb.attn_metadata = dataclasses.replace(md, causal=False)
    masked = fb.attn_backend.forward_gqa(q, k, v, layer, scale, fb)
    assert torch.equal(fast, masked)
    assert not paged.batch([(0, [0] * 5), (3, [0] * 4)]).attn_metadata.causal  # request 0 has a prefix now
