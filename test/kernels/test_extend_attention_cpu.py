"""The CPU extend attention kernel (pdserve_kernels.extend_attention_cpu: a ragged batch's new queries,
causal over each request's prefix and new keys, read by slot from the paged pool) against SDPA and its
twin: batches of 1 to 6 requests of mixed new (1..300) and prefix (0..500) lengths on scattered pages,
page sizes 1 and 16, query heads per KV head 1, 2 and 4, head dims 32, 64 and 128; the same bits for
any thread count and under concurrent callers; bad inputs refused by name; the fallback where no
library can be built; the backend's choice of it."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from fixtures.kernel_inputs import paged_slots, without_compiler
from pdserve_kernels import extend_attention_cpu as K

TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def built():
    if K.load() is None:
        pytest.skip(f"no C compiler ({K.compiler()}) to build the kernel with")


def _case(seed: int, prefix: list[int], ext: list[int], S: int, Hq: int, Hkv: int, D: int):
    """q [T, Hq, D], k/v pools [P, Hkv, S, D] of random values, slots on random pages ([B, L]), lengths."""
    g = torch.Generator().manual_seed(seed)
    seq = [p + e for p, e in zip(prefix, ext)]
    P = sum(-(-n // S) for n in seq) + 3
    k = torch.randn(P, Hkv, S, D, generator=g)
    v = torch.randn(P, Hkv, S, D, generator=g)
    q = torch.randn(sum(ext), Hq, D, generator=g)
    return q, k, v, paged_slots(seq, S, P, seed=seed), torch.tensor(prefix), torch.tensor(ext)


def _sdpa(q, k, v, slots, prefix, ext, scale):
    """Each request alone through SDPA over its own gathered rows: is_causal without a prefix, else
    the explicit mask (query i sees keys j <= prefix + i), independent of ``K.reference``."""
    S, outs, start = k.shape[2], [], 0
    for b, (p, e) in enumerate(zip(prefix.tolist(), ext.tolist())):
        s = slots[b, :p + e]
        kb, vb = k[s // S, :, s % S].transpose(0, 1), v[s // S, :, s % S].transpose(0, 1)  # [Hkv, n, D]
        qb = q[start:start + e].transpose(0, 1)  # [Hq, e, D]
        if p == 0:
            o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale, enable_gqa=True)
        else:
            mask = torch.ones(e, p + e, dtype=torch.bool).tril(p)
            o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale, enable_gqa=True)
        outs.append(o.transpose(0, 1))  # [e, Hq, D]
        start += e
    return torch.cat(outs)


BATCHES = [([0], [1]), ([0], [300]), ([500], [1]), ([17], [16]),  # one request: a token, long, prefix, a tile
           ([0, 0], [65, 64]), ([63, 1, 0], [2, 129, 7]),
           ([0, 500, 31, 2, 0, 128], [300, 1, 90, 17, 5, 64])]  # six of mixed prefix and new lengths


@pytest.mark.parametrize("S", [1, 16])
@pytest.mark.parametrize("G", [1, 2, 4])
@pytest.mark.parametrize("D", [32, 64, 128])
def test_matches_sdpa_and_twin(built, S, G, D):
    Hkv = 2
    for i, (prefix, ext) in enumerate(BATCHES):
        q, k, v, slots, pre, ex = _case(S * 1000 + G * 100 + D + i, prefix, ext, S, G * Hkv, Hkv, D)
        scale = D ** -0.5
        out = K.extend_attention(q, k, v, slots, pre, ex, scale)
        torch.testing.assert_close(out, _sdpa(q, k, v, slots, pre, ex, scale), **TOL)
        torch.testing.assert_close(out, K.reference(q, k, v, slots, pre, ex, scale), **TOL)


@pytest.mark.parametrize("D", [8, 40, 80, 200])
def test_head_dims_off_the_vector_width(built, D):
    """Head dims that are not a multiple of the 16-float vector (a scalar tail) or wider than a 64-column
    pass of the values: SDPA's answer."""
    prefix, ext = [0, 70], [37, 20]
    q, k, v, slots, pre, ex = _case(D, prefix, ext, 16, 6, 3, D)
    out = K.extend_attention(q, k, v, slots, pre, ex, D ** -0.5)
    torch.testing.assert_close(out, _sdpa(q, k, v, slots, pre, ex, D ** -0.5), **TOL)


@pytest.mark.parametrize("G", [3, 5, 8])
def test_query_heads_per_kv_head_off_the_vector_width(built, G):
    """G x 16 query rows per tile lie across vectors of 16 lanes: 48 (two vectors and one), 80 and 128 rows,
    and partial tiles whose rows end inside a vector (lanes past them padding): SDPA's answer."""
    prefix, ext = [0, 33, 0], [41, 70, 5]
    q, k, v, slots, pre, ex = _case(G, prefix, ext, 1, 2 * G, 2, 32)
    out = K.extend_attention(q, k, v, slots, pre, ex, 0.2)
    torch.testing.assert_close(out, _sdpa(q, k, v, slots, pre, ex, 0.2), **TOL)


def test_each_request_is_its_own_and_padding_slots_are_never_read(built):
    """A request's output is what it gets alone (the same bits), and slots past a request's length
    (garbage, out of range) are never read."""
    prefix, ext = [3, 0, 200], [40, 77, 9]
    q, k, v, slots, pre, ex = _case(3, prefix, ext, 16, 8, 4, 32)
    out = K.extend_attention(q, k, v, slots, pre, ex, 0.2)
    slots[0, 43:] = 10**9
    slots[1, 77:] = -1
    assert torch.equal(K.extend_attention(q, k, v, slots, pre, ex, 0.2), out)
    start = 0
    for b, (p, e) in enumerate(zip(prefix, ext)):
        alone = K.extend_attention(q[start:start + e], k, v, slots[b:b + 1, :p + e], pre[b:b + 1], ex[b:b + 1], 0.2)
        assert torch.equal(out[start:start + e], alone), b
        start += e


def test_large_scores_stay_finite(built):
    """Scores in the hundreds, growing along the keys (the running max moves by large steps), give the
    float64 answer: within what float32 scores of that size allow (a score of 1000 rounds by ~6e-5,
    SDPA's float32 output is off by ~2e-4 here)."""
    q, k, v, slots, pre, ex = _case(6, [150, 0], [100, 200], 4, 4, 2, 32)
    k *= torch.linspace(0.5, 8.0, k.shape[0])[:, None, None, None]
    out = K.extend_attention(q * 10, k, v, slots, pre, ex, 1.0)
    assert torch.isfinite(out).all()
    want = _sdpa((q * 10).double(), k.double(), v.double(), slots, pre, ex, 1.0).float()
    torch.testing.assert_close(out, want, atol=2e-4, rtol=1e-3)


@pytest.mark.parametrize("threads", [2, 3])
def test_helper_threads_give_the_same_bits(built, threads):
    """threads > 1 shares the (request, KV head, query tile) units with the helper threads, each unit
    whole by one thread: the same bits as one thread, call after call."""
    prefix, ext = [0, 500, 31, 2, 0, 128], [300, 1, 90, 17, 5, 64]
    q, k, v, slots, pre, ex = _case(9, prefix, ext, 16, 8, 2, 64)
    assert sum(e * (p + (e + 1) // 2) for p, e in zip(prefix, ext)) * 8 >= K.PARALLEL_MIN_SCORES  # shared
    one = K.extend_attention(q, k, v, slots, pre, ex, 0.125)
    for i in range(20):
        qi = q * (1 + i / 20)
        got = K.extend_attention(qi, k, v, slots, pre, ex, 0.125, threads=threads)
        assert torch.equal(got, K.extend_attention(qi, k, v, slots, pre, ex, 0.125)), i
    assert torch.equal(K.extend_attention(q, k, v, slots, pre, ex, 0.125, threads=threads), one)


def test_helper_threads_under_concurrent_callers(built):
    """Callers on several Python threads at once (ctypes drops the GIL): one call shares with the
    helpers at a time, the others run alone; every answer is its own call's."""
    cases = [_case(20 + i, [i * 40, 0], [150, 120], 1, 8, 4, 32) for i in range(4)]
    want = [K.extend_attention(*c, 0.2) for c in cases]
    bad = []

    def run(i):
        for _ in range(15):
            if not torch.equal(K.extend_attention(*cases[i], 0.2, threads=2), want[i]):
                bad.append(i)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert bad == []


def _args():
    q, k, v, slots, pre, ex = _case(8, [4, 0], [5, 9], 4, 4, 2, 32)
    return dict(q=q, k_cache=k, v_cache=v, kv_slots=slots, prefix_lens=pre, ext_lens=ex)


@pytest.mark.parametrize("name,bad,error,match", [
    ("q", lambda a: a["q"].double(), TypeError, "q: expected torch.float32"),
    ("q", lambda a: a["q"].transpose(0, 1), ValueError, "q: must be contiguous"),
    ("q", lambda a: a["q"][:, :3].contiguous(), ValueError, "q: 3 heads do not split evenly over k_cache's 2"),
    ("q", lambda a: a["q"][:-1].contiguous(), ValueError, "ext_lens: they sum to 14, but q has 13 rows"),
    ("q", lambda a: a["q"].to("meta"), ValueError, "q: the CPU extend attention kernel needs a CPU tensor"),
    ("k_cache", lambda a: a["k_cache"][..., :16], ValueError, "k_cache: rows of 16 values, but q's head dim is 32"),
    ("k_cache", lambda a: a["k_cache"].transpose(2, 3), ValueError, "k_cache: its rows must be contiguous"),
    ("v_cache", lambda a: a["v_cache"][:, :1], ValueError, r"v_cache: pages, heads and page size"),
    ("v_cache", lambda a: a["v_cache"].bfloat16(), TypeError, "v_cache: expected torch.float32"),
    ("kv_slots", lambda a: a["kv_slots"].int(), TypeError, "kv_slots: expected torch.int64"),
    ("kv_slots", lambda a: a["kv_slots"][:1], ValueError, r"prefix_lens: expected shape \(1,\)"),
    ("kv_slots", lambda a: a["kv_slots"] + 10**6, ValueError, "kv_slots: a slot a request reads lies outside"),
    ("kv_slots", lambda a: a["kv_slots"] - 10**6, ValueError, "kv_slots: a slot a request reads lies outside"),
    ("prefix_lens", lambda a: a["prefix_lens"] + 1, ValueError, r"prefix_lens: each must lie in \[0, 9 - ext_lens\]"),
    ("prefix_lens", lambda a: a["prefix_lens"] - 5, ValueError, r"prefix_lens: each must lie in \[0, 9 - ext_lens\]"),
    ("prefix_lens", lambda a: a["prefix_lens"][:1], ValueError, r"prefix_lens: expected shape \(2,\)"),
    ("ext_lens", lambda a: a["ext_lens"] * 0, ValueError, "ext_lens: every request needs at least one new token"),
    ("ext_lens", lambda a: a["ext_lens"].int(), TypeError, "ext_lens: expected torch.int64"),
])
def test_bad_inputs_are_refused_naming_the_argument(built, name, bad, error, match):
    args = _args()
    args[name] = bad(args)
    with pytest.raises(error, match=match):
        K.extend_attention(**args, scale=0.3)


def test_bad_scale_and_threads_are_refused(built):
    with pytest.raises(ValueError, match="scale: must be finite"):
        K.extend_attention(**_args(), scale=float("inf"))
    with pytest.raises(ValueError, match="threads: must be >= 1"):
        K.extend_attention(**_args(), scale=0.3, threads=0)


def test_an_empty_batch_returns_no_rows(built):
    a = _args()
    out = K.extend_attention(a["q"][:0], a["k_cache"], a["v_cache"], a["kv_slots"][:0], a["prefix_lens"][:0],
                             a["ext_lens"][:0], 0.3)
    assert out.shape == (0, 4, 32)


@pytest.mark.parametrize("cc", ["/nonexistent/cc", "false"], ids=["missing", "failing"])
def test_no_compiler_falls_back_to_sdpa(monkeypatch, tmp_path, caplog, cc):
    from pdserve.layers.attention.torch_native import TorchNativeBackend
    from pdserve.mem.kv_pool import GQAKVPool

    with without_compiler(K, monkeypatch, tmp_path, caplog, cc):
        backend = TorchNativeBackend()
        assert backend._extend_kernel_for(GQAKVPool(4, 2, 1, 2, 8, torch.float32)) is False
        assert backend.describe()["extend_attention"] == "sdpa"
        with pytest.raises(K.KernelUnavailable, match="could not be built"):
            K.extend_attention(**_args(), scale=0.3)


def test_the_backend_takes_the_kernel_only_for_float32_gqa_pools(built):
    """A float32 GQA pool on CPU takes the kernel; bf16, fp8 and MLA pools keep SDPA; the choice is
    made once and shown in describe()."""
    from pdserve.layers.attention.torch_native import TorchNativeBackend
    from pdserve.mem.kv_pool import FP8_DTYPE, GQAKVPool, MLAKVPool

    backend = TorchNativeBackend()
    assert backend.describe()["extend_attention"] == "not chosen yet"
    assert backend._extend_kernel_for(GQAKVPool(4, 2, 1, 2, 8, torch.float32)) is True
    assert backend.describe()["extend_attention"] == "cpu_kernel"
    for pool in (GQAKVPool(4, 2, 1, 2, 8, torch.bfloat16),
                 GQAKVPool(4, 2, 1, 2, 8, FP8_DTYPE, compute_dtype=torch.float32),
                 MLAKVPool(4, 2, 1, 8, 4, torch.float32)):
        other = TorchNativeBackend()
        assert other._extend_kernel_for(pool) is False
        assert other.describe()["extend_attention"] == "sdpa"
