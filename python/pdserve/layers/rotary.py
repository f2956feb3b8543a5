"""Rotary position embedding: default, linear, llama3 and YaRN (incl. DeepSeek's mscale).

Legend: T tokens, H heads, D head dim, R rotary dim (<= D), F = R/2 frequencies, P cached positions.

Frequencies follow transformers' ``modeling_rope_utils`` exactly (same formulas,
same float32 arithmetic), so logits agree with the HF oracle to float rounding.
Two layouts pair the rotated dims differently: *neox* rotates (x[i], x[i+F])
(Llama, Qwen), *interleaved* rotates (x[2i], x[2i+1]) (DeepSeek). The
interleaved path writes its result de-interleaved ([rotated evens | rotated
odds]), as transformers' DeepSeek-V3 does: q and k get the same permutation,
so q.k is unchanged, and a cat is cheaper than re-interleaving.

On CPU float32 (eagerly, up to ``fused_cpu.MAX_ELEMENTS``) a Rotation is one plain-C call
(``pdserve_kernels.fused_cpu.rotate``, q and k together where the caller passes them side by side);
``rotate_halves`` and ``RotaryEmbedding.rotate`` are its twins and every other case.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pdserve_kernels import fused_cpu


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    """[F] theta_i = base^(-2i/dim)."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _linear_inv_freq(p: Mapping[str, Any], dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    return _base_inv_freq(p["rope_theta"], dim) / p["factor"], 1.0


def _llama3_inv_freq(p: Mapping[str, Any], dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    inv_freq = _base_inv_freq(p["rope_theta"], dim)
    factor, lo, hi = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_ctx = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are interpolated by `factor`, short ones kept, the band between blended.
    scaled = torch.where(wavelen > old_ctx / lo, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - lo) / (hi - lo)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = ~(wavelen < old_ctx / hi) * ~(wavelen > old_ctx / lo)
    return torch.where(is_mid, blended, scaled), 1.0


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature: 0.1 * mscale * ln(scale) + 1 (1 when not extrapolating)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_correction_range(p: Mapping[str, Any], dim: int, base: float) -> tuple[float, float]:
    """Dims rotating fewer than beta_slow / more than beta_fast times over the original context."""
    orig = p["original_max_position_embeddings"]
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def dim_of(rotations):
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _yarn_inv_freq(p: Mapping[str, Any], dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    base = p["rope_theta"]
    factor = p.get("factor") or max_pos / p["original_max_position_embeddings"]
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            # DeepSeek: cos/sin carry mscale/mscale_all_dim; the rest goes into the softmax scale.
            attention_factor = float(yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = yarn_get_mscale(factor)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    low, high = _yarn_correction_range(p, dim, base)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: high-frequency dim, extrapolated as is; 0: interpolated by factor
    return interpolation * (1 - keep) + extrapolation * keep, attention_factor


_INV_FREQ = {
    "default": lambda p, dim, max_pos: (_base_inv_freq(p["rope_theta"], dim), 1.0),
    "linear": _linear_inv_freq,
    "llama3": _llama3_inv_freq,
    "yarn": _yarn_inv_freq,
}


def rope_parameters_of(hf_config) -> dict:
    """The config's rope dict in transformers-5 form (``rope_parameters``), falling back to the
    older ``rope_scaling`` + ``rope_theta`` attributes."""
    params = getattr(hf_config, "rope_parameters", None)
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    if params["rope_type"] in ("llama3", "yarn"):
        params.setdefault("original_max_position_embeddings",
                          getattr(hf_config, "original_max_position_embeddings", None)
                          or hf_config.max_position_embeddings)
    return params


def softmax_scale_correction(rope_parameters: Mapping[str, Any]) -> float:
    """Multiplier DeepSeek applies to 1/sqrt(d) under YaRN: mscale(factor, mscale_all_dim)^2."""
    if rope_parameters.get("rope_type", "default") == "default":
        return 1.0
    mscale_all_dim = rope_parameters.get("mscale_all_dim", 0)
    if not mscale_all_dim:
        return 1.0
    m = yarn_get_mscale(rope_parameters["factor"], mscale_all_dim)
    return m * m


class RotaryEmbedding(nn.Module):
    """Rotates the first R dims of each head by position.

    ``lookup(positions)`` is done once per forward and shared by every layer;
    ``rotate`` then costs a handful of elementwise ops per layer (not named ``apply``, which
    ``nn.Module.apply`` calls on every submodule).
    """

    inv_freq: torch.Tensor  # [F] buffer
    cos_sin: torch.Tensor  # [P, 2F] buffer, grown by ensure_capacity

    def __init__(self, rotary_dim: int, inv_freq: torch.Tensor, attention_scaling: float,
                 max_positions: int, interleaved: bool, dtype: torch.dtype):
        super().__init__()
        self.rotary_dim = rotary_dim
        self.attention_scaling = attention_scaling
        self.interleaved = interleaved
        self.dtype = dtype
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)  # [F]
        self.register_buffer("cos_sin", self._table(max_positions), persistent=False)  # [P, 2F]

    def _table(self, n: int) -> torch.Tensor:
        freqs = torch.arange(n, dtype=torch.int64).float()[:, None] * self.inv_freq[None, :]  # [P, F]
        cs = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * self.attention_scaling  # [P, 2F]
        return cs.to(self.dtype)

    def ensure_capacity(self, n: int) -> None:
        """Grow the table to cover positions < n (context_length beyond max_position_embeddings)."""
        if n > self.cos_sin.shape[0]:
            self.cos_sin = self._table(max(n, 2 * self.cos_sin.shape[0])).to(self.cos_sin.device)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, 1, F] (broadcast over heads)."""
        cs = self.cos_sin[positions].unsqueeze(1)  # [T, 1, 2F]
        cos, sin = cs.chunk(2, dim=-1)
        return cos, sin

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H, D] -> rotated [T, H, D] (new tensor; x is not modified)."""
        R = self.rotary_dim
        rot = x if R == x.shape[-1] else x[..., :R]
        if self.interleaved:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]  # [T, H, F] each
        else:
            x1, x2 = rot[..., :R // 2], rot[..., R // 2:]
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)  # [T, H, R]
        return out if R == x.shape[-1] else torch.cat([out, x[..., R:]], dim=-1)

    def rotation(self, positions: torch.Tensor) -> Rotation:
        cos, sin = self.lookup(positions)
        halves = None
        if not self.interleaved:
            # [cos | cos] and [-sin | sin], built once per forward: each layer's rotation is then a
            # swap of halves and two multiply-adds over the whole head (rotate_halves).
            halves = (torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1))  # [T, 1, R] each
        return Rotation(self, cos, sin, halves)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos, sin = self.lookup(positions)
        return self.rotate(q, cos, sin), self.rotate(k, cos, sin)


@dataclass(frozen=True)
class Rotation:
    """This step's rotation (cos/sin gathered for ``fb.positions``), built once per forward and
    applied by every layer: ``rotation(x [T, H, D])``."""

    rope: RotaryEmbedding
    cos: torch.Tensor  # [T, 1, F]
    sin: torch.Tensor  # [T, 1, F]
    halves: tuple[torch.Tensor, torch.Tensor] | None = None  # neox: [cos | cos], [-sin | sin] [T, 1, R]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if fused_cpu.takes(x) and self.cos.dtype == torch.float32:
            return fused_cpu.rotate(x, self.cos, self.sin, self.rope.rotary_dim, self.rope.interleaved)
        if self.halves is not None:
            return rotate_halves(x, *self.halves, self.rope.rotary_dim)
        return self.rope.rotate(x, self.cos, self.sin)

    def pair(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hk, D] -> both rotated: one kernel call where the fused kernel runs (MLA's
        q_pe and k_pe come from different projections, so they cannot be passed side by side)."""
        if fused_cpu.takes(q) and fused_cpu.takes(k) and self.cos.dtype == torch.float32:
            return fused_cpu.rotate_pair(q, k, self.cos, self.sin, self.rope.rotary_dim, self.rope.interleaved)
        return self(q), self(k)


def rotate_halves(x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor, R: int) -> torch.Tensor:
    """RotaryEmbedding.rotate's neox rotation in four kernels instead of seven: x [T, H, D],
    cos2 = [cos | cos], sin2 = [-sin | sin] [T, 1, R] -> rotated [T, H, D] (new tensor).

    [x1 | x2] * cos2 + [x2 | x1] * sin2 = [x1 cos - x2 sin | x2 cos + x1 sin], the same products and
    sums in the same order (a - b is a + (-b) exactly in IEEE arithmetic), so it is bit-identical
    to ``rotate`` (test/layers/test_rotary.py checks it)."""
    T, H, D = x.shape
    rot = x if R == D else x[..., :R]
    swapped = rot.unflatten(-1, (2, R // 2)).flip(-2).flatten(-2)  # [T, H, R]: [x2 | x1]
    out = (rot * cos2).add_(swapped.mul_(sin2))  # [T, H, R]
    return out if R == D else torch.cat([out, x[..., R:]], dim=-1)


def get_rope(rotary_dim: int, max_positions: int, rope_parameters: Mapping[str, Any],
             interleaved: bool = False, dtype: torch.dtype = torch.float32) -> RotaryEmbedding:
    """Build the rotary embedding a config's ``rope_parameters`` describe.

    Raises ValueError for rope types pdserve does not implement (dynamic, longrope …).
    """
    rope_type = rope_parameters.get("rope_type", "default")
    if rope_type not in _INV_FREQ:
        raise ValueError(f"rope_parameters.rope_type: {rope_type!r} is not supported "
                         f"(supported: {', '.join(sorted(_INV_FREQ))})")
    inv_freq, attention_scaling = _INV_FREQ[rope_type](rope_parameters, rotary_dim, max_positions)
    return RotaryEmbedding(rotary_dim, inv_freq, attention_scaling, max_positions, interleaved, dtype)
