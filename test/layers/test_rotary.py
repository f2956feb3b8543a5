"""Rotary embeddings vs transformers: frequencies, attention scaling, and the rotation itself."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf_v2
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3
from transformers.models.llama import modeling_llama as hf_llama

from pdserve.layers.rotary import get_rope, rope_parameters_of, softmax_scale_correction

YARN_DS = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
           "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 500000.0, "factor": 4.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 2048},
    "yarn-deepseek-v3": YARN_DS,
    "yarn-deepseek-v2": {**YARN_DS, "mscale": 0.707, "mscale_all_dim": 0.707},
    "yarn-mscale-differs": {**YARN_DS, "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.8},
    "yarn-no-truncate": {**YARN_DS, "truncate": False},
}


def _llama_config(rope: dict, head_dim: int = 64, max_pos: int = 32768):
    return LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                       max_position_embeddings=max_pos, rope_parameters=dict(rope))


@pytest.mark.parametrize("name", sorted(ROPES))
def test_frequencies_and_scaling_match_transformers(name):
    cfg = _llama_config(ROPES[name])
    params = rope_parameters_of(cfg)
    want_freq, want_scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg) if params["rope_type"] != "default" \
        else hf_llama.LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)
    rope = get_rope(64, 512, params)
    torch.testing.assert_close(rope.inv_freq, want_freq, atol=0, rtol=1e-6)
    assert rope.attention_scaling == pytest.approx(want_scale, rel=1e-7)


@pytest.mark.parametrize("name", ["default", "llama3", "yarn"])
def test_neox_rotation_matches_llama(name):
    cfg = _llama_config(ROPES[name], head_dim=32)
    hf_rope = hf_llama.LlamaRotaryEmbedding(cfg)
    pos = torch.tensor([0, 1, 5, 77, 1000, 3])
    q, k = torch.randn(6, 4, 32), torch.randn(6, 2, 32)
    cos, sin = hf_rope(q, pos[None])  # [1, T, D]
    want_q, want_k = hf_llama.apply_rotary_pos_emb(q[None].transpose(1, 2), k[None].transpose(1, 2), cos, sin)
    rope = get_rope(32, 2048, rope_parameters_of(cfg))
    got_q, got_k = rope(pos, q, k)
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), atol=1e-6, rtol=0)
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), atol=1e-6, rtol=0)


def _deepseek_config(rope: dict, R: int = 16):
    return DeepseekV3Config(hidden_size=64, num_attention_heads=4, qk_rope_head_dim=R, qk_nope_head_dim=16,
                            v_head_dim=16, kv_lora_rank=32, q_lora_rank=32, max_position_embeddings=163840,
                            rope_parameters=dict(rope), n_routed_experts=8, n_group=2, topk_group=1)


def _scores(q, k):
    return torch.einsum("thd,tgd->thg", q, k)


def test_interleaved_rotation_matches_deepseek_v3_and_v2():
    """Both HF DeepSeek variants rotate adjacent pairs; V3 writes the result de-interleaved, V2
    interleaved. pdserve matches V3's layout exactly, and V2's up to the same permutation on q
    and k, which leaves every q.k score unchanged."""
    cfg = _deepseek_config(YARN_DS)
    pos = torch.tensor([0, 2, 9, 4095, 4096, 100000])
    q, k = torch.randn(6, 4, 16), torch.randn(6, 1, 16)
    rope = get_rope(16, 163840, rope_parameters_of(cfg), interleaved=True)
    got_q, got_k = rope(pos, q, k)

    cos, sin = hf_v3.DeepseekV3RotaryEmbedding(cfg)(q, pos[None])
    v3_q, v3_k = hf_v3.apply_rotary_pos_emb_interleave(q[None].transpose(1, 2), k[None].transpose(1, 2), cos, sin)
    torch.testing.assert_close(got_q, v3_q[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, v3_k[0].transpose(0, 1), atol=1e-5, rtol=1e-5)

    freqs_cis = hf_v2.DeepseekV2RotaryEmbedding(cfg)(q, pos[None])
    v2_q, v2_k = hf_v2.apply_rotary_emb(q[None].transpose(1, 2), k[None].transpose(1, 2), freqs_cis)
    torch.testing.assert_close(_scores(got_q, got_k), _scores(v2_q[0].transpose(0, 1), v2_k[0].transpose(0, 1)),
                               atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("name", ["default", "yarn-deepseek-v3", "yarn-deepseek-v2", "yarn-mscale-differs"])
def test_softmax_scale_correction_matches_deepseek(name):
    params = rope_parameters_of(_deepseek_config(ROPES[name]))
    base = 48 ** -0.5
    assert base * softmax_scale_correction(params) == pytest.approx(hf_v3.yarn_apply_mscale(params, base), rel=1e-12)


def test_partial_rotary_leaves_tail_untouched():
    rope = get_rope(16, 64, {"rope_type": "default", "rope_theta": 10000.0})
    x = torch.randn(3, 2, 32)
    out = rope.rotate(x, *rope.lookup(torch.tensor([1, 2, 3])))
    assert torch.equal(out[..., 16:], x[..., 16:])
    assert not torch.allclose(out[..., :16], x[..., :16])


def test_table_grows_past_max_positions():
    rope = get_rope(8, 16, {"rope_type": "default", "rope_theta": 10000.0})
    big = get_rope(8, 4096, {"rope_type": "default", "rope_theta": 10000.0})
    rope.ensure_capacity(1000)
    pos = torch.tensor([999, 15, 16])
    torch.testing.assert_close(torch.cat(rope.lookup(pos), -1), torch.cat(big.lookup(pos), -1))


def test_unsupported_rope_type_is_a_value_error():
    with pytest.raises(ValueError, match="rope_type.*longrope"):
        get_rope(16, 64, {"rope_type": "longrope", "rope_theta": 10000.0})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_dim", [32, 16])  # full head, and a partial rotary factor of 1/2
def test_rotation_by_halves_is_bit_identical_to_rotate(dtype, rotary_dim):
    """The per-forward Rotation (neox) swaps halves and multiply-adds once; it must give exactly
    the seven-kernel ``rotate``'s bits, on a strided view as the layers pass it (q and k out of qkv)."""
    rope = get_rope(rotary_dim, 2048, ROPES["llama3"], dtype=dtype)
    pos = torch.tensor([0, 1, 5, 77, 1000, 3, 2047])
    qkv = torch.randn(7, 10 * 32, dtype=dtype)
    x = qkv[:, :6 * 32].view(7, 6, 32)  # strided, like GQAAttention's q|k
    rotation = rope.rotation(pos)
    assert rotation.halves is not None
    got = rotation(x)
    want = rope.rotate(x, *rope.lookup(pos))
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.equal(got, want)


def test_interleaved_rotation_keeps_rotate():
    rope = get_rope(16, 2048, {"rope_type": "default", "rope_theta": 10000.0}, interleaved=True)
    pos = torch.tensor([3, 9])
    x = torch.randn(2, 4, 16)
    rotation = rope.rotation(pos)
    assert rotation.halves is None
    assert torch.equal(rotation(x), rope.rotate(x, *rope.lookup(pos)))
