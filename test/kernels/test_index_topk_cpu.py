"""The CPU indexer kernel (pdserve_kernels.index_topk_cpu: DeepSeek-V3.2's score + top-k in C, keys
read by slot from the paged pool) against its twin, the torch_native backend's ``select_top_tokens``
over the gathered keys: the same picks in the same order over random batches (1-4 requests, contexts
below and several times topk, scattered pages, queries seeing fewer tokens than topk, extends whose
queries see growing prefixes), exact ties at the cut, bad inputs, and the fallback where no library
can be built."""

from __future__ import annotations

import ctypes
import threading

import pytest
import torch

from fixtures.kernel_inputs import paged_slots, without_compiler
from pdserve.layers.attention.torch_native import TorchNativeBackend, select_top_tokens, select_top_tokens_paged
from pdserve_kernels import index_topk_cpu as K

Hi, Di, TOPK = 4, 32, 16


@pytest.fixture(scope="module")
def built():
    if K.load() is None:
        pytest.skip(f"no C compiler ({K.compiler()}) to build the kernel with")


def _case(seed: int, B: int, L: int, Q: int, S: int, ints: bool = False, hi: int = Hi, di: int = Di):
    """A batch of B requests of at most L tokens each (request 0 exactly L), Q queries per request, the
    pool's pages shuffled. ints: small integers everywhere, so every score is exact in any summation
    order and ties are common (the twin's GEMM and the kernel then score bit for bit alike)."""
    g = torch.Generator().manual_seed(seed)
    lens = [L] + torch.randint(1, L + 1, (B - 1,), generator=g).tolist()
    P = sum(-(-n // S) for n in lens) + 3
    slots = paged_slots(lens, S, P, seed=seed)  # [B, L]
    if ints:
        pool = torch.randint(-2, 3, (P, S, di), generator=g).float()
        q = torch.randint(-2, 3, (B, Q, hi, di), generator=g).float()
        w = torch.randint(-3, 4, (B, Q, hi), generator=g).float()
    else:
        pool, q, w = torch.randn(P, S, di, generator=g), torch.randn(B, Q, hi, di, generator=g), torch.randn(
            B, Q, hi, generator=g)
    # queries of an extend: the last Q tokens of each request, seeing a growing prefix (some see < TOPK)
    n = torch.tensor(lens)[:, None]
    seen = (n - Q + 1 + torch.arange(Q)[None]).clamp(min=1)  # [B, Q]
    return pool, slots, q, w, seen


def _twin(pool, slots, q, w, seen, scale, topk):
    keys = pool.view(-1, pool.shape[-1])[slots]  # [B, L, Di] gathered copy
    visible = torch.arange(slots.shape[1]) < seen[..., None]  # [B, Q, L]
    return select_top_tokens(q, w, keys, visible, scale, topk)


def _kernel(pool, slots, q, w, seen, scale, topk):
    B, Q = seen.shape
    return K.index_topk(q.reshape(B * Q, *q.shape[2:]).contiguous(), w.reshape(B * Q, -1).contiguous(), pool,
                        slots, torch.arange(B).repeat_interleave(Q), seen.reshape(-1), scale, topk).view(B, Q, -1)


CASES = [(seed, B, L, Q, S) for seed, (B, L, Q, S) in enumerate(
    [(1, 5, 1, 1), (1, TOPK + 1, 1, 4), (2, 3 * TOPK, 1, 4), (4, 7 * TOPK + 3, 1, 16), (3, 10 * TOPK, 5, 1),
     (4, 4 * TOPK, 2 * TOPK, 16), (1, 20 * TOPK, 3, 64), (2, TOPK, 3, 2)])]


@pytest.mark.parametrize("ints", [False, True], ids=["random", "exact_ties"])
@pytest.mark.parametrize("seed,B,L,Q,S", CASES)
def test_picks_match_twin(built, seed, B, L, Q, S, ints):
    pool, slots, q, w, seen = _case(seed, B, L, Q, S, ints)
    scale = 0.5 if ints else 0.3
    want, want_valid = _twin(pool, slots, q, w, seen, scale, TOPK)
    got, got_valid = select_top_tokens_paged(q, w, pool, slots, seen, scale, TOPK)
    assert torch.equal(got, want) and torch.equal(got_valid, want_valid)
    if L > TOPK:  # the kernel itself ran (not the twin's fallback): its own call gives the same positions
        assert torch.equal(_kernel(pool, slots, q, w, seen, scale, TOPK), want)


@pytest.mark.parametrize("hi,di", [(3, 24), (5, 13), (8, 64), (2, 128)])
def test_picks_match_twin_at_other_widths(built, hi, di):
    """Heads not a multiple of four and head dims off the unrolled widths take the general loops."""
    for ints in (False, True):
        pool, slots, q, w, seen = _case(hi * di, 3, 5 * TOPK, 2, 8, ints, hi, di)
        want, _ = _twin(pool, slots, q, w, seen, 0.5, TOPK)
        assert torch.equal(_kernel(pool, slots, q, w, seen, 0.5, TOPK), want)


def test_ties_at_the_cut_go_to_the_lowest_positions(built):
    """All-negative head weights: every score is <= 0 and most are exact zeros, so the cut falls inside
    a run of equal scores, which the twin fills from position 0 up; so does the kernel."""
    pool, slots, q, w, seen = _case(7, 2, 12 * TOPK, 1, 4)
    w = -w.abs()
    got = _kernel(pool, slots, q, w, seen, 0.3, TOPK)
    want, _ = _twin(pool, slots, q, w, seen, 0.3, TOPK)
    assert torch.equal(got, want)
    # Every key equal: all scores tie, the first TOPK positions win.
    flat = torch.ones_like(pool)
    assert _kernel(flat, slots, q, w.abs(), seen, 0.3, TOPK).tolist() == [[list(range(TOPK))]] * 2


def test_rows_shorter_than_topk_keep_all_and_pad_after_them(built):
    pool, slots, q, w, _ = _case(3, 2, 4 * TOPK, 3, 4)
    seen = torch.tensor([[1, TOPK - 1, TOPK], [3, TOPK + 1, 4 * TOPK]])
    got, valid = select_top_tokens_paged(q, w, pool, slots, seen, 0.3, TOPK)
    want, want_valid = _twin(pool, slots, q, w, seen, 0.3, TOPK)
    assert torch.equal(got, want) and torch.equal(valid, want_valid)
    assert got[0, 0].tolist() == list(range(TOPK)) and valid[0, 0].sum() == 1


def test_a_non_finite_score_runs_the_twin(built):
    pool, slots, q, w, seen = _case(5, 2, 6 * TOPK, 1, 4)
    pool.view(-1, Di)[slots[1, 7]] = float("inf")
    with pytest.raises(K.KernelUnavailable):
        _kernel(pool, slots, q, w, seen, 0.3, TOPK)
    got = select_top_tokens_paged(q, w, pool, slots, seen, 0.3, TOPK)
    want = _twin(pool, slots, q, w, seen, 0.3, TOPK)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_a_nan_in_one_head_is_not_lost_to_the_relu(built):
    """Five heads: the fifth takes the one-head loop. A NaN there must reach the score (torch's ReLU
    keeps it) so the twin's rule for NaN runs: here, refusing the cut."""
    pool, slots, q, w, seen = _case(6, 1, 6 * TOPK, 1, 4, hi=5)
    q[0, 0, 4, 0] = float("nan")
    with pytest.raises(K.KernelUnavailable):
        _kernel(pool, slots, q, w, seen, 0.3, TOPK)
    for select in (lambda: _twin(pool, slots, q, w, seen, 0.3, TOPK),
                   lambda: select_top_tokens_paged(q, w, pool, slots, seen, 0.3, TOPK)):
        with pytest.raises(RuntimeError, match="NaN in the scores"):
            select()


def _flat(seed: int = 1):
    pool, slots, q, w, seen = _case(seed, 2, 3 * TOPK, 1, 4)
    return dict(q=q[:, 0].contiguous(), weights=w[:, 0].contiguous(), index_k=pool, kv_slots=slots,
                req=torch.arange(2), vis=seen[:, 0].contiguous())


@pytest.mark.parametrize("name,bad,error,match", [
    ("q", lambda a: a["q"].double(), TypeError, "q: expected torch.float32"),
    ("weights", lambda a: a["weights"][:, :2].contiguous(), ValueError, "weights: expected shape"),
    ("index_k", lambda a: a["index_k"].transpose(0, 1), ValueError, "index_k: must be contiguous"),
    ("index_k", lambda a: a["index_k"][..., :8].contiguous(), ValueError, "index_k: rows of 8"),
    ("kv_slots", lambda a: a["kv_slots"].int(), TypeError, "kv_slots: expected torch.int64"),
    ("kv_slots", lambda a: a["kv_slots"] + 10**6, ValueError, "kv_slots: a visible slot lies outside"),
    ("kv_slots", lambda a: a["kv_slots"] - 10**6, ValueError, "kv_slots: a visible slot lies outside"),
    ("req", lambda a: a["req"] + 2, ValueError, r"req: rows must lie in \[0, 2\)"),
    ("req", lambda a: a["req"][:1], ValueError, "req: 1 entries for 2 query rows"),
    ("vis", lambda a: a["vis"] + 10**3, ValueError, "vis: counts must lie in"),
    ("vis", lambda a: a["vis"] - 10**3, ValueError, "vis: counts must lie in"),
    ("q", lambda a: a["q"].to("meta"), ValueError, "q: the CPU indexer kernel needs a CPU tensor"),
    ("weights", lambda a: a["weights"][None], ValueError, "weights: expected 2 dimensions"),
])
def test_bad_inputs_are_refused_naming_the_argument(built, name, bad, error, match):
    args = _flat()
    args[name] = bad(args)
    with pytest.raises(error, match=match):
        K.index_topk(**args, scale=0.3, topk=TOPK)


def test_a_scale_the_relu_cannot_take_is_refused(built):
    with pytest.raises(ValueError, match="scale: must be > 0"):
        K.index_topk(**_flat(), scale=-0.3, topk=TOPK)
    with pytest.raises(ValueError, match="topk: must be >= 0"):
        K.index_topk(**_flat(), scale=0.3, topk=-1)


def _pool(dtype=torch.float32):
    class Pool:  # what _index_kernel_for reads of an MLA pool
        index_k = torch.zeros(1, 2, 4, Di, dtype=dtype)
    return Pool()


@pytest.mark.parametrize("cc", ["/nonexistent/cc", "false"], ids=["missing", "failing"])
def test_no_compiler_falls_back_to_the_torch_path(monkeypatch, tmp_path, caplog, cc):
    with without_compiler(K, monkeypatch, tmp_path, caplog, cc):
        backend = TorchNativeBackend()
        assert backend._index_kernel_for(_pool()) is False
        assert backend.describe() == {"attention_backend": "torch_native", "index_topk": "torch",
                                      "decode_attention": "not chosen yet", "extend_attention": "not chosen yet",
                                      "decode_stack": "layers"}
        with pytest.raises(K.KernelUnavailable, match="could not be built"):
            K.index_topk(**_flat(), scale=0.3, topk=TOPK)


def test_the_backend_takes_the_kernel_only_for_float32_cpu_pools(built):
    backend = TorchNativeBackend()
    assert backend.describe()["index_topk"] == "not chosen yet"
    assert backend._index_kernel_for(_pool()) is True
    assert backend.describe()["index_topk"] == "cpu_kernel"
    assert TorchNativeBackend()._index_kernel_for(_pool(torch.bfloat16)) is False


def test_concurrent_builds_each_load_a_whole_library(monkeypatch, tmp_path):
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path))
    results: list = []

    def one():
        try:
            results.append(K.build(K.compiler()))
        except Exception as e:  # noqa: BLE001 - reported below
            results.append(e)

    threads = [threading.Thread(target=one) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if any(isinstance(r, FileNotFoundError) for r in results):
        pytest.skip("no C compiler")
    assert len(set(results)) == 1 and all(not isinstance(r, Exception) for r in results), results
    assert ctypes.CDLL(str(results[0])).pdserve_index_topk_f32 is not None
    assert [p.name for p in tmp_path.iterdir()] == [results[0].name]  # temporaries renamed or removed
