"""Prometheus metrics of the router (its own registry): requests and errors per worker,
worker health and in-flight counts, requests refused for want of a healthy worker, requests
served by decode alone (degraded), streams resumed on another decode, and the policies'
decisions: why each worker was chosen, the prompt tokens cache_aware expected the chosen
prefill to hold vs the ``cached_tokens`` the answer reported, each followed KV-event stream, and
whether cache_aware routes each prefill on its events or on the router's guess.
For a fleet: each worker's circuit breaker state and transitions, retries, the admission queue
(in flight, waiting, refused with 429 or timed out with 408), and workers discovery added and removed."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pdserve.router.breaker import BreakerState
from pdserve.router.cache_view import PrefixView
from pdserve.router.workers import Role, Worker, WorkerSet

PREFIX = "pdserve_router:"
LABELS = ["role", "worker"]


class RouterMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter(PREFIX + "requests", "Requests sent to a worker", LABELS, registry=r)
        self.errors = Counter(PREFIX + "worker_errors", "Failed requests to a worker, by kind "
                              "(connect, status, timeout, broken)", LABELS + ["kind"], registry=r)
        self.no_worker = Counter(PREFIX + "no_healthy_worker", "Requests refused (503): no healthy worker "
                                 "of this role", ["role"], registry=r)
        self.degraded_requests = Counter(PREFIX + "degraded_requests", "Requests sent to a decode worker alone "
                                         "(no healthy prefill worker: decode prefilled them)", registry=r)
        self.resumed = Counter(PREFIX + "resumed_streams", "Streams resumed on another decode worker after "
                               "theirs broke off mid-stream", registry=r)
        self.degraded = Gauge(PREFIX + "degraded", "1 while no prefill worker is healthy and decode workers "
                              "serve alone", registry=r)
        self.client_disconnects = Counter(PREFIX + "client_disconnects", "Clients that left before the "
                                          "answer ended (their upstream requests were closed)", registry=r)
        self.healthy = Gauge(PREFIX + "worker_healthy", "1 if the worker passes health checks", LABELS, registry=r)
        self.in_flight = Gauge(PREFIX + "worker_in_flight", "Requests in flight on the worker", LABELS, registry=r)
        self.dead = Gauge(PREFIX + "dead_workers", "Workers marked dead", ["role"], registry=r)
        self.decisions = Counter(PREFIX + "policy_decisions", "Workers chosen, by policy and reason (cache_hit: "
                                 "the longest cached prefix; balance: it was overloaded, the least loaded one "
                                 "instead; load: nothing cached, the least loaded)", LABELS + ["policy", "reason"],
                                 registry=r)
        self.predicted_cached = Counter(PREFIX + "predicted_cached_tokens", "Prompt tokens the router expected "
                                        "the chosen prefill worker to hold (its KV events, else the router's guess; "
                                        "a text block counts as a page)", LABELS, registry=r)
        self.reported_cached = Counter(PREFIX + "reported_cached_tokens", "cached_tokens the answers reported "
                                       "(meta_info or usage), by the prefill worker chosen", LABELS, registry=r)
        self.kv_event_batches = Gauge(PREFIX + "kv_event_batches", "KV event batches received from a worker",
                                      LABELS, registry=r)
        self.kv_event_gaps = Gauge(PREFIX + "kv_event_gaps", "Gaps in a worker's KV event numbers (lost batches, "
                                   "restarts, first contact)", LABELS, registry=r)
        self.kv_event_resyncs = Gauge(PREFIX + "kv_event_resyncs", "Snapshots a worker's KV index was rebuilt "
                                      "from", LABELS, registry=r)
        self.kv_blocks = Gauge(PREFIX + "kv_indexed_blocks", "Blocks the router believes a worker caches (its KV "
                               "events while fresh, else the router's guess)", LABELS, registry=r)
        self.kv_on_events = Gauge(PREFIX + "kv_view_on_events", "1 while cache_aware routes on the worker's KV "
                                  "events, 0 while on the router's guess from its own routing", LABELS, registry=r)
        self.role_moves = Counter(PREFIX + "worker_role_switches", "Workers seen in another role than before "
                                  "(POST /pd_role_switch on them), by the role they left and took",
                                  ["worker", "from_role", "to_role"], registry=r)
        self._add_fleet_metrics(r)

    def _add_fleet_metrics(self, r: CollectorRegistry) -> None:
        self.breaker_state = Gauge(PREFIX + "worker_cb_state", "The worker's circuit breaker: 0 closed, 1 open "
                                   "(not picked), 2 half-open (probing)", LABELS, registry=r)
        self.breaker_transitions = Counter(PREFIX + "worker_cb_transitions", "Circuit breaker transitions, by the "
                                           "state entered", LABELS + ["to"], registry=r)
        self.retries = Counter(PREFIX + "retries", "Requests sent again to a new pair after a failure before any "
                               "byte reached the client, by the worker that failed and how (connect, broken)",
                               LABELS + ["reason"], registry=r)
        self.retries_exhausted = Counter(PREFIX + "retries_exhausted", "Requests that failed with no retry left",
                                         registry=r)
        self.admitted = Gauge(PREFIX + "active_requests", "Generation requests holding one of the "
                              "--max-concurrent-requests slots", registry=r)
        self.queued = Gauge(PREFIX + "queued_requests", "Generation requests waiting for a slot", registry=r)
        self.rejected = Counter(PREFIX + "rejected_requests", "Generation requests refused by admission: "
                                "queue_full (429, Retry-After) or queue_timeout (408)", ["reason"], registry=r)
        self.discovered = Counter(PREFIX + "discovery_events", "Workers added or removed by discovery, by source "
                                  "(file, kubernetes)", ["source", "event"], registry=r)
        self.on_render: list[Callable[[], None]] = []  # read what others own into gauges (the admission queue)

    def retry(self, worker: Worker, reason: str) -> None:
        self.retries.labels(worker.role.value, worker.url, reason).inc()

    def breaker_moved(self, worker: Worker, new: BreakerState) -> None:
        self.breaker_transitions.labels(worker.role.value, worker.url, new.value).inc()

    def forget(self, worker: Worker) -> None:
        """A worker discovery removed: its gauges go (its counters stay, as a restarted worker's would)."""
        gauges = (self.healthy, self.in_flight, self.breaker_state, self.kv_event_batches, self.kv_event_gaps,
                  self.kv_event_resyncs, self.kv_blocks, self.kv_on_events)
        for gauge in gauges:
            try:
                gauge.remove(worker.role.value, worker.url)
            except KeyError:
                pass  # never rendered

    def request(self, worker: Worker) -> None:
        self.requests.labels(worker.role.value, worker.url).inc()

    def error(self, worker: Worker, kind: str) -> None:
        self.errors.labels(worker.role.value, worker.url, kind).inc()

    def decision(self, worker: Worker, policy: str, reason: str) -> None:
        self.decisions.labels(worker.role.value, worker.url, policy, reason).inc()

    def moved(self, worker: Worker, old: Role) -> None:
        self.role_moves.labels(worker.url, old.value, worker.role.value).inc()
        for gauge in (self.healthy, self.in_flight, self.breaker_state):
            try:
                gauge.remove(old.value, worker.url)
            except KeyError:
                pass  # never rendered under its old role

    def refused(self, role: Role) -> None:
        self.no_worker.labels(role.value).inc()

    def render(self, sets: Sequence[WorkerSet]) -> bytes:
        """The exposition text, with the worker gauges read from ``sets`` now."""
        for s in sets:
            for w in s.workers:
                self.healthy.labels(w.role.value, w.url).set(int(w.healthy))
                self.in_flight.labels(w.role.value, w.url).set(w.in_flight)
                if w.breaker is not None:
                    self.breaker_state.labels(w.role.value, w.url).set(w.breaker.state.code)
            self.dead.labels(s.role.value).set(len(s.workers) - len(s.healthy))
            for w in s.workers:
                self._kv_gauges(w)
        prefill = next(s for s in sets if s.role is Role.PREFILL)
        self.degraded.set(int(not prefill.healthy))
        for hook in self.on_render:
            hook()
        return generate_latest(self.registry)

    def _kv_gauges(self, w: Worker) -> None:
        view = w.kv
        if not isinstance(view, PrefixView):
            return
        labels = (w.role.value, w.url)
        self.kv_blocks.labels(*labels).set(view.num_blocks)
        self.kv_on_events.labels(*labels).set(int(view.on_events))
        if view.events is not None:
            self.kv_event_batches.labels(*labels).set(view.events.batches)
            self.kv_event_gaps.labels(*labels).set(view.events.gaps)
            self.kv_event_resyncs.labels(*labels).set(view.events.resyncs)
