"""The fused element-wise CPU kernels (pdserve_kernels.fused_cpu: residual add + RMSNorm, rotary,
SiLU x mul in plain C) against their torch twins in the layers: T = 1, 7, 32, 2048 rows of widths
64..2752, strided views as the layers pass them (column slices of a fused projection, heads of a
qkv), bad inputs named, the layers' gate (float32 CPU only, eager only, below MAX_ELEMENTS / SILU_MAX_ELEMENTS), and
the fallback where no library can be built."""

from __future__ import annotations

import pytest
import torch

from fixtures.kernel_inputs import without_compiler
from pdserve.layers import activation
from pdserve.layers.activation import silu_and_mul_torch
from pdserve.layers.norm import RMSNorm, rms_norm_torch
from pdserve.layers.rotary import get_rope, rotate_halves
from pdserve_kernels import fused_cpu as K

ROWS = [1, 7, 32, 2048]
WIDTHS = [64, 100, 256, 512, 1376, 2752]
RTOL = 1e-6


@pytest.fixture(scope="module")
def built():
    if K.load() is None:
        pytest.skip(f"no C compiler ({K.compiler()}) to build the kernels with")


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float = RTOL, atol: float = 1e-7) -> None:
    """Element-wise within rtol of the twin (atol for values near zero), and the same shape."""
    assert got.shape == want.shape
    err = (got - want).abs() - rtol * want.abs()
    assert err.max().item() <= atol, f"max excess {err.max().item():.3g}"


def _x(*shape: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("T", ROWS)
@pytest.mark.parametrize("X", WIDTHS)
def test_add_rmsnorm_matches_twin(built, T, X):
    x, res, w = _x(T, X, seed=1), _x(T, X, seed=2, scale=3.0), _x(X, seed=3)
    out, total = K.rms_norm(x, w, 1e-6, res)
    want_out, want_total = rms_norm_torch(x, w, 1e-6, res)
    assert torch.equal(total, want_total)  # one float add per element: exact
    _close(out, want_out, rtol=2e-6)  # another summation order of the squares
    _close(K.rms_norm(x, w, 1e-5), rms_norm_torch(x, w, 1e-5), rtol=2e-6)


def test_no_rows_give_empty_outputs(built):
    w = torch.ones(64)
    out, total = K.rms_norm(torch.empty(0, 64), w, 1e-6, torch.empty(0, 64))
    assert out.shape == total.shape == (0, 64)
    assert K.silu_and_mul(torch.empty(0, 128)).shape == (0, 64)
    assert K.rotate(torch.empty(0, 2, 64), torch.empty(0, 1, 32), torch.empty(0, 1, 32), 64, False).shape == (0, 2, 64)


def test_rmsnorm_eps_counts_on_small_and_zero_rows(built):
    """Rows whose mean square is near eps (and zero rows, which eps keeps finite) as the twin has them."""
    X = 256
    x = torch.cat([_x(3, X, seed=15, scale=1e-3), torch.zeros(1, X)])
    w = _x(X, seed=16)
    got = K.rms_norm(x, w, 1e-5)
    assert got.isfinite().all() and not got[-1].any()
    _close(got, rms_norm_torch(x, w, 1e-5), rtol=2e-6)
    out, total = K.rms_norm(x, w, 1e-5, torch.zeros_like(x))
    assert torch.equal(total, x)
    _close(out, rms_norm_torch(x, w, 1e-5), rtol=2e-6)


def test_rmsnorm_reads_strided_views_and_leaves_inputs_alone(built):
    T, H, D = 7, 6, 64
    qkv = _x(T, (H + 4) * D, seed=4)
    before = qkv.clone()
    q = qkv[:, :H * D].view(T, H, D)  # rows at stride (H + 4) D, heads at D: a q_norm's input
    w = _x(D, seed=5)
    _close(K.rms_norm(q, w, 1e-6), rms_norm_torch(q, w, 1e-6), rtol=2e-6)
    res = _x(T, 2 * H * D, seed=6)[:, ::2].reshape(T, H, D)  # copied, any layout
    out, total = K.rms_norm(q, w, 1e-6, res)
    assert torch.equal(total, q + res)
    _close(out, rms_norm_torch(q, w, 1e-6, res)[0], rtol=2e-6)
    transposed = _x(D, T, seed=7).t()  # last dimension not contiguous: copied first
    _close(K.rms_norm(transposed, w, 1e-6), rms_norm_torch(transposed, w, 1e-6), rtol=2e-6)
    four = _x(2, 3, 4, D, seed=8)
    _close(K.rms_norm(four, w, 1e-6), rms_norm_torch(four, w, 1e-6), rtol=2e-6)
    assert torch.equal(qkv, before)


@pytest.mark.parametrize("T", ROWS)
@pytest.mark.parametrize("I", WIDTHS)
def test_silu_and_mul_matches_twin(built, T, I):
    x = _x(T, 2 * I, seed=T + I, scale=6.0)
    _close(K.silu_and_mul(x), silu_and_mul_torch(x), rtol=1e-6, atol=1e-30)


def test_silu_and_mul_at_the_edges_of_exp(built):
    gate = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 87.0, 88.5, 88.8, 90.0, 200.0, -87.0, -87.5, -88.5, -88.8, -104.0,
                         -200.0, float("inf"), float("-inf"), float("nan")] + torch.linspace(-20, 20, 46).tolist())
    x = torch.cat([gate, torch.ones_like(gate)])[None]  # [1, 2I], up = 1
    got, want = K.silu_and_mul(x), silu_and_mul_torch(x)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[want.isinf()], want[want.isinf()])
    finite = want.isfinite()
    _close(got[finite], want[finite], rtol=1e-6, atol=1e-36)


def test_silu_and_mul_reads_a_column_slice_and_more_dims(built):
    wide = _x(9, 3 * 96, seed=9)
    x = wide[:, 40:40 + 2 * 96]  # rows at stride 288
    _close(K.silu_and_mul(x), silu_and_mul_torch(x))
    three = _x(2, 5, 2 * 96, seed=10)
    _close(K.silu_and_mul(three), silu_and_mul_torch(three))
    _close(K.silu_and_mul(three.transpose(0, 1)), silu_and_mul_torch(three.transpose(0, 1)))


@pytest.mark.parametrize("T,I", [(1024, 688), (333, 1376), (4096, 688)])
def test_silu_and_mul_on_helper_threads_gives_the_same_bits(built, T, I):
    """Prefill's sizes split in units of rows over 2 and 3 threads: the one-thread bits, call after call
    (and a strided column slice), and the twin's answer."""
    assert T * I >= K.SILU_PARALLEL_MIN_ELEMENTS  # big enough to be shared
    wide = _x(T, 2 * I + 16, seed=T, scale=6.0)
    for x in (wide[:, :2 * I].contiguous(), wide[:, 16:]):
        one = K.silu_and_mul(x)
        for threads in (2, 3, 2, 3):
            assert torch.equal(K.silu_and_mul(x, threads), one), threads
        _close(one, silu_and_mul_torch(x), rtol=1e-6, atol=1e-30)
    with pytest.raises(ValueError, match="threads: must be >= 1"):
        K.silu_and_mul(wide[:, 16:], 0)


def _rotation(T: int, D: int, R: int, interleaved: bool, seed: int = 0):
    rope = get_rope(R, 4096, {"rope_type": "default", "rope_theta": 10000.0}, interleaved=interleaved)
    positions = torch.randint(0, 4096, (T,), generator=torch.Generator().manual_seed(seed))
    return rope, rope.rotation(positions)


@pytest.mark.parametrize("T", ROWS)
@pytest.mark.parametrize("D,R", [(64, 64), (128, 128), (128, 64), (96, 32)])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
def test_rotary_matches_twin_bit_for_bit(built, T, D, R, interleaved):
    """q and k side by side in one qkv projection's columns (v after them), as the GQA layer rotates."""
    Hq, Hkv = 4, 2
    qkv = _x(T, (Hq + 2 * Hkv) * D, seed=T + D + R)
    qk = qkv[:, :(Hq + Hkv) * D].view(T, Hq + Hkv, D)
    rope, rot = _rotation(T, D, R, interleaved, seed=T)
    got = K.rotate(qk, rot.cos, rot.sin, R, interleaved)
    want = rope.rotate(qk, rot.cos, rot.sin)
    assert torch.equal(got, want)  # the same products and sums, no FMA contraction
    if not interleaved:
        assert torch.equal(got, rotate_halves(qk, *rot.halves, R))
    assert got.is_contiguous()


@pytest.mark.parametrize("T", [1, 7, 32])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
def test_rotary_pair_matches_the_twin_on_mla_views(built, T, interleaved):
    """MLA: q_pe the last R dims of each head of q, k_pe the last R columns of the kv_a projection."""
    H, Dn, R, C = 4, 32, 64, 48
    q_pe = _x(T, H, Dn + R, seed=T)[..., Dn:]  # [T, H, R] at strides (H (Dn + R), Dn + R, 1)
    k_pe = _x(T, C + R, seed=T + 1)[:, C:].unsqueeze(1)  # [T, 1, R]
    rope, rot = _rotation(T, R, R, interleaved, seed=T)
    q_got, k_got = K.rotate_pair(q_pe, k_pe, rot.cos, rot.sin, R, interleaved)
    assert torch.equal(q_got, rope.rotate(q_pe, rot.cos, rot.sin))
    assert torch.equal(k_got, rope.rotate(k_pe, rot.cos, rot.sin))
    q_layer, k_layer = rot.pair(q_pe, k_pe)
    assert torch.equal(q_layer, q_got) and torch.equal(k_layer, k_got)


def test_rotary_of_a_non_contiguous_head_dim(built):
    rope, rot = _rotation(5, 64, 64, False)
    x = _x(5, 64, 3, seed=11).transpose(1, 2)  # [T, H, D] with D at stride 3: copied first
    assert torch.equal(K.rotate(x, rot.cos, rot.sin, 64, False), rope.rotate(x, rot.cos, rot.sin))


BAD = [
    ("norm x dtype", lambda: K.rms_norm(torch.ones(2, 8, dtype=torch.float64), torch.ones(8), 1e-6), TypeError, "x:"),
    ("norm weight width", lambda: K.rms_norm(torch.ones(2, 8), torch.ones(7), 1e-6), ValueError, "weight:"),
    ("norm weight type", lambda: K.rms_norm(torch.ones(2, 8), [1.0] * 8, 1e-6), TypeError, "weight:"),
    ("norm residual shape", lambda: K.rms_norm(torch.ones(2, 8), torch.ones(8), 1e-6, torch.ones(3, 8)), ValueError,
     "residual:"),
    ("norm residual device", lambda: K.rms_norm(torch.ones(2, 8), torch.ones(8), 1e-6,
                                                torch.ones(2, 8, device="meta")), ValueError, "residual:"),
    ("norm eps", lambda: K.rms_norm(torch.ones(2, 8), torch.ones(8), -1.0), ValueError, "eps:"),
    ("norm scalar", lambda: K.rms_norm(torch.tensor(1.0), torch.ones(1), 1e-6), ValueError, "x:"),
    ("rotary x dims", lambda: K.rotate(torch.ones(2, 8), torch.ones(2, 1, 4), torch.ones(2, 1, 4), 8, False),
     ValueError, "x:"),
    ("rotary odd dim", lambda: K.rotate(torch.ones(2, 1, 8), torch.ones(2, 1, 4), torch.ones(2, 1, 4), 7, False),
     ValueError, "rotary_dim:"),
    ("rotary dim past head", lambda: K.rotate(torch.ones(2, 1, 8), torch.ones(2, 1, 5), torch.ones(2, 1, 5), 10,
                                              False), ValueError, "rotary_dim:"),
    ("rotary cos rows", lambda: K.rotate(torch.ones(2, 1, 8), torch.ones(3, 1, 4), torch.ones(2, 1, 4), 8, False),
     ValueError, "cos:"),
    ("rotary sin width", lambda: K.rotate(torch.ones(2, 1, 8), torch.ones(2, 1, 4), torch.ones(2, 1, 3), 8, False),
     ValueError, "sin:"),
    ("rotary sin dtype", lambda: K.rotate(torch.ones(2, 1, 8), torch.ones(2, 1, 4),
                                          torch.ones(2, 1, 4, dtype=torch.bfloat16), 8, False), TypeError, "sin:"),
    ("rotary pair k rows", lambda: K.rotate_pair(torch.ones(2, 1, 8), torch.ones(3, 1, 8), torch.ones(2, 1, 4),
                                                 torch.ones(2, 1, 4), 8, False), ValueError, "k:"),
    ("rotary pair k head dim", lambda: K.rotate_pair(torch.ones(2, 1, 8), torch.ones(2, 1, 6), torch.ones(2, 1, 4),
                                                     torch.ones(2, 1, 4), 8, False), ValueError, "rotary_dim:.*k's"),
    ("silu odd", lambda: K.silu_and_mul(torch.ones(2, 7)), ValueError, "x:"),
    ("silu dtype", lambda: K.silu_and_mul(torch.ones(2, 8, dtype=torch.int64)), TypeError, "x:"),
]


@pytest.mark.parametrize("name,call,error,match", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs_are_refused_naming_the_argument(built, name, call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_the_layers_take_the_kernels_only_for_eager_float32_cpu_tensors_below_the_limit(built, monkeypatch):
    calls: list[str] = []
    for name in ("rms_norm", "rotate", "silu_and_mul"):
        real = getattr(K, name)
        monkeypatch.setattr(K, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    layer = RMSNorm(64)
    rope, rot = _rotation(3, 64, 64, False)
    x = _x(3, 2, 64)
    layer(x[:, 0]), rot(x), activation.silu_and_mul(x)
    assert calls == ["rms_norm", "rotate", "silu_and_mul"]
    calls.clear()
    big = torch.zeros(K.MAX_ELEMENTS // 64 + 1, 64)
    wide_silu = torch.zeros(K.SILU_MAX_ELEMENTS // 64 + 1, 64)  # below MAX_ELEMENTS: SiLU's own line
    low = _x(3, 64).bfloat16()
    layer(big), activation.silu_and_mul(wide_silu), layer.bfloat16()(low), activation.silu_and_mul(low)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    RMSNorm(64)(x[:, 0]), rot(x), activation.silu_and_mul(x)
    assert calls == []


def test_the_layers_give_the_twins_answers(built):
    T, H, D = 32, 4, 64
    layer = RMSNorm(H * D, eps=1e-5)
    layer.weight.data = _x(H * D, seed=12)
    x, res = _x(T, H * D, seed=13), _x(T, H * D, seed=14)
    out, total = layer(x, res)
    want_out, want_total = rms_norm_torch(x, layer.weight, 1e-5, res)
    assert torch.equal(total, want_total)
    _close(out, want_out, rtol=2e-6)
    rope, rot = _rotation(T, D, D, False)
    assert torch.equal(rot(x.view(T, H, D)), rotate_halves(x.view(T, H, D), *rot.halves, D))
    _close(activation.silu_and_mul(x), silu_and_mul_torch(x))


@pytest.mark.parametrize("cc", ["/nonexistent/cc", "false"], ids=["missing", "failing"])
def test_no_compiler_falls_back_to_the_torch_path(monkeypatch, tmp_path, caplog, cc):
    with without_compiler(K, monkeypatch, tmp_path, caplog, cc):
        x = _x(4, 64)
        assert not K.takes(x)
        with pytest.raises(K.KernelUnavailable, match="could not be built"):
            K.silu_and_mul(x)
    layer = RMSNorm(64)
    assert torch.equal(layer(x), rms_norm_torch(x, layer.weight, layer.eps))
    assert torch.equal(activation.silu_and_mul(x), silu_and_mul_torch(x))
    rope, rot = _rotation(4, 64, 64, False)
    assert torch.equal(rot(x.view(4, 1, 64)), rotate_halves(x.view(4, 1, 64), *rot.halves, 64))
    q, k = rot.pair(x.view(4, 1, 64), x.view(4, 1, 64).flip(0))
    assert torch.equal(k, rotate_halves(x.view(4, 1, 64).flip(0), *rot.halves, 64))
    assert list(tmp_path.iterdir()) == []  # no half-written library left behind

