"""The small-M CPU GEMM (pdserve_kernels.gemm_cpu: x @ W^T (+ bias) on a weight packed into 32-column
panels, in C) against its twin F.linear: rows 1 to 64 (tiles of one row to eight, and their remainders),
the decode shapes of the tiny models plus odd N and K, with and without bias; any number of helper threads
gives the same bits as one; concurrent callers; bad inputs refused by name; the fallback where no library
can be built."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from fixtures.kernel_inputs import without_compiler
from pdserve_kernels import gemm_cpu as G

TOL = dict(rtol=1e-5, atol=1e-5)
SHAPES = [(256, 512), (256, 256), (256, 1376), (688, 256), (256, 2048), (512, 1024), (512, 2752), (1376, 512),
          (37, 100), (1, 1), (5, 33)]  # (K, N)
ROWS = [1, 5, 6, 7, 32, 64]


@pytest.fixture(scope="module")
def built():
    if G.load() is None:
        pytest.skip(f"no C compiler ({G.compiler()}) to build the kernel with")


def _case(seed: int, M: int, K: int, N: int):
    g = torch.Generator().manual_seed(seed)
    # values of a trained layer's scale, so 1e-5 relative is about float rounding, not cancellation
    return torch.randn(M, K, generator=g), torch.randn(N, K, generator=g) / K ** 0.5, torch.randn(N, generator=g)


def test_the_panel_width_agrees_with_the_library(built):
    assert G.load().pdserve_gemm_panel() == G.PANEL


def test_pack_lays_out_panels_with_zero_padding(built):
    w = torch.arange(40 * 3, dtype=torch.float32).view(40, 3)  # N=40: two panels, the second 8 wide
    p = G.pack(w)
    assert p.shape == (2, 3, G.PANEL)
    torch.testing.assert_close(p[0], w[:32].t())
    torch.testing.assert_close(p[1, :, :8], w[32:].t())
    assert p[1, :, 8:].abs().sum() == 0


@pytest.mark.parametrize("K,N", SHAPES)
@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_f_linear(built, M, K, N, with_bias):
    x, w, b = _case(M * 7 + K * 3 + N, M, K, N)
    b = b if with_bias else None
    out = G.linear(x, G.pack(w), N, b, threads=1)
    assert out.shape == (M, N)
    torch.testing.assert_close(out, F.linear(x, w, b), **TOL)
    torch.testing.assert_close(out, G.reference(x, w, b), **TOL)


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("K,N", [(256, 1376), (512, 2752), (37, 100), (1376, 512)])
@pytest.mark.parametrize("M", [7, 32, 64])
def test_helper_threads_give_the_same_bits(built, threads, M, K, N, monkeypatch):
    monkeypatch.setattr(G, "PARALLEL_MIN_WORK", 0)  # share even the small calls
    x, w, b = _case(M + K + N, M, K, N)
    wp = G.pack(w)
    one = G.linear(x, wp, N, b, threads=1)
    for _ in range(3):  # the helpers' second and third jobs too (a late helper must not claim them)
        assert torch.equal(G.linear(x, wp, N, b, threads=threads), one)


def test_set_threads_is_the_default_and_refuses_below_one(built, monkeypatch):
    monkeypatch.setattr(G, "_threads", 1)
    monkeypatch.setattr(G, "PARALLEL_MIN_WORK", 0)
    x, w, b = _case(1, 32, 256, 512)
    wp = G.pack(w)
    one = G.linear(x, wp, 512, b)
    G.set_threads(2)
    assert G.threads() == 2
    assert torch.equal(G.linear(x, wp, 512, b), one)
    with pytest.raises(ValueError, match="threads"):
        G.set_threads(0)
    with pytest.raises(ValueError, match="threads"):
        G.linear(x, wp, 512, b, threads=0)


def test_concurrent_callers(built, monkeypatch):
    """Callers on several threads at once: one holds the helpers, the others run alone; all are right."""
    monkeypatch.setattr(G, "PARALLEL_MIN_WORK", 0)
    cases = [_case(s, 32, 256, 1376) for s in range(4)]
    packed = [G.pack(w) for _, w, _ in cases]
    want = [G.linear(x, wp, 1376, b, threads=1) for (x, _, b), wp in zip(cases, packed)]
    errors: list[str] = []

    def call(i: int) -> None:
        x, _, b = cases[i]
        for _ in range(30):
            if not torch.equal(G.linear(x, packed[i], 1376, b, threads=2), want[i]):
                errors.append(f"caller {i}: different bits")
                return

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_no_rows_gives_an_empty_result(built):
    x, w, _ = _case(0, 0, 16, 40)
    assert G.linear(x, G.pack(w), 40).shape == (0, 40)


_X, _W = torch.randn(4, 8), torch.randn(40, 8)
_P = G.pack(_W)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(x=_X.double()), TypeError, "x: expected torch.float32"),
    (dict(x=_X[:, :4]), ValueError, "x: "),
    (dict(x=_X.t().contiguous().t()), ValueError, "x: must be contiguous"),
    (dict(x=_X[0]), ValueError, "x: expected 2 dimensions"),
    (dict(x=[[1.0]]), TypeError, "x: expected a torch.Tensor"),
    (dict(packed=_P[:, :4]), ValueError, "packed: "),
    (dict(packed=_P.half()), TypeError, "packed: expected torch.float32"),
    (dict(packed=_W), ValueError, "packed: expected 3 dimensions"),
    (dict(n=65), ValueError, "n: "),
    (dict(n=32), ValueError, "n: "),
    (dict(bias=torch.randn(39)), ValueError, "bias: expected 40"),
    (dict(bias=torch.randn(40, dtype=torch.float64)), TypeError, "bias: expected torch.float32"),
])
def test_bad_inputs_are_refused_naming_the_argument(built, kwargs, error, match):
    args = dict(x=_X, packed=_P, n=40, bias=None) | kwargs
    with pytest.raises(error, match=match):
        G.linear(args["x"], args["packed"], args["n"], args["bias"])


def test_pack_refuses_a_bad_weight():
    with pytest.raises(TypeError, match="weight: expected torch.float32"):
        G.pack(_W.bfloat16())
    with pytest.raises(ValueError, match="weight: expected 2 dimensions"):
        G.pack(_W[0])


@pytest.mark.parametrize("cc", ["/nonexistent/cc", "false"])
def test_no_compiler_falls_back(monkeypatch, tmp_path, caplog, cc):
    """No compiler (or a failing one): load() is None, said once; linear raises KernelUnavailable."""
    with without_compiler(G, monkeypatch, tmp_path, caplog, cc):
        with pytest.raises(G.KernelUnavailable):
            G.linear(_X, _P, 40)


def test_a_header_edit_changes_the_cache_key(tmp_path):
    """cpu_threads.h joins the key: editing the header rebuilds the library that includes it."""
    header = tmp_path / "cpu_threads.h"
    header.write_text(G.LIBRARY.headers[0].read_text())
    lib = G.CLibrary(G.SOURCE, lambda lib: None, "x", headers=(header,))
    before = lib.library_path("cc")
    header.write_text(header.read_text() + "\n/* edited */\n")
    assert lib.library_path("cc") != before
