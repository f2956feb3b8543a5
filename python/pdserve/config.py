"""Frozen configuration dataclasses, composed (not inherited) and validated on construction.

argparse lives in ``entrypoints/``; everything below it receives these objects.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar, TypeVar

from pdserve.assets import PRESET_NAMES, preset_dir

DTYPES = ("float32", "bfloat16", "float16")
# --cpu-gemm: CPU linears on oneDNN-packed weights where they pay (auto), always (packed), never (plain)
CPU_GEMMS = ("auto", "packed", "plain")
# --kv-cache-dtype (SGLang's): auto stores KV in the model dtype; fp8_e4m3 in float8_e4m3fn, 1 byte an element
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")
# --index-cache-dtype (pdserve's; SGLang has no flag, it stores FP8 on GPU): DeepSeek-V3.2's index keys. auto:
# fp8_e4m3 on CUDA (the reference's: e4m3 with a float32 scale per 128 values), the model dtype on CPU
INDEX_CACHE_DTYPES = ("auto", "model", "fp8_e4m3")


def resolve_index_cache_dtype(index_cache_dtype: str, device: str) -> str:
    """What ``--index-cache-dtype`` stores on ``device`` ("cpu", "cuda"): "model" or "fp8_e4m3"."""
    _check_choice("index_cache_dtype", index_cache_dtype, INDEX_CACHE_DTYPES)
    if index_cache_dtype == "auto":
        return "fp8_e4m3" if str(device).split(":")[0] == "cuda" else "model"
    return index_cache_dtype
LOAD_FORMATS = ("auto", "dummy", "safetensors")
SCHEDULE_POLICIES = ("fcfs", "lpm")
DEVICES = ("cpu", "cuda")
ATTENTION_BACKENDS = ("torch_native", "triton", "flashinfer")
DEEPEP_MODES = ("normal", "low_latency", "auto")
HICACHE_WRITE_POLICIES = ("write_back", "write_through", "write_through_selective")
HICACHE_MEM_LAYOUTS = ("layer_first", "page_first")
HICACHE_STORAGE_BACKENDS = ("file", "mooncake")
HICACHE_PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
# --tool-call-parser / --reasoning-parser (SGLang's names; the parsers themselves: pdserve/parsers/)
TOOL_CALL_PARSERS = ("deepseekv3", "qwen25", "llama3", "kimi_k2", "deepseekv31", "deepseekv32", "deepseekv4")
REASONING_PARSERS = ("deepseek-r1", "qwen3", "deepseek-v3", "kimi_k2")
# Extra config keys the engine reads itself (SGLang's names for the first two); never passed to a store.
HICACHE_ENGINE_EXTRA_KEYS = ("prefetch_timeout_base", "prefetch_timeout_per_ki_token", "prefill_tokens_per_s")
# Storage objects smaller than this cost more in per-object overhead than they save.
HICACHE_MIN_CHUNK_TOKENS = 64


@dataclass(frozen=True)
class Architecture:
    """One supported HF architecture. ``ARCHITECTURES`` is the only list of them: the model
    registry derives its classes from it, so support is added in one place."""

    name: str  # HF ``architectures[0]``, also the class name in pdserve.models.<module>
    model_type: str  # HF ``model_type``: resolves a config.json that names no architecture
    attention: str  # "gqa" (per-head K/V pool), "mla" (latent pool) or "regions" (named per-token regions)
    module: str  # pdserve.models.<module> defines the class


ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture("LlamaForCausalLM", "llama", "gqa", "llama"),
    Architecture("Qwen2ForCausalLM", "qwen2", "gqa", "qwen2"),
    Architecture("Qwen3ForCausalLM", "qwen3", "gqa", "qwen3"),
    Architecture("Qwen3MoeForCausalLM", "qwen3_moe", "gqa", "qwen3_moe"),
    Architecture("DeepseekV2ForCausalLM", "deepseek_v2", "mla", "deepseek"),
    Architecture("DeepseekV3ForCausalLM", "deepseek_v3", "mla", "deepseek"),
    Architecture("DeepseekV32ForCausalLM", "deepseek_v32", "mla", "deepseek_v32"),
    Architecture("DeepseekV4ForCausalLM", "deepseek_v4", "regions", "deepseek_v4"),
)}


def deepseek_v4_regions(c) -> tuple[tuple[str, tuple[int, ...], int, int], ...]:
    """DeepSeek-V4's state as (region, layers, width, rate): every layer's raw K=V row, and on
    compressed layers the compressor's source rows (kv and gate, two series for CSA), the
    compressed entry (one row per ``rate`` tokens, kept with its window's last token) and, for CSA,
    the same for the indexer (docs/kv-cache.md, "What is built for DeepSeek-V4")."""
    kinds = list(c.layer_types)
    csa = tuple(i for i, k in enumerate(kinds) if k == "compressed_sparse_attention")
    hca = tuple(i for i, k in enumerate(kinds) if k == "heavily_compressed_attention")
    D, Di = int(c.head_dim), int(c.index_head_dim)
    regions = [("window_kv", tuple(range(len(kinds))), D, 1)]
    if csa:
        m = int(c.compress_rates["compressed_sparse_attention"])
        regions += [("csa_src", csa, 4 * D, 1), ("csa_kv", csa, D, m), ("csa_index_src", csa, 4 * Di, 1),
                    ("csa_index_k", csa, Di, m)]
    if hca:
        m = int(c.compress_rates["heavily_compressed_attention"])
        regions += [("hca_src", hca, 2 * D, 1), ("hca_kv", hca, D, m)]
    return tuple(regions)


# A reusable boundary of DeepSeek-V4's bounded layout every >= this many windows: the window rows
# kept for a boundary then cost 1/16 of keeping every token's (docs/kv-cache.md, "The bounded layout").
V4_REUSE_WINDOWS = 16


def deepseek_v4_bounded(c, page_size: int, rollback: int = 0) -> tuple[dict[str, int], dict[str, int], int]:
    """DeepSeek-V4's bounded layout: (rings, tails, reuse_tokens). rings: rate-1 region -> rows its
    per-request ring keeps (the rows a step still reads, plus ``rollback``: positions a speculative
    step may roll back); tails: region -> rows before a reusable boundary kept for a prefix resumed
    there (the window's W - 1; CSA's last closed window of sources, the overlap slice); reuse_tokens:
    the smallest multiple of page_size and every rate of at least V4_REUSE_WINDOWS windows."""
    W = int(c.sliding_window)
    rates = {k: int(m) for k, m in c.compress_rates.items() if k in set(c.layer_types)}
    rings, tails = {"window_kv": W - 1}, {"window_kv": W - 1}
    if "compressed_sparse_attention" in rates:
        m = rates["compressed_sparse_attention"]
        rings |= {"csa_src": 2 * m - 1, "csa_index_src": 2 * m - 1}
        tails |= {"csa_src": m, "csa_index_src": m}
    if "heavily_compressed_attention" in rates:
        rings["hca_src"] = rates["heavily_compressed_attention"] - 1
    step = math.lcm(page_size, *rates.values())
    reuse = -(-V4_REUSE_WINDOWS * W // step) * step
    return ({k: max(1, r + rollback) for k, r in rings.items()}, {k: t for k, t in tails.items() if t > 0}, reuse)


def supported_architecture(name: str) -> Architecture:
    """The entry for ``name``; ValueError naming the field and the supported ones otherwise."""
    if name not in ARCHITECTURES:
        raise ValueError(f"architectures: {name!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
    return ARCHITECTURES[name]


def architecture_of(raw: dict, directory: Path) -> str:
    """``architectures[0]`` of a config.json, or, when it names none, the architecture of its
    ``model_type`` (what transformers' AutoModelForCausalLM would pick)."""
    archs = raw.get("architectures") or []
    if archs:
        return archs[0]
    by_type = {a.model_type: a.name for a in ARCHITECTURES.values()}
    model_type = raw.get("model_type")
    if model_type not in by_type:
        raise ValueError(f"architectures: config.json in {directory} names no architecture and its model_type "
                         f"{model_type!r} is not one of {', '.join(by_type)}")
    return by_type[model_type]


def has_weight_files(directory: Path) -> bool:
    return (directory / "model.safetensors.index.json").is_file() or any(directory.glob("*.safetensors"))


def resolve_model_path(model_path: str) -> tuple[Path, bool]:
    """Return (directory, is_preset). A preset name maps to a directory shipped in the package."""
    if model_path in PRESET_NAMES:
        return preset_dir(model_path), True
    path = Path(model_path).expanduser()
    if not path.is_dir():
        raise ValueError(
            f"model_path: {model_path!r} is neither a directory nor a built-in preset "
            f"({', '.join(PRESET_NAMES)})"
        )
    if not (path / "config.json").is_file():
        raise ValueError(f"model_path: {path} has no config.json")
    return path, False


def _torch_dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _read_eos_ids(directory: Path, hf_config) -> tuple[int, ...]:
    ids: list[int] = []
    gen = directory / "generation_config.json"
    sources = [getattr(hf_config, "eos_token_id", None)]
    if gen.is_file():
        sources.append(json.loads(gen.read_text()).get("eos_token_id"))
    for eos in sources:
        for t in eos if isinstance(eos, (list, tuple)) else [eos]:
            if t is not None and int(t) not in ids:
                ids.append(int(t))
    return tuple(ids)


@dataclass(frozen=True)
class Fp8BlockConfig:
    """A block-quantized FP8 checkpoint (DeepSeek-V3/R1, Kimi-K2, Qwen3-*-FP8): every quantized
    linear ``X.weight`` is float8_e4m3fn beside a float32 ``X.weight_scale_inv`` holding one
    scale per ``weight_block_size`` block, weight = fp8 * scale (HF ``quantization_config``).
    Activations are quantized per token group at run time (``activation_scheme: dynamic``)."""

    block_out: int = 128  # rows of W [Out, In] per scale
    block_in: int = 128  # columns of W per scale
    # "fp4": routed experts are FP4 (e2m1 pairs in int8, ue8m0 scales per 32 columns), DeepSeek-V4's
    # format (layers/quant/fp4.py); "fp8": experts block-FP8 like every other quantized linear.
    expert_dtype: str = "fp8"

    SUPPORTED: ClassVar[dict[str, Any]] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                 "weight_block_size": [128, 128]}

    @property
    def block(self) -> tuple[int, int]:
        return self.block_out, self.block_in

    @property
    def name(self) -> str:
        """How records and messages name it, e.g. ``fp8-block128x128``."""
        return f"fp8-block{self.block_out}x{self.block_in}" + ("-fp4experts" if self.expert_dtype == "fp4" else "")

    def to_hf(self) -> dict[str, Any]:
        """The ``quantization_config`` a checkpoint of this format carries."""
        hf = {**self.SUPPORTED, "weight_block_size": [self.block_out, self.block_in]}
        return hf | {"expert_dtype": "fp4"} if self.expert_dtype == "fp4" else hf

    @classmethod
    def from_hf(cls, raw: Any) -> Fp8BlockConfig | None:
        """Parse HF ``quantization_config`` (None: a full-precision checkpoint); ValueError naming
        the first field this engine cannot serve."""
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raw = raw.to_dict() if hasattr(raw, "to_dict") else vars(raw)
        for key, want in cls.SUPPORTED.items():
            got = raw.get(key, "e4m3" if key == "fmt" else None)  # Qwen3's FP8 configs omit fmt
            if key == "weight_block_size":
                got = list(got) if got is not None else None
            if got != want:
                raise ValueError(f"quantization_config.{key}: {got!r} is not supported "
                                 f"(pdserve loads {key}={want!r} checkpoints)")
        expert_dtype = raw.get("expert_dtype") or "fp8"
        if expert_dtype not in ("fp8", "fp4"):
            raise ValueError(f"quantization_config.expert_dtype: {expert_dtype!r} is not supported "
                             "(pdserve loads 'fp8' and, for DeepSeek-V4, 'fp4' experts)")
        block_out, block_in = raw["weight_block_size"]
        return cls(block_out, block_in, expert_dtype)


def _check_quantization(quant: Fp8BlockConfig | None, architecture: str) -> None:
    if quant is not None and quant.expert_dtype == "fp4" and architecture != "DeepseekV4ForCausalLM":
        raise ValueError(f"quantization_config.expert_dtype: 'fp4' experts load for DeepSeek-V4 only, "
                         f"not {architecture}")


def num_kv_heads_of(c: Any, attention: str) -> int:
    """KV heads in the pool of a model config ``c`` (1 latent "head" for MLA)."""
    if attention == "mla":
        return 1
    return getattr(c, "num_key_value_heads", None) or c.num_attention_heads


def routed_experts_of(c: Any) -> int:
    """Routed experts of a model config ``c`` (0: a dense model), by any of the names checkpoints use
    (config.json keeps the canonical one, which transformers' classes also answer to by an alias)."""
    return getattr(c, "n_routed_experts", None) or getattr(c, "num_experts", None) or \
        getattr(c, "num_local_experts", None) or 0


def index_head_dim_of(c: Any, attention: str) -> int:
    """Width of DeepSeek-V3.2's index key (one more region of the latent's pages); 0 without one."""
    return int(getattr(c, "index_head_dim", 0) or 0) if attention == "mla" else 0


@dataclass(frozen=True)
class ModelFiles:
    """A model directory as its config.json says, read with ``json`` alone: no transformers config
    class (they import torch, seconds of CPU a process). What the HTTP frontend knows of the model,
    and what every start-up check of the model reads (``ServerArgs.model_files``), so a refusal comes
    before any process imports torch. ``config``: config.json's fields as attributes, as checkpoints
    save them (no transformers defaults); ``ModelConfig`` is built from this and keeps it."""

    path: str
    raw: dict = field(repr=False)
    architecture: str
    load_format: str = "auto"
    is_preset: bool = False

    def __post_init__(self):
        _check_choice("load_format", self.load_format, LOAD_FORMATS)
        supported_architecture(self.architecture)
        _check_quantization(self.quantization, self.architecture)  # refuses an unsupported one, naming its field

    @classmethod
    def read(cls, model_path: str, load_format: str = "auto") -> ModelFiles:
        """Resolve ``model_path`` (a directory or a preset) and read its config.json; ValueError naming
        the field when it cannot be served (no such directory, an unsupported architecture, no weights)."""
        directory, is_preset = resolve_model_path(model_path)
        raw = json.loads((directory / "config.json").read_text())
        arch = supported_architecture(architecture_of(raw, directory))
        if is_preset and load_format == "auto":
            load_format = "dummy"
        if load_format != "dummy" and not has_weight_files(directory):
            raise ValueError(f"model_path: {directory} has no model.safetensors or model.safetensors.index.json "
                             f"(only safetensors weights are supported; pass --load-format dummy for random weights)")
        return cls(str(directory), raw, arch.name, load_format, is_preset)

    @property
    def config(self) -> SimpleNamespace:
        return SimpleNamespace(**self.raw)

    @property
    def model_type(self) -> str:
        return self.raw.get("model_type") or ARCHITECTURES[self.architecture].model_type

    @property
    def attention(self) -> str:
        """"gqa", "mla" or "regions" (``Architecture.attention``)."""
        return ARCHITECTURES[self.architecture].attention

    @property
    def quantization(self) -> Fp8BlockConfig | None:
        return Fp8BlockConfig.from_hf(self.raw.get("quantization_config"))

    @property
    def num_kv_heads(self) -> int:
        return num_kv_heads_of(self.config, self.attention)

    @property
    def index_head_dim(self) -> int:
        return index_head_dim_of(self.config, self.attention)


@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs to know about a model; ``hf_config`` is the transformers config."""

    path: str
    hf_config: Any
    dtype: str = "float32"
    load_format: str = "auto"
    is_preset: bool = False
    context_length_override: int | None = None
    # EOS ids from config.json and generation_config.json (chat models list several there)
    eos_token_ids: tuple[int, ...] = ()
    files: ModelFiles | None = field(default=None, repr=False, compare=False)  # what from_path read

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: {self.dtype!r} is not one of {DTYPES}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format: {self.load_format!r} is not one of {LOAD_FORMATS}")
        supported_architecture(self.architecture)
        _check_quantization(self.quantization, self.architecture)  # refuses an unsupported one, naming its field

    @property
    def quantization(self) -> Fp8BlockConfig | None:
        """The checkpoint's weight quantization (``quantization_config``), None when full precision."""
        return Fp8BlockConfig.from_hf(getattr(self.hf_config, "quantization_config", None))

    @classmethod
    def from_path(cls, model_path: str, dtype: str = "float32", load_format: str = "auto",
                  context_length: int | None = None) -> ModelConfig:
        """Read the model directory's config.json (once: build this once per process and pass it on)."""
        files = ModelFiles.read(model_path, load_format)
        from transformers import CONFIG_MAPPING  # imports torch (ModelFiles is what needs none)

        if files.model_type not in CONFIG_MAPPING:
            raise ValueError(f"model_type: {files.model_type!r} in {Path(files.path) / 'config.json'} is unknown "
                             f"to transformers")
        # What AutoConfig.from_pretrained does, from the dict already read.
        hf_config = CONFIG_MAPPING[files.model_type].from_dict(files.raw)
        hf_config.architectures = [files.architecture]
        hf_config.name_or_path = files.path
        return cls(files.path, hf_config, dtype, files.load_format, files.is_preset, context_length,
                   _read_eos_ids(Path(files.path), hf_config), files)

    @property
    def architecture(self) -> str:
        archs = getattr(self.hf_config, "architectures", None) or [""]
        return archs[0]

    @property
    def torch_dtype(self):
        return _torch_dtype(self.dtype)

    @property
    def attention(self) -> str:
        return ARCHITECTURES[self.architecture].attention

    @property
    def config(self) -> Any:
        """The fields the start-up checks read (``ModelFiles.config``'s twin, with transformers' defaults)."""
        return self.hf_config

    @property
    def is_mla(self) -> bool:
        return self.attention == "mla"

    @property
    def state_regions(self) -> tuple[tuple[str, tuple[int, ...], int, int], ...]:
        """Named regions (name, layers, width, rate) of a "regions" model (DeepSeek-V4), () for GQA and
        MLA pools."""
        if ARCHITECTURES[self.architecture].attention != "regions":
            return ()
        return deepseek_v4_regions(self.hf_config)

    def _v4_elements_per_token(self, page_size: int | None, bounded: bool, context: int | None) -> float:
        rings, tails, reuse = deepseek_v4_bounded(self.hf_config, page_size or 1) if bounded else ({}, {}, 1)
        total = 0.0
        for name, layers, width, rate in self.state_regions:
            rows = len(layers) * width
            if name in rings:
                tail = tails.get(name, 0)
                total += rows * (tail / reuse if page_size is None else -(-tail * page_size // reuse) / page_size)
                total += rows * rings[name] / context if context else 0.0
            else:
                total += rows * (1 / rate if page_size is None else -(-page_size // rate) / page_size)
        return total

    def state_record_bytes(self, page_size: int, rollback: int = 0, extra_layers: int = 0) -> int:
        """Bytes of one request's record in DeepSeek-V4's bounded layout (its rings; a draft's
        ``extra_layers`` keep a window ring too); 0 for models without records."""
        if not self.state_regions:
            return 0
        rings, _, _ = deepseek_v4_bounded(self.hf_config, page_size, rollback)
        itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[self.dtype]
        return sum((len(layers) + (extra_layers if name == "window_kv" else 0)) * width * rings[name] * itemsize
                   for name, layers, width, _ in self.state_regions if name in rings)

    @property
    def index_head_dim(self) -> int:
        """Width of DeepSeek-V3.2's index key (one more region of the latent's pages); 0 without one."""
        return index_head_dim_of(self.hf_config, self.attention)

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    @property
    def num_kv_heads(self) -> int:
        """KV heads in the pool: 1 latent "head" for MLA."""
        return num_kv_heads_of(self.hf_config, self.attention)

    @property
    def head_dim(self) -> int:
        """Width of one KV-pool row per head: kv_lora_rank + qk_rope_head_dim for MLA."""
        c = self.hf_config
        if self.is_mla:
            return c.kv_lora_rank + c.qk_rope_head_dim
        return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads

    @property
    def context_length(self) -> int:
        if self.context_length_override:
            return self.context_length_override
        return int(self.hf_config.max_position_embeddings)

    def kv_bytes_per_token(self, kv_cache_dtype: str = "auto", page_size: int | None = None,
                           bounded: bool = False, context: int | None = None, index_cache_dtype: str = "model") -> int:
        """Bytes of KV cache one token occupies over all layers (``kv_cache_dtype``: --kv-cache-dtype).
        A region of rate r (DeepSeek-V4's compressed entries) keeps ``ceil(page_size / r)`` rows per
        page: ``page_size`` None counts r tokens a row (pages a multiple of every rate), rounded up.
        ``bounded``: V4's bounded layout (CacheConfig.state_records): its pages' bytes, and with
        ``context`` one request's record spread over that many tokens too. ``index_cache_dtype`` (resolved:
        "model" or "fp8_e4m3"): V3.2's index keys, in fp8 one byte a value plus a float32 scale a block."""
        _check_choice("kv_cache_dtype", kv_cache_dtype, KV_CACHE_DTYPES)
        compute = {"float32": 4, "bfloat16": 2, "float16": 2}[self.dtype]
        itemsize = 1 if kv_cache_dtype == "fp8_e4m3" else compute
        if self.state_regions:
            return math.ceil(self._v4_elements_per_token(page_size, bounded, context) * itemsize)
        per_layer = self.head_dim if self.is_mla else 2 * self.num_kv_heads * self.head_dim
        # V3.2's index keys: their own dtype, whatever the latent's (mem/kv_pool.py MLAKVPool)
        _check_choice("index_cache_dtype", index_cache_dtype, ("model", "fp8_e4m3"))
        index = self.index_head_dim * compute
        if self.index_head_dim and index_cache_dtype == "fp8_e4m3":
            index = self.index_head_dim + 4 * (self.index_head_dim // min(128, self.index_head_dim))
        return self.num_layers * (per_layer * itemsize + index)


def _check_choice(field_name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{field_name}: {value!r} is not one of {choices}")


def _check_at_least(field_name: str, value: float, minimum: float) -> None:
    if value < minimum:
        raise ValueError(f"{field_name}: must be >= {minimum}, got {value}")


def _flag_error(field_name: str, why: str) -> ValueError:
    """A config error naming both the field and the flag an operator typed."""
    return ValueError(f"{field_name} (--{field_name.replace('_', '-')}): {why}")


# SGLang's defaults for the timeout policy (extra config keys of the same names).
PREFETCH_TIMEOUT_BASE_S = 1.0
PREFETCH_TIMEOUT_PER_KI_TOKEN_S = 0.25


@dataclass(frozen=True)
class PrefetchPolicy:
    """``--hicache-storage-prefetch-policy``: ``best_effort`` stops waiting as soon as the request
    could be scheduled, ``wait_complete`` only once every chunk is read, ``timeout`` then or
    after ``base_s + per_ki_token_s * tokens / 1024``, whichever comes first."""

    name: str = "best_effort"
    timeout_base_s: float = PREFETCH_TIMEOUT_BASE_S
    timeout_per_ki_token_s: float = PREFETCH_TIMEOUT_PER_KI_TOKEN_S

    def bound_s(self, tokens: int) -> float:
        return self.timeout_base_s + self.timeout_per_ki_token_s * tokens / 1024


@dataclass(frozen=True)
class HiCacheConfig:
    """The hierarchical KV cache: device pages demote to a host pool, host pages to storage.

    ``size_gb`` > 0 sizes the host pool in bytes; otherwise it holds ``ratio`` x the device
    pool's pages. ``storage_chunk_tokens`` 0 picks the smallest multiple of the page size
    >= HICACHE_MIN_CHUNK_TOKENS (one storage object per token would drown in overhead).
    """

    enabled: bool = False
    ratio: float = 2.0
    size_gb: float = 0.0
    write_policy: str = "write_through"
    mem_layout: str = "layer_first"
    storage_backend: str | None = None
    storage_dir: str | None = None
    storage_size_gb: float = 0.0
    storage_prefetch_policy: str = "timeout"
    storage_chunk_tokens: int = 0
    storage_backend_extra_config: str | None = None
    # The deployment's token (resolve_token): storage pages are signed with it, unsigned ones refused
    auth_token: str | None = field(default=None, repr=False)
    # The server's --host: where a shared tier's other clients reach the memory this server lends
    host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if not self.ratio > 0:
            raise _flag_error("hicache_ratio", f"must be > 0, got {self.ratio}")
        if self.size_gb < 0:
            raise _flag_error("hicache_size", f"must be >= 0 GB (0: use --hicache-ratio), got {self.size_gb}")
        self._check_choice("hicache_write_policy", self.write_policy, HICACHE_WRITE_POLICIES)
        self._check_choice("hicache_mem_layout", self.mem_layout, HICACHE_MEM_LAYOUTS)
        self._check_choice("hicache_storage_prefetch_policy", self.storage_prefetch_policy,
                           HICACHE_PREFETCH_POLICIES)
        if self.storage_backend is not None:
            self._check_choice("hicache_storage_backend", self.storage_backend, HICACHE_STORAGE_BACKENDS)
        if self.storage_size_gb < 0:
            raise _flag_error("hicache_storage_size_gb", f"must be >= 0, got {self.storage_size_gb}")
        if self.storage_chunk_tokens < 0:
            raise _flag_error("hicache_storage_chunk_tokens", f"must be >= 0 (0: automatic), got "
                              f"{self.storage_chunk_tokens}")
        self.prefetch_policy()
        self.pinned_prefill_tokens_per_s()

    @staticmethod
    def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
        if value not in choices:
            raise _flag_error(name, f"{value!r} is not one of {choices}")

    def extra_config(self) -> dict[str, Any]:
        """The storage backend's extra settings (a JSON object, Mooncake's key names)."""
        if not self.storage_backend_extra_config:
            return {}
        try:
            value = json.loads(self.storage_backend_extra_config)
        except json.JSONDecodeError as e:
            raise _flag_error("hicache_storage_backend_extra_config", f"not valid JSON ({e})") from None
        if not isinstance(value, dict):
            raise _flag_error("hicache_storage_backend_extra_config",
                              f"must be a JSON object, got {type(value).__name__}")
        return value

    def store_extra_config(self) -> dict[str, Any]:
        """The extra config minus the engine's own keys (the prefetch timeout, the prefill-speed
        pin), which no storage backend takes."""
        return {k: v for k, v in self.extra_config().items() if k not in HICACHE_ENGINE_EXTRA_KEYS}

    def prefetch_policy(self) -> PrefetchPolicy:
        extra = self.extra_config()
        return PrefetchPolicy(self.storage_prefetch_policy,
                              self._positive(extra, "prefetch_timeout_base", PREFETCH_TIMEOUT_BASE_S),
                              self._positive(extra, "prefetch_timeout_per_ki_token", PREFETCH_TIMEOUT_PER_KI_TOKEN_S))

    def pinned_prefill_tokens_per_s(self) -> float | None:
        extra = self.extra_config()
        return self._positive(extra, "prefill_tokens_per_s", None) if "prefill_tokens_per_s" in extra else None

    @staticmethod
    def _positive(extra: dict[str, Any], key: str, default: float | None) -> float:
        """``extra[key]`` (or ``default``) as a number > 0, else an error naming the flag and key."""
        value = extra.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise _flag_error("hicache_storage_backend_extra_config", f"{key} must be a number > 0, got {value!r}")
        return float(value)

    def check_page_size(self, page_size: int) -> None:
        if self.storage_chunk_tokens and self.storage_chunk_tokens % page_size:
            raise _flag_error("hicache_storage_chunk_tokens", f"must be a multiple of the page size "
                              f"({page_size}), got {self.storage_chunk_tokens}")

    def chunk_tokens(self, page_size: int) -> int:
        if self.storage_chunk_tokens:
            return self.storage_chunk_tokens
        return -(-HICACHE_MIN_CHUNK_TOKENS // page_size) * page_size

    def num_host_pages(self, device_pages: int, page_bytes: int) -> int:
        """Host pool pages: ``size_gb`` of ``page_bytes`` pages, else ``ratio`` x ``device_pages``."""
        if self.size_gb > 0:
            pages = int(self.size_gb * (1 << 30)) // max(1, page_bytes)
            if pages < 1:
                raise _flag_error("hicache_size", f"{self.size_gb} GB holds no page of {page_bytes} bytes")
            return pages
        return max(1, int(device_pages * self.ratio))


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = 1
    max_total_tokens: int | None = None  # None: from the byte budget below (mem/kv_budget.py)
    disable_radix_cache: bool = False
    hicache: HiCacheConfig = field(default_factory=HiCacheConfig)
    # --kv-cache-dtype: what the KV pool stores (mem/kv_pool.py: fp8 pages with per-tensor scales)
    kv_cache_dtype: str = "auto"
    # the key of the block hash chain (mem/radix_cache.py; resolve_kv_hash_key); b"": unkeyed
    hash_key: bytes = field(default=b"", repr=False)
    # The pool's byte budget (mem/kv_budget.py; zero-filled up front, so resident memory):
    # --kv-cache-memory-bytes (vLLM's) or --mem-fraction-static (SGLang's), else a small default.
    kv_cache_memory_bytes: int | None = None
    mem_fraction_static: float | None = None
    # Per-request record slots (one per request-table row) of a model whose state has records
    # (DeepSeek-V4's bounded layout, docs/kv-cache.md); 0: every state in pages. ServerArgs gives
    # records to every server: P/D moves them beside the pages, and the hierarchical cache's tiers keep
    # a boundary's tail rows in the block's pages.
    state_records: int = 0
    # --index-cache-dtype: DeepSeek-V3.2's index keys (INDEX_CACHE_DTYPES; resolve_index_cache_dtype)
    index_cache_dtype: str = "auto"

    def __post_init__(self):
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _check_choice("index_cache_dtype", self.index_cache_dtype, INDEX_CACHE_DTYPES)
        if self.page_size < 1:
            raise ValueError(f"page_size: must be >= 1, got {self.page_size}")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError(
                f"max_total_tokens: must be >= page_size ({self.page_size}), got {self.max_total_tokens}"
            )
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes: must be >= 1, got {self.kv_cache_memory_bytes}")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static <= 1:
            raise ValueError(f"mem_fraction_static: must be in (0, 1], got {self.mem_fraction_static}")
        if self.kv_cache_memory_bytes is not None and self.mem_fraction_static is not None:
            raise ValueError("kv_cache_memory_bytes: give it or mem_fraction_static, not both")
        if self.hicache.enabled:
            self.hicache.check_page_size(self.page_size)
            if self.disable_radix_cache:
                raise _flag_error("enable_hierarchical_cache", "needs the radix cache (drop --disable-radix-cache)")


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int = 64
    chunked_prefill_size: int = 2048  # <= 0 disables chunking
    max_prefill_tokens: int = 16384
    schedule_policy: str = "fcfs"
    random_seed: int = 0
    # --disable-overlap-schedule: decode forwards run on the scheduler thread (engine/overlap.py)
    disable_overlap_schedule: bool = False

    def __post_init__(self):
        _check_at_least("max_running_requests", self.max_running_requests, 1)
        _check_choice("schedule_policy", self.schedule_policy, SCHEDULE_POLICIES)
        _check_at_least("max_prefill_tokens", self.max_prefill_tokens, 1)


GRAMMAR_BACKENDS = ("xgrammar", "llguidance", "outlines", "none")


@dataclass(frozen=True)
class GrammarConfig:
    """Constrained decoding (SGLang's ``--grammar-backend``; docs/structured-outputs.md): which
    backend compiles a request's json_schema / regex / ebnf, how long a compile may take before
    only that request fails, how many compiled grammars are kept (LRU by kind and text), how many
    threads compile (never the scheduler's), and whether JSON may carry free whitespace between
    its tokens (``--constrained-json-any-whitespace``; compact JSON by default, as SGLang's
    ``--constrained-json-disable-any-whitespace`` asks: a permissive grammar lets a model pad with
    newlines until ``max_tokens``)."""

    backend: str = "xgrammar"
    compile_timeout_s: float = 60.0
    cache_size: int = 256
    compile_threads: int = 2
    any_whitespace: bool = False
    # jump-forward (--grammar-jump-forward): where the grammar allows one continuation only, append
    # its tokens without sampling them (docs/structured-outputs.md); on by default: a forced tool call's
    # fixed text takes a few steps instead of one per spelled piece
    jump_forward: bool = True
    max_compiles_per_client: int = 4  # new compiles one client may have queued or running (constrained/service.py)
    # the frontend's check compiles in child processes with CPU and memory limits (constrained/isolation.py)
    compile_isolation: bool = True
    compile_memory_mb: int = 2048  # address space one such compile may add

    def __post_init__(self):
        _check_choice("grammar_backend", self.backend, GRAMMAR_BACKENDS)
        if not self.compile_timeout_s > 0:
            raise ValueError(f"grammar_compile_timeout: must be > 0 seconds, got {self.compile_timeout_s}")
        _check_at_least("grammar_cache_size", self.cache_size, 1)
        _check_at_least("grammar_compile_threads", self.compile_threads, 1)
        _check_at_least("grammar_max_compiles_per_client", self.max_compiles_per_client, 1)
        _check_at_least("grammar_compile_memory_mb", self.compile_memory_mb, 1)

    @property
    def enabled(self) -> bool:
        return self.backend != "none"


MOE_A2A_BACKENDS = ("none", "deepep")


@dataclass(frozen=True)
class ParallelConfig:
    """How the engine's ranks split the model, with SGLang's semantics.

    Without DP attention, ``dp_size`` replicas of ``tp_size`` ranks serve disjoint requests
    (world = tp_size * dp_size). With ``enable_dp_attention`` the world is ``tp_size`` ranks:
    attention runs in ``dp_size`` groups of ``tp_size / dp_size`` ranks, each owning whole
    requests, while dense and MoE layers span all ``tp_size`` ranks. ``ep_size`` (1 or
    tp_size) splits routed experts whole over the TP ranks instead of slicing each one.
    """

    tp_size: int = 1
    dp_size: int = 1
    ep_size: int = 1
    enable_dp_attention: bool = False
    moe_a2a_backend: str = "none"
    dist_init_addr: str | None = None  # "host:port" of rank 0's rendezvous (required with nnodes > 1)
    nnodes: int = 1
    node_rank: int = 0
    deepep_mode: str = "auto"  # with moe_a2a_backend deepep: normal (prefill), low_latency (decode), auto

    def __post_init__(self):
        if self.deepep_mode not in DEEPEP_MODES:
            raise ValueError(f"deepep_mode: {self.deepep_mode!r} is not one of {DEEPEP_MODES}")
        for name in ("tp_size", "dp_size", "ep_size", "nnodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.enable_dp_attention and self.tp_size % self.dp_size:
            raise ValueError(f"dp_size: with enable_dp_attention it must divide tp_size ({self.tp_size}), "
                             f"got {self.dp_size}")
        if self.ep_size not in (1, self.tp_size):
            raise ValueError(f"ep_size: must be 1 or equal to tp_size ({self.tp_size}), got {self.ep_size}")
        if self.moe_a2a_backend not in MOE_A2A_BACKENDS:
            raise ValueError(f"moe_a2a_backend: {self.moe_a2a_backend!r} is not one of {MOE_A2A_BACKENDS}")
        if self.moe_a2a_backend == "deepep" and self.ep_size == 1:
            raise ValueError("moe_a2a_backend: 'deepep' dispatches over expert parallelism; set ep_size > 1")
        self._check_nodes()

    def _check_nodes(self) -> None:
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank: must be in [0, nnodes={self.nnodes}), got {self.node_rank}")
        if self.world_size % self.nnodes:
            raise ValueError(f"nnodes: {self.nnodes} does not divide the {self.world_size} ranks "
                             f"(tp_size x dp_size, or tp_size with enable_dp_attention)")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("dist_init_addr: required with nnodes > 1 (host:port of node 0)")
        if self.dist_init_addr is not None:
            split_host_port(self.dist_init_addr, "dist_init_addr")

    @property
    def world_size(self) -> int:
        """Scheduler ranks (processes) in the whole engine, over every node."""
        return self.tp_size if self.enable_dp_attention else self.tp_size * self.dp_size

    @property
    def attn_tp_size(self) -> int:
        """Ranks one attention layer (and the KV pool's heads) is split over."""
        return self.tp_size // self.dp_size if self.enable_dp_attention else self.tp_size

    def check_model(self, model: ModelFiles | ModelConfig) -> None:
        """Raise ValueError naming the field when this split cannot shard ``model`` (start-up checks the
        ModelFiles; a test, that a ModelConfig gets the same answer)."""
        c, arch = model.config, model.architecture
        if self.enable_dp_attention and model.attention == "gqa":  # V4 ("regions"): its own refusal
            raise ValueError(f"enable_dp_attention: only MLA (DeepSeek) models support DP attention; "
                             f"{arch} uses GQA")
        heads = c.num_attention_heads
        if heads % self.attn_tp_size:
            raise ValueError(f"tp_size: num_attention_heads ({heads}) is not divisible by the attention TP "
                             f"size {self.attn_tp_size}")
        kv = model.num_kv_heads
        if model.attention != "mla" and kv % self.attn_tp_size and self.attn_tp_size % kv:
            raise ValueError(f"tp_size: num_key_value_heads ({kv}) and the attention TP size "
                             f"{self.attn_tp_size} must divide one another")
        self._check_mlp(model)

    def _check_mlp(self, model: ModelFiles | ModelConfig) -> None:
        c = model.config
        experts = routed_experts_of(c)
        if self.ep_size > 1 and not experts:
            raise ValueError(f"ep_size: {model.architecture} has no routed experts to split")
        if experts % self.ep_size:
            raise ValueError(f"ep_size: {self.ep_size} does not divide the number of experts ({experts})")
        sizes = {"intermediate_size": getattr(c, "intermediate_size", None)}
        if experts and self.ep_size == 1:
            sizes["moe_intermediate_size"] = getattr(c, "moe_intermediate_size", None)
        if experts and getattr(c, "n_shared_experts", None):  # shared experts are TP-split even under EP
            sizes["moe_intermediate_size * n_shared_experts"] = c.moe_intermediate_size * c.n_shared_experts
        for name, size in sizes.items():
            if size and size % self.tp_size:
                raise ValueError(f"tp_size: {name} ({size}) is not divisible by tp_size={self.tp_size}")


def split_host_port(addr: str | None, field_name: str) -> tuple[str, int]:
    """"host:port" (IPv6 as "[::1]:port") -> (host, port); ValueError naming ``field_name``
    (also when the address is unset)."""
    if addr is None:
        raise ValueError(f"{field_name}: required here (expected host:port)")
    host, sep, port = addr.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{field_name}: expected host:port with a port in 1..65535, got {addr!r}")
    return host, int(port)


@dataclass(frozen=True)
class CompileConfig:
    """``--enable-torch-compile``: decode forwards compiled with inductor, one graph set per
    batch-size bucket up to ``max_bs`` (SGLang's ``--torch-compile-max-bs``); larger decode
    batches and every extend run eagerly."""

    enabled: bool = False
    max_bs: int = 32

    def __post_init__(self):
        if self.max_bs < 1:
            raise ValueError(f"torch_compile_max_bs: must be >= 1, got {self.max_bs}")

    @property
    def buckets(self) -> tuple[int, ...]:
        """Padded decode batch sizes: powers of two below ``max_bs``, then ``max_bs`` itself."""
        sizes, b = [], 1
        while b < self.max_bs:
            sizes.append(b)
            b *= 2
        return (*sizes, self.max_bs)

    def bucket_for(self, batch_size: int) -> int | None:
        """The smallest bucket holding ``batch_size`` requests; None when it runs eagerly."""
        return next((b for b in self.buckets if b >= batch_size), None) if self.enabled else None


SPECULATIVE_ALGORITHMS = ("NEXTN", "EAGLE")


@dataclass(frozen=True)
class SpeculativeConfig:
    """SGLang's ``--speculative-*`` flags: a draft proposes ``num_steps`` tokens per decode step
    (a chain: ``eagle_topk`` 1), the target verifies them in one forward of
    ``num_draft_tokens`` = steps + 1 rows (engine/speculative.py). ``algorithm`` None: off.
    NEXTN drafts with DeepSeek's MTP layer (``model.layers.{num_hidden_layers}`` of the target
    checkpoint, or of ``draft_model_path``); EAGLE with a Llama EAGLE checkpoint
    (``draft_model_path``, required)."""

    algorithm: str | None = None
    draft_model_path: str | None = None
    num_steps: int = 3
    eagle_topk: int = 1
    num_draft_tokens: int | None = None  # None: num_steps + 1

    def __post_init__(self):
        if self.algorithm is None:
            return
        if self.algorithm not in SPECULATIVE_ALGORITHMS:
            raise _flag_error("speculative_algorithm", f"{self.algorithm!r} is not one of {SPECULATIVE_ALGORITHMS}")
        if self.algorithm == "EAGLE" and not self.draft_model_path:
            raise _flag_error("speculative_draft_model_path", "EAGLE needs a draft checkpoint")
        if self.num_steps < 1:
            raise _flag_error("speculative_num_steps", f"must be >= 1, got {self.num_steps}")
        if self.eagle_topk != 1:
            raise _flag_error("speculative_eagle_topk", f"only chain drafts (1) are supported for now, "
                              f"got {self.eagle_topk}")
        if self.num_draft_tokens is not None and self.num_draft_tokens != self.num_steps + 1:
            raise _flag_error("speculative_num_draft_tokens", f"with --speculative-eagle-topk 1 it must be "
                              f"--speculative-num-steps + 1 ({self.num_steps + 1}), got {self.num_draft_tokens}")

    @property
    def enabled(self) -> bool:
        return self.algorithm is not None

    @property
    def draft_layers(self) -> int:
        """KV-pool layers the draft adds after the target's (at index num_layers)."""
        return 1 if self.enabled else 0


# Device files a GPU driver creates (NVIDIA's, WSL2's GPU paravirtualization, ROCm's, which torch.cuda also
# drives): without any of them no CUDA device can be seen, so the answer needs no torch.
GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/dxg", "/dev/kfd")


def cuda_available() -> bool:
    """Whether torch sees a CUDA device. On a Linux host without a GPU driver's device files it answers
    False without importing torch (seconds of CPU: the HTTP frontend imports none); elsewhere it asks torch
    (call it only where a device is chosen)."""
    if sys.platform == "linux" and not any(os.path.exists(f) for f in GPU_DEVICE_FILES):
        return False
    import torch

    return torch.cuda.is_available()


def default_prefill_chunk(device: str) -> int:
    """Prefill tokens per step when ``--chunked-prefill-size`` is not given: what one chunk stalls the
    running requests for, as SGLang sizes its default by the GPU. 2,048 tokens on an accelerator (tens
    of ms); 1,024 on CPU, where 2,048 tokens took ~120 ms on two cores and a wave of 32 new requests
    (64-256 tokens each) got its median first token ~25% later than with 1,024 chunks at the same
    throughput (docs/benchmarking.md, "Against vLLM-CPU"; 512 was slower again)."""
    return 1024 if device == "cpu" else 2048


@dataclass(frozen=True)
class DeviceConfig:
    """Where the model runs and with which kernels: ``--device``, ``--attention-backend``,
    ``--dtype`` and decode CUDA graphs (``--cuda-graph-max-bs``, ``--disable-cuda-graph``).

    Fields hold resolved names; ``resolve`` fills the host-dependent defaults (CUDA when torch
    sees a GPU; flashinfer and bfloat16 on CUDA, torch_native and float32 on CPU). Whether this
    host can run the choice (a GPU, the packages) is checked by ``engine.device.require_device``.
    """

    device: str = "cpu"
    attention_backend: str = "torch_native"
    dtype: str = "float32"
    cuda_graph_max_bs: int = 32
    disable_cuda_graph: bool = False
    cpu_gemm: str = "auto"  # CPU_GEMMS; engine.device.cpu_pack_policy picks the policy per host and dtype

    def __post_init__(self):
        _check_choice("cpu_gemm", self.cpu_gemm, CPU_GEMMS)
        if self.device not in DEVICES:
            raise ValueError(f"device: {self.device!r} is not one of {DEVICES}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend: {self.attention_backend!r} is not one of {ATTENTION_BACKENDS}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: {self.dtype!r} is not one of {DTYPES}")
        if self.attention_backend == "flashinfer" and self.device != "cuda":
            raise ValueError(f"attention_backend: 'flashinfer' runs on CUDA only, but device is {self.device!r} "
                             "(use --attention-backend torch_native or triton)")
        if self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs: must be >= 1, got {self.cuda_graph_max_bs}")

    @classmethod
    def resolve(cls, device: str | None, attention_backend: str | None, dtype: str = "auto",
                cuda_graph_max_bs: int = 32, disable_cuda_graph: bool = False,
                cpu_gemm: str = "auto") -> DeviceConfig:
        """None / "auto" fields take this host's defaults."""
        device = device or ("cuda" if cuda_available() else "cpu")
        on_cuda = device == "cuda"
        backend = attention_backend or ("flashinfer" if on_cuda else "torch_native")
        if dtype == "auto":
            dtype = "bfloat16" if on_cuda else "float32"
        return cls(device, backend, dtype, cuda_graph_max_bs, disable_cuda_graph, cpu_gemm)

    @property
    def use_cuda_graph(self) -> bool:
        """Decode runs captured graphs only on CUDA; on CPU the flags are accepted and ignored."""
        return self.device == "cuda" and not self.disable_cuda_graph

    @property
    def cuda_graph_batch_sizes(self) -> tuple[int, ...]:
        """Captured decode batch sizes: 1, 2, 4, 8, then every 8 up to ``cuda_graph_max_bs``
        (a step pads to the next one; larger batches run eagerly)."""
        sizes = [b for b in (1, 2, 4) if b < self.cuda_graph_max_bs]
        sizes += list(range(8, self.cuda_graph_max_bs, 8))
        return (*sizes, self.cuda_graph_max_bs)

    def graph_size_for(self, batch_size: int) -> int | None:
        """The smallest captured size holding ``batch_size``; None: run eagerly."""
        if not self.use_cuda_graph:
            return None
        return next((b for b in self.cuda_graph_batch_sizes if b >= batch_size), None)


DISAGG_MODES = ("null", "prefill", "decode")
AUTH_TOKEN_ENV = "PDSERVE_DISAGGREGATION_AUTH_TOKEN"
API_KEY_ENV = "PDSERVE_API_KEY"  # --api-key of serve, router and up when the flag is not given (kept out of ps)
TRANSFER_BACKENDS = ("mooncake", "memory", "nixl")  # pdserve.transfer's backends, by name
# What a server may use: its scheduler runs in its own process, and "memory" moves KV only
# between schedulers built in one process (test/disagg/pd_pair.py).
SERVER_TRANSFER_BACKENDS = ("mooncake", "nixl")
FALLBACK_POLICIES = ("local", "error")
PACK_POLICIES = ("auto", "on", "off")  # --disaggregation-transfer-pack (disagg/layout.py, packing_pays)


def resolve_token(token: str | None, token_file: str | None, env: dict | None = None) -> str | None:
    """The P/D shared token: the flag, else the file's first line, else ``AUTH_TOKEN_ENV``."""
    if token:
        return token
    if token_file:
        return secret_file_line(token_file, "disaggregation_auth_token_file")
    return (os.environ if env is None else env).get(AUTH_TOKEN_ENV, "").strip() or None


def secret_file_line(path: str, field: str) -> str:
    """The first line of a secret's file (a token, a key), or ValueError naming ``field``."""
    try:
        with open(path, encoding="utf-8") as f:
            value = f.readline().strip()
    except OSError as e:
        raise ValueError(f"{field}: cannot read {path}: {e.strerror}") from None
    if not value:
        raise ValueError(f"{field}: {path} is empty")
    return value


KV_HASH_KEY_ENV = "PDSERVE_KV_HASH_KEY"  # --kv-hash-key-file's content when the flag is not given (pdserve up)
_KV_HASH_KEY_DOMAIN = b"pdserve-kv-block-hash-key-v1\0"


def resolve_kv_hash_key(key_file: str | None, env: dict | None = None) -> bytes:
    """The key of the KV block hash chain (mem/radix_cache.py), shared by a deployment's servers and
    router: derived from ``key_file``'s first line, else from ``KV_HASH_KEY_ENV``; b"" (the unkeyed
    chain) without either. A random key per process is no default: the router must compute the
    hashes the workers publish, and prefill and decode servers key their stored pages alike."""
    if key_file:
        secret: str | None = secret_file_line(key_file, "kv_hash_key_file")
    else:
        secret = (os.environ if env is None else env).get(KV_HASH_KEY_ENV, "").strip() or None
    if secret is None:
        return b""
    return hashlib.sha256(_KV_HASH_KEY_DOMAIN + secret.encode()).digest()


@dataclass(frozen=True)
class DisaggConfig:
    """Prefill/decode disaggregation (docs/disaggregation.md). ``mode`` "null" is a colocated server."""

    mode: str = "null"
    transfer_backend: str = "mooncake"
    bootstrap_port: int = 8998  # prefill: where its bootstrap registry listens
    ib_device: str | None = None  # RDMA device(s) for the transfer engine; None: TCP
    timeout_s: float = 30.0  # longest wait without progress (unpaired room, KV in flight); quarantine lease 2x
    heartbeat_s: float = 1.0  # decode probes each prefill peer it waits on this often
    fallback: str = "local"  # decode, when a transfer fails: prefill locally, or fail the request
    min_prefill_tokens: int = 0  # decode prefills locally when it would receive fewer tokens
    # Shared by every server of a deployment: HMACs on bootstrap requests and control frames
    # (disagg/auth.py). None: loopback peers only, unless allow_unauthenticated.
    auth_token: str | None = field(default=None, repr=False)
    allow_unauthenticated: bool = False
    # Packed transfers between different TP sizes (disagg/staging.py): decode's choice per room
    # ("auto": where one write per forward replaces one per page), and each rank's staging buffer
    transfer_pack: str = "auto"
    pack_staging_mb: int = 64
    # decode: prefill registries (HOST:PORT) it may be sent to without the router's signature
    # (sglang-router), beyond the loopback of a server without a token (disagg/routed.py)
    bootstrap_allow: tuple[str, ...] = ()

    def __post_init__(self):
        _check_choice("disaggregation_mode", self.mode, DISAGG_MODES)
        for entry in self.bootstrap_allow:
            host, sep, port = entry.rpartition(":")
            if not sep or not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"disaggregation_bootstrap_allow: {entry!r} is not HOST:PORT")
        _check_choice("disaggregation_transfer_backend", self.transfer_backend, TRANSFER_BACKENDS)
        if not 0 < self.bootstrap_port < 65536:
            raise ValueError(f"disaggregation_bootstrap_port: must be in 1..65535, got {self.bootstrap_port}")
        for name in ("timeout_s", "heartbeat_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"disaggregation_{name}: must be > 0, got {getattr(self, name)}")
        _check_choice("disaggregation_fallback", self.fallback, FALLBACK_POLICIES)
        _check_at_least("disaggregation_min_prefill_tokens", self.min_prefill_tokens, 0)
        _check_choice("disaggregation_transfer_pack", self.transfer_pack, PACK_POLICIES)
        _check_at_least("disaggregation_pack_staging_mb", self.pack_staging_mb, 0)

    def check_servable(self) -> None:
        """Raise ValueError when a server (prefill and decode in separate processes) cannot use
        this configuration."""
        if self.enabled and self.transfer_backend not in SERVER_TRANSFER_BACKENDS:
            raise ValueError(f"disaggregation_transfer_backend: {self.transfer_backend!r} moves KV only between "
                             "schedulers in one process (tests); a prefill or decode server needs one of "
                             f"{SERVER_TRANSFER_BACKENDS}")

    @property
    def enabled(self) -> bool:
        return self.mode != "null"


KV_EVENTS_DEFAULT_PORT = 5557  # SGLang's and vLLM's


@dataclass(frozen=True)
class KVEventsConfig:
    """``--kv-events-config``: SGLang's JSON (``{"publisher": "zmq", "endpoint": "tcp://10.0.0.5:5557"}``).
    ``endpoint`` is where the PUB socket binds (``tcp://127.0.0.1:*``: a free port, reported in
    ``/get_server_info``); empty: the server's ``--host`` on port 5557, never every interface
    (SGLang's ``tcp://*:5557`` would hand the events to anyone who can reach the machine).
    ``max_queue_size`` batches wait for the publisher thread, more are dropped (subscribers see
    the sequence gap and resync from the snapshot)."""

    publisher: str = "null"
    endpoint: str = ""  # "": endpoint_for(--host)
    topic: str = ""
    max_queue_size: int = 100_000
    hwm: int = 100_000

    def __post_init__(self):
        if self.publisher not in KV_EVENT_PUBLISHERS:
            raise ValueError(f"kv_events_config: publisher {self.publisher!r} is not one of {KV_EVENT_PUBLISHERS}")
        if self.endpoint and not self.endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"kv_events_config: endpoint {self.endpoint!r} is not a tcp://, ipc:// or inproc:// "
                             f"ZMQ address")
        for name in ("max_queue_size", "hwm"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"kv_events_config: {name} must be an integer >= 1, got {getattr(self, name)!r}")

    @property
    def enabled(self) -> bool:
        return self.publisher != "null"

    def endpoint_for(self, host: str) -> str:
        """Where to bind on a server whose ``--host`` is ``host``: ``endpoint`` if given, else that host."""
        if self.endpoint:
            return self.endpoint
        return f"tcp://{f'[{host}]' if ':' in host else host}:{KV_EVENTS_DEFAULT_PORT}"

    @classmethod
    def parse(cls, text: str | None) -> KVEventsConfig:
        if not text:
            return cls()
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise ValueError(f"kv_events_config: not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise ValueError("kv_events_config: must be a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"kv_events_config: unknown field(s) {unknown}; known: {sorted(known)}")
        return cls(**raw)


KV_EVENT_PUBLISHERS = ("null", "zmq")


_HICACHE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(HiCacheConfig)}


def _hicache_flag(name: str) -> Any:
    """A ServerArgs field that sets ``HiCacheConfig.<name>``, with that field's default (declared there)."""
    return field(default=_HICACHE_DEFAULTS[name], metadata={"hicache": name})


_Built = TypeVar("_Built")


def _built_once(method: Callable[[ServerArgs], _Built]) -> Callable[[ServerArgs], _Built]:
    """A ServerArgs method whose result is built on the first call (``__post_init__`` makes it)
    and then returned as it is: kept in the instance's ``__dict__`` (no dataclass field, so not in
    ``to_dict``, equality or ``replace``, which builds anew) and pickled with it."""
    key = f"_built_{method.__name__}"

    @functools.wraps(method)
    def once(self: ServerArgs) -> _Built:
        if key not in self.__dict__:
            self.__dict__[key] = method(self)  # a frozen dataclass refuses setattr, not its __dict__
        return self.__dict__[key]

    return once


@dataclass(frozen=True)
class ServerArgs:
    """Everything a server (or the offline Engine) is launched with; names follow SGLang's flags."""

    model_path: str
    tokenizer_path: str | None = None
    load_format: str = "auto"
    dtype: str = "auto"  # bfloat16 on CUDA, float32 on CPU (DeviceConfig.resolve)
    context_length: int | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    page_size: int = 1
    kv_cache_dtype: str = "auto"  # CacheConfig.kv_cache_dtype
    index_cache_dtype: str = "auto"  # CacheConfig.index_cache_dtype (DeepSeek-V3.2's index keys)
    max_running_requests: int = 64
    max_total_tokens: int | None = None
    kv_cache_memory_bytes: int | None = None  # CacheConfig.kv_cache_memory_bytes (vLLM's flag)
    mem_fraction_static: float | None = None  # CacheConfig.mem_fraction_static (SGLang's flag)
    chunked_prefill_size: int | None = None  # None: default_prefill_chunk(the device); <= 0: no chunking
    max_prefill_tokens: int = 16384
    schedule_policy: str = "fcfs"
    disable_radix_cache: bool = False
    # SGLang's --hicache-* flags: each sets the HiCacheConfig field it names, with that field's default
    enable_hierarchical_cache: bool = _hicache_flag("enabled")
    hicache_ratio: float = _hicache_flag("ratio")
    hicache_size: float = _hicache_flag("size_gb")
    hicache_write_policy: str = _hicache_flag("write_policy")
    hicache_mem_layout: str = _hicache_flag("mem_layout")
    hicache_storage_backend: str | None = _hicache_flag("storage_backend")
    hicache_storage_dir: str | None = _hicache_flag("storage_dir")
    hicache_storage_size_gb: float = _hicache_flag("storage_size_gb")
    hicache_storage_prefetch_policy: str = _hicache_flag("storage_prefetch_policy")
    hicache_storage_chunk_tokens: int = _hicache_flag("storage_chunk_tokens")
    hicache_storage_backend_extra_config: str | None = _hicache_flag("storage_backend_extra_config")
    random_seed: int = 0
    api_key: str | None = None
    admin_api_key: str | None = field(default=None, repr=False)  # admin routes (web/api_key.py)
    # Host / Origin names a browser's request may carry beyond the bind's own (web/origin.py; "*": any)
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    allow_no_api_key: bool = False  # listen beyond the loopback without --api-key (refused otherwise)
    log_level: str = "info"
    served_model_name: str | None = None
    skip_tokenizer_init: bool = False
    tp_size: int = 1
    dp_size: int = 1
    ep_size: int = 1
    enable_dp_attention: bool = False
    moe_a2a_backend: str = "none"
    dist_init_addr: str | None = None
    nnodes: int = 1
    node_rank: int = 0
    num_threads: int | None = None
    cpu_gemm: str = "auto"  # DeviceConfig.cpu_gemm
    disable_overlap_schedule: bool = False  # decode forwards on the scheduler thread (engine/overlap.py)
    disable_thread_tuning: bool = False  # the forward's threads stay the layout's (engine/thread_tuner.py)
    enable_torch_compile: bool = False
    torch_compile_max_bs: int = 32
    stream_interval: int = 1  # stream a request's text every N tokens (first and last always)
    max_request_bytes: int = 32 << 20  # larger HTTP request bodies are refused (413) before parsing
    max_logprobs: int = 20  # top-k logprobs per token a request may ask for (vLLM's flag); -1: up to the vocabulary
    max_seqs_per_request: int = 256  # sequences (prompts x n, or x best_of) one API request may run
    tool_call_parser: str | None = None  # the model family's tool-call format (TOOL_CALL_PARSERS)
    reasoning_parser: str | None = None  # how the model marks its thinking part (REASONING_PARSERS)
    disaggregation_mode: str = "null"
    disaggregation_transfer_backend: str = "mooncake"
    disaggregation_bootstrap_port: int = 8998
    disaggregation_ib_device: str | None = None
    disaggregation_timeout_s: float = 30.0
    disaggregation_heartbeat_s: float = 1.0
    disaggregation_fallback: str = "local"
    disaggregation_min_prefill_tokens: int = 0
    disaggregation_auth_token: str | None = field(default=None, repr=False)
    disaggregation_auth_token_file: str | None = None
    disaggregation_allow_unauthenticated: bool = False
    disaggregation_transfer_pack: str = "auto"
    disaggregation_pack_staging_mb: int = 64
    disaggregation_bootstrap_allow: tuple[str, ...] = ()  # decode: HOST:PORT registries it may be sent to unsigned
    kv_events_config: str | None = None  # JSON, KVEventsConfig
    kv_hash_key_file: str | None = None  # the block hash chain's key (resolve_kv_hash_key); KV_HASH_KEY_ENV without it
    cache_salt_per_client: bool = False  # each client (key + X-Client-Token) its own prefix cache (cache isolation)
    # GPU engine path (DeviceConfig): None resolves by what this host has.
    device: str | None = None
    attention_backend: str | None = None
    cuda_graph_max_bs: int = 32
    disable_cuda_graph: bool = False
    deepep_mode: str = "auto"
    # speculative decoding (SpeculativeConfig; SGLang's flags)
    speculative_algorithm: str | None = None
    speculative_draft_model_path: str | None = None
    speculative_num_steps: int = 3
    speculative_eagle_topk: int = 1
    speculative_num_draft_tokens: int | None = None
    # constrained decoding (GrammarConfig; SGLang's --grammar-backend)
    grammar_backend: str = "xgrammar"
    grammar_compile_timeout: float = 60.0
    grammar_cache_size: int = 256
    grammar_max_compiles_per_client: int = 4
    constrained_json_disable_any_whitespace: bool = False  # accepted (SGLang's flag); compact is the default
    constrained_json_any_whitespace: bool = False
    grammar_jump_forward: bool = True
    grammar_compile_isolation: bool = True
    grammar_compile_memory_mb: int = 2048
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval: must be >= 1, got {self.stream_interval}")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes: must be >= 1, got {self.max_request_bytes}")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs: must be >= 0, or -1 (no cap but the vocabulary), got {self.max_logprobs}")
        if self.max_seqs_per_request < 1:
            raise ValueError(f"max_seqs_per_request: must be >= 1, got {self.max_seqs_per_request}")
        for parser_field in ("tool_call_parser", "reasoning_parser"):  # case-insensitive, as in SGLang
            if getattr(self, parser_field) is not None:
                object.__setattr__(self, parser_field, getattr(self, parser_field).lower())
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            raise ValueError(f"tool_call_parser: {self.tool_call_parser!r} is not one of {TOOL_CALL_PARSERS}")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"reasoning_parser: {self.reasoning_parser!r} is not one of {REASONING_PARSERS}")
        if not (0 < self.port < 65536):
            raise ValueError(f"port: must be in 1..65535, got {self.port}")
        # Building the parts validates every field they own. Each is built here, once (the secret
        # read once), and kept on this object: a pickled copy carries them to the scheduler processes.
        self.cache_config()
        self.scheduler_config()
        self.parallel_config()
        self.disagg_config()
        self.grammar_config()
        if self.kv_events().enabled and self.dp_size > 1:
            # each DP group caches its own requests; one stream and one snapshot per server would mix them
            raise ValueError(f"kv_events_config: KV events are published by single-group servers (dp_size 1), "
                             f"got dp_size {self.dp_size}")
        if self.disaggregation_mode == "prefill" and self.dp_size > 1:
            # Decode plans a request's writes from the prefill layout before prefill has assigned the
            # request to a DP group, so it could not know which group's ranks hold the KV.
            raise ValueError(f"dp_size: a prefill server runs one attention group (TP/EP), got dp_size "
                             f"{self.dp_size}; start more prefill servers instead")
        if self.enable_hierarchical_cache and self.dp_size > 1:
            # TP ranks agree on every hit length before loading (docs/hicache.md); that round spans
            # every rank, and the DP groups of a server schedule different requests.
            raise _flag_error("enable_hierarchical_cache", f"runs with one attention group for now (dp_size 1, "
                              f"any tp_size/ep_size), got dp_size {self.dp_size}")
        if self.compile_config().enabled and self.parallel_config().world_size > 1:
            raise ValueError("enable_torch_compile: compiled decode runs on single-rank servers for now "
                             "(tp_size, dp_size and ep_size 1)")
        if self.dtype not in ("auto", *DTYPES):
            raise ValueError(f"dtype: {self.dtype!r} is not one of {('auto', *DTYPES)}")
        self.device_config()
        self._check_speculative()
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format: {self.load_format!r} is not one of {LOAD_FORMATS}")
        # A chunk must hold at least one page, or a long prompt could never advance.
        if 0 < self.prefill_chunk() < self.page_size:
            raise ValueError(f"chunked_prefill_size: must be >= page_size ({self.page_size}) or <= 0 "
                             f"(disabled), got {self.prefill_chunk()}")
        if self.max_prefill_tokens < self.page_size:
            raise ValueError(f"max_prefill_tokens: must be >= page_size ({self.page_size}), "
                             f"got {self.max_prefill_tokens}")

    def model_config(self) -> ModelConfig:
        """Reads config.json: call once per process and pass the result on. Raises ValueError
        when the parallel split cannot shard this model (naming the field)."""
        model = ModelConfig.from_path(self.model_path, self.device_config().dtype, self.load_format,
                                      self.context_length)
        assert model.files is not None  # from_path keeps what it read
        self._check_model(model.files)
        return model

    def model_files(self) -> ModelFiles:
        """``model_config`` without transformers and torch (the HTTP frontend's): config.json read with
        json, and every refusal of this model checked, naming the field; the model's own checks that need
        transformers (its model_type known there) run where ``model_config`` is built."""
        files = ModelFiles.read(self.model_path, self.load_format)
        self._check_model(files)
        return files

    def _check_model(self, model: ModelFiles) -> None:
        self.parallel_config().check_model(model)
        if model.index_head_dim:
            self._check_sparse_index(model)
        elif self.index_cache_dtype != "auto":
            raise _flag_error("index_cache_dtype", f"{self.index_cache_dtype}: the model keeps no index keys "
                                                   f"(DeepSeek-V3.2's lightning indexer)")
        if model.attention == "regions":
            self._check_deepseek_v4(model)

    def _check_deepseek_v4(self, model: ModelFiles) -> None:
        """DeepSeek-V4 runs in one attention group (TP and EP, no DP), eagerly on torch, with a full-precision
        pool for now (docs/models.md); everything else is refused here, naming it. P/D and the tiers move its
        state regions as they move any pool's pages (disagg/layout.py's regions layout, mem/host_pool.py);
        so does NEXTN's draft layer (its window rows, one more layer of ``window_kv``)."""
        v4 = "DeepSeek-V4"
        dev = self.device_config()
        refusals = {
            "speculative_algorithm": (self.speculative_algorithm not in (None, "NEXTN"),
                                      f"{self.speculative_algorithm}: {v4} drafts with NEXTN (its MTP layer) only: "
                                      f"EAGLE's Llama KV has no place among its state regions"),
            "attention_backend": (dev.attention_backend != "torch_native",
                                  f"{dev.attention_backend}: {v4}'s attention runs in torch only (no Triton or "
                                  f"flashinfer kernels yet)"),
            "enable_dp_attention": (self.enable_dp_attention, f"{v4} runs without DP attention for now (TP and EP "
                                                              f"split it; its replicated state has no DP split)"),
            "dp_size": (self.dp_size > 1, f"{self.dp_size}: {v4} runs one attention group for now (dp_size 1; "
                                          f"tp_size and ep_size split it)"),
            "tp_size": (model.config.o_groups % self.parallel_config().attn_tp_size != 0,
                        f"{self.tp_size}: {v4}'s o_groups ({model.config.o_groups}) must be divisible by it "
                        f"(each rank projects whole output groups of its heads)"),
            "kv_cache_dtype": (self.kv_cache_dtype != "auto",
                               f"{self.kv_cache_dtype}: {v4}'s state stays in the model dtype (no FP8 regions yet)"),
            "enable_torch_compile": (self.enable_torch_compile, f"{v4}'s attention runs eagerly"),
            "disable_cuda_graph": (dev.use_cuda_graph, f"{v4}'s decode is not captured in CUDA graphs yet "
                                                       f"(pass --disable-cuda-graph)"),
        }
        for field_name, (refused, why) in refusals.items():
            if refused:
                raise _flag_error(field_name, why)
        quant = model.quantization
        if quant is not None and quant.expert_dtype != "fp4":
            raise ValueError(f"quantization_config.expert_dtype: {quant.expert_dtype!r}: {v4} checkpoints load with "
                             f"FP4 experts (expert_dtype 'fp4', as shipped) only")

    def _check_sparse_index(self, model: ModelFiles) -> None:
        """DeepSeek-V3.2 (MLA + DSA) runs over torch_native or triton for now (docs/models.md); everything else is
        refused here, naming it. P/D, the tiers and TP/DP/EP carry its index keys as one more region of
        the latent's pages; so does NEXTN's draft layer (one more layer of both regions)."""
        v32 = "DeepSeek-V3.2"
        _check_choice("index_cache_dtype", self.index_cache_dtype, INDEX_CACHE_DTYPES)
        if resolve_index_cache_dtype(self.index_cache_dtype, self.device_config().device) == "fp8_e4m3":
            di = model.index_head_dim
            if di % min(128, di):
                raise _flag_error("index_cache_dtype", f"fp8_e4m3: {v32}'s FP8 index keys take blocks of 128 "
                                                       f"values, but index_head_dim is {di}")
        refusals = {
            "attention_backend": (self.device_config().attention_backend not in ("torch_native", "triton"),
                                  f"{self.device_config().attention_backend}: {v32}'s sparse attention runs on "
                                  f"torch_native or triton (no flashinfer sparse kernels yet)"),
        }
        for field_name, (refused, why) in refusals.items():
            if refused:
                raise _flag_error(field_name, why)

    @_built_once
    def cache_config(self) -> CacheConfig:
        return CacheConfig(self.page_size, self.max_total_tokens, self.disable_radix_cache,
                           hicache=self.hicache_config(), kv_cache_dtype=self.kv_cache_dtype,
                           hash_key=resolve_kv_hash_key(self.kv_hash_key_file),
                           kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                           mem_fraction_static=self.mem_fraction_static,
                           state_records=self.max_running_requests, index_cache_dtype=self.index_cache_dtype)

    @_built_once
    def hicache_config(self) -> HiCacheConfig:
        flags = {f.metadata["hicache"]: getattr(self, f.name) for f in _HICACHE_FLAGS}
        return HiCacheConfig(**flags, auth_token=self.auth_token(), host=self.host)

    @_built_once
    def auth_token(self) -> str | None:
        """The P/D shared token (resolve_token), read once."""
        return resolve_token(self.disaggregation_auth_token, self.disaggregation_auth_token_file)

    def prefill_chunk(self) -> int:
        """``--chunked-prefill-size``, else the device's default (``default_prefill_chunk``)."""
        if self.chunked_prefill_size is not None:
            return self.chunked_prefill_size
        return default_prefill_chunk(self.device_config().device)

    @_built_once
    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(self.max_running_requests, self.prefill_chunk(),
                               self.max_prefill_tokens, self.schedule_policy, self.random_seed,
                               disable_overlap_schedule=self.disable_overlap_schedule)

    @_built_once
    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(self.tp_size, self.dp_size, self.ep_size, self.enable_dp_attention,
                              self.moe_a2a_backend, self.dist_init_addr, self.nnodes, self.node_rank,
                              deepep_mode=self.deepep_mode)

    @_built_once
    def compile_config(self) -> CompileConfig:
        return CompileConfig(self.enable_torch_compile, self.torch_compile_max_bs)

    @_built_once
    def device_config(self) -> DeviceConfig:
        return DeviceConfig.resolve(self.device, self.attention_backend, self.dtype, self.cuda_graph_max_bs,
                                    self.disable_cuda_graph, self.cpu_gemm)

    @_built_once
    def disagg_config(self) -> DisaggConfig:
        return DisaggConfig(self.disaggregation_mode, self.disaggregation_transfer_backend,
                            self.disaggregation_bootstrap_port, self.disaggregation_ib_device,
                            self.disaggregation_timeout_s, self.disaggregation_heartbeat_s,
                            self.disaggregation_fallback, self.disaggregation_min_prefill_tokens,
                            self.auth_token(), self.disaggregation_allow_unauthenticated,
                            self.disaggregation_transfer_pack, self.disaggregation_pack_staging_mb,
                            tuple(self.disaggregation_bootstrap_allow))

    def thread_layout(self, frontend: bool = True, share: int = 1) -> ThreadLayout:
        """This compute process's threads (``ThreadLayout``); the scheduler runs overlapped unless
        --disable-overlap-schedule, speculation or several ranks keep it on one thread (a prefill
        server never decodes: nothing of its runs beside a forward)."""
        overlap = (not self.disable_overlap_schedule and not self.speculative_config().enabled
                   and self.parallel_config().world_size == 1 and self.disaggregation_mode != "prefill")
        return ThreadLayout.choose(self.num_threads, overlap, frontend, share)

    @_built_once
    def speculative_config(self) -> SpeculativeConfig:
        return SpeculativeConfig(self.speculative_algorithm, self.speculative_draft_model_path,
                                 self.speculative_num_steps, self.speculative_eagle_topk,
                                 self.speculative_num_draft_tokens)

    @_built_once
    def grammar_config(self) -> GrammarConfig:
        if self.constrained_json_any_whitespace and self.constrained_json_disable_any_whitespace:
            raise ValueError("constrained_json_any_whitespace: cannot be set with "
                             "constrained_json_disable_any_whitespace (pick one)")
        return GrammarConfig(self.grammar_backend, self.grammar_compile_timeout, self.grammar_cache_size,
                             any_whitespace=self.constrained_json_any_whitespace,
                             jump_forward=self.grammar_jump_forward,
                             max_compiles_per_client=self.grammar_max_compiles_per_client,
                             compile_isolation=self.grammar_compile_isolation,
                             compile_memory_mb=self.grammar_compile_memory_mb)

    def _check_speculative(self) -> None:
        """What speculation does not run with yet, refused naming the flag."""
        if not self.speculative_config().enabled:
            return
        # A prefill server only computes the draft layer's prompt KV (replicated on every rank);
        # decoding with drafts runs on one rank for now.
        if self.parallel_config().world_size > 1 and self.disaggregation_mode != "prefill":
            raise _flag_error("speculative_algorithm", "decodes on single-rank servers for now (tp_size, dp_size "
                              "and ep_size 1; a --disaggregation-mode prefill server may have more ranks)")
        if self.compile_config().enabled:
            raise _flag_error("speculative_algorithm", "does not run with --enable-torch-compile yet")

    @_built_once
    def kv_events(self) -> KVEventsConfig:
        return KVEventsConfig.parse(self.kv_events_config)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path

    def replace(self, **changes) -> ServerArgs:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        for secret in ("api_key", "admin_api_key", "disaggregation_auth_token"):
            if d.get(secret):
                d[secret] = "***"
        return d


_HICACHE_FLAGS = tuple(f for f in dataclasses.fields(ServerArgs) if "hicache" in f.metadata)


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, which containers narrow), else os.cpu_count()."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def default_num_threads(frontend: bool = True, overlap: bool = False) -> int:
    """Torch threads of a compute process when ``--num-threads`` is not given.

    OMP_NUM_THREADS when the operator set it. Otherwise every usable core, less one when
    an HTTP frontend shares the machine (``frontend``: a server's scheduler process): the
    frontend's event loop parses requests and detokenizes and frames every streamed token,
    and when the scheduler's threads take all cores each token waits for the frontend to be
    scheduled (measured on 2 cores: see the README's benchmark section). The in-process
    Engine (``frontend=False``) has no frontend. Less one more with ``overlap``: the scheduler
    thread works beside the forward (engine/overlap.py), and OpenMP threads that share a core with
    it stall the whole forward at every barrier. Never fewer than one.
    """
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    return max(1, usable_cores() - frontend - overlap)


@dataclass(frozen=True)
class ThreadLayout:
    """How a compute process shares its cores, chosen at start-up (``/get_server_info`` shows it):
    ``torch_threads`` intra-op threads run the forward; beside them, the scheduler thread when
    ``overlap`` is on, and an HTTP frontend process when ``frontend``. ``source``: what decided
    the count (``--num-threads``, ``OMP_NUM_THREADS``, or the usable cores); ``reason``: the
    same in words, with what the count leaves room for."""

    cores: int
    torch_threads: int
    overlap: bool
    frontend: bool
    source: str
    reason: str = ""

    @classmethod
    def choose(cls, num_threads: int | None, overlap: bool, frontend: bool, share: int = 1) -> ThreadLayout:
        """``share``: compute processes (ranks) on this machine splitting the cores."""
        env = os.environ.get("OMP_NUM_THREADS", "")
        source = "--num-threads" if num_threads else "OMP_NUM_THREADS" if env.isdigit() and int(env) > 0 else "cores"
        threads = num_threads or max(1, default_num_threads(frontend, overlap) // share)
        cores = usable_cores()
        if source != "cores":
            return cls(cores, threads, overlap, frontend, source, f"{source} sets the torch threads")
        left = [what for what, on in (("the HTTP frontend", frontend), ("the overlapped scheduler thread", overlap))
                if on]
        reason = f"{cores} usable cores" + (f" over {share} ranks" if share > 1 else "") + \
            (f", one left to {' and one to '.join(left)}" if left else "") + \
            ("; at least one thread, so these share a core" if cores - len(left) < share else "")
        return cls(cores, threads, overlap, frontend, source, reason)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
