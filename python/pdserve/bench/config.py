"""Frozen configuration of one ``pdserve bench`` run, composed of small validated parts.

Every field is named after its flag (``random_input_len`` <- ``--random-input-len``),
so a validation error names the flag a person typed. ``BenchConfig.from_flat``
builds the whole tree from one flat ``{field: value}`` mapping (argparse's namespace).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field

from pdserve.web.api_key import ADMIN_KEY_ENV

BACKENDS = ("pdserve", "sglang", "openai", "openai-chat")
NATIVE_BACKENDS = ("pdserve", "sglang")
DATASETS = ("random", "sharegpt", "generated-shared-prefix", "multi-turn", "mixed")
PROFILE_KINDS = ("prefill", "decode")
SLO_KEYS = ("ttft", "tpot", "e2e")
_SLO_ALIASES = {"e2el": "e2e", "e2e_latency": "e2e"}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _positive(obj, *names: str, allow_zero: bool = False) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is None:
            continue
        if value < 0 or (value == 0 and not allow_zero):
            raise ValueError(f"{_flag(name)}: must be {'>= 0' if allow_zero else '> 0'}, got {value}")


@dataclass(frozen=True)
class EndpointConfig:
    """Where requests go and in which API's shape."""

    backend: str = "pdserve"
    base_url: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    model: str | None = None  # None: the server's first /v1/models entry
    tokenizer: str | None = None  # None: the model's (a preset name or a local directory)
    api_key: str | None = None  # None: $OPENAI_API_KEY, as sglang's and vLLM's clients read it
    disable_ignore_eos: bool = False
    tokenize_prompt: bool = False  # native backends: send input_ids instead of text
    extra_request_body: dict = field(default_factory=dict)
    request_timeout: float = 6 * 3600.0

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"--backend: {self.backend!r} is not one of {', '.join(BACKENDS)}")
        if self.tokenize_prompt and self.backend not in NATIVE_BACKENDS:
            raise ValueError("--tokenize-prompt: only the native backends (pdserve, sglang) take input_ids")
        if not 0 < self.port < 65536:
            raise ValueError(f"--port: must be in 1..65535, got {self.port}")
        _positive(self, "request_timeout")

    @property
    def url(self) -> str:
        return (self.base_url or f"http://{self.host}:{self.port}").rstrip("/")

    @property
    def native(self) -> bool:
        return self.backend in NATIVE_BACKENDS

    @property
    def ignore_eos(self) -> bool:
        return not self.disable_ignore_eos

    def headers(self) -> dict:
        key = self.api_key or os.environ.get("OPENAI_API_KEY")
        return {"Authorization": f"Bearer {key}"} if key else {}

    def admin_headers(self) -> dict:
        """For admin routes (POST /flush_cache): $PDSERVE_ADMIN_API_KEY when set, else ``headers()``."""
        key = os.environ.get(ADMIN_KEY_ENV)
        return {"Authorization": f"Bearer {key}"} if key else self.headers()


@dataclass(frozen=True)
class DatasetConfig:
    """Which prompts are sent; lengths are in tokens of the benchmark's tokenizer."""

    dataset_name: str = "random"
    dataset_path: str | None = None
    random_input_len: int = 1024
    random_output_len: int = 1024
    random_range_ratio: float = 0.0
    sharegpt_output_len: int | None = None
    sharegpt_context_len: int | None = None
    gsp_num_groups: int = 64
    gsp_prompts_per_group: int = 16
    gsp_system_prompt_len: int = 2048
    gsp_question_len: int = 128
    gsp_output_len: int = 256
    multi_turn_clients: int = 8
    multi_turn_rounds: int = 4
    multi_turn_question_len: int = 128
    multi_turn_output_len: int = 128
    mixed_interactive_input_len: int = 128
    mixed_interactive_output_len: int = 128
    mixed_interactive_rate: float | None = None  # None: --request-rate
    mixed_background_input_len: int = 2048
    mixed_background_output_len: int = 16
    mixed_background_rate: float = 0.5

    def __post_init__(self):
        if self.dataset_name not in DATASETS:
            raise ValueError(f"--dataset-name: {self.dataset_name!r} is not one of {', '.join(DATASETS)}")
        if self.dataset_name == "sharegpt" and not self.dataset_path:
            raise ValueError("--dataset-path: the sharegpt dataset reads a local JSON file; nothing is downloaded")
        if not 0.0 <= self.random_range_ratio <= 1.0:
            raise ValueError(f"--random-range-ratio: must be in [0, 1], got {self.random_range_ratio}")
        _positive(self, "random_input_len", "random_output_len", "gsp_num_groups", "gsp_prompts_per_group",
                  "gsp_system_prompt_len", "gsp_question_len", "gsp_output_len", "multi_turn_clients",
                  "multi_turn_rounds", "multi_turn_question_len", "multi_turn_output_len",
                  "mixed_interactive_input_len", "mixed_interactive_output_len", "mixed_interactive_rate",
                  "mixed_background_input_len", "mixed_background_output_len", "mixed_background_rate")
        if self.sharegpt_output_len is not None and self.sharegpt_output_len < 1:
            raise ValueError(f"--sharegpt-output-len: must be > 0, got {self.sharegpt_output_len}")
        if self.mixed_background_rate == math.inf or self.mixed_interactive_rate == math.inf:
            raise ValueError("--mixed-background-rate/--mixed-interactive-rate: the mixed dataset needs finite rates")


@dataclass(frozen=True)
class LoadConfig:
    """How requests arrive: count, Poisson/gamma arrivals, a client-side concurrency cap."""

    num_prompts: int = 1000
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    warmup_requests: int = 1
    seed: int = 1
    flush_cache: bool = False
    disable_tqdm: bool = False

    def __post_init__(self):
        _positive(self, "num_prompts", "request_rate", "burstiness", "max_concurrency")
        _positive(self, "warmup_requests", allow_zero=True)


@dataclass(frozen=True)
class ReportConfig:
    """What is measured against what, and where results go."""

    output_file: str | None = None
    output_details: bool = False  # also keep generated texts in the JSON
    metric_percentiles: tuple[float, ...] = (90.0, 95.0, 99.0)
    slo: dict = field(default_factory=dict)  # {"ttft": ms, "tpot": ms, "e2e": ms}
    label: str | None = None
    kv_link_gbps: float | None = None  # the P/D link's bandwidth (None: loopback measured, else unknown)

    def __post_init__(self):
        _positive(self, "kv_link_gbps")
        for p in self.metric_percentiles:
            if not 0 < p < 100:
                raise ValueError(f"--metric-percentiles: each must be in (0, 100), got {p}")
        for key, ms in self.slo.items():
            if key not in SLO_KEYS:
                raise ValueError(f"--slo: unknown metric {key!r}; use {', '.join(SLO_KEYS)}")
            if not ms > 0:
                raise ValueError(f"--slo: {key} must be > 0 ms, got {ms}")


@dataclass(frozen=True)
class ProfileConfig:
    """``--profile prefill|decode``: measure a planner profile instead of running a dataset."""

    profile: str | None = None
    profile_input_lens: tuple[int, ...] = (128, 256, 512, 1024, 2048)
    profile_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    profile_context_len: int = 128
    profile_output_len: int = 64
    profile_repeats: int = 3

    def __post_init__(self):
        if self.profile is not None and self.profile not in PROFILE_KINDS:
            raise ValueError(f"--profile: {self.profile!r} is not one of {', '.join(PROFILE_KINDS)}")
        for name in ("profile_input_lens", "profile_batch_sizes"):
            values = getattr(self, name)
            if not values or min(values) < 1:
                raise ValueError(f"{_flag(name)}: needs one or more values >= 1, got {list(values)}")
        if self.profile_output_len < 3:
            raise ValueError(f"--profile-output-len: needs >= 3 tokens to time decode steps, got "
                             f"{self.profile_output_len}")
        _positive(self, "profile_context_len", "profile_repeats")


@dataclass(frozen=True)
class BenchConfig:
    endpoint: EndpointConfig = field(default_factory=EndpointConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    load: LoadConfig = field(default_factory=LoadConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)

    @classmethod
    def from_flat(cls, values: dict) -> BenchConfig:
        """Distribute ``{field: value}`` over the parts by field name; unknown keys are ignored."""
        parts = {}
        for name, part in _PARTS.items():
            names = {f.name for f in dataclasses.fields(part)}
            parts[name] = part(**{k: v for k, v in values.items() if k in names})
        return cls(**parts)

    def to_dict(self) -> dict:
        """Flat ``{field: value}`` of every setting (the ``args`` of a result), without the API key."""
        out = {}
        for part in (self.endpoint, self.dataset, self.load, self.report, self.profile):
            out.update(dataclasses.asdict(part))
        out["api_key"] = "***" if out.get("api_key") else None
        return {k: _jsonable(v) for k, v in out.items()}


_PARTS = {"endpoint": EndpointConfig, "dataset": DatasetConfig, "load": LoadConfig, "report": ReportConfig,
          "profile": ProfileConfig}


def _jsonable(v):
    if isinstance(v, float) and math.isinf(v):
        return "inf"
    return list(v) if isinstance(v, tuple) else v


def parse_slo(text: str) -> dict:
    """``"ttft:200,tpot:50"`` (commas or spaces) -> ``{"ttft": 200.0, "tpot": 50.0}`` in ms."""
    slo = {}
    for item in text.replace(",", " ").split():
        key, sep, value = item.partition(":")
        key = _SLO_ALIASES.get(key.strip().lower(), key.strip().lower())
        if not sep:
            raise ValueError(f"--slo: {item!r} is not METRIC:MS (e.g. ttft:200)")
        if key not in SLO_KEYS:
            raise ValueError(f"--slo: unknown metric {key!r}; use {', '.join(SLO_KEYS)}")
        try:
            slo[key] = float(value)
        except ValueError:
            raise ValueError(f"--slo: {item!r}: {value!r} is not a number of milliseconds") from None
    return slo


def parse_floats(text: str, flag: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.replace(",", " ").split())
    except ValueError:
        raise ValueError(f"{flag}: {text!r} is not a comma-separated list of numbers") from None


def parse_ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.replace(",", " ").split())
    except ValueError:
        raise ValueError(f"{flag}: {text!r} is not a comma-separated list of integers") from None
