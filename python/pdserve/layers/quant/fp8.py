"""Block-quantized FP8 weights, the format DeepSeek-V3/R1, Kimi-K2 and Qwen3-*-FP8 ship.

Legend: Out, In the full weight's dims; bo, bi the block (128, 128); So = ceil(Out/bo),
Si = ceil(In/bi) the scale grid. A quantized linear ``X.weight`` [Out, In] is float8_e4m3fn
beside ``X.weight_scale_inv`` [So, Si] float32, and W[r, c] = fp8[r, c] * scale[r // bo, c // bi].
Edge blocks are partial (``kv_a_proj_with_mqa`` has 576 rows: 4.5 blocks); their scale covers
the rows/columns that exist.

Which tensors are quantized is read from the checkpoint itself: ``X.weight`` comes with
``X.weight_scale_inv``. ``quantized_checkpoint`` (our own quantizer, for dummy weights and
tests) quantizes what DeepSeek's and Qwen's converters do: every linear of attention, dense
MLP, routed and shared experts; never the MoE router, norms, embeddings, ``lm_head``, nor the
MTP layer's ``eh_proj`` and ``shared_head``. DeepSeek-V3.2's lightning indexer: ``wq_b`` and
``wk`` are quantized, ``weights_proj`` is not (transformers keeps it in float32; the official
checkpoint ships it in bf16 without a scale).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch

from pdserve.config import Fp8BlockConfig  # the format's config lives in config.py (a floor below layers/)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
SCALE_SUFFIX = "_scale_inv"  # "X.weight" -> "X.weight_scale_inv"
# Projection names whose ``.weight`` the converters quantize (attention, MLP, experts, V3.2's indexer).
QUANTIZED_PROJECTIONS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj",
                                   "kv_a_proj_with_mqa", "kv_b_proj", "gate_proj", "up_proj", "down_proj",
                                   "wq_b", "wk"})


def is_quantized_linear(key: str) -> bool:
    """Whether an FP8 converter quantizes checkpoint tensor ``key`` (``mlp.gate`` is the router,
    ``eh_proj``/``shared_head``/``lm_head`` are not in the set, so they stay full precision)."""
    module, _, param = key.rpartition(".")
    return param == "weight" and module.rpartition(".")[2] in QUANTIZED_PROJECTIONS


def scale_grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """(So, Si) for a weight of ``shape`` [Out, In]."""
    (out, inp), (bo, bi) = shape, block
    return -(-out // bo), -(-inp // bi)


def _expand(scale_inv: torch.Tensor, block: tuple[int, int], shape: tuple[int, ...]) -> torch.Tensor:
    """scale_inv [So, Si] -> one scale per weight element [Out, In]."""
    rows = torch.arange(shape[0], device=scale_inv.device) // block[0]  # [Out] block row
    cols = torch.arange(shape[1], device=scale_inv.device) // block[1]  # [In] block column
    return scale_inv[rows[:, None], cols[None, :]]


def quantize_block_fp8(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """w [Out, In] float -> (w_fp8 [Out, In] float8_e4m3fn, scale_inv [So, Si] float32), with
    scale = amax(|block|) / 448 so each block's largest element lands on the FP8 maximum and
    w ~= w_fp8 * scale. An all-zero block gets scale 1 (its FP8 values are zero either way)."""
    out, inp = w.shape
    so, si = scale_grid(tuple(w.shape), block)
    padded = w.new_zeros(so * block[0], si * block[1], dtype=torch.float32)  # zero pad: no effect on amax
    padded[:out, :inp] = w.float()
    amax = padded.view(so, block[0], si, block[1]).abs().amax(dim=(1, 3))  # [So, Si]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w.float() / _expand(scale, block, (out, inp))).clamp(-FP8_MAX, FP8_MAX)  # [Out, In]
    return q.to(FP8_DTYPE), scale


def dequantize_block_fp8(w_fp8: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128),
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w_fp8 [Out, In] * its block's scale, computed in float32, returned in ``dtype``: the same
    arithmetic as any reference dequantizer (fp8 upcast, one float32 multiply), so exact."""
    if tuple(scale_inv.shape) != scale_grid(tuple(w_fp8.shape), block):
        raise ValueError(f"weight_scale_inv: shape {tuple(scale_inv.shape)} does not match a {tuple(w_fp8.shape)} "
                         f"weight in {block[0]}x{block[1]} blocks (expected {scale_grid(tuple(w_fp8.shape), block)})")
    return (w_fp8.float() * _expand(scale_inv.float(), block, tuple(w_fp8.shape))).to(dtype)  # [Out, In]


def quantized_checkpoint(weights: Iterable[tuple[str, torch.Tensor]], cfg: Fp8BlockConfig
                         ) -> Iterator[tuple[str, torch.Tensor]]:
    """Full-precision checkpoint tensors -> the same checkpoint in ``cfg``'s FP8 format: each
    quantized linear becomes ``X.weight`` (FP8) and ``X.weight_scale_inv``; the rest pass as they are."""
    for name, tensor in weights:
        if is_quantized_linear(name) and tensor.dim() == 2:
            w_fp8, scale = quantize_block_fp8(tensor, cfg.block)
            yield name, w_fp8
            yield name + SCALE_SUFFIX, scale
        else:
            yield name, tensor


def dequantized_checkpoint(weights: Iterable[tuple[str, torch.Tensor]], cfg: Fp8BlockConfig, dtype: torch.dtype,
                           keep: Callable[[str], bool] = lambda key: False,
                           unused: Callable[[str], bool] = lambda key: False) -> Iterator[tuple[str, torch.Tensor]]:
    """Pair every FP8 ``X.weight`` with its ``X.weight_scale_inv`` and yield ``X.weight``
    dequantized to ``dtype``, or, where ``keep(X.weight)`` (a layer that holds FP8 itself), the
    pair as it is. Other tensors pass through in stream order. A pair the model will not load
    (``unused``: the MTP layer when not drafting, other EP ranks' experts) is checked and dropped
    undequantized.

    The two halves of a pair may come in either order and from different files: the first one
    waits in a buffer until its partner arrives (memory: the unpaired tensors only). An FP8
    weight without its scale, a scale without its weight, or a scale beside a full-precision
    weight is a ValueError naming the key: never a garbage cast nor a silently skipped tensor.
    """
    waiting_weights: dict[str, torch.Tensor] = {}  # FP8 weight key -> tensor, scale not seen yet
    waiting_scales: dict[str, torch.Tensor] = {}  # weight key -> scale, weight not seen yet
    for name, tensor in weights:
        if name.endswith(".weight" + SCALE_SUFFIX):
            key = name[: -len(SCALE_SUFFIX)]
            if key in waiting_weights:
                yield from _paired(key, waiting_weights.pop(key), tensor, cfg, dtype, keep, unused)
            else:
                waiting_scales[key] = tensor
        elif tensor.dtype.is_floating_point and tensor.element_size() == 1:  # any FP8 kind
            if name in waiting_scales:
                yield from _paired(name, tensor, waiting_scales.pop(name), cfg, dtype, keep, unused)
            else:
                waiting_weights[name] = tensor
        elif name in waiting_scales:
            raise ValueError(f"{name}{SCALE_SUFFIX}: a block scale for {name}, which is {tensor.dtype}, not FP8")
        else:
            yield name, tensor
    if waiting_weights:
        key = sorted(waiting_weights)[0]
        raise ValueError(f"{key}: FP8 weight without its block scale {key}{SCALE_SUFFIX} in the checkpoint "
                         f"({len(waiting_weights)} such weight(s))")
    if waiting_scales:
        key = sorted(waiting_scales)[0]
        raise ValueError(f"{key}{SCALE_SUFFIX}: block scale without its weight {key} in the checkpoint")


def _paired(key: str, w_fp8: torch.Tensor, scale_inv: torch.Tensor, cfg: Fp8BlockConfig, dtype: torch.dtype,
            keep: Callable[[str], bool], unused: Callable[[str], bool]) -> Iterator[tuple[str, torch.Tensor]]:
    if w_fp8.dtype != FP8_DTYPE:
        raise ValueError(f"{key}: checkpoint tensor is {w_fp8.dtype}; quantization_config.fmt e4m3 wants "
                         f"{FP8_DTYPE}")
    if unused(key):
        return
    if keep(key):
        scale_grid(tuple(w_fp8.shape), cfg.block)  # 2-D, or the unpack raises
        yield key, w_fp8
        yield key + SCALE_SUFFIX, scale_inv.float()
        return
    try:
        yield key, dequantize_block_fp8(w_fp8, scale_inv, cfg.block, dtype)
    except ValueError as e:
        raise ValueError(f"{key}{SCALE_SUFFIX}: {e}") from None


# ---------------------------------------------------------------------------- FP8 held by a layer (GPU)


def hold_fp8(module: torch.nn.Module, block: tuple[int, int], name: str = "weight") -> None:
    """Swap ``module.<name>`` [..., Out, In] for an FP8 parameter of the same shape plus
    ``<name>_scale_inv`` [..., So, Si] float32, both filled by the loader from the checkpoint's
    pair as it is (no dequantize, no requantize)."""
    w = getattr(module, name)
    *lead, out, inp = w.shape
    setattr(module, name, torch.nn.Parameter(torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device),
                                             requires_grad=False))
    scale = torch.ones(*lead, *scale_grid((out, inp), block), dtype=torch.float32, device=w.device)
    setattr(module, name + SCALE_SUFFIX, torch.nn.Parameter(scale, requires_grad=False))


def block_rows_aligned(start: int, size: int, full: int, bo: int, last: bool) -> bool:
    """Whether rows [start, start + size) of a [full, ...] weight, placed at a block-aligned spot
    (``last``: the final rows of the local weight), keep whole scale blocks: they start on a
    block and end on one, or at the end of the weight (its partial edge block)."""
    return start % bo == 0 and (size % bo == 0 or (last and start + size == full))


def fp8_linear(x: torch.Tensor, w_fp8: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., In] -> [..., Out] through the block-scaled W8A8 GEMM (activations quantized per token
    group of ``block[1]``); output in x's dtype. Kernels import lazily: Triton/DeepGEMM are GPU-only."""
    from pdserve.layers.quant.fp8_kernels import w8a8_block_matmul

    y = w8a8_block_matmul(x.reshape(-1, x.shape[-1]), w_fp8, scale_inv, block)  # [T, Out]
    y = y.view(*x.shape[:-1], y.shape[-1])
    return y if bias is None else y + bias


def keep_fp8_layers(model: torch.nn.Module, cfg: Fp8BlockConfig, quantized: Callable[[str], bool]) -> set[str]:
    """Let every layer that can hold FP8 weights do so (``keep_fp8(block, prefix, quantized)``:
    linears and routed experts whose checkpoint weights are all ``quantized`` and whose TP
    shard boundaries fall on block edges); return the checkpoint keys it will load as FP8
    pairs. The loader dequantizes every other quantized key."""
    kept: set[str] = set()
    for path, module in model.named_modules():
        keep = getattr(module, "keep_fp8", None)
        if keep is not None:
            kept |= keep(cfg.block, path, quantized)
    return kept
