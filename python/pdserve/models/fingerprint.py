"""Weights fingerprint: which weights a server holds, whatever its path, split or rank.

Prefill and decode compare it (``disagg.bootstrap.CompatRecord.weights``): KV written by one
checkpoint means nothing to another with the same shapes, and the same checkpoint may sit at
different paths on different hosts. It is a sha256 over

- the canonical config: config.json as parsed, less the keys that change neither the weights
  nor the KV (``IGNORED_CONFIG_KEYS``), with ``architectures`` reduced to the one the engine
  builds;
- checkpoint weights: every tensor's name, and for a deterministic sample of tensors (sorted
  names, every k-th plus the first and the last) dtype, shape and a few small windows of
  values read through ``safe_open(...).get_slice`` — bytes read are bounded
  (``MAX_SAMPLED_TENSORS`` x ``len(PROBES)`` x ``WINDOW`` elements), never a whole tensor;
- dummy weights (``--load-format dummy``): "dummy", the seed and the dtype instead. That is
  all they depend on besides the config: ``models/loader.py`` draws them with one generator
  seeded by ``seed`` over the single-rank model's parameters (built from the config alone,
  every split loads slices of that model), in float32, rounded to the model dtype. (And on
  pdserve's model code, whose parameter order the draws follow: both sides run one version.)

It reads the checkpoint, not the loaded (sharded) parameters, so every TP/EP split and rank
gets the same value; tensors are keyed by name, so a checkpoint re-sharded into other files
keeps it. The sample tells different checkpoints apart (every tensor of another training run
or fine-tune differs nearly everywhere); it does not prove two checkpoints equal byte for byte.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import math
import time
from pathlib import Path

from pdserve.config import ModelConfig, architecture_of

logger = logging.getLogger(__name__)

# Part of what is hashed: a change of recipe must change every fingerprint, not match an old one.
RECIPE = "pdserve-weights-v1"
# Keys that say how a checkpoint was produced or is stored, not what its weights are:
# torch_dtype/dtype is the storage dtype (each sampled tensor's own dtype is hashed, and the
# serving dtype is a field of its own in the compatibility record), use_cache a runtime default.
IGNORED_CONFIG_KEYS = frozenset({"_name_or_path", "transformers_version", "torch_dtype", "dtype", "use_cache",
                                 "_commit_hash", "_attn_implementation_autoset"})
MAX_SAMPLED_TENSORS = 64
PROBES = (0.0, 0.5, 1.0)  # where each sampled window sits within a tensor, as a fraction of every dim
WINDOW = 64  # elements per window, contiguous along the last dim


def weights_fingerprint(model_config: ModelConfig, seed: int = 0) -> str:
    """The sha256 hex of ``model_config``'s weights; ``seed`` counts only for dummy weights.
    Computed once per process for each model (cached)."""
    dummy = model_config.load_format == "dummy"
    return _fingerprint(model_config.path, dummy, model_config.dtype if dummy else "", seed if dummy else 0)


@functools.lru_cache(maxsize=8)
def _fingerprint(path: str, dummy: bool, dtype: str, seed: int) -> str:
    start = time.perf_counter()
    h = hashlib.sha256(RECIPE.encode())
    _update(h, canonical_config(Path(path)))
    if dummy:
        _update(h, json.dumps(["dummy", seed, dtype]).encode())
        sampled = 0
    else:
        sampled = hash_checkpoint(h, Path(path))
    digest = h.hexdigest()
    logger.info("weights fingerprint %s (%s, %d tensors sampled, %.1f ms)", digest[:12],
                f"dummy seed {seed}" if dummy else path, sampled, 1e3 * (time.perf_counter() - start))
    return digest


def canonical_config(directory: Path) -> bytes:
    """config.json as the weights see it: ignored keys dropped, ``architectures`` reduced to the
    one the engine builds (its first entry, or the model_type's: the rest of the list never
    reaches a weight, and a different first entry builds another model), keys sorted."""
    raw = json.loads((directory / "config.json").read_text())
    raw["architectures"] = [architecture_of(raw, directory)]
    kept = {k: v for k, v in raw.items() if k not in IGNORED_CONFIG_KEYS}
    return json.dumps(kept, sort_keys=True, separators=(",", ":")).encode()


def hash_checkpoint(h, directory: Path) -> int:
    """Feed ``h`` every tensor name and the sampled tensors' dtype, shape and windows; return how
    many tensors were sampled."""
    from safetensors import safe_open

    files = tensor_files(directory)
    names = sorted(files)
    _update(h, "\n".join(names).encode())
    chosen = sample_names(names)
    with contextlib.ExitStack() as stack:
        opened = {}
        for name in chosen:  # in name order, whichever file holds each tensor
            file = files[name]
            if file not in opened:
                opened[file] = stack.enter_context(safe_open(str(file), framework="pt"))
            _hash_tensor(h, name, opened[file].get_slice(name))
    return len(chosen)


def tensor_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (headers only; the index's map when there is one)."""
    from safetensors import safe_open

    from pdserve.models.loader import INDEX_FILE, safetensors_files

    index = directory / INDEX_FILE
    if index.is_file():
        safetensors_files(directory)  # checks the shards the index names exist
        weight_map = json.loads(index.read_text())["weight_map"]
        shards = {f: directory / f for f in set(weight_map.values())}
        return {n: shards[f] for n, f in weight_map.items()}
    files: dict[str, Path] = {}
    for file in safetensors_files(directory):
        with safe_open(str(file), framework="pt") as f:
            files.update((name, file) for name in f.keys())
    return files


def sample_names(names: list[str]) -> list[str]:
    """Every k-th of the sorted ``names`` (so at most MAX_SAMPLED_TENSORS) plus the last one."""
    if not names:
        return []
    k = max(1, math.ceil(len(names) / MAX_SAMPLED_TENSORS))
    chosen = names[::k]
    return chosen if chosen[-1] == names[-1] else [*chosen, names[-1]]


def _hash_tensor(h, name: str, view) -> None:
    shape = list(view.get_shape())
    _update(h, json.dumps([name, view.get_dtype(), shape]).encode())
    if 0 in shape:
        return
    for frac in PROBES:
        _update(h, _bytes(view[_window(shape, frac)] if shape else view[...]))


def _window(shape: list[int], frac: float) -> tuple[slice, ...]:
    """One element at ``frac`` of each leading dim, WINDOW elements from ``frac`` of the last."""
    lead = [slice(i, i + 1) for i in (round(frac * (d - 1)) for d in shape[:-1])]
    width = min(WINDOW, shape[-1])
    start = round(frac * (shape[-1] - width))
    return (*lead, slice(start, start + width))


def _bytes(tensor) -> bytes:
    import torch

    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _update(h, data: bytes) -> None:
    """Length-prefixed, so no two different sequences of parts hash the same."""
    h.update(len(data).to_bytes(8, "little"))
    h.update(data)
