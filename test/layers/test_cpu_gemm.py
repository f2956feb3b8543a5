"""oneDNN-packed CPU linears (layers/cpu_gemm.py) against F.linear, their slow twin: equal within
float rounding on random inputs, exactly F.linear where the policy says packing does not pay,
and every linear layer (column, merged, QKV, row with its bias once, LM head) the same packed
or plain."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.distributed.parallel_state import SINGLE, ParallelState
from pdserve.layers.cpu_gemm import PACK_ALWAYS, PackedLinear, PackPolicy, linear, pack_linears, packed_linear
from pdserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pdserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs torch's oneDNN ops")

NEVER = PackPolicy(min_rows=1 << 30, min_weight=1 << 30, big_weight=1 << 30)
# Outputs of N(0, 1) weights and inputs are ~sqrt(K) (16..26): float32 rounding of such sums.
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [0, 1, 3, 4, 17, 64])
@pytest.mark.parametrize("K, N", [(64, 96), (256, 688), (688, 256)])
def test_packed_equals_f_linear(dtype, rows, K, N):
    w, b, x = _randn(N, K, seed=1, dtype=dtype), _randn(N, seed=2, dtype=dtype), _randn(rows, K, seed=3, dtype=dtype)
    packed = PackedLinear(w, PACK_ALWAYS)
    for bias in (None, b):
        got = packed(x, bias)
        assert got.dtype == dtype and got.shape == (rows, N)
        # bf16: both round the same float32 sums; only the order of the sums differs.
        torch.testing.assert_close(got, F.linear(x, w, bias), **TOL[dtype])


def test_packed_takes_strided_and_batched_inputs():
    w = _randn(48, 32, seed=1)
    packed = PackedLinear(w, PACK_ALWAYS)
    strided = _randn(10, 64, seed=2)[:, ::2]  # [10, 32], not contiguous
    torch.testing.assert_close(packed(strided), F.linear(strided, w), atol=1e-5, rtol=1e-5)
    batched = _randn(2, 5, 32, seed=3)  # [2, 5, K]: rows counted over the leading dims
    torch.testing.assert_close(packed(batched), F.linear(batched, w), atol=1e-5, rtol=1e-5)


def test_packed_linear_op_is_the_packed_call_with_a_consistent_fake():
    """The custom op compiled decode calls: the packed GEMM found through the plain weight (the very
    object: torch.library.opcheck, which clones its inputs, cannot run it), its fake (meta) impl of
    the real output's shape, dtype and strides; an unpacked weight is refused."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    w, b, x = _randn(96, 64, seed=1), _randn(96, seed=2), _randn(2, 5, 64, seed=3)
    packed = PackedLinear(w, PACK_ALWAYS)
    for bias in (None, b):
        real = packed_linear(x, w, bias)
        assert torch.equal(real, packed(x, bias))
        with FakeTensorMode() as mode:
            fb = None if bias is None else mode.from_tensor(bias)
            fake = packed_linear(mode.from_tensor(x), mode.from_tensor(w), fb)
        assert (fake.shape, fake.dtype, fake.stride()) == (real.shape, real.dtype, real.stride())
    with pytest.raises(RuntimeError, match="never packed"):
        packed_linear(x, w.clone(), None)


def test_compiled_layer_keeps_the_packed_weight():
    """Under torch.compile the packed layer runs pdserve::packed_linear (not F.linear) on the
    packed copy: the same bits as the eager packed call."""
    layer = MergedColumnParallelLinear(64, [96, 96], SINGLE)
    layer.weight.data.copy_(_randn(192, 64, seed=1))
    assert layer.pack_cpu(PACK_ALWAYS)
    x = _randn(4, 64, seed=2)
    ops = []

    def inductor_seeing(gm, inputs):  # dynamo's graph, then inductor as usual
        from torch._inductor.compile_fx import compile_fx

        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return compile_fx(gm, inputs)

    compiled = torch.compile(lambda t: torch.relu(layer(t)), backend=inductor_seeing, dynamic=False, fullgraph=True)
    with torch.inference_mode():
        assert torch.equal(compiled(x), torch.relu(layer(x)))
    assert "pdserve.packed_linear.default" in ops and "<built-in function linear>" not in ops, ops


def test_policy_picks_by_rows_and_weight_size():
    policy = PackPolicy(min_rows=4, min_weight=1000, big_weight=100_000)
    assert [policy.pays(r, 999) for r in (1, 4, 64)] == [False, False, False]  # small weight: never
    assert [policy.pays(r, 1000) for r in (1, 3, 4, 64)] == [False, False, True, True]
    assert [policy.pays(r, 100_000) for r in (1, 3)] == [True, True]  # big weight: from one row
    with pytest.raises(ValueError, match="^PackPolicy: thresholds must be >= 0"):
        PackPolicy(min_rows=-1, min_weight=0, big_weight=0)


def test_linear_is_exactly_f_linear_where_packing_does_not_pay():
    w, x = _randn(64, 32, seed=1), _randn(3, 32, seed=2)
    policy = PackPolicy(min_rows=4, min_weight=0, big_weight=1 << 30)
    packed = PackedLinear(w, policy)
    assert torch.equal(linear(x, w, None, packed), F.linear(x, w))  # 3 rows < 4: the plain path
    x4 = _randn(4, 32, seed=3)
    assert torch.equal(linear(x4, w, None, packed), packed(x4))  # 4 rows: the packed one
    assert torch.equal(linear(x4, w, None, None), F.linear(x4, w))


def test_unsupported_weights_are_refused_by_name():
    assert not PackedLinear.supports(torch.zeros(4, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="^PackedLinear: needs a 2-D CPU weight"):
        PackedLinear(torch.zeros(4, 4, dtype=torch.float16), PACK_ALWAYS)


def _filled(layer, seed):
    g = torch.Generator().manual_seed(seed)
    for p in layer.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g))
    return layer


@pytest.mark.parametrize("make", [
    lambda: MergedColumnParallelLinear(64, [96, 96], SINGLE, ckpt_names=("gate_proj", "up_proj")),
    lambda: QKVParallelLinear(64, 16, 4, 2, SINGLE, bias=True),
    lambda: RowParallelLinear(96, 64, SINGLE, bias=True),
    lambda: RowParallelLinear(96, 64, ParallelState(tp_rank=1, tp_size=2), bias=True, reduce_results=False),
], ids=["merged", "qkv_bias", "row_bias", "row_rank1_unreduced"])
def test_layers_give_the_same_output_packed(make):
    layer = _filled(make(), seed=1)
    x = _randn(7, layer.in_features, seed=2)
    plain = layer(x)
    assert layer.pack_cpu(PACK_ALWAYS) and layer.packed is not None
    torch.testing.assert_close(layer(x), plain, atol=1e-5, rtol=1e-5)
    assert torch.equal(layer.weight, _filled(make(), seed=1).weight)  # the parameter is untouched


def test_lm_head_packs_its_table_and_the_tied_embedding_keeps_looking_up():
    embed = _filled(VocabParallelEmbedding(100, 32, SINGLE, torch.float32), seed=1)
    head = ParallelLMHead(100, 32, SINGLE, torch.float32, tie_to=embed)
    hidden, ids = _randn(5, 32, seed=2), torch.tensor([0, 7, 99])
    want_logits, want_rows = head(hidden), embed(ids)
    assert pack_linears(torch.nn.ModuleList([embed, head]), PACK_ALWAYS) == 1  # the head only
    torch.testing.assert_close(head(hidden), want_logits, atol=1e-5, rtol=1e-5)
    assert head(hidden).dtype == torch.float32
    assert torch.equal(embed(ids), want_rows)


def test_never_policy_keeps_every_layer_bit_exact():
    layer = _filled(MergedColumnParallelLinear(256, [688, 688], SINGLE, ckpt_names=("g", "u")), seed=1)
    x = _randn(32, 256, seed=2)
    plain = layer(x)
    assert not layer.pack_cpu(NEVER) and layer.packed is None  # no copy a call would never read
    assert torch.equal(layer(x), plain)


def test_weights_the_policy_never_packs_get_no_copy():
    from pdserve.engine.device import PACK_FLOAT32

    small = RowParallelLinear(256, 256, SINGLE)  # 2^16 elements: F.linear at every M
    big = MergedColumnParallelLinear(256, [688, 688], SINGLE, ckpt_names=("g", "u"))
    assert [m.pack_cpu(PACK_FLOAT32) for m in (small, big)] == [False, True]
    assert small.packed is None and big.packed is not None
    assert not PACK_FLOAT32.ever_pays(256 * 256) and PACK_FLOAT32.ever_pays(256 * 512)


def _count_c_calls(monkeypatch) -> list[int]:
    """Counts the calls of the C small-M GEMM (pdserve_kernels.gemm_cpu.run, PackedLinear's entry) from now on."""
    from pdserve_kernels import gemm_cpu

    calls, real = [], gemm_cpu.run

    def counted(lib, x, *args, **kwargs):
        calls.append(x.shape[0])
        return real(lib, x, *args, **kwargs)

    monkeypatch.setattr(gemm_cpu, "run", counted)
    return calls


def test_decode_sized_float32_calls_take_the_c_gemm(monkeypatch):
    """Up to SMALL_M_MAX_ROWS rows of float32: the C GEMM (same values as F.linear); more rows, or
    bfloat16: oneDNN."""
    from pdserve.layers import cpu_gemm
    from pdserve_kernels import gemm_cpu

    if gemm_cpu.load() is None:
        pytest.skip("no C compiler to build the small-M GEMM with")
    w, b = _randn(100, 37, seed=1), _randn(100, seed=2)
    packed = PackedLinear(w, PACK_ALWAYS)
    calls = _count_c_calls(monkeypatch)
    limit = cpu_gemm.SMALL_M_MAX_ROWS
    for rows in (1, 7, limit, limit + 1):
        x = _randn(rows, 37, seed=rows)
        torch.testing.assert_close(packed(x, b), F.linear(x, w, b), **TOL[torch.float32])
    x3 = _randn(2, 3, 37, seed=9)  # leading dims fold into M
    torch.testing.assert_close(packed(x3, b), F.linear(x3, w, b), **TOL[torch.float32])
    assert calls == [1, 7, limit, 6]
    PackedLinear(w.bfloat16(), PACK_ALWAYS)(_randn(4, 37, dtype=torch.bfloat16), b.bfloat16())
    assert len(calls) == 4  # bfloat16: not the C GEMM


def test_a_default_engine_decode_runs_the_c_gemm(monkeypatch):
    """tiny-llama with default flags: its decode steps' GEMMs run in C, with the scheduler's threads."""
    import pdserve
    from pdserve_kernels import gemm_cpu

    if gemm_cpu.load() is None:
        pytest.skip("no C compiler to build the small-M GEMM with")
    monkeypatch.setattr(gemm_cpu, "_threads", 1)
    # The per-op path on purpose: by default the decode step's layers run in one C call (the decode stack,
    # models/fused_decode.py), which includes this GEMM's code but never calls gemm_cpu.run.
    monkeypatch.setenv("PDSERVE_DECODE_STACK", "layers")
    engine = pdserve.Engine(model_path="tiny-llama")
    try:
        assert gemm_cpu.threads() == engine.scheduler.threads.most
        calls = _count_c_calls(monkeypatch)
        prompts = [[5 + i] * (3 + i) for i in range(6)]
        engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 4, "temperature": 0.0,
                                                            "ignore_eos": True})
        assert calls.count(len(prompts)) > 0  # decode steps of the six requests, one row each
    finally:
        engine.shutdown()
