"""Prometheus metrics of one server (its own registry: no module-global state).

Gauges mirror the scheduler's ``stats()`` (refreshed when ``/metrics`` is
scraped); histograms and counters are fed by the frontend as requests finish.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.utils import floatToGoString

from pdserve.obs.timeline import STAGES, ReqTimeline

PREFIX = "pdserve:"
# Seconds; fine steps at the low end where CPU decode steps live, up to a minute.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                   1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0)
# scheduler stats() key -> (gauge name, help)
STAT_GAUGES = {
    "num_running_reqs": ("num_running_reqs", "Requests in the running (prefill or decode) set"),
    "num_waiting_reqs": ("num_queue_reqs", "Requests waiting for admission"),
    "token_usage": ("token_usage", "Fraction of KV pages held by requests or locked cache entries"),
    "free_pages": ("free_pages", "Free KV pages"),
    "cached_pages": ("cached_pages", "KV pages held by the prefix cache"),
    "total_pages": ("total_pages", "KV pages in the pool"),
}

# Disaggregation: scheduler stats() key -> (metric name, help); counters are cumulative there.
DISAGG_COUNTERS = {
    "kv_bytes_sent": ("kv_transfer_bytes", "Prefill: KV bytes posted to decode servers"),
    "kv_writes_sent": ("kv_transfer_writes", "Prefill: KV write operations posted (after merging page runs)"),
    "kv_writes_packed": ("kv_transfer_writes_packed", "Prefill: of those, head blocks packed into staging"),
    "kv_rooms_packed": ("decode_kv_rooms_packed", "Decode: requests whose KV was asked for packed (staging lent)"),
    "rooms_completed": ("prefill_rooms_completed", "Prefill: requests whose KV fully landed on decode"),
    "rooms_failed": ("prefill_rooms_failed", "Prefill: requests whose KV transfer failed"),
    "rooms_dropped": ("prefill_rooms_dropped", "Prefill: rooms decode prefilled itself (conditional)"),
    "rooms_aborted": ("prefill_rooms_aborted", "Prefill: rooms decode aborted"),
    "rooms_expired": ("prefill_rooms_expired", "Prefill: request halves never paired in time"),
    "requests_disaggregated": ("decode_kv_requests", "Decode: requests that asked a prefill server for KV"),
    "kv_received": ("decode_kv_received", "Decode: requests whose KV landed from prefill"),
    "kv_pages_received": ("decode_kv_pages_received", "Decode: KV pages received from prefill"),
    "kv_pages_requested": ("kv_pages_requested", "KV pages decode asked prefill for (prefill: asked of it, each decode "
                           "rank's request counted; decode: by it); pages decode's own prefix cache holds are never "
                           "asked for"),
    "kv_bytes_received": ("kv_transfer_bytes_received", "Decode: KV bytes landed from prefill"),
    "decode_cached_tokens": ("decode_cached_tokens", "Decode: prompt tokens its own prefix cache held for requests "
                             "that asked prefill for the rest (prefill's hit is cache_hit_tokens on prefill)"),
    "local_prefills": ("decode_local_prefills", "Decode: routed requests prefilled locally by choice"),
    "fallbacks": ("decode_fallbacks", "Decode: requests prefilled locally after a failed transfer"),
    "transfer_failures": ("decode_transfer_failures", "Decode: failed KV transfers"),
    "control_refused": ("control_frames_refused", "P/D control frames refused (unauthenticated or malformed)"),
    "stale_messages": ("control_stale_messages", "P/D messages for another life of a room (wrong nonce) or "
                       "an unexpected type, ignored"),
    "duplicate_rooms": ("decode_duplicate_rooms", "Decode: requests refused for a bootstrap room already in flight"),
    "kv_requests_refused": ("prefill_kv_requests_refused", "Prefill: KV requests refused (no or another decode "
                            "record, duplicate room, layout)"),
}
DISAGG_GAUGES = {
    "rooms_waiting": ("prefill_rooms_waiting", "Prefill: request halves waiting for their other half"),
    "rooms_transferring": ("prefill_rooms_transferring", "Prefill: requests whose KV writes are draining"),
    "num_waiting_for_kv": ("decode_waiting_for_kv", "Decode: requests waiting for their KV"),
    "num_pending_kv": ("decode_pending_kv", "Decode: routed requests waiting for pages or their prefill's records"),
    "quarantined_pages": ("decode_quarantined_pages", "Decode: pages held until no late write can land"),
    "fallback_rate": ("decode_fallback_rate", "Decode: share of recent disaggregated requests that fell back"),
}

# Hierarchical KV cache: scheduler stats() key -> (metric name, help).
HICACHE_COUNTERS = {
    "host_load_bytes": ("hicache_host_load_bytes", "KV bytes loaded back from host memory to the device"),
    "host_backup_bytes": ("hicache_host_backup_bytes", "KV bytes copied from the device to host memory"),
    "host_evicted_pages": ("hicache_host_evicted_pages", "Host KV pages evicted"),
    "device_demoted_pages": ("hicache_device_demoted_pages", "Device KV pages demoted to host on eviction"),
    "storage_hit_pages": ("hicache_storage_hit_pages", "KV pages read from the storage tier"),
    "storage_get_bytes": ("hicache_storage_get_bytes", "KV bytes read from the storage tier"),
    "storage_put_bytes": ("hicache_storage_put_bytes", "KV bytes written to the storage tier"),
    "storage_put_failures": ("hicache_storage_put_failures", "Storage puts that failed (the page stays on host)"),
    "storage_puts_dropped": ("hicache_storage_puts_dropped", "Storage puts dropped because the queue was full"),
    "storage_thread_restarts": ("hicache_storage_thread_restarts", "Storage threads that failed and were restarted"),
    "storage_corrupt": ("hicache_storage_corrupt", "Stored pages refused on load (bad checksum, key or length)"),
    "storage_bad_mac": ("hicache_storage_bad_mac", "Stored pages refused on load under a token: no or a wrong MAC"),
    "storage_prefetches": ("hicache_storage_prefetches", "Storage reads started for waiting requests"),
    "storage_prefetch_stopped_early": ("hicache_storage_prefetch_stopped_early",
                                       "Storage reads cut short by the prefetch policy (best_effort, timeout)"),
    "host_loads_skipped": ("hicache_host_loads_skipped", "Host hits recomputed: shorter than the break-even length"),
    "storage_prefetch_skipped": ("hicache_storage_prefetch_skipped",
                                 "Storage reads not started: loading would not beat recomputing"),
}
HICACHE_GAUGES = {
    "host_total_pages": ("hicache_host_total_pages", "KV pages in the host pool"),
    "host_cached_pages": ("hicache_host_cached_pages", "Host KV pages held by the prefix cache"),
    "host_free_pages": ("hicache_host_free_pages", "Free host KV pages"),
    "storage_prefetching": ("hicache_storage_prefetching", "Storage reads in flight for waiting requests"),
    "tier_host_bytes_per_s": ("hicache_host_load_bandwidth", "Host -> device copy bytes/s measured at start-up"),
    "tier_storage_bytes_per_s": ("hicache_storage_get_bandwidth", "Storage get bytes/s measured at start-up"),
    "tier_prefill_tokens_per_s": ("hicache_prefill_tokens_per_s", "Prefill tokens/s the skip rule compares loads "
                                  "with (-1: not observed yet)"),
}
# Speculative decoding: scheduler stats() key -> (metric name, help).
SPEC_COUNTERS = {
    "spec_verify_ct": ("spec_verify_total", "Speculative verify forwards (one per request per decode step)"),
    "spec_draft_tokens": ("spec_draft_tokens", "Draft tokens proposed for verification"),
    "spec_accepted_tokens": ("spec_accepted_tokens", "Draft tokens the target accepted"),
}
SPEC_GAUGES = {
    "spec_accept_length": ("spec_accept_length", "Tokens emitted per verify forward (accepted drafts + 1)"),
}
TIERS = ("device", "host", "storage")
# Constrained decoding (SGLang's names): grammar stats key -> (counter name, help). The scheduler
# reports them under "grammar" (its compiles, masks), the frontend under "grammar_frontend" (the
# compile that checks a request before it is sent on); label ``process`` tells them apart.
GRAMMAR_COUNTERS = {
    "requests": ("num_grammar", "Requests with a json_schema, regex or ebnf constraint"),
    "cache_hits": ("num_grammar_cache_hit", "Grammar compiles served from the compiled-grammar cache"),
    "cache_misses": ("num_grammar_cache_miss", "Grammar compiles started (not in the cache)"),
    "compile_failures": ("num_grammar_aborted", "Constraints that did not compile (the request got a 400)"),
    "timeouts": ("num_grammar_timeout", "Grammar compiles past --grammar-compile-timeout"),
    "busy": ("num_grammar_busy", "Compiles refused (429): the client had --grammar-max-compiles-per-client queued"),
    "abandoned": ("num_grammar_abandoned", "Queued compiles dropped before they started: nobody waited any more"),
    "killed": ("num_grammar_killed", "Running compiles whose child process was killed: nobody waited any more"),
}
GRAMMAR_HISTOGRAMS = {
    "compile_seconds": ("grammar_compilation_time_seconds", "Grammar compile time"),
    "mask_seconds": ("grammar_mask_time_seconds", "Token-bitmask time per step with grammars in the batch "
                     "(filling, on the mask thread while the forward runs, plus applying to the logits)"),
}
GRAMMAR_SOURCES = (("grammar", "scheduler"), ("grammar_frontend", "frontend"))


def _grammar_families(stats: dict, names: list[str], values: list[str]):
    """Counters and histograms of the scheduler's and the frontend's grammar figures."""
    sources = [(stats[key], process) for key, process in GRAMMAR_SOURCES if isinstance(stats.get(key), dict)]
    if not sources:
        return
    labels = names + ["process"]
    for key, (name, doc) in GRAMMAR_COUNTERS.items():
        family = CounterMetricFamily(PREFIX + name, doc, labels=labels)
        for figures, process in sources:
            family.add_metric(values + [process], float(figures.get(key, 0)))
        yield family
    for key, (name, doc) in GRAMMAR_HISTOGRAMS.items():
        histogram = HistogramMetricFamily(PREFIX + name, doc, labels=labels)
        for figures, process in sources:
            h = figures.get(key)
            if isinstance(h, dict) and h.get("count"):
                histogram.add_metric(values + [process], _cumulative(h), sum_value=float(h["sum"]))
        yield histogram


def _cumulative(h: dict) -> list[tuple[str, float]]:
    out, running = [], 0
    for bound, count in zip([*h["bounds"], float("inf")], h["counts"]):
        running += count
        out.append(("+Inf" if bound == float("inf") else repr(float(bound)), float(running)))
    return out


class _DisaggCollector:
    """Renders the latest scheduler stats' disaggregation numbers (counters stay cumulative)."""

    def __init__(self, labels: dict):
        self.labels = labels
        self.stats: dict = {}

    def collect(self):
        names, values = list(self.labels), list(self.labels.values())
        tables = ((DISAGG_COUNTERS, CounterMetricFamily), (DISAGG_GAUGES, GaugeMetricFamily),
                  (HICACHE_COUNTERS, CounterMetricFamily), (HICACHE_GAUGES, GaugeMetricFamily),
                  (SPEC_COUNTERS, CounterMetricFamily), (SPEC_GAUGES, GaugeMetricFamily))
        for table, family in tables:
            for key, (name, doc) in table.items():
                if key in self.stats:
                    m = family(PREFIX + name, doc, labels=names)
                    m.add_metric(values, float(self.stats[key]))
                    yield m
        if any(f"cache_hit_tokens_{t}" in self.stats for t in TIERS):
            hits = CounterMetricFamily(PREFIX + "cache_hit_tokens", "Prompt tokens served from the prefix cache, "
                                       "by the tier their KV came from", labels=names + ["tier"])
            for t in TIERS:
                hits.add_metric(values + [t], float(self.stats.get(f"cache_hit_tokens_{t}", 0)))
            yield hits
        yield from _grammar_families(self.stats, names, values)
        if "num_grammar_queue_reqs" in self.stats:
            queue = GaugeMetricFamily(PREFIX + "num_grammar_queue_reqs", "Requests waiting for their grammar to "
                                      "compile", labels=names)
            queue.add_metric(values, float(self.stats["num_grammar_queue_reqs"]))
            yield queue
        if isinstance(self.stats.get("control_refused_by_reason"), dict):
            refused = CounterMetricFamily(PREFIX + "control_frames_refused_by_reason", "P/D control frames refused, "
                                          "by reason (auth, malformed, oversize, over_budget, wrong_destination, "
                                          "stale, replay)", labels=names + ["reason"])
            for reason, n in sorted(self.stats["control_refused_by_reason"].items()):
                refused.add_metric(values + [str(reason)], float(n))
            yield refused


class BatchHistogram:
    """A histogram fed a request's samples at once (its inter-token gaps, as it finishes): one
    bisect per sample. prometheus_client's ``Histogram.observe`` takes its locks twice per sample
    (~10 us): a 64-token stream cost ~1 ms of the frontend's event loop as it ended, and the 32
    streams that end in one step held every other stream and every new request for tens of ms.
    The frontend's event loop is its only writer, and /metrics renders on that loop."""

    def __init__(self, name: str, doc: str, labels: dict, buckets: Sequence[float]):
        self.name, self.doc, self.labels = name, doc, labels
        self.bounds = list(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # per bucket, not cumulative; the last is +Inf
        self.sum = 0.0

    def observe_many(self, values: Sequence[float]) -> None:
        counts, bounds, total = self.counts, self.bounds, self.sum
        for v in values:
            counts[bisect_left(bounds, v)] += 1  # the first bound >= v: Prometheus's "le"
            total += v  # in order, as one observe() after another would add
        self.sum = total

    def collect(self):
        family = HistogramMetricFamily(self.name, self.doc, labels=list(self.labels))
        cumulative, buckets = 0, []
        for bound, n in zip([*self.bounds, float("inf")], self.counts):
            cumulative += n
            buckets.append((floatToGoString(bound), cumulative))
        family.add_metric(list(self.labels.values()), buckets, self.sum)
        yield family


class ServerMetrics:
    """All metrics of one server, labelled with the served model name."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.labels = {"model_name": model_name}
        names = ["model_name"]
        self.gauges = {key: Gauge(PREFIX + name, doc, names, registry=self.registry).labels(**self.labels)
                       for key, (name, doc) in STAT_GAUGES.items()}
        self.prompt_tokens = self._counter("prompt_tokens", "Prompt tokens of finished requests", names)
        self.generation_tokens = self._counter("generation_tokens", "Generated tokens of finished requests",
                                               names)
        self._requests = Counter(PREFIX + "num_requests", "Finished requests by finish reason",
                                 names + ["finish_reason"], registry=self.registry)
        self.ttft = self._histogram("time_to_first_token_seconds", "Time to first token", names)
        self.itl = BatchHistogram(PREFIX + "inter_token_latency_seconds", "Gap between consecutive tokens",
                                  self.labels, LATENCY_BUCKETS)
        self.registry.register(self.itl)
        self.e2e = self._histogram("e2e_request_latency_seconds", "Arrival to last token", names)
        self._stages = Histogram(PREFIX + "ttft_stage_seconds", "Time to first token by stage (queue, prefill, "
                                 "transfer, decode_scheduling); the stages of a request sum to its TTFT",
                                 names + ["stage"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self._role_switches = Counter(PREFIX + "role_switches", "P/D role switches (POST /pd_role_switch) by "
                                      "target role and outcome (done, refused, timeout)",
                                      names + ["target_role", "outcome"], registry=self.registry)
        self._role = Gauge(PREFIX + "pd_role", "1 for this server's current P/D role", names + ["role"],
                           registry=self.registry)
        self._disagg = _DisaggCollector(self.labels)
        self.registry.register(self._disagg)

    def _counter(self, name, doc, names):
        return Counter(PREFIX + name, doc, names, registry=self.registry).labels(**self.labels)

    def _histogram(self, name, doc, names):
        return Histogram(PREFIX + name, doc, names, buckets=LATENCY_BUCKETS,
                         registry=self.registry).labels(**self.labels)

    def set_scheduler_stats(self, stats: dict) -> None:
        for key, gauge in self.gauges.items():
            if key in stats:
                gauge.set(stats[key])
        self._disagg.stats = stats

    def observe_finished(self, timeline: ReqTimeline, prompt_tokens: int, completion_tokens: int,
                         finish_type: str) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self._requests.labels(finish_reason=finish_type, **self.labels).inc()
        if timeline.ttft is not None:
            self.ttft.observe(timeline.ttft)
        self.itl.observe_many(timeline.itls)
        if timeline.e2e is not None:
            self.e2e.observe(timeline.e2e)
        stages = timeline.stages or {}
        for stage in STAGES if stages else ():
            self._stages.labels(stage=stage, **self.labels).observe(stages[stage])

    def set_role(self, role: str) -> None:
        for r in ("prefill", "decode", "null"):
            self._role.labels(role=r, **self.labels).set(1.0 if r == role else 0.0)

    def observe_role_switch(self, target_role: str, outcome: str) -> None:
        self._role_switches.labels(target_role=target_role, outcome=outcome, **self.labels).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
