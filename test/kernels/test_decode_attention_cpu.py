"""The CPU decode attention kernel (pdserve_kernels.decode_attention_cpu: one query row per request, keys
and values read by slot from the paged pool, online softmax in C) against its twin (``reference``: the
gathered KV in torch) and SDPA: page sizes 1 and 16, query heads per KV head 1, 2 and 8, head dims 32, 64
and 128, lengths 1 to several hundred on scattered pages, one batch of very different lengths, MLA's
shapes (one latent head, values its first C columns), bad inputs refused by name, and the fallback where
no library can be built."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fixtures.kernel_inputs import paged_slots, without_compiler
from pdserve_kernels import decode_attention_cpu as K
from pdserve_kernels.cpu_build import CLibrary

TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def built():
    if K.load() is None:
        pytest.skip(f"no C compiler ({K.compiler()}) to build the kernel with")


def _case(seed: int, lens: list[int], S: int, Hq: int, Hkv: int, Dk: int, Dv: int | None = None):
    """q [B, Hq, Dk], k/v pools [P, Hkv, S, D] of random values, slots of random pages ([B, L]), seq_lens."""
    g = torch.Generator().manual_seed(seed)
    P = sum(-(-n // S) for n in lens) + 3
    k = torch.randn(P, Hkv, S, Dk, generator=g)
    v = torch.randn(P, Hkv, S, Dv or Dk, generator=g)
    q = torch.randn(len(lens), Hq, Dk, generator=g)
    return q, k, v, paged_slots(lens, S, P, seed=seed), torch.tensor(lens)


def _sdpa(q, k, v, slots, lens, scale):
    """Each request alone through SDPA over its own gathered rows (no mask at all)."""
    S, outs = k.shape[2], []
    for b, n in enumerate(lens.tolist()):
        s = slots[b, :n]
        kb, vb = k[s // S, :, s % S].transpose(0, 1), v[s // S, :, s % S].transpose(0, 1)  # [Hkv, n, D]
        o = F.scaled_dot_product_attention(q[b][:, None], kb, vb, scale=scale, enable_gqa=True)  # [Hq, 1, D]
        outs.append(o[:, 0])
    return torch.stack(outs)  # [B, Hq, D]


@pytest.mark.parametrize("S", [1, 16])
@pytest.mark.parametrize("G", [1, 2, 8])
@pytest.mark.parametrize("D", [32, 64, 128])
def test_matches_twin_and_sdpa(built, S, G, D):
    Hkv = 2
    lens = [1, 7, 64, 65, 130, 333]  # one key, a block, a block and one, several blocks
    q, k, v, slots, seq = _case(S * 100 + G * 10 + D, lens, S, G * Hkv, Hkv, D)
    scale = D ** -0.5
    out = K.decode_attention(q, k, v, slots, seq, scale)
    torch.testing.assert_close(out, K.reference(q, k, v, slots, seq, scale), **TOL)
    torch.testing.assert_close(out, _sdpa(q, k, v, slots, seq, scale), **TOL)


def test_a_batch_of_very_different_lengths(built):
    """One long request beside one-token ones, unsorted: each output is its own request's alone."""
    lens = [3, 611, 1, 40, 257, 2]
    q, k, v, slots, seq = _case(5, lens, 16, 8, 4, 64)
    out = K.decode_attention(q, k, v, slots, seq, 0.125)
    torch.testing.assert_close(out, K.reference(q, k, v, slots, seq, 0.125), **TOL)
    for b in range(len(lens)):
        alone = K.decode_attention(q[b:b + 1], k, v, slots[b:b + 1, :lens[b]], seq[b:b + 1], 0.125)
        assert torch.equal(out[b:b + 1], alone)


def test_large_scores_stay_finite(built):
    """Scores in the hundreds (the running max moves by large steps between blocks) give the twin's answer."""
    q, k, v, slots, seq = _case(6, [300, 129], 4, 4, 2, 32)
    k[:, :, :, :] *= torch.linspace(0.5, 8.0, k.shape[2])[None, None, :, None]
    out = K.decode_attention(q * 10, k, v, slots, seq, 1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, K.reference(q * 10, k, v, slots, seq, 1.0), **TOL)


@pytest.mark.parametrize("S", [1, 16])
def test_mla_shapes(built, S):
    """DeepSeek's absorbed decode: the latent [P, S, C+R] as one KV head, values its first C columns."""
    H, C, R = 16, 64, 16
    lens = [5, 100, 31]
    g = torch.Generator().manual_seed(S)
    P = sum(-(-n // S) for n in lens) + 2
    latent = torch.randn(P, S, C + R, generator=g)
    q = torch.randn(len(lens), H, C + R, generator=g)
    slots, seq = paged_slots(lens, S, P, seed=S), torch.tensor(lens)
    kv = latent.unsqueeze(1)  # [P, 1, S, C+R]
    out = K.decode_attention(q, kv, kv, slots, seq, 0.1, v_width=C)
    assert out.shape == (3, H, C)
    torch.testing.assert_close(out, K.reference(q, kv, kv, slots, seq, 0.1, v_width=C), **TOL)
    rows = latent.view(-1, C + R)[slots]  # [B, L, C+R]
    mask = torch.arange(slots.shape[1]) < seq[:, None]
    s = torch.einsum("bhx,blx->bhl", q, rows) * 0.1
    want = torch.softmax(s.masked_fill(~mask[:, None], float("-inf")), -1) @ rows[..., :C]
    torch.testing.assert_close(out, want, **TOL)


@pytest.mark.parametrize("ahead", [0, 1, 1 << 30], ids=["no_cursor", "one_block", "whole_call"])
def test_the_l2_prefetch_cursor_changes_no_result(built, monkeypatch, ahead):
    """The cursor that pulls rows into L2 ahead of the compute (AHEAD_BYTES) runs across requests of
    every length, page sizes that are and are not powers of two, MLA's shared rows and helper threads'
    units: whatever its distance, the same bits as the default build."""
    variant = CLibrary(K.LIBRARY.source, K._declare, "decode attention", flags=(*K.LIBRARY.flags,
                       f"-DAHEAD_BYTES={ahead}"), headers=K.LIBRARY.headers)
    if variant.load() is None:
        pytest.skip("the variant could not be built")
    cases = [(_case(21, [1, 7, 64, 65, 130, 333, 2, 900], S, 8, 2, 32), threads) for S in (1, 3, 16)
             for threads in (1, 2)]
    q, latent, _, slots, seq = _case(22, [5, 70, 129, 1], 4, 16, 1, 72)
    cases.append(((q, latent, latent, slots, seq), 1))  # MLA: one latent head, the values its rows
    want = [K.decode_attention(*args, 0.2, threads=threads) for args, threads in cases]
    monkeypatch.setattr(K, "LIBRARY", variant)
    for (args, threads), w in zip(cases, want):
        assert torch.equal(K.decode_attention(*args, 0.2, threads=threads), w)


def test_padding_slots_past_seq_len_are_never_read(built):
    """Slots past a request's length may hold anything (garbage, out of range): they are not read."""
    q, k, v, slots, seq = _case(7, [9, 20], 4, 2, 1, 32)
    want = K.decode_attention(q, k, v, slots, seq, 0.3)
    slots[0, 9:] = 10**9
    assert torch.equal(K.decode_attention(q, k, v, slots, seq, 0.3), want)


def _args():
    q, k, v, slots, seq = _case(8, [5, 9], 4, 4, 2, 32)
    return dict(q=q, k_cache=k, v_cache=v, kv_slots=slots, seq_lens=seq)


@pytest.mark.parametrize("name,bad,error,match", [
    ("q", lambda a: a["q"].double(), TypeError, "q: expected torch.float32"),
    ("q", lambda a: a["q"].transpose(0, 1), ValueError, "q: must be contiguous"),
    ("q", lambda a: a["q"][:, :3].contiguous(), ValueError, "q: 3 heads do not split evenly over k_cache's 2"),
    ("q", lambda a: a["q"].to("meta"), ValueError, "q: the CPU decode attention kernel needs a CPU tensor"),
    ("k_cache", lambda a: a["k_cache"][..., :16], ValueError, "k_cache: rows of 16 values, but q's head dim is 32"),
    ("k_cache", lambda a: a["k_cache"].transpose(2, 3), ValueError, "k_cache: its rows must be contiguous"),
    ("k_cache", lambda a: a["k_cache"][0], ValueError, "k_cache: expected 4 dimensions"),
    ("v_cache", lambda a: a["v_cache"][:, :1], ValueError, r"v_cache: pages, heads and page size"),
    ("v_cache", lambda a: a["v_cache"].bfloat16(), TypeError, "v_cache: expected torch.float32"),
    ("kv_slots", lambda a: a["kv_slots"].int(), TypeError, "kv_slots: expected torch.int64"),
    ("kv_slots", lambda a: a["kv_slots"][:1], ValueError, "kv_slots: 1 rows for 2 requests"),
    ("kv_slots", lambda a: a["kv_slots"] + 10**6, ValueError, "kv_slots: a slot a request reads lies outside"),
    ("kv_slots", lambda a: a["kv_slots"] - 10**6, ValueError, "kv_slots: a slot a request reads lies outside"),
    ("seq_lens", lambda a: a["seq_lens"] + 1, ValueError, r"seq_lens: lengths must lie in \[1, 9\]"),
    ("seq_lens", lambda a: a["seq_lens"] * 0, ValueError, r"seq_lens: lengths must lie in \[1, 9\]"),
    ("seq_lens", lambda a: a["seq_lens"][:1], ValueError, r"seq_lens: expected shape \(2,\)"),
])
def test_bad_inputs_are_refused_naming_the_argument(built, name, bad, error, match):
    args = _args()
    args[name] = bad(args)
    with pytest.raises(error, match=match):
        K.decode_attention(**args, scale=0.3)


def test_bad_scale_and_value_width_are_refused(built):
    with pytest.raises(ValueError, match="scale: must be finite"):
        K.decode_attention(**_args(), scale=float("nan"))
    with pytest.raises(ValueError, match=r"v_width: must lie in \[1, 32\]"):
        K.decode_attention(**_args(), scale=0.3, v_width=33)


def test_an_empty_batch_returns_no_rows(built):
    a = _args()
    out = K.decode_attention(a["q"][:0], a["k_cache"], a["v_cache"], a["kv_slots"][:0], a["seq_lens"][:0], 0.3)
    assert out.shape == (0, 4, 32)


@pytest.mark.parametrize("cc", ["/nonexistent/cc", "false"], ids=["missing", "failing"])
def test_no_compiler_falls_back_to_the_torch_path(monkeypatch, tmp_path, caplog, cc):
    from pdserve.layers.attention.torch_native import TorchNativeBackend
    from pdserve.mem.kv_pool import GQAKVPool

    with without_compiler(K, monkeypatch, tmp_path, caplog, cc):
        backend = TorchNativeBackend()
        assert backend._decode_kernel_for(GQAKVPool(4, 2, 1, 2, 8, torch.float32)) is False
        assert backend.describe()["decode_attention"] == "torch"
        with pytest.raises(K.KernelUnavailable, match="could not be built"):
            K.decode_attention(**_args(), scale=0.3)


def test_the_backend_takes_the_kernel_only_for_float32_cpu_pools(built):
    """float32 GQA and MLA pools on CPU take the kernel; bf16, fp8 and DeepSeek-V3.2's (index keys) keep
    the torch path; the choice is made once and shown in describe()."""
    from pdserve.layers.attention.torch_native import TorchNativeBackend
    from pdserve.mem.kv_pool import FP8_DTYPE, GQAKVPool, MLAKVPool

    backend = TorchNativeBackend()
    assert backend.describe()["decode_attention"] == "not chosen yet"
    assert backend._decode_kernel_for(GQAKVPool(4, 2, 1, 2, 8, torch.float32)) is True
    assert backend.describe()["decode_attention"] == "cpu_kernel"
    assert TorchNativeBackend()._decode_kernel_for(MLAKVPool(4, 2, 1, 8, 4, torch.float32)) is True
    for pool in (GQAKVPool(4, 2, 1, 2, 8, torch.bfloat16),
                 GQAKVPool(4, 2, 1, 2, 8, FP8_DTYPE, compute_dtype=torch.float32),
                 MLAKVPool(4, 2, 1, 8, 4, torch.float32, index_head_dim=8)):
        other = TorchNativeBackend()
        assert other._decode_kernel_for(pool) is False
        assert other.describe()["decode_attention"] == "torch"


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("lens", [[1, 7, 64, 65, 130, 333] * 6, [611] + [2] * 40, [3000, 3000]],
                         ids=["mixed", "one_long", "two"])
def test_helper_threads_give_the_same_bits(built, threads, lens):
    """threads > 1 shares the batch's requests with the kernel's helper threads (each request whole,
    by one thread): the same bits as one thread, for batches of every shape, call after call (the
    helpers poll between calls, then sleep, and each call's late helpers must claim nothing of the next)."""
    q, k, v, slots, seq = _case(9, lens, 16, 8, 2, 64)
    assert len(lens) * slots.shape[1] * 2 >= K.PARALLEL_MIN_ROWS  # big enough to be shared
    one = K.decode_attention(q, k, v, slots, seq, 0.125)
    for i in range(40):
        qi = q * (1 + i / 40)
        got = K.decode_attention(qi, k, v, slots, seq, 0.125, threads=threads)
        assert torch.equal(got, K.decode_attention(qi, k, v, slots, seq, 0.125)), i
    assert torch.equal(K.decode_attention(q, k, v, slots, seq, 0.125, threads=threads), one)


def test_helper_threads_under_concurrent_callers(built):
    """Callers on several Python threads at once (ctypes drops the GIL): one call shares with the
    helpers at a time, the others run alone; every answer is its own call's."""
    import threading

    cases = [_case(20 + i, [200] * 48, 1, 8, 4, 32) for i in range(4)]
    want = [K.decode_attention(q, k, v, s, n, 0.2) for q, k, v, s, n in cases]
    bad = []

    def run(i):
        q, k, v, s, n = cases[i]
        for _ in range(25):
            if not torch.equal(K.decode_attention(q, k, v, s, n, 0.2, threads=2), want[i]):
                bad.append(i)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert bad == []


def test_helper_threads_in_a_forked_child(built):
    """A child forked after the parent started its helpers has none of them: its shared calls start
    its own and still answer (no wait on helpers that do not exist in it)."""
    import multiprocessing as mp

    q, k, v, slots, seq = _case(30, [300] * 40, 1, 8, 4, 32)
    want = K.decode_attention(q, k, v, slots, seq, 0.2, threads=2)  # the parent's helpers exist now
    ctx = mp.get_context("fork")
    with ctx.Pool(1) as pool:
        got = pool.apply(K.decode_attention, (q, k, v, slots, seq, 0.2), {"threads": 2})
    assert torch.equal(got, want)


def test_threads_below_one_is_refused(built):
    q, k, v, slots, seq = _case(31, [5], 1, 2, 1, 32)
    with pytest.raises(ValueError, match="threads: must be >= 1"):
        K.decode_attention(q, k, v, slots, seq, 0.2, threads=0)
