"""Prometheus metrics of the router (its own registry): requests and errors per worker,
worker health and in-flight counts, requests refused for want of a healthy worker, requests
served by decode alone (degraded) and streams resumed on another decode."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

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
        self.role_moves = Counter(PREFIX + "worker_role_switches", "Workers seen in another role than before "
                                  "(POST /pd_role_switch on them), by the role they left and took",
                                  ["worker", "from_role", "to_role"], registry=r)

    def request(self, worker: Worker) -> None:
        self.requests.labels(worker.role.value, worker.url).inc()

    def error(self, worker: Worker, kind: str) -> None:
        self.errors.labels(worker.role.value, worker.url, kind).inc()

    def moved(self, worker: Worker, old: Role) -> None:
        self.role_moves.labels(worker.url, old.value, worker.role.value).inc()
        for gauge in (self.healthy, self.in_flight):
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
            self.dead.labels(s.role.value).set(len(s.workers) - len(s.healthy))
        prefill = next(s for s in sets if s.role is Role.PREFILL)
        self.degraded.set(int(not prefill.healthy))
        return generate_latest(self.registry)
