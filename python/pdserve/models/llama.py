"""Llama: the plain GQA decoder (``attention_bias`` biases q/k/v and o alike)."""

from __future__ import annotations

from pdserve.models.decoder import GQACausalLM


class LlamaForCausalLM(GQACausalLM):
    pass
