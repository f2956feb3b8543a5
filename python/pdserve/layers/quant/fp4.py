"""DeepSeek-V4's checkpoint format: routed experts in FP4 (e2m1, MXFP4-like), every other quantized
linear block-FP8 as DeepSeek-V3's (layers/quant/fp8.py). ``quantization_config`` is V3's plus
``expert_dtype: "fp4"`` (and ``scale_fmt: "ue8m0"``).

Legend: Out, In a weight's dims; B = 32 the FP4 block along In; P = In / 2 packed bytes per row.

An FP4 expert ``X.weight`` is int8 [Out, P]: byte j of a row holds columns 2j (low nibble) and
2j + 1 (high nibble), each an e2m1 code (bit 3 the sign, bits 0-2 index 0, 0.5, 1, 1.5, 2, 3, 4, 6;
code 8 is negative zero). Its scale ``X.weight_scale_inv`` (DeepSeek ships it as ``X.scale``) is
[Out, In / B], one ue8m0 byte per row and block of B columns (float8_e8m0fnu, or its raw uint8),
worth 2^(byte - 127). W[r, c] = e2m1(code[r, c]) * 2^(scale[r, c // B] - 127): both factors are
exact in float32, so the dequantized weight is exact in float32 (and in bf16, which holds every
e2m1 value times a power of two in its range).

Which tensors are which is read from the checkpoint itself (the weight's dtype): an int8 weight
is FP4, a float8_e4m3fn one is FP8. Our quantizer (dummy weights, presets, tests) quantizes what
DeepSeek-V4-Flash ships quantized: routed experts FP4; attention's ``wq_a``, ``wq_b``, ``wkv``,
``wo_b``, the indexer's ``wq_b`` and the shared experts FP8. It leaves as they are the grouped
``wo_a``, the compressors' ``wkv``/``wgate``, the indexer's ``weights_proj`` (shipped in BF16),
the router, norms, hyper-connections, embeddings and the head.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator

import torch

from pdserve.config import Fp8BlockConfig
from pdserve.layers.quant.fp8 import FP8_DTYPE, SCALE_SUFFIX, dequantize_block_fp8, quantize_block_fp8

FP4_BLOCK = 32  # columns per ue8m0 scale
UE8M0_BIAS = 127
# e2m1 code -> value; codes 8..15 are the negatives of 0..7 (code 8: -0.0).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E2M1_MAX = 6.0
# Both namings: DeepSeek's as shipped (``attn.wq_a``, ``ffn.experts.3.w1``) and the module names.
_FP4 = re.compile(r"\.experts\.\d+\.w[123]\.weight$")
_FP8 = re.compile(r"(\.(attn|self_attn)\.(wq_a|wq_b|wkv|wo_b|q_a_proj|q_b_proj|kv_proj|o_b_proj)"
                  r"|\.indexer\.(wq_b|q_b_proj)"
                  r"|\.shared_experts\.(w1|w2|w3|gate_proj|up_proj|down_proj))\.weight$")


def is_fp4_expert(key: str) -> bool:
    return _FP4.search(key) is not None


def is_v4_fp8_linear(key: str) -> bool:
    return _FP8.search(key) is not None


# ---------------------------------------------------------------------------- the FP4 format


def ue8m0_exponents(scale: torch.Tensor) -> torch.Tensor:
    """A ue8m0 scale (float8_e8m0fnu, or its raw bytes as uint8) -> its biased exponents as int32."""
    if scale.dtype == torch.uint8:
        return scale.int()
    if scale.dtype == getattr(torch, "float8_e8m0fnu", None):
        return scale.view(torch.uint8).int()
    raise ValueError(f"dtype {scale.dtype}, expected float8_e8m0fnu or uint8 (ue8m0 exponents)")


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """packed int8 [Out, P], scale ue8m0 [Out, 2P / B] -> W [Out, 2P] in ``dtype`` (exact)."""
    if packed.dtype not in (torch.int8, torch.uint8) or packed.dim() != 2:
        raise ValueError(f"FP4 weight: {packed.dtype} {tuple(packed.shape)}, expected int8 [Out, In / 2]")
    out, cols = packed.shape[0], 2 * packed.shape[1]
    if cols % FP4_BLOCK or tuple(scale.shape) != (out, cols // FP4_BLOCK):
        raise ValueError(f"shape {tuple(scale.shape)} does not match an FP4 weight of {out} x {cols} in blocks of "
                         f"1 x {FP4_BLOCK} (expected {(out, cols // FP4_BLOCK)})")
    exps = ue8m0_exponents(scale)
    if int(exps.max()) == 255:
        raise ValueError("a ue8m0 scale is 0xFF (NaN)")
    u8 = packed.view(torch.uint8).int()
    codes = torch.stack([u8 & 0xF, u8 >> 4], dim=-1).view(out, cols)  # [Out, In], column 2j from the low nibble
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)[codes]  # [Out, In]
    per_col = (exps.float() - UE8M0_BIAS).exp2()  # [Out, In / B]
    return (values * per_col.repeat_interleave(FP4_BLOCK, dim=1)).to(dtype)


def quantize_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [Out, In] float -> (packed int8 [Out, In / 2], scale [Out, In / B] ue8m0): each block's scale
    the smallest power of two putting its largest |element| within 6, elements rounded to the nearest
    e2m1 value. An all-zero block gets 2^0."""
    out, cols = w.shape
    if cols % FP4_BLOCK:
        raise ValueError(f"FP4 weight: {cols} columns, not a multiple of the block {FP4_BLOCK}")
    blocks = w.float().view(out, cols // FP4_BLOCK, FP4_BLOCK)
    amax = blocks.abs().amax(dim=-1)  # [Out, In / B]
    exp = torch.where(amax > 0, torch.ceil(torch.log2(amax / E2M1_MAX)), torch.zeros_like(amax)).int()
    exp = exp.clamp(-UE8M0_BIAS, UE8M0_BIAS)
    scaled = (blocks / exp.float().exp2()[..., None]).view(out, cols)
    magnitudes = torch.tensor(E2M1_VALUES[:8])
    codes = (scaled.abs()[..., None] - magnitudes).abs().argmin(dim=-1)  # [Out, In] 0..7
    codes = codes | (scaled < 0).long() << 3
    pairs = codes.view(out, cols // 2, 2)
    packed = (pairs[..., 0] | pairs[..., 1] << 4).to(torch.uint8).view(torch.int8)  # [Out, In / 2]
    return packed, _ue8m0(exp + UE8M0_BIAS)


def _ue8m0(biased: torch.Tensor) -> torch.Tensor:
    raw = biased.to(torch.uint8)
    e8m0 = getattr(torch, "float8_e8m0fnu", None)
    return raw.view(e8m0) if e8m0 is not None else raw


# ---------------------------------------------------------------------------- the checkpoint


def quantized_v4_checkpoint(weights: Iterable[tuple[str, torch.Tensor]], cfg: Fp8BlockConfig
                            ) -> Iterator[tuple[str, torch.Tensor]]:
    """Full-precision V4 checkpoint tensors -> V4's shipped format: FP4 experts, FP8 linears. Experts
    fused as transformers holds them (our dummy weights) are split into DeepSeek's per-expert tensors."""
    for name, tensor in _per_expert(weights):
        if is_fp4_expert(name):
            packed, scale = quantize_fp4(tensor)
        elif is_v4_fp8_linear(name):
            packed, scale = quantize_block_fp8(tensor, cfg.block)
        else:
            yield name, tensor
            continue
        yield name, packed
        yield name + SCALE_SUFFIX, scale


def _per_expert(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``X.experts.gate_up_proj`` [E, 2I, Hd] -> ``X.experts.{e}.w1.weight`` (gate rows) and ``w3`` (up
    rows); ``X.experts.down_proj`` [E, Hd, I] -> ``X.experts.{e}.w2.weight``; the rest as it is."""
    for name, tensor in weights:
        prefix, _, fused = name.rpartition(".")
        if not prefix.endswith(".experts") or fused not in ("gate_up_proj", "down_proj") or tensor.dim() != 3:
            yield name, tensor
        elif fused == "down_proj":
            yield from ((f"{prefix}.{e}.w2.weight", w) for e, w in enumerate(tensor))
        else:
            for e, w in enumerate(tensor):
                gate, up = w.chunk(2)  # [I, Hd] each
                yield f"{prefix}.{e}.w1.weight", gate
                yield f"{prefix}.{e}.w3.weight", up


def scale_key(name: str) -> str | None:
    """The weight key a checkpoint scale belongs to, None if ``name`` is no block scale. DeepSeek ships
    ``X.scale``; transformers saves ``X.weight_scale_inv``; the hyper-connections' own ``*_hc.scale``
    (module names) and ``hc_*_scale`` (DeepSeek's) are parameters, not scales."""
    if name.endswith(".weight" + SCALE_SUFFIX):
        return name[: -len(SCALE_SUFFIX)]
    if name.endswith(".scale") and not name.endswith("_hc.scale"):
        return name[: -len(".scale")] + ".weight"
    return None


def dequantized_v4_checkpoint(weights: Iterable[tuple[str, torch.Tensor]], cfg: Fp8BlockConfig, dtype: torch.dtype,
                              unused: Callable[[str], bool] = lambda key: False,
                              keep: Callable[[str], bool] = lambda key: False
                              ) -> Iterator[tuple[str, torch.Tensor]]:
    """Pair each quantized ``X.weight`` (int8: FP4; float8_e4m3fn: FP8) with its scale and yield it
    dequantized to ``dtype``, or, where ``keep(X.weight)`` (FP4 experts a layer holds as they are, on
    GPU), the packed weight and its ue8m0 exponents as uint8 ``X.weight_scale_inv``; other tensors
    pass through in stream order. The halves of a pair may
    come in either order and from different files (the first waits for its partner). A weight
    without its scale, a scale without its weight, or a scale beside a full-precision weight is a
    ValueError naming the key. ``unused`` pairs (the MTP layer) are checked for presence and dropped."""
    weights_waiting: dict[str, torch.Tensor] = {}
    scales_waiting: dict[str, tuple[str, torch.Tensor]] = {}  # weight key -> (scale's name, scale)
    for name, tensor in weights:
        key = scale_key(name)
        if key is not None:
            if key in weights_waiting:
                yield from _pair(key, weights_waiting.pop(key), name, tensor, cfg, dtype, unused, keep)
            else:
                scales_waiting[key] = (name, tensor)
        elif tensor.dtype in (torch.int8, FP8_DTYPE):
            if name in scales_waiting:
                yield from _pair(name, tensor, *scales_waiting.pop(name), cfg, dtype, unused, keep)
            else:
                weights_waiting[name] = tensor
        elif name in scales_waiting:
            raise ValueError(f"{scales_waiting[name][0]}: a block scale for {name}, which is {tensor.dtype}, "
                             "not FP8 or FP4")
        else:
            yield name, tensor
    if weights_waiting:
        key = sorted(weights_waiting)[0]
        raise ValueError(f"{key}: quantized weight without its block scale in the checkpoint "
                         f"({len(weights_waiting)} such weight(s))")
    if scales_waiting:
        name = sorted(v[0] for v in scales_waiting.values())[0]
        raise ValueError(f"{name}: block scale without its weight in the checkpoint")


def _pair(key: str, weight: torch.Tensor, scale_name: str, scale: torch.Tensor, cfg: Fp8BlockConfig,
          dtype: torch.dtype, unused: Callable[[str], bool], keep: Callable[[str], bool]
          ) -> Iterator[tuple[str, torch.Tensor]]:
    if unused(key):
        return
    try:
        if weight.dtype == torch.int8 and keep(key):
            dequantize_fp4(weight[:1], scale[:1])  # the pair's shapes and scale dtype checked, one row
            yield key, weight
            yield key + SCALE_SUFFIX, ue8m0_exponents(scale).to(torch.uint8)
        elif weight.dtype == torch.int8:
            yield key, dequantize_fp4(weight, scale, dtype)
        else:
            yield key, dequantize_block_fp8(weight, _fp8_scale(scale), cfg.block, dtype)
    except ValueError as e:
        raise ValueError(f"{scale_name}: {e}") from None


def _fp8_scale(scale: torch.Tensor) -> torch.Tensor:
    """An FP8 block scale as float32: float32 as V3 ships it, or ue8m0 bytes (V4-Flash's ``scale_fmt``)."""
    if scale.dtype in (torch.uint8, getattr(torch, "float8_e8m0fnu", None)):
        exps = ue8m0_exponents(scale)
        return (exps.float() - UE8M0_BIAS).exp2()
    return scale.float()


# ---------------------------------------------------------------------------- FP4 experts held by a layer (GPU)


def hold_fp4(module: torch.nn.Module, name: str) -> None:
    """Swap ``module.<name>`` [E, Out, In] for its packed FP4 form, int8 [E, Out, In/2], plus
    ``<name>_scale`` uint8 [E, Out, In/B] (ue8m0 exponents), both filled by the loader from the
    checkpoint's pairs as they are."""
    w = getattr(module, name)
    E, out, inp = w.shape
    if inp % FP4_BLOCK:
        raise ValueError(f"{name}: {inp} columns, not a multiple of the FP4 block {FP4_BLOCK}")
    packed = torch.zeros(E, out, inp // 2, dtype=torch.int8, device=w.device)
    setattr(module, name, torch.nn.Parameter(packed, requires_grad=False))
    scale = torch.full((E, out, inp // FP4_BLOCK), UE8M0_BIAS, dtype=torch.uint8, device=w.device)
    setattr(module, name + "_scale", torch.nn.Parameter(scale, requires_grad=False))


def fused_moe_fp4(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                  w2_scale: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  swiglu_limit: float | None = None) -> torch.Tensor:
    """x [T, Hd], w13 int8 [E, 2I, Hd/2] (gate | up rows) with ue8m0 w13_scale [E, 2I, Hd/B], w2 int8
    [E, Hd, I/2] with w2_scale [E, Hd, I/B], topk_weights [T, k] float32, topk_ids [T, k] ->
    sum_k topk_weights * down(clamped swiglu(gate, up)) [T, Hd] in x.dtype. On CUDA the Triton kernel
    (pdserve_kernels.fp4_moe, dequantizing its tiles in-kernel), elsewhere its torch twin; both are
    imported here, on first use, so importing pdserve never imports Triton."""
    E, I2, Hp = w13.shape
    if w13.dtype != torch.int8 or w2.dtype != torch.int8 or tuple(w2.shape) != (E, 2 * Hp, I2 // 4):
        raise ValueError(f"w13 {w13.dtype} {tuple(w13.shape)}, w2 {w2.dtype} {tuple(w2.shape)}: expected int8 "
                         "w13 [E, 2I, Hd/2] and w2 [E, Hd, I/2]")
    for name, w, s in (("w13_scale", w13, w13_scale), ("w2_scale", w2, w2_scale)):
        if tuple(s.shape) != (*w.shape[:2], 2 * w.shape[2] // FP4_BLOCK) or 2 * w.shape[2] % FP4_BLOCK:
            raise ValueError(f"{name}: shape {tuple(s.shape)}, expected {(*w.shape[:2], 2 * w.shape[2] // FP4_BLOCK)} "
                             f"(one scale per row and {FP4_BLOCK} columns)")
    if x.dim() != 2 or x.shape[1] != 2 * Hp or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"x {tuple(x.shape)}, topk_ids {tuple(topk_ids.shape)}, topk_weights "
                         f"{tuple(topk_weights.shape)}: expected x [T, {2 * Hp}] and both [T, k]")
    s13, s2 = (ue8m0_exponents(s).to(torch.uint8) for s in (w13_scale, w2_scale))
    if x.is_cuda:
        from pdserve_kernels.fp4_moe import fused_moe_fp4 as fused

        return fused(x, w13, s13, w2, s2, topk_weights, topk_ids, swiglu_limit)
    from pdserve_kernels.fp4_ref import fused_moe_fp4_ref

    return fused_moe_fp4_ref(x, w13, s13, w2, s2, topk_weights, topk_ids, swiglu_limit)
