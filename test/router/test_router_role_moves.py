"""The health checker moves a worker that reports the other P/D role between the worker sets
(a server switched by POST /pd_role_switch), keeps its leases, and learns nothing from a dead one."""

from __future__ import annotations

import asyncio
import random

from pdserve.router.policy import RoundRobinPolicy
from pdserve.router.workers import HealthChecker, Lease, Role, make_worker_set


def test_a_switched_worker_changes_sets_and_keeps_its_leases():
    rr = RoundRobinPolicy(random.Random(0))
    prefill = make_worker_set(Role.PREFILL, ["http://p0", "http://p1"], rr, [9000, 9001])
    decode = make_worker_set(Role.DECODE, ["http://d0"], RoundRobinPolicy(random.Random(0)))
    reports = {"http://p0": Role.PREFILL, "http://p1": Role.DECODE, "http://d0": Role.DECODE}
    moved = []

    async def probe(worker):
        worker.reported_role = reports[worker.url]
        return None

    checker = HealthChecker([prefill, decode], probe, 1.0)
    checker.on_move.append(lambda w, old: moved.append((w.url, old, w.role)))
    lease = Lease(prefill.workers[1])
    asyncio.run(checker.check_all())
    assert [w.url for w in prefill.workers] == ["http://p0"]
    assert [w.url for w in decode.workers] == ["http://d0", "http://p1"]
    assert moved == [("http://p1", Role.PREFILL, Role.DECODE)]
    assert decode.workers[1].in_flight == 1 and decode.workers[1].position == 1
    lease.release()
    assert decode.workers[1].in_flight == 0

    reports["http://d0"] = Role.PREFILL  # d0 switches too, but its check fails: it stays until healthy
    checker.probe = lambda w: _dead_after_report(w, reports)
    asyncio.run(checker.check_all())
    assert [w.url for w in decode.workers] == ["http://d0", "http://p1"]


async def _dead_after_report(worker, reports):
    worker.reported_role = reports[worker.url]
    return "GET /health answered 503"
