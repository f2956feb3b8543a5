"""RouterArgs: everything ``pdserve router`` is launched with (flag names follow sglang-router's)."""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from pdserve.router.policy import POLICIES

DEFAULT_BOOTSTRAP_PORT = 8998  # SGLang's --disaggregation-bootstrap-port default
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


@dataclass(frozen=True)
class PrefillSpec:
    """One ``--prefill URL [BOOTSTRAP_PORT]``."""

    url: str
    bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT

    def __post_init__(self):
        _check_url(self.url, "prefill")
        _check_port(self.bootstrap_port, f"prefill {self.url}: bootstrap_port")

    @classmethod
    def parse(cls, values: list[str]) -> PrefillSpec:
        """``["http://h:p"]`` or ``["http://h:p", "8998"]`` (argparse's ``nargs="+"``) -> PrefillSpec."""
        if not 1 <= len(values) <= 2:
            raise ValueError(f"prefill: expected URL [BOOTSTRAP_PORT], got {' '.join(values)!r}")
        if len(values) == 1:
            return cls(normalize_url(values[0]))
        if not values[1].isdigit():
            raise ValueError(f"prefill {values[0]}: bootstrap_port must be an integer port, got {values[1]!r}")
        return cls(normalize_url(values[0]), int(values[1]))


@dataclass(frozen=True)
class RouterArgs:
    """A router's configuration; ``__post_init__`` names the field of any bad value."""

    prefill: tuple[PrefillSpec, ...]
    decode: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 30000
    policy: str = "cache_aware"
    prefill_policy: str | None = None  # None: --policy
    decode_policy: str | None = None
    # cache_aware: a worker caching the longest prefix wins unless it has more than abs AND more than
    # rel times the in-flight requests of the least loaded one (sglang-router's names and defaults)
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    cache_threshold: float = 0.3  # cache_aware: below this cached share of the prompt, route by load
    tokenizer_path: str | None = None  # None: the path the prefill workers report (if it is local)
    kv_events_timeout_secs: float = 5.0  # a worker silent this long (no event, no heartbeat): routed on the guess
    approximate_index: bool = True  # cache_aware guesses each prefill's cache from its own routing (approx_index)
    health_check_interval_secs: float = 5.0
    health_check_timeout_secs: float = 5.0
    worker_startup_timeout_secs: float = 600.0
    worker_startup_check_interval: float = 1.0
    request_timeout_secs: float = 1800.0
    log_level: str = "info"
    # repr=False: keys stay out of logs and tracebacks
    api_key: str | None = field(default=None, repr=False)  # clients must send it; the workers get it too
    worker_api_key: str | None = field(default=None, repr=False)  # sent to the workers instead of api_key
    # admin routes need it from clients (web/api_key.py); sent to the workers for admin calls
    admin_api_key: str | None = field(default=None, repr=False)

    def __post_init__(self):
        if not self.prefill:
            raise ValueError("prefill: give at least one --prefill URL [BOOTSTRAP_PORT]")
        if not self.decode:
            raise ValueError("decode: give at least one --decode URL")
        for url in self.decode:
            _check_url(url, "decode")
        _check_unique([p.url for p in self.prefill], "prefill")
        _check_unique(list(self.decode), "decode")
        _check_port(self.port, "port")
        for name in ("policy", "prefill_policy", "decode_policy"):
            value = getattr(self, name)
            if value is not None and value not in POLICIES:
                raise ValueError(f"{name}: {value!r} is not one of {tuple(POLICIES)}")
        if self.balance_abs_threshold < 0:
            raise ValueError(f"balance_abs_threshold: must be >= 0, got {self.balance_abs_threshold}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold: must be in [0, 1], got {self.cache_threshold}")
        if not self.balance_rel_threshold >= 1.0:
            raise ValueError(f"balance_rel_threshold: must be >= 1.0, got {self.balance_rel_threshold}")
        for name in ("health_check_interval_secs", "health_check_timeout_secs", "worker_startup_timeout_secs",
                     "worker_startup_check_interval", "request_timeout_secs", "kv_events_timeout_secs"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        for name in ("api_key", "worker_api_key", "admin_api_key"):
            if getattr(self, name) == "":
                raise ValueError(f"{name}: must not be empty")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level: {self.log_level!r} is not one of {LOG_LEVELS}")

    @property
    def prefill_policy_name(self) -> str:
        return self.prefill_policy or self.policy

    @property
    def decode_policy_name(self) -> str:
        return self.decode_policy or self.policy

    @property
    def worker_key(self) -> str | None:
        """The key sent to the workers: ``worker_api_key``, else the router's own ``api_key``."""
        return self.worker_api_key or self.api_key



def normalize_url(url: str) -> str:
    return url.rstrip("/")


def _check_url(url: str, field: str) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{field}: {url!r} is not an http(s)://HOST[:PORT] URL")
    if parts.path not in ("", "/") or parts.query:
        raise ValueError(f"{field}: {url!r} must be a server's base URL (no path or query)")
    try:
        parts.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError:
        raise ValueError(f"{field}: {url!r} has an invalid port") from None


def _check_port(port: int, field: str) -> None:
    if not 0 < port < 65536:
        raise ValueError(f"{field}: must be in 1..65535, got {port}")


def _check_unique(urls: list[str], field: str) -> None:
    seen = set()
    for url in urls:
        if url in seen:
            raise ValueError(f"{field}: {url} is listed twice")
        seen.add(url)
