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
- the weight quantization (``ModelConfig.quantization``, e.g. ``fp8-block128x128``) when there is
  one: FP8 weights and their dequantized copy are different weights to serve;
- dummy weights (``--load-format dummy``): "dummy", the seed and the dtype instead. That is
  all they depend on besides the config: ``models/loader.py`` draws them with one generator
  seeded by ``seed`` over the single-rank model's parameters (built from the config alone,
  every split loads slices of that model), in float32, rounded to the model dtype. (And on
  pdserve's model code, whose parameter order the draws follow: both sides run one version.)

It reads the checkpoint, not the loaded (sharded) parameters, so every TP/EP split and rank
gets the same value; tensors are keyed by name, so a checkpoint re-sharded into other files
keeps it. The sample tells different checkpoints apart (every tensor of another training run
or fine-tune differs nearly everywhere); it does not prove two checkpoints equal byte for byte.

``content_fingerprint`` does: the storage tier keeps KV across restarts, so weights swapped at
the same path (a partial fine-tune, a layer edited, an update that changes a few tensors)
must never find the old model's pages. It hashes the canonical config and, for every tensor
in name order, its name, dtype, shape and a sha256 of all its bytes, read from the
safetensors files (headers parsed here, data through mmap), tensors hashed on
``HASH_THREADS`` threads (hashlib releases the GIL). No size/mtime shortcut and no cache across
calls: a file overwritten in place keeps its size and may keep its mtime. Cost: one read of
the checkpoint (warm in the page cache right after loading) and sha256 at 0.6-1 GB/s per core
(0.8 GB in 1.4 s on one busy core here): seconds for a 16 GB checkpoint on 8 free cores,
minutes for 700 GB. Called once per process (each TP rank) at start-up, and only when a storage
tier is configured.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import math
import mmap
import time
from concurrent.futures import ThreadPoolExecutor
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
CONTENT_RECIPE = "pdserve-weights-content-v1"
HASH_THREADS = 8
MAX_HEADER_BYTES = 100 << 20  # safetensors' own bound on a file's JSON header


def weights_fingerprint(model_config: ModelConfig, seed: int = 0) -> str:
    """The sha256 hex of ``model_config``'s weights; ``seed`` counts only for dummy weights.
    Computed once per process for each model (cached)."""
    dummy = model_config.load_format == "dummy"
    quant = model_config.quantization
    return _fingerprint(model_config.path, dummy, model_config.dtype if dummy else "", seed if dummy else 0,
                        quant.name if quant is not None else "")


@functools.lru_cache(maxsize=8)
def _fingerprint(path: str, dummy: bool, dtype: str, seed: int, quantization: str = "") -> str:
    start = time.perf_counter()
    h = hashlib.sha256(RECIPE.encode())
    _update(h, canonical_config(Path(path)))
    if quantization:  # in the config too; hashed as its own part so no config edit can drop it
        _update(h, json.dumps(["quantization", quantization]).encode())
    if dummy:
        _update(h, json.dumps(["dummy", seed, dtype]).encode())
        sampled = 0
    else:
        sampled = hash_checkpoint(h, Path(path))
    digest = h.hexdigest()
    logger.info("weights fingerprint %s (%s, %d tensors sampled, %.1f ms)", digest[:12],
                f"dummy seed {seed}" if dummy else path, sampled, 1e3 * (time.perf_counter() - start))
    return digest


def content_fingerprint(model_config: ModelConfig, seed: int = 0) -> str:
    """The sha256 hex of the config and every byte of every checkpoint tensor (dummy weights:
    the config, seed and dtype, all they depend on). Reads the whole checkpoint on every call."""
    start = time.perf_counter()
    directory = Path(model_config.path)
    h = hashlib.sha256(CONTENT_RECIPE.encode())
    _update(h, canonical_config(directory))
    nbytes = 0
    if model_config.load_format == "dummy":
        _update(h, json.dumps(["dummy", seed, model_config.dtype]).encode())
    else:
        for name, dtype, shape, digest, size in checkpoint_digests(directory):
            _update(h, json.dumps([name, dtype, shape]).encode())
            _update(h, digest)
            nbytes += size
    digest_hex = h.hexdigest()
    logger.info("weights content fingerprint %s (%s, %.2f GB hashed in %.1f s)", digest_hex[:12], directory,
                nbytes / 1e9, time.perf_counter() - start)
    return digest_hex


TensorDigest = tuple[str, str, list[int], bytes, int]  # name, dtype, shape, sha256 of the bytes, byte count


def checkpoint_digests(directory: Path) -> list[TensorDigest]:
    """Every tensor of the checkpoint files (the loader's list), sorted by name (a name in two
    files keeps the files' order), each with the sha256 of its bytes."""
    from pdserve.models.loader import safetensors_files

    with contextlib.ExitStack() as stack:
        jobs = []
        for file in safetensors_files(directory):
            view, tensors = stack.enter_context(_mapped(file))
            jobs += [(view, *t) for t in tensors]
        with ThreadPoolExecutor(max_workers=HASH_THREADS) as pool:
            digests = list(pool.map(lambda job: _digest(*job), jobs))
    return sorted(digests, key=lambda d: d[0])


@contextlib.contextmanager
def _mapped(file: Path):
    """(the file's bytes as a memoryview, its tensors as (name, dtype, shape, begin, end) with
    absolute offsets), checked against the file's length."""
    with open(file, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        view = memoryview(mm)
        try:
            yield view, _tensor_table(file, view)
        finally:
            view.release()


def _tensor_table(file: Path, view: memoryview) -> list[tuple[str, str, list[int], int, int]]:
    n = int.from_bytes(view[:8], "little") if len(view) >= 8 else -1
    if not 0 < n <= min(MAX_HEADER_BYTES, len(view) - 8):
        raise ValueError(f"{file}: not a safetensors file (header length {n})")
    header = json.loads(bytes(view[8 : 8 + n]))
    out = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = (8 + n + int(o) for o in info["data_offsets"])
        if not 8 + n <= begin <= end <= len(view):
            raise ValueError(f"{file}: tensor {name} lies outside the file ({info['data_offsets']})")
        out.append((name, str(info["dtype"]), [int(d) for d in info["shape"]], begin, end))
    return out


def _digest(view: memoryview, name: str, dtype: str, shape: list[int], begin: int, end: int) -> TensorDigest:
    return name, dtype, shape, hashlib.sha256(view[begin:end]).digest(), end - begin


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
