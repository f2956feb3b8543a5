"""RouterArgs: everything ``pdserve router`` is launched with (flag names follow sglang-router's)."""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from pdserve.router.policy import POLICIES

DEFAULT_BOOTSTRAP_PORT = 8998  # SGLang's --disaggregation-bootstrap-port default
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
BOOTSTRAP_PORT_ANNOTATION = "sglang.ai/bootstrap-port"  # sglang-router's default
NO_LIMIT = -1  # --max-concurrent-requests: no cap


@dataclass(frozen=True)
class PrefillSpec:
    """One ``--prefill URL [BOOTSTRAP_PORT]``."""

    url: str
    bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT

    def __post_init__(self):
        check_url(self.url, "prefill")
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
    max_request_bytes: int = 32 << 20  # the servers' default: larger bodies get a 413 as they arrive
    log_level: str = "info"
    # repr=False: keys stay out of logs and tracebacks
    api_key: str | None = field(default=None, repr=False)  # clients must send it; the workers get it too
    worker_api_key: str | None = field(default=None, repr=False)  # sent to the workers instead of api_key
    # admin routes need it from clients (web/api_key.py); sent to the workers for admin calls
    admin_api_key: str | None = field(default=None, repr=False)
    # Host / Origin names a browser's request may carry beyond the bind's own (web/origin.py; "*": any)
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    allow_no_api_key: bool = False  # listen beyond the loopback without --api-key (refused otherwise)
    # the P/D token (the servers'): the router signs the bootstrap fields it adds (disagg/routed.py)
    disaggregation_auth_token: str | None = field(default=None, repr=False)
    # ---- a fleet: breakers, retries, admission, health thresholds, discovery (sglang-router's names
    # and defaults, checked by _check_fleet). The cap is off unless --max-concurrent-requests is given.
    cb_failure_threshold: int = 10  # consecutive failed requests that open a worker's breaker
    cb_success_threshold: int = 3  # consecutive successes in half-open that close it
    cb_timeout_duration_secs: float = 60.0  # open this long, then half-open
    disable_circuit_breaker: bool = False
    retry_max_retries: int = 5  # connection failures before any byte reached the client
    retry_initial_backoff_ms: int = 50
    retry_max_backoff_ms: int = 30_000
    retry_backoff_multiplier: float = 1.5
    retry_jitter_factor: float = 0.2
    disable_retries: bool = False
    max_concurrent_requests: int = NO_LIMIT  # generation requests in flight; more wait in the queue
    queue_size: int = 100  # beyond it: 429 with Retry-After
    queue_timeout_secs: float = 60.0  # longer in the queue: 408
    health_failure_threshold: int = 3  # consecutive failed checks that mark a healthy worker dead
    # consecutive passed checks that bring a dead one back; 1, not sglang-router's 2: a restarted worker
    # is used at its first passed check (its breaker keeps it out if its requests still fail)
    health_success_threshold: int = 1
    health_check_endpoint: str = "/health"
    service_discovery: bool = False  # Kubernetes pods by label (router/discovery.py)
    selector: tuple[str, ...] = ()  # key=value labels every worker pod has
    prefill_selector: tuple[str, ...] = ()
    decode_selector: tuple[str, ...] = ()
    service_discovery_namespace: str | None = None  # required with service_discovery
    service_discovery_port: int = 80
    bootstrap_port_annotation: str = BOOTSTRAP_PORT_ANNOTATION
    workers_file: str | None = None  # a JSON/YAML file of workers, watched for changes
    kv_hash_key_file: str | None = None  # the workers' block hash key (pdserve.config.resolve_kv_hash_key)

    def __post_init__(self):
        if not self.prefill and not self.discovers:
            raise ValueError("prefill: give at least one --prefill URL [BOOTSTRAP_PORT] (or --service-discovery, "
                             "or --workers-file)")
        if not self.decode and not self.discovers:
            raise ValueError("decode: give at least one --decode URL (or --service-discovery, or --workers-file)")
        for url in self.decode:
            check_url(url, "decode")
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
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes: must be >= 1, got {self.max_request_bytes}")
        for name in ("api_key", "worker_api_key", "admin_api_key"):
            if getattr(self, name) == "":
                raise ValueError(f"{name}: must not be empty")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level: {self.log_level!r} is not one of {LOG_LEVELS}")
        _check_fleet(self)

    @property
    def discovers(self) -> bool:
        """Workers come (also) from Kubernetes or a watched file, so the flags may name none."""
        return self.service_discovery or self.workers_file is not None

    @property
    def prefill_policy_name(self) -> str:
        return self.prefill_policy or self.policy

    @property
    def decode_policy_name(self) -> str:
        return self.decode_policy or self.policy

    def hash_key(self) -> bytes:
        """The key the workers hash KV blocks under (their events match prompts hashed with it)."""
        from pdserve.config import resolve_kv_hash_key

        return resolve_kv_hash_key(self.kv_hash_key_file)

    @property
    def worker_key(self) -> str | None:
        """The key sent to the workers: ``worker_api_key``, else the router's own ``api_key``."""
        return self.worker_api_key or self.api_key



def _check_fleet(a: RouterArgs) -> None:
    """The breaker, retry, admission, health-threshold and discovery fields."""
    for name in ("cb_failure_threshold", "cb_success_threshold", "health_failure_threshold",
                 "health_success_threshold"):
        if getattr(a, name) < 1:
            raise ValueError(f"{name}: must be >= 1, got {getattr(a, name)}")
    for name in ("cb_timeout_duration_secs", "queue_timeout_secs"):
        if not getattr(a, name) > 0:
            raise ValueError(f"{name}: must be > 0, got {getattr(a, name)}")
    for name in ("retry_max_retries", "retry_initial_backoff_ms", "queue_size"):
        if getattr(a, name) < 0:
            raise ValueError(f"{name}: must be >= 0, got {getattr(a, name)}")
    if a.retry_max_backoff_ms < a.retry_initial_backoff_ms:
        raise ValueError(f"retry_max_backoff_ms: must be >= retry_initial_backoff_ms ({a.retry_initial_backoff_ms}), "
                         f"got {a.retry_max_backoff_ms}")
    if not a.retry_backoff_multiplier >= 1.0:
        raise ValueError(f"retry_backoff_multiplier: must be >= 1.0, got {a.retry_backoff_multiplier}")
    if not 0.0 <= a.retry_jitter_factor <= 1.0:
        raise ValueError(f"retry_jitter_factor: must be in [0, 1], got {a.retry_jitter_factor}")
    if a.max_concurrent_requests != NO_LIMIT and a.max_concurrent_requests < 1:
        raise ValueError(f"max_concurrent_requests: must be >= 1 (or {NO_LIMIT}: no cap), got "
                         f"{a.max_concurrent_requests}")
    if not a.health_check_endpoint.startswith("/"):
        raise ValueError(f"health_check_endpoint: must be a path starting with '/', got {a.health_check_endpoint!r}")
    _check_port(a.service_discovery_port, "service_discovery_port")
    for name in ("selector", "prefill_selector", "decode_selector"):
        for label in getattr(a, name):
            parse_label(label, name)
    if a.service_discovery and not (a.prefill_selector and a.decode_selector):
        raise ValueError("prefill_selector: --service-discovery needs --prefill-selector and --decode-selector "
                         "(key=value labels of each role's pods)")
    if a.service_discovery and not a.service_discovery_namespace:
        raise ValueError("service_discovery_namespace: --service-discovery needs the namespace of the worker pods "
                         "(the router sends its worker key and every prompt to the pods it finds)")
    if a.workers_file == "":
        raise ValueError("workers_file: must not be empty")


def parse_label(label: str, field: str) -> tuple[str, str]:
    """``key=value`` (a Kubernetes equality selector term) -> (key, value)."""
    key, sep, value = label.partition("=")
    if not sep or not key or "," in label or key.endswith("!"):
        raise ValueError(f"{field}: {label!r} is not a key=value label")
    return key, value


def normalize_url(url: str) -> str:
    return url.rstrip("/")


def check_url(url: str, field: str) -> None:
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
