"""HF architecture name -> pdserve model class, imported only when asked for."""

from __future__ import annotations

import importlib

_MODELS = {
    "LlamaForCausalLM": ("pdserve.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("pdserve.models.llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("pdserve.models.llama", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("pdserve.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "DeepseekV2ForCausalLM": ("pdserve.models.deepseek", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("pdserve.models.deepseek", "DeepseekV3ForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str):
    if architecture not in _MODELS:
        raise ValueError(f"architectures: {architecture!r} is not supported "
                         f"(supported: {', '.join(supported_architectures())})")
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(module), name)
