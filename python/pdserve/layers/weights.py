"""How a layer takes its weights from a checkpoint.

A checkpoint is a flat ``name -> tensor`` map in the HF layout; a layer's
parameters may be fused (QKV, gate+up, all experts in one tensor) and sharded
(TP, EP). Each layer therefore describes the checkpoint tensors it consumes as
``WeightEntry``s: the key, a function that copies this rank's part of the
tensor into place, and the *units* (pieces of parameters) the tensor fills.
The loader checks that every unit was filled, so a missing tensor is reported
by its checkpoint name instead of surfacing later as garbage output.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn


@dataclass(frozen=True)
class WeightEntry:
    key: str  # checkpoint tensor name, e.g. "model.layers.0.self_attn.q_proj.weight"
    load: Callable[[torch.Tensor], None]  # copies this rank's part; raises ValueError on a bad shape
    units: tuple[str, ...]  # parameter pieces this tensor fills; () = accepted but not required
    canonical: bool = True  # False: an alternative layout (e.g. fused experts) that also fills ``units``


def check_shape(key: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"{key}: checkpoint tensor has shape {tuple(tensor.shape)}, expected {tuple(expected)}")


_SCALED_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                   "float8_e5m2fnuz") if hasattr(torch, n))


def copy_into(key: str, dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy ``src`` (whole checkpoint tensor or its slice) into ``dst``, casting to dst's dtype."""
    if src.dtype in _SCALED_DTYPES and dst.dtype != src.dtype:
        # A plain cast would drop the block scales (``weight_scale_inv``) and load garbage; FP8
        # checkpoints load through layers/quant/fp8.py when config.json names their quantization_config.
        raise ValueError(f"{key}: checkpoint tensor is {src.dtype} but config.json has no supported "
                         f"quantization_config (FP8 checkpoints need quantization_config.quant_method 'fp8')")
    if dst.dtype in _SCALED_DTYPES and dst.dtype != src.dtype:
        raise ValueError(f"{key}: this layer holds {dst.dtype} weights but the checkpoint tensor is {src.dtype} "
                         f"(a quantized layer needs its FP8 weight and weight_scale_inv)")
    check_shape(key, src, tuple(dst.shape))
    with torch.no_grad():
        dst.copy_(src)


def direct_tensors(module: nn.Module, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint key, tensor) of every parameter/persistent buffer owned directly by ``module``."""
    tensors: dict[str, torch.Tensor] = dict(module.named_parameters(recurse=False))
    tensors.update({n: b for n, b in module.named_buffers(recurse=False)
                    if n not in module._non_persistent_buffers_set})
    for name, tensor in tensors.items():
        yield (f"{prefix}.{name}" if prefix else name), tensor


def direct_entries(module: nn.Module, prefix: str) -> Iterator[WeightEntry]:
    """One entry per parameter/persistent buffer owned directly by ``module``, copied whole."""
    for key, tensor in direct_tensors(module, prefix):
        yield WeightEntry(key, partial(copy_into, key, tensor), (key,))


def sibling(prefix: str, name: str) -> str:
    """``model.layers.0.self_attn.qkv_proj`` + ``q_proj`` -> ``model.layers.0.self_attn.q_proj``."""
    parent = prefix.rpartition(".")[0]
    return f"{parent}.{name}" if parent else name
