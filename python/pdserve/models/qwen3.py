"""Qwen3: the GQA decoder with a per-head RMSNorm on q and k before RoPE."""

from __future__ import annotations

from pdserve.models.decoder import GQACausalLM


class Qwen3ForCausalLM(GQACausalLM):
    qk_norm = True
