"""Attention backends by name; each is imported only when selected."""

from __future__ import annotations

import importlib

from pdserve.layers.attention.base import AttentionBackend

_BACKENDS = {
    "torch_native": ("pdserve.layers.attention.torch_native", "TorchNativeBackend"),
    "triton": ("pdserve.layers.attention.triton", "TritonBackend"),
    "flashinfer": ("pdserve.layers.attention.flashinfer", "FlashInferBackend"),
}


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def create_backend(name: str) -> AttentionBackend:
    if name not in _BACKENDS:
        raise ValueError(f"attention_backend: {name!r} is not one of {available_backends()}")
    module, cls = _BACKENDS[name]
    return getattr(importlib.import_module(module), cls)()
