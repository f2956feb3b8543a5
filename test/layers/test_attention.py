"""The paged torch_native backend vs the contiguous references, over prefix + extend + decode
steps with random page placement; MLA absorbed vs expanded vs the paper's formulation; the
staged decode KV when the decode batch changes under it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from fixtures.paged_batches import PagedRequests
from pdserve.layers.attention.reference import gqa_reference, mla_reference
from pdserve.layers.attention.torch_native import TorchNativeBackend
from pdserve.mem.kv_pool import GQAKVPool, MLAKVPool

LENGTHS = (31, 8, 17)
# Each step: (request, new tokens); the last four are decode steps. The fixture gives requests
# identities, so decodes use the backend's staged KV: built, appended to twice, rebuilt for a
# smaller batch.
STEPS = [[(0, 11), (2, 16)], [(0, 16), (1, 5), (2, 1)], [(0, 1), (1, 1)], [(0, 1), (1, 1)], [(0, 1), (1, 1)],
         [(0, 1)]]


def _sdpa_backend():
    """A backend whose extends take SDPA (``_gqa_ragged`` or the padded batch), not the CPU extend kernel
    it would choose for a float32 GQA pool: for the tests of that path."""
    backend = TorchNativeBackend()
    backend.extend_attention_impl = "sdpa"
    return backend


def _walk(pool, run_step, check, backend=None):
    """Feed STEPS through ``run_step(fb, [(request, start, n)])`` and ``check`` every output."""
    paged = PagedRequests(pool, seed=pool.page_size, backend=backend)
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


@pytest.mark.parametrize("extend", ["cpu_kernel", "sdpa"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("Hq,Hkv", [(4, 2), (4, 4), (6, 1)])
def test_torch_native_gqa_matches_reference(page_size, Hq, Hkv, extend):
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

    backend = _sdpa_backend() if extend == "sdpa" else TorchNativeBackend()
    _walk(pool, run_step, check, backend)
    assert backend.extend_attention_impl == extend  # the kernel where it builds: float32 GQA on CPU


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
    paged = PagedRequests(pool, seed=3, backend=_backend("gqa"))  # the stage, not the CPU decode kernel
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
    paged = PagedRequests(pool, seed=1, backend=_sdpa_backend())  # SDPA's is_causal, not the CPU extend kernel
    lens = [70, 9, 33]
    fb = paged.batch([(r, [0] * n) for r, n in enumerate(lens)])
    assert fb.attn_metadata.spans  # these lengths run request by request; the padded batch is checked here
    md = fb.attn_metadata = dataclasses.replace(fb.attn_metadata, spans=())
    assert md.causal
    q, k, v = (torch.randn(sum(lens), H, D, generator=g).to(dtype) for H in (Hq, Hkv, Hkv))
    fast = fb.attn_backend.forward_gqa(q, k, v, layer, scale, fb)
    fb.attn_metadata = dataclasses.replace(md, causal=False)
    masked = fb.attn_backend.forward_gqa(q, k, v, layer, scale, fb)
    assert torch.equal(fast, masked)
    assert not paged.batch([(0, [0] * 5), (3, [0] * 4)]).attn_metadata.causal  # request 0 has a prefix now


def _mla_inputs(g, n, H, Dn, R, C):
    return (torch.randn(n, H, Dn, generator=g), torch.randn(n, H, R, generator=g), torch.randn(n, C, generator=g),
            torch.randn(n, R, generator=g))


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("kind", ["gqa", "mla_expanded", "mla_absorbed"])
def test_mixed_length_extend_matches_each_request_alone(page_size, kind):
    """One long extend among short ones (two of them on cached prefixes) runs request by request:
    each request's output is what it gets alone (the same bits where its keys are exactly its own
    tokens, page size 1), and matches the contiguous reference."""
    H, Hkv, D, Dn, R, Dv, C, layer = 4, 2, 16, 16, 8, 12, 32, 0
    scale = 0.25
    g = torch.Generator().manual_seed(11)
    prefix, ext = [0, 6, 0, 13], [90, 7, 5, 3]
    w_kc, w_vc = torch.randn(H, Dn, C, generator=g) * 0.2, torch.randn(H, C, Dv, generator=g) * 0.2
    if kind == "gqa":
        data = [tuple(torch.randn(p + e, h, D, generator=g) for h in (H, Hkv, Hkv)) for p, e in zip(prefix, ext)]
        new_pool = lambda: GQAKVPool(64 * 16 // page_size, page_size, 1, Hkv, D, torch.float32)  # noqa: E731
        want = [gqa_reference(q[p:], k, v, scale) for (q, k, v), p in zip(data, prefix)]
    else:
        data = [_mla_inputs(g, p + e, H, Dn, R, C) for p, e in zip(prefix, ext)]
        new_pool = lambda: MLAKVPool(64 * 16 // page_size, page_size, 1, C, R, torch.float32)  # noqa: E731
        want = [mla_reference(qn[p:], qp[p:], lat, kp, w_kc, w_vc, scale) for (qn, qp, lat, kp), p in zip(data, prefix)]

    def run(paged, reqs, spans_expected=None):  # reqs: (index, start, n); returns each request's output
        fb = paged.batch([(r, [0] * n) for r, _, n in reqs])
        if spans_expected is not None:
            assert bool(fb.attn_metadata.spans) == spans_expected
        cat = lambda i: torch.cat([data[r][i][s:s + n] for r, s, n in reqs])  # noqa: E731
        if kind == "gqa":
            out = fb.attn_backend.forward_gqa(cat(0), cat(1), cat(2), layer, scale, fb)
        else:
            out = fb.attn_backend.forward_mla(cat(0), cat(1), cat(2), cat(3), w_kc, w_vc, layer, scale, fb,
                                              absorbed=kind == "mla_absorbed")
        return out.split([n for _, _, n in reqs])

    # SDPA request by request (``_gqa_ragged``), not the CPU extend kernel (test_extend_attention_cpu)
    together = PagedRequests(new_pool(), seed=2, backend=_sdpa_backend())
    run(together, [(r, 0, p) for r, p in enumerate(prefix) if p])
    mixed = run(together, [(r, p, e) for r, (p, e) in enumerate(zip(prefix, ext))], spans_expected=True)
    for r, (p, e) in enumerate(zip(prefix, ext)):
        alone = PagedRequests(new_pool(), seed=3, backend=_sdpa_backend())
        if p:
            run(alone, [(r, 0, p)])
        (solo,) = run(alone, [(r, p, e)], spans_expected=False)
        if page_size == 1:
            assert torch.equal(mixed[r], solo), r
        else:
            torch.testing.assert_close(mixed[r], solo, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(mixed[r], want[r], atol=1e-5, rtol=1e-5)


def test_equal_or_mildly_padded_extends_stay_batched():
    from pdserve.layers.attention.torch_native import _ragged_spans

    t = lambda *x: torch.tensor(x)  # noqa: E731
    assert _ragged_spans(t(16, 16), t(0, 0), t(16, 16), 4) == ()  # equal: nothing padded
    assert _ragged_spans(t(12, 16), t(0, 0), t(12, 16), 4) == ()  # padding a fifth of the work
    assert _ragged_spans(t(40), t(0), t(40), 4) == ()  # one request
    spans = _ragged_spans(t(40, 3), t(0, 5), t(40, 8), 4)
    assert [(r.start, r.ext, r.prefix, r.seq, r.pages) for r in spans] == [(0, 40, 0, 40, 10), (40, 3, 5, 8, 2)]


@pytest.mark.parametrize("causal", [True, False])
def test_mla_value_padding_keeps_the_outputs_and_takes_the_flash_kernel(causal):
    """MLA's values (Dv) are narrower than its keys (Dn + R): ``_sdpa`` zero-pads them to the key width
    so SDPA runs its flash kernel instead of the math path; the outputs match SDPA on the narrow values."""
    from torch.profiler import ProfilerActivity, profile

    from pdserve.layers.attention.torch_native import _sdpa

    g = torch.Generator().manual_seed(4)
    Q, K = 20, 20 if causal else 29
    q, k, v = torch.randn(2, 4, Q, 24, generator=g), torch.randn(2, 4, K, 24, generator=g), torch.randn(
        2, 4, K, 12, generator=g)
    mask = None if causal else torch.rand(2, 1, Q, K, generator=g) < 0.7
    mask = mask if mask is None else mask | torch.eye(Q, K, dtype=torch.bool)  # every row sees a key
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        got = _sdpa(q, k, v, mask, 0.3)
    ops = {e.key for e in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ops, ops
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=0.3)  # the math path
    assert got.shape == want.shape == (2, 4, Q, 12)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


class _StagedPool:
    """Requests' KV by uid ([H, n, X] each) as a pool gathers it: rows past a request's length are
    the pool's padding (finite, not zero), what a padded page-table slot reads."""

    H, X = 2, 8

    def __init__(self, seed: int):
        self.g = torch.Generator().manual_seed(seed)
        self.kv: dict[str, torch.Tensor] = {}

    def batch(self, entries):  # entries: (uid, length); a new uid gets fresh KV
        for uid, n in entries:
            if uid not in self.kv or self.kv[uid].shape[1] < n:
                old = self.kv.get(uid, torch.empty(self.H, 0, self.X))
                more = torch.randn(self.H, 400 - old.shape[1], self.X, generator=self.g)
                self.kv[uid] = torch.cat([old, more], dim=1)
        uids = tuple(u for u, _ in entries)
        lens = torch.tensor([n for _, n in entries])
        return SimpleNamespace(req_uids=uids, seq_lens=lens, batch_size=len(entries))

    def gather(self, fb, calls):
        L = int(fb.seq_lens.max())

        def gather(rows):
            calls.append(rows.tolist())
            return (torch.stack([self.kv[fb.req_uids[r]][:, :L + 3] for r in rows.tolist()]),)
        return gather

    def new(self, fb):
        return (torch.stack([self.kv[u][:, n - 1] for u, n in zip(fb.req_uids, fb.seq_lens.tolist())]),)


# (uid, length) per decode step: appends, a leaver mid-batch, a joiner at the end and one at the front, a
# reorder, a length jump (a retracted request back with more tokens), a joiner longer than the capacity,
# and more joiners at once than the spare rows.
STAGE_STEPS = [
    [("a", 20), ("b", 9), ("c", 31)], [("a", 21), ("b", 10), ("c", 32)],
    [("a", 22), ("c", 33)], [("a", 23), ("c", 34), ("d", 12)], [("e", 5), ("a", 24), ("c", 35), ("d", 13)],
    [("c", 36), ("a", 25), ("d", 14)], [("c", 37), ("a", 30), ("d", 15)], [("c", 38), ("a", 31), ("f", 150)],
    [("c", 39), ("a", 32), ("f", 151)] + [(f"g{i}", 7 + i) for i in range(10)],
]


def test_decode_stage_across_joins_and_leaves_matches_a_fresh_stage():
    """Every step's staged keys equal a stage built afresh from the pool on the real positions, and
    masked attention over them gives the same bits (the padding differs: zeros against pool rows)."""
    from pdserve.layers.attention.torch_native import _DecodeStage

    pool, stage = _StagedPool(5), _DecodeStage()
    g = torch.Generator().manual_seed(6)
    for entries in STAGE_STEPS:
        fb = pool.batch(entries)
        (kept,) = stage.get(0, stage.plan(fb), pool.new(fb), pool.gather(fb, []))
        fresh = _DecodeStage()
        (rebuilt,) = fresh.get(0, fresh.plan(fb), pool.new(fb), pool.gather(fb, []))
        assert kept.shape == rebuilt.shape and bool(kept.isfinite().all())
        for b, n in enumerate(fb.seq_lens.tolist()):
            assert torch.equal(kept[b, :, :n], rebuilt[b, :, :n])
        q = torch.randn(fb.batch_size, pool.H, 1, pool.X, generator=g)
        mask = (torch.arange(kept.shape[2]) < fb.seq_lens[:, None])[:, None, None]  # [B, 1, 1, L]
        assert torch.equal(F.scaled_dot_product_attention(q, kept, kept, attn_mask=mask),
                           F.scaled_dot_product_attention(q, rebuilt, rebuilt, attn_mask=mask))


def test_decode_stage_reads_only_joiners_from_the_pool():
    """A join gathers the joiner's row alone and a leave gathers nothing, into the same buffers;
    only outgrowing the rows or the capacity reads everyone again."""
    from pdserve.layers.attention.torch_native import _DecodeStage

    pool, stage = _StagedPool(8), _DecodeStage()

    def step(entries):
        fb = pool.batch(entries)
        calls: list = []
        stage.get(0, stage.plan(fb), pool.new(fb), pool.gather(fb, calls))
        return calls, stage.bufs[("kv", 0)][0].data_ptr()

    calls, ptr = step(STAGE_STEPS[0])
    assert calls == [[0, 1, 2]]
    assert step(STAGE_STEPS[1]) == ([], ptr)  # one token later: append only
    assert step(STAGE_STEPS[2]) == ([], ptr)  # b left: c's row moves down, nothing read
    assert step(STAGE_STEPS[3]) == ([[2]], ptr)  # d joins at the end
    assert step(STAGE_STEPS[4]) == ([[0]], ptr)  # e joins at the front, the others move up
    assert step(STAGE_STEPS[5]) == ([], ptr)  # e left, c and a swapped: nothing read
    calls, grown = step([("c", 37), ("a", 26), ("f", 150)])
    assert calls == [[0, 1, 2]] and grown != ptr  # f is longer than the capacity: a rebuild


# (uid, length) per decode step, each with the stage's rows (request -> row), the requests read from the pool,
# and the row moves (source -> hole) it must plan: a leave in the middle whose row a joiner takes, more
# leavers than joiners (a stayer past the new size moves into a hole), more joiners than leavers, a reorder
# (nothing read or moved), and a leave then a rejoin of the same uid one token longer (read from the pool:
# its old row holds another request by then).
SWAP_STEPS = [
    ([("a", 20), ("b", 9), ("c", 31), ("d", 12), ("e", 5)], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4], []),
    ([("a", 21), ("b", 10), ("d", 13), ("e", 6), ("f", 40)], [0, 1, 3, 4, 2], [4], []),
    ([("d", 14), ("e", 7), ("f", 41), ("g", 8)], [3, 0, 2, 1], [3], [(4, 0)]),
    ([("e", 8), ("f", 42), ("g", 9), ("h", 3), ("i", 4)], [0, 2, 1, 3, 4], [3, 4], []),
    ([("i", 5), ("h", 4), ("g", 10), ("f", 43), ("e", 9)], [4, 3, 1, 2, 0], [], []),
    ([("i", 6), ("h", 5), ("g", 11), ("f", 44)], [0, 3, 1, 2], [], [(4, 0)]),
    ([("i", 7), ("h", 6), ("g", 12), ("f", 45), ("e", 10)], [0, 3, 1, 2, 4], [4], []),
    ([("i", 8), ("h", 7), ("g", 13), ("f", 46), ("e", 11)], [0, 3, 1, 2, 4], [], []),
]


def test_decode_stage_keeps_rows_and_attention_maps_the_order():
    """A staying request keeps its row, a joiner takes a leaver's, a shrink moves one row per hole; the
    rows' KV equals a fresh stage's, and attention over the rows with queries, mask and outputs permuted
    gives a fresh stage's bits in batch order."""
    from pdserve.layers.attention.torch_native import _DecodeStage

    pool, stage = _StagedPool(9), _DecodeStage()
    g = torch.Generator().manual_seed(10)
    for entries, rows, reads, moves in SWAP_STEPS:
        fb = pool.batch(entries)
        calls: list = []
        plan = stage.plan(fb)
        (staged,) = stage.get_rows(0, plan, pool.new(fb), pool.gather(fb, calls))
        assert plan.rows.tolist() == rows and calls == ([reads] if reads else [])
        got_moves = [] if plan.move_src is None else list(zip(plan.move_src.tolist(), plan.move_dst.tolist()))
        assert got_moves == moves
        order = plan.order if plan.order is not None else torch.arange(len(rows))
        assert plan.rows[order].tolist() == list(range(len(rows)))  # order is rows' inverse
        fresh = _DecodeStage()
        (rebuilt,) = fresh.get(0, fresh.plan(fb), pool.new(fb), pool.gather(fb, []))
        for b, n in enumerate(fb.seq_lens.tolist()):
            assert torch.equal(staged[rows[b], :, :n], rebuilt[b, :, :n])
        q = torch.randn(fb.batch_size, pool.H, 1, pool.X, generator=g)
        mask = (torch.arange(staged.shape[2]) < fb.seq_lens[:, None])[:, None, None]  # [B, 1, 1, L]
        by_rows = F.scaled_dot_product_attention(q[order], staged, staged, attn_mask=mask[order])[plan.rows]
        assert torch.equal(by_rows, F.scaled_dot_product_attention(q, rebuilt, rebuilt, attn_mask=mask))


# Decode steps over the backend (request key per step): the SWAP_STEPS changes; a joiner is prefilled first.
BACKEND_SWAPS = [list("abcde"), list("abcde"), list("abdef"), list("defg"), list("efghi"), list("ihgfe"),
                 list("ihgf"), list("ihgfe"), list("ihgfe")]
PROMPTS = dict(zip("abcdefghi", (20, 9, 31, 12, 5, 40, 8, 3, 17)))


def _backend(kind):
    from pdserve.layers.attention.torch_native import TorchNativeBackend

    backend = TorchNativeBackend()
    if kind == "mla_sparse":
        backend.index_topk_impl = "torch"  # the twin scores the staged index keys (the kernel reads the pool)
    if not kind.endswith("_cpu_kernel"):
        backend.decode_attention_impl = "torch"  # the stage (the CPU kernel reads float32 pools by slot)
    return backend


@pytest.mark.parametrize("kind", ["gqa", "gqa_bf16", "mla", "mla_sparse", "gqa_cpu_kernel", "mla_cpu_kernel"])
def test_staged_decode_through_swaps_matches_a_fresh_stage_and_the_reference(kind):
    """The backend's decode steps while requests leave, join, reorder and rejoin: each output has the bits
    of a fresh backend's (a stage built from the pool in batch order) and matches the reference (DeepSeek-V3.2's
    sparse attention: the pool-gathering path, with its index keys read from pages). ``*_cpu_kernel``: the
    CPU decode kernel instead of the stage, reading the pool by slot (a fresh backend gives the same bits)."""
    from dataclasses import replace

    from pdserve.layers.attention.base import SparseIndex

    H, Hkv, D, C, R, Hi, Di, topk, scale, layer = 4, 2, 16, 32, 8, 2, 8, 6, 0.3, 1
    dtype = torch.bfloat16 if kind == "gqa_bf16" else torch.float32
    g = torch.Generator().manual_seed(11)
    n_max = max(PROMPTS.values()) + len(BACKEND_SWAPS)
    if kind.startswith("mla"):
        pool = MLAKVPool(256, 4, 2, C, R, dtype, index_head_dim=Di if kind == "mla_sparse" else 0)
        w_kc, w_vc = torch.randn(H, D, C, generator=g) * 0.2, torch.randn(H, C, 12, generator=g) * 0.2
        shapes = ((H, D), (H, R), (C,), (R,)) + (((Hi, Di), (Hi,), (Di,)) if kind == "mla_sparse" else ())
        seqs = {s: [torch.randn(n_max, *shape, generator=g) for shape in shapes] for s in PROMPTS}
    else:
        pool = GQAKVPool(256, 4, 2, Hkv, D, dtype)
        seqs = {s: [torch.randn(n_max, h, D, generator=g).to(dtype) for h in (H, Hkv, Hkv)] for s in PROMPTS}
    paged = PagedRequests(pool, seed=4, backend=_backend(kind))
    done = dict.fromkeys(PROMPTS, 0)

    def forward(fb, keys, n):
        x = [torch.cat([seqs[s][i][done[s]:done[s] + n] for s in keys]) for i in range(len(seqs[keys[0]]))]
        if kind == "mla_sparse":
            index = SparseIndex(x[4], x[5], x[6], Di ** -0.5, topk)
            return fb.attn_backend.forward_mla_sparse(*x[:4], w_kc, w_vc, layer, scale, index, fb)
        if kind in ("mla", "mla_cpu_kernel"):
            return fb.attn_backend.forward_mla(*x, w_kc, w_vc, layer, scale, fb)
        return fb.attn_backend.forward_gqa(*x, layer, scale, fb)

    def reference(s, n):
        x = [t[:n] for t in seqs[s]]
        if kind in ("mla", "mla_cpu_kernel"):
            return mla_reference(x[0][-1:], x[1][-1:], x[2], x[3], w_kc, w_vc, scale)
        return gqa_reference(x[0][-1:].float(), x[1].float(), x[2].float(), scale)

    for keys in BACKEND_SWAPS:
        for s in keys:
            if not done[s]:
                forward(paged.batch([(s, [0] * PROMPTS[s])]), [s], PROMPTS[s])
                done[s] = PROMPTS[s]
        fb = paged.batch([(s, [0]) for s in keys], decode=True)
        out = forward(fb, keys, 1)
        fresh = _backend(kind)
        fb_fresh = replace(fb, attn_backend=fresh)
        fb_fresh.attn_metadata = fresh.prepare(fb_fresh)
        assert torch.equal(out, forward(fb_fresh, keys, 1))
        if kind == "mla_sparse":  # the reference: no stage (no request identities), every key from the pool
            fb_pool = replace(fb, attn_backend=_backend(kind), req_uids=None)
            fb_pool.attn_metadata = fb_pool.attn_backend.prepare(fb_pool)
            torch.testing.assert_close(out, forward(fb_pool, keys, 1), atol=1e-5, rtol=1e-5)
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        for s, o in zip(keys, out):
            done[s] += 1
            if kind != "mla_sparse":
                torch.testing.assert_close(o[None].float(), reference(s, done[s]).float(), atol=tol, rtol=tol)
    if kind.endswith("_cpu_kernel"):
        if fb.attn_backend.decode_attention_impl == "torch":
            pytest.skip("no C compiler: the kernel was not built")
        assert fb.attn_metadata.decode_kernel and fb.attn_metadata.stage is None  # no stage planned, none kept
        assert fb.attn_backend.stage.bufs == {} and fb.attn_backend.describe()["decode_attention"] == "cpu_kernel"
    else:
        assert fb.attn_metadata.stage.order is not None  # the rows ended permuted: the mapping ran
