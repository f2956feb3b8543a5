"""The workers behind the router: their health, their in-flight counts, and the policy that picks among them.

Everything here runs on the router's event loop (no locks): health flips and
in-flight counts change only between awaits.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pdserve.disagg.bootstrap import bootstrap_host
from pdserve.router.breaker import CircuitBreaker
from pdserve.router.policy import Candidate, Policy

logger = logging.getLogger(__name__)


class PrefixIndex(Protocol):
    """What a worker's KV-event follower tells the policy (``router.kv_events.KVEventSubscriber``)."""

    def matched_blocks(self, hashes: Sequence[int]) -> int: ...

    @property
    def num_blocks(self) -> int: ...


class Role(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass
class Worker:
    """One upstream server. Invariant: ``in_flight >= 0``; a worker starts dead until a health check passes."""

    url: str
    role: Role
    position: int  # index in its set's configured order
    bootstrap_port: int | None = None  # prefill only
    healthy: bool = False
    ever_healthy: bool = False  # False: the router is still waiting for it to come up
    in_flight: int = 0
    last_error: str | None = None  # why it was last marked dead
    kv: PrefixIndex | None = None  # its cached blocks, from its KV events (cache_aware)
    load: dict = field(default_factory=dict)  # its last reported stats (num_running_reqs, free_pages)
    reported_role: Role | None = None  # what its last /health said it is (P/D servers can switch roles)
    instance: str | None = None  # the run its last /health named: bootstrap fields are signed for it
    breaker: CircuitBreaker | None = None  # None: --disable-circuit-breaker
    health_failures: int = 0  # consecutive failed health checks (the thresholds count these)
    health_successes: int = 0  # consecutive passed ones
    probe_ok: bool = False  # its last health check passed
    draining: bool = False  # its last /health said it is draining (a role switch): out at once
    source: str = "args"  # who added it: args, file, kubernetes (only that source removes it)

    @property
    def available(self) -> bool:
        """Healthy, and its circuit breaker lets requests through."""
        return self.healthy and (self.breaker is None or self.breaker.allows)

    @property
    def bootstrap_host(self) -> str:
        return bootstrap_host(self.url)

    @property
    def prefill_bootstrap_port(self) -> int:
        """A prefill worker's bootstrap port (every ``--prefill`` entry has one)."""
        if self.bootstrap_port is None:
            raise RuntimeError(f"{self.role.value} worker {self.url} has no bootstrap port")
        return self.bootstrap_port

    def info(self) -> dict:
        d = {"url": self.url, "role": self.role.value, "healthy": self.healthy, "in_flight": self.in_flight,
             "last_error": self.last_error,
             "circuit_breaker": self.breaker.state.value if self.breaker is not None else None}
        if self.role is Role.PREFILL:
            d["bootstrap_port"] = self.bootstrap_port
        return d


class NoHealthyWorker(Exception):
    """No worker of ``role`` is alive; the message lists why each was marked dead."""

    def __init__(self, role: Role, workers: Sequence[Worker]):
        reasons = "; ".join(f"{w.url}: {_why_not(w)}" for w in workers)
        super().__init__(f"no healthy {role.value} worker ({reasons or 'none known yet'})")
        self.role = role


def _why_not(w: Worker) -> str:
    if w.healthy and w.breaker is not None and not w.breaker.allows:
        return "circuit breaker open"
    return w.last_error or "not checked yet"


class Lease:
    """One request's claim on a worker: counts toward its in-flight load until released (exactly once).
    ``cached_blocks``: the prompt blocks the router expected the worker to hold when it chose it."""

    def __init__(self, worker: Worker, cached_blocks: int = 0):
        self.worker = worker
        self.cached_blocks = cached_blocks
        self.released = False
        worker.in_flight += 1

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.worker.in_flight -= 1
            assert self.worker.in_flight >= 0, f"{self.worker.url}: in-flight count went negative"


class WorkerSet:
    """The workers of one role and the policy choosing among the healthy ones."""

    def __init__(self, role: Role, workers: Sequence[Worker], policy: Policy, policy_name: str = ""):
        """``workers`` may later change sets (``HealthChecker`` moves a server that switched roles) and
        come and go (``Fleet``, discovery); a set may be empty while discovery finds none."""
        assert all(w.role is role for w in workers)
        self.role = role
        self.workers = list(workers)
        self.policy = policy
        self.policy_name = policy_name or type(policy).__name__

    @property
    def healthy(self) -> list[Worker]:
        return [w for w in self.workers if w.healthy]

    @property
    def available(self) -> list[Worker]:
        """Healthy workers whose breaker is not open: those a request may go to."""
        return [w for w in self.workers if w.available]

    def pick(self, avoid: Worker | None = None, block_hashes: Sequence[int] = (),
             exclude: Collection[Worker] = ()) -> Lease:
        """A lease on the worker the policy picks (never ``avoid`` nor one of ``exclude``, nor one whose
        breaker is open); raises NoHealthyWorker when none is alive. ``block_hashes``: the prompt's page
        hashes, matched against each worker's KV-event index."""
        alive = [w for w in self.available if w is not avoid and w not in exclude]
        if not alive:
            raise NoHealthyWorker(self.role, self.workers)
        candidates = [_candidate(w, block_hashes) for w in alive]
        index = self.policy.pick(candidates)
        return Lease(alive[index], candidates[index].cached_blocks)

    def mark_dead(self, worker: Worker, reason: str) -> None:
        if worker.healthy:
            logger.warning("%s worker %s marked dead: %s", self.role.value, worker.url, reason)
            worker.health_successes = 0  # back only after the success threshold
        worker.healthy = False
        worker.last_error = reason

    def mark_alive(self, worker: Worker) -> None:
        if not worker.healthy:
            logger.info("%s worker %s is healthy", self.role.value, worker.url)
            worker.health_failures = 0
        worker.healthy = worker.ever_healthy = True

    def remove(self, worker: Worker) -> None:
        self.workers.remove(worker)

    def add(self, worker: Worker) -> None:
        worker.role = self.role
        worker.position = max((w.position for w in self.workers), default=-1) + 1
        self.workers.append(worker)

    @property
    def waiting_for(self) -> list[Worker]:
        """Workers that have never passed a health check (still starting, or misconfigured)."""
        return [w for w in self.workers if not w.ever_healthy]


def _candidate(w: Worker, block_hashes: Sequence[int]) -> Candidate:
    cached = w.kv.matched_blocks(block_hashes) if w.kv is not None and block_hashes else 0
    indexed = w.kv.num_blocks if w.kv is not None else 0
    free, running = w.load.get("free_pages", 0), w.load.get("num_running_reqs", 0)
    return Candidate(w.position, w.url, w.in_flight, cached, indexed, free if isinstance(free, int) else 0,
                     len(block_hashes), running if isinstance(running, int) else 0)


def make_worker_set(role: Role, urls: Sequence[str], policy: Policy,
                    bootstrap_ports: Sequence[int | None] | None = None, policy_name: str = "") -> WorkerSet:
    ports = bootstrap_ports or [None] * len(urls)
    return WorkerSet(role, [Worker(u, role, i, p) for i, (u, p) in enumerate(zip(urls, ports))], policy,
                     policy_name)


class Fleet:
    """Both worker sets as discovery changes them (``router.discovery``). A URL is one worker
    whichever set holds it (a worker that switched roles stays where the health checks moved it).
    A worker added starts unchecked, as at start-up; one removed keeps its in-flight leases (they
    hold the worker) and the ``on_remove`` callbacks let go of what the router kept for it."""

    def __init__(self, prefill: WorkerSet, decode: WorkerSet):
        self.sets = {Role.PREFILL: prefill, Role.DECODE: decode}
        self.on_add: list[Callable[[Worker], None]] = []
        self.on_remove: list[Callable[[Worker], None]] = []

    def find(self, url: str) -> Worker | None:
        return next((w for s in self.sets.values() for w in s.workers if w.url == url), None)

    def add(self, role: Role, url: str, bootstrap_port: int | None = None, source: str = "") -> Worker | None:
        """The new worker, or None when ``url`` is already known (from any source)."""
        if self.find(url) is not None:
            return None
        worker = Worker(url, role, 0, bootstrap_port if role is Role.PREFILL else None, source=source)
        self.sets[role].add(worker)
        logger.info("%s worker %s added (%s)", role.value, url, source)
        for callback in self.on_add:
            callback(worker)
        return worker

    def remove(self, url: str, source: str = "") -> Worker | None:
        """The worker removed, or None when no set holds ``url``."""
        worker = self.find(url)
        if worker is None:
            return None
        self.sets[worker.role].remove(worker)
        worker.healthy = False
        worker.last_error = f"removed ({source})"
        logger.info("%s worker %s removed (%s)", worker.role.value, url, source)
        for callback in self.on_remove:
            callback(worker)
        return worker


# A probe returns None when the worker is healthy, else why not.
Probe = Callable[[Worker], Awaitable[str | None]]


class HealthChecker:
    """Probes every worker of every set. A healthy worker is marked dead after ``failure_threshold``
    failed probes in a row (at once when it says it is draining for a role switch); a dead one that
    was healthy before comes back after ``success_threshold`` passed probes in a row, one never seen
    healthy at its first (it was starting). Dead workers keep being probed, so a restarted one is back
    within a few intervals. ``after_check`` callbacks run after each round (the router's degraded-mode
    and start-up reports)."""

    def __init__(self, sets: Sequence[WorkerSet], probe: Probe, interval_s: float, failure_threshold: int = 1,
                 success_threshold: int = 1):
        self.sets = list(sets)
        self.probe = probe
        self.interval_s = interval_s
        self.failure_threshold = failure_threshold
        self.success_threshold = success_threshold
        self.after_check: list[Callable[[], object]] = []  # results ignored
        self.on_move: list[Callable[[Worker, Role], None]] = []  # a worker moved from the given role's set
        self.next_interval: Callable[[], float] = lambda: self.interval_s  # the router shortens it at start-up

    async def check_all(self) -> None:
        pairs = [(s, w) for s in self.sets for w in s.workers]
        results = await asyncio.gather(*(self.probe(w) for _, w in pairs))
        by_role = {s.role: s for s in self.sets}
        for (s, w), reason in zip(pairs, results):
            self._judge(by_role.get(w.role, s), w, reason)  # its set now: it may have moved meanwhile
        self.move_switched()
        for callback in self.after_check:
            callback()

    def _judge(self, s: WorkerSet, w: Worker, reason: str | None) -> None:
        w.probe_ok = reason is None
        if reason is None:
            w.health_successes, w.health_failures = w.health_successes + 1, 0
            if not w.healthy and (not w.ever_healthy or w.health_successes >= self.success_threshold):
                s.mark_alive(w)
            return
        w.health_failures, w.health_successes = w.health_failures + 1, 0
        if not w.healthy or w.draining or w.health_failures >= self.failure_threshold:
            s.mark_dead(w, reason)  # a dead one's reason is kept current

    def move_switched(self) -> None:
        """A healthy worker whose last probe passed and reports the other role (``POST /pd_role_switch``
        on it) leaves its set for the set of that role; its leases stay valid (they hold the worker,
        not the set)."""
        by_role = {s.role: s for s in self.sets}
        for s in self.sets:
            for w in list(s.workers):
                target = by_role.get(w.reported_role) if w.reported_role is not None else None
                if target is None or target is s or not (w.healthy and w.probe_ok):
                    continue
                s.remove(w)
                target.add(w)
                logger.info("worker %s switched role: %s -> %s", w.url, s.role.value, target.role.value)
                for callback in self.on_move:
                    callback(w, s.role)

    async def run(self) -> None:
        """Check forever, every ``next_interval()`` s (cancel to stop)."""
        while True:
            await asyncio.sleep(self.next_interval())
            await self.check_all()
