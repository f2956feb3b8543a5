"""Build a model from a ModelConfig: real weights from safetensors, or seeded dummy weights."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path, PurePosixPath, PureWindowsPath

import torch
from torch import nn

from pdserve.config import Fp8BlockConfig, ModelConfig
from pdserve.distributed.parallel_state import SINGLE, ParallelState
from pdserve.layers.norm import RMSNorm
from pdserve.layers.quant.fp8 import (
    SCALE_SUFFIX,
    dequantized_checkpoint,
    is_quantized_linear,
    keep_fp8_layers,
    quantized_checkpoint,
)
from pdserve.models.base import CausalLM, checkpoint_tensors, weight_spec
from pdserve.models.registry import get_model_class

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(path: str | Path) -> list[Path]:
    """The checkpoint files of a model directory: the shards an index names, or every
    ``*.safetensors``. Raises ValueError when there are none or a named shard is absent."""
    directory = Path(path)
    index = directory / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not weight_map:
            raise ValueError(f"{index}: has no weight_map")
        files = [directory / name for name in sorted(set(_shard_names(index, weight_map)))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ValueError(f"{index}: names shard file(s) that do not exist: {', '.join(absent)}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model_path: {directory} has no model.safetensors or {INDEX_FILE} "
                         f"(only safetensors weights are supported; pass --load-format dummy for random weights)")
    return files


def _shard_names(index: Path, weight_map: object) -> list[str]:
    """The index's shard names, each a relative path that stays inside the model directory: an
    index is data (a downloaded checkpoint), so ``../x`` or ``/etc/x`` must not pick the files read.
    Checked on the names, not the resolved files: a Hugging Face cache links its shards elsewhere."""
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index}: weight_map must be an object of tensor name -> shard file")
    names = []
    for tensor, name in weight_map.items():
        parts = PurePosixPath(name).parts if isinstance(name, str) else ()
        if not parts or name.startswith(("/", "\\")) or "\\" in name or any(p in ("..", ".") for p in parts) \
                or PureWindowsPath(name).drive:
            raise ValueError(f"{index}: weight_map[{tensor!r}] = {name!r} is not a file inside the model directory "
                             "(shard names are relative paths without '..')")
        names.append(name)
    return names


def iter_safetensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every checkpoint file, one tensor in memory at a time."""
    from safetensors import safe_open

    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Seeded random weights that give a tiny model varied greedy output.

    Matrices ~ N(0, (2.4/sqrt(fan_in))^2): transformers' 0.02 makes small models collapse
    onto one token, which would let engine tests pass vacuously. Norm weights are 1 and
    other vectors (biases) small, so activations stay O(1) through every layer.
    """
    gen = torch.Generator().manual_seed(seed)
    norm_weights = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    with torch.no_grad():
        for _, p in model.named_parameters():
            if id(p) in norm_weights:
                p.fill_(1.0)
                continue
            std = 2.4 / p.shape[-1] ** 0.5 if p.dim() >= 2 else 0.05
            p.copy_(torch.randn(p.shape, generator=gen) * std)


def dummy_checkpoint(model_config: ModelConfig, seed: int) -> list[tuple[str, torch.Tensor]]:
    """The single-rank model's seeded dummy weights as checkpoint tensors, so every split of the
    model loads slices of the same weights (and TP/EP runs equal the single-rank run). Builds
    the whole model once in host memory."""
    full = get_model_class(model_config.architecture)(model_config.hf_config, SINGLE, model_config.torch_dtype)
    init_dummy_weights(full, seed)
    return list(checkpoint_tensors(full))


def checkpoint_weights(model_config: ModelConfig, seed: int, model: nn.Module, keep_fp8: bool = False
                       ) -> Iterable[tuple[str, torch.Tensor]]:
    """The tensors ``model`` loads: the checkpoint's, or the seeded dummy ones. With a quantized
    (FP8) config, dummy weights are first quantized by our own quantizer, so they take the same
    path as a real FP8 checkpoint; then every FP8 pair is dequantized to the model dtype
    (exact), except those of layers that hold FP8 themselves (``keep_fp8``, on GPU)."""
    dummy = model_config.load_format == "dummy"
    weights: Iterable[tuple[str, torch.Tensor]] = (dummy_checkpoint(model_config, seed) if dummy
                                                   else iter_safetensors(model_config.path))
    quant = model_config.quantization
    if quant is None:
        return weights
    if quant.expert_dtype == "fp4":
        return _fp4_expert_weights(weights, quant, model_config.torch_dtype, model, dummy, keep_fp8)
    if dummy:
        weights = quantized_checkpoint(weights, quant)
        quantized = is_quantized_linear
    else:
        names = set(tensor_names(model_config.path))
        quantized = lambda key: key + SCALE_SUFFIX in names  # noqa: E731  (the checkpoint says which)
    kept = keep_fp8_layers(model, quant, quantized) if keep_fp8 else set()
    spec = weight_spec(model)  # after keep_fp8_layers: FP8 layers also take the scales
    # Entries with no units are accepted but not this rank's (another EP rank's experts).
    unused = lambda key: key not in spec or not spec[key].units  # noqa: E731
    return dequantized_checkpoint(weights, quant, model_config.torch_dtype, keep=kept.__contains__, unused=unused)


def _fp4_expert_weights(weights: Iterable[tuple[str, torch.Tensor]], quant: Fp8BlockConfig, dtype: torch.dtype,
                        model: nn.Module, dummy: bool, keep: bool) -> Iterable[tuple[str, torch.Tensor]]:
    """DeepSeek-V4's format (FP4 experts, FP8 linears), dequantized on load, except, with ``keep`` (the
    CUDA runner), the routed experts of layers that hold FP4 themselves (``keep_fp4``). Its FP8
    linears are dequantized on every device for now. Dummy weights go through our quantizer first."""
    from pdserve.layers.quant.fp4 import dequantized_v4_checkpoint, quantized_v4_checkpoint
    from pdserve.models.deepseek_v4 import module_key

    if dummy:
        weights = quantized_v4_checkpoint(weights, quant)
    kept: set[str] = set()
    for path, module in model.named_modules() if keep else ():
        if hasattr(module, "keep_fp4"):
            kept |= module.keep_fp4(path)
    spec = weight_spec(model)  # after keep_fp4: held experts also take their scales
    unused = lambda key: module_key(key) not in spec  # noqa: E731  (the MTP layer's, not loaded)
    return dequantized_v4_checkpoint(weights, quant, dtype, unused=unused, keep=lambda key: module_key(key) in kept)


def tensor_names(path: str | Path) -> Iterator[str]:
    """Every tensor name of the checkpoint files (headers only)."""
    from safetensors import safe_open

    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            yield from f.keys()


def load_model(model_config: ModelConfig, parallel: ParallelState = SINGLE, seed: int = 0,
               keep_fp8: bool = False) -> CausalLM:
    """The model for ``model_config`` in its dtype, in eval mode, without gradients.

    ``load_format``: "dummy" -> seeded random weights (the same on any split); "auto" /
    "safetensors" -> the checkpoint in ``model_config.path`` (single file or sharded with an index).
    ``keep_fp8`` (the CUDA runner): layers of an FP8 checkpoint keep FP8 weights where their
    shards fall on scale blocks; otherwise (CPU) FP8 weights are dequantized on load.
    Raises ValueError for an unknown architecture, absent weight files, or missing tensors.
    """
    cls = get_model_class(model_config.architecture)
    with torch.no_grad():
        model = cls(model_config.hf_config, parallel, model_config.torch_dtype)
        if model_config.load_format == "dummy" and parallel.is_single and model_config.quantization is None:
            init_dummy_weights(model, seed)
            model.process_weights_after_loading()
        else:
            model.load_weights(checkpoint_weights(model_config, seed, model, keep_fp8))
    model.eval()
    model.requires_grad_(False)
    return model
