"""The decode stack kernel (pdserve_kernels.decode_stack_cpu, through models/fused_decode.py) against its
slow twin, the layer-by-layer eager path of the same model on the same pool: the hidden states after the
final norm and every pool row written. With every linear on the C small-M GEMM (packed) the two run the
same C code in the same order, so they agree bit for bit; with F.linear beside it, within 1e-5."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fixtures.kernel_inputs import without_compiler
from fixtures.paged_batches import PagedRequests
from pdserve.distributed.parallel_state import SINGLE
from pdserve.layers.attention.torch_native import TorchNativeBackend
from pdserve.layers.cpu_gemm import PACK_ALWAYS, pack_linears
from pdserve.layers.rotary import get_rope, rope_parameters_of
from pdserve.mem.kv_pool import GQAKVPool
from pdserve.models.fused_decode import FusedDecode
from pdserve.models.llama import LlamaForCausalLM
from pdserve.models.qwen2 import Qwen2ForCausalLM
from pdserve_kernels import decode_stack_cpu as K

TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def built():
    if K.load() is None:
        pytest.skip(f"no C compiler ({K.compiler()}) to build the kernel with")


def _model(heads: int, kv_heads: int, head_dim: int, rotary_factor: float, interleaved: bool, bias: str,
           seed: int):
    """A random 2-layer GQA model: bias "none", "qkv" (Qwen2) or "all" (Llama's attention_bias)."""
    c = SimpleNamespace(vocab_size=64, hidden_size=96, intermediate_size=80, num_hidden_layers=2,
                        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                        max_position_embeddings=256, rms_norm_eps=1e-6, hidden_act="silu",
                        tie_word_embeddings=False, attention_bias=bias == "all",
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                         "partial_rotary_factor": rotary_factor})
    model = (Qwen2ForCausalLM if bias == "qkv" else LlamaForCausalLM)(c, SINGLE, torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.1 if "norm" not in name else 0.2) + ("norm" in name))
    stack = model.model
    if interleaved:
        rope = stack.rotary_emb
        stack.rotary_emb = get_rope(rope.rotary_dim, 256, rope_parameters_of(c), interleaved=True,
                                    dtype=torch.float32)
    return model


def _decode_step(model, lengths: list[int], page_size: int, seed: int, c_attention: bool = True):
    """A pool of random KV with requests of ``lengths - 1`` tokens in it, and the decode step that adds
    each request's next token (prepared by the torch_native backend, whose C decode attention is chosen
    unless ``c_attention`` is False)."""
    c = model.config
    pool = GQAKVPool(sum(lengths) // page_size + len(lengths) + 4, page_size, c.num_hidden_layers,
                     c.num_key_value_heads, c.head_dim, torch.float32)
    g = torch.Generator().manual_seed(seed)
    pool.k.copy_(torch.randn(pool.k.shape, generator=g))
    pool.v.copy_(torch.randn(pool.v.shape, generator=g))
    paged = PagedRequests(pool, seed=seed, backend=TorchNativeBackend())
    for r, n in enumerate(lengths):
        paged._append(r, n - 1)  # the prefix's slots: its KV is the pool's random rows
    ids = torch.randint(0, c.vocab_size, (len(lengths),), generator=g).tolist()
    fb = paged.batch([(r, [t]) for r, t in enumerate(ids)], decode=True)
    assert fb.attn_metadata.decode_kernel == c_attention
    return pool, fb


def _run(model, fb, fused: bool, threads: int = 1):
    """(final hidden [B, H], the pool's k and v after the step); the pool is restored afterwards."""
    stack, pool = model.model, fb.kv_pool
    saved = pool.k.clone(), pool.v.clone()
    stack.fused_decode = FusedDecode(stack) if fused else None
    fb.attn_backend.decode_threads = threads
    before = fb.attn_backend.decode_stack_steps
    with torch.no_grad():
        hidden = model(fb)
    assert fb.attn_backend.decode_stack_steps == before + fused  # the path asked for is the one that ran
    written = pool.k.clone(), pool.v.clone()
    pool.k.copy_(saved[0])
    pool.v.copy_(saved[1])
    return hidden, written


CASES = [  # (B lengths, page size, heads, kv heads, head dim, rotary factor, interleaved, bias)
    pytest.param([7], 1, 4, 4, 32, 1.0, False, "none", id="B1-G1-D32"),
    pytest.param([5, 17, 1, 40, 16], 16, 8, 4, 32, 0.5, False, "qkv", id="B5-G2-partial-qkv-bias"),
    pytest.param([3, 30, 64, 2, 9, 65, 33], 16, 8, 2, 64, 1.0, True, "all", id="B7-G4-D64-interleaved-all-bias"),
    pytest.param([(7 * b) % 150 + 1 for b in range(33)], 1, 4, 2, 64, 0.25, True, "qkv",
                 id="B33-G2-D64-partial-interleaved"),
    pytest.param([(5 * b) % 90 + 2 for b in range(33)], 16, 4, 1, 32, 1.0, False, "all", id="B33-G4-all-bias"),
]


@pytest.mark.parametrize("lengths,page_size,heads,kv_heads,head_dim,factor,interleaved,bias", CASES)
def test_the_one_call_is_the_layers_bit_for_bit(built, lengths, page_size, heads, kv_heads, head_dim, factor,
                                                interleaved, bias):
    """Every linear packed for the C GEMM: the layers run the same C kernels one by one, so the final
    hidden states and every pool row written have the same bits; 1 and 2 threads too."""
    model = _model(heads, kv_heads, head_dim, factor, interleaved, bias, seed=len(lengths))
    pack_linears(model, PACK_ALWAYS)
    pool, fb = _decode_step(model, lengths, page_size, seed=page_size)
    want, want_kv = _run(model, fb, fused=False)
    for threads in (1, 2):
        got, got_kv = _run(model, fb, fused=True, threads=threads)
        assert torch.equal(got, want), f"threads={threads}: {(got - want).abs().max()}"
        assert torch.equal(got_kv[0], want_kv[0]) and torch.equal(got_kv[1], want_kv[1])
    new = fb.out_cache_loc
    page, off = new // page_size, new % page_size
    assert not torch.equal(want_kv[0][:, page, :, off], pool.k[:, page, :, off])  # the step wrote its rows


@pytest.mark.parametrize("lengths,page_size,heads,kv_heads,head_dim,factor,interleaved,bias", CASES[1:4])
def test_the_one_call_matches_the_layers_on_f_linear(built, lengths, page_size, heads, kv_heads, head_dim, factor,
                                                     interleaved, bias):
    """Nothing packed: the layers' GEMMs are F.linear (another summation order), the call packs its own
    panels; within 1e-5, the pool rows too."""
    model = _model(heads, kv_heads, head_dim, factor, interleaved, bias, seed=3)
    pool, fb = _decode_step(model, lengths, page_size, seed=1)
    want, want_kv = _run(model, fb, fused=False)
    got, got_kv = _run(model, fb, fused=True, threads=2)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(got_kv[0], want_kv[0], **TOL)
    torch.testing.assert_close(got_kv[1], want_kv[1], **TOL)


def _call(model, fb):
    stack = model.model
    return FusedDecode(stack)._bind(fb.kv_pool), stack.embed_tokens(fb.input_ids), stack.rotary_emb.rotation(
        fb.positions)


@pytest.mark.parametrize("what", ["length 0", "length past L", "slot past the pool", "negative slot",
                                  "new slot past the pool"])
def test_bad_slots_and_lengths_are_refused_before_any_write(built, what):
    model = _model(4, 2, 32, 1.0, False, "none", seed=0)
    pool, fb = _decode_step(model, [5, 9, 3], 16, seed=0)
    call, hidden, rot = _call(model, fb)
    slots, lens, loc = fb.kv_slots.clone(), fb.seq_lens.clone(), fb.out_cache_loc.clone()
    N = pool.num_pages * pool.page_size
    name = "seq_lens"
    if what == "length 0":
        lens[1] = 0
    elif what == "length past L":
        lens[0] = slots.shape[1] + 1
    elif what == "slot past the pool":
        slots[2, 1], name = N, "kv_slots"
    elif what == "negative slot":
        slots[1, 0], name = -1, "kv_slots"
    else:
        loc[0], name = N + 3, "out_cache_loc"
    k, v = pool.k.clone(), pool.v.clone()
    with pytest.raises(ValueError, match=name):
        call(hidden, rot.cos, rot.sin, loc, slots, lens)
    assert torch.equal(pool.k, k) and torch.equal(pool.v, v)


def test_bad_shapes_are_named(built):
    model = _model(4, 2, 32, 1.0, False, "none", seed=0)
    pool, fb = _decode_step(model, [5, 9], 1, seed=0)
    call, hidden, rot = _call(model, fb)
    args = rot.cos, rot.sin, fb.out_cache_loc, fb.kv_slots, fb.seq_lens
    with pytest.raises(ValueError, match="hidden"):
        call(hidden[:, :10].contiguous(), *args)
    with pytest.raises(TypeError, match="kv_slots"):
        call(hidden, rot.cos, rot.sin, fb.out_cache_loc, fb.kv_slots.int(), fb.seq_lens)
    with pytest.raises(ValueError, match="seq_lens"):
        call(hidden, rot.cos, rot.sin, fb.out_cache_loc, fb.kv_slots, fb.seq_lens[:1])
    with pytest.raises(ValueError, match="cos"):
        call(hidden, rot.cos[:1], *args[1:])
    with pytest.raises(ValueError, match="threads"):
        call(hidden, *args, threads=0)


@pytest.mark.parametrize("cc", ["false", "/nonexistent/cc"])
def test_without_a_compiler_the_layers_run(cc, monkeypatch, tmp_path, caplog):
    """No library: the stack refuses the call (the backend's describe() says "layers"), the step runs
    layer by layer on the torch paths and gives the hidden states the C kernels give (within rounding);
    the call itself raises KernelUnavailable."""
    model = _model(4, 2, 32, 1.0, False, "qkv", seed=0)
    _, fb = _decode_step(model, [5, 9, 3], 16, seed=0)
    with torch.no_grad():
        want = model(fb)
    with without_compiler(K, monkeypatch, tmp_path, caplog, cc):
        fused = FusedDecode(model.model)
        assert fused.refusal == "the plain-C library is not built"
        model.model.fused_decode = fused
        _, fb = _decode_step(model, [5, 9, 3], 16, seed=0, c_attention=False)
        with torch.no_grad():
            got = model(fb)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert fb.attn_backend.describe()["decode_stack"] == "layers"
        assert fb.attn_backend.decode_stack_steps == 0
        with pytest.raises(K.KernelUnavailable):
            K.DecodeStack.__call__(object.__new__(K.DecodeStack), want, *(None,) * 5)


def test_the_switch_keeps_the_layers(built, monkeypatch):
    """PDSERVE_DECODE_STACK=layers (A/B runs, the per-op kernels' tests): the stack refuses the call."""
    monkeypatch.setenv("PDSERVE_DECODE_STACK", "layers")
    model = _model(4, 2, 32, 1.0, False, "none", seed=0)
    _, fb = _decode_step(model, [5, 9], 1, seed=0)
    model.model.fused_decode = FusedDecode(model.model)
    with torch.no_grad():
        model(fb)
    assert fb.attn_backend.describe()["decode_stack"] == "layers"
