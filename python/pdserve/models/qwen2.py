"""Qwen2: the GQA decoder with q/k/v biases (and none on o_proj), whatever the config says."""

from __future__ import annotations

from pdserve.models.decoder import GQACausalLM


class Qwen2ForCausalLM(GQACausalLM):
    @staticmethod
    def qkv_bias(c) -> bool:
        return True

    @staticmethod
    def o_bias(c) -> bool:
        return False
