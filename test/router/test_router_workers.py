"""Worker sets: picking among healthy workers, in-flight leases, health checks (injected probe)."""

from __future__ import annotations

import asyncio
import random

import pytest

from pdserve.router.policy import LeastLoadPolicy, RoundRobinPolicy
from pdserve.router.workers import HealthChecker, NoHealthyWorker, Role, make_worker_set


def decode_set(n: int, policy=RoundRobinPolicy):
    ws = make_worker_set(Role.DECODE, [f"http://d{i}:1" for i in range(n)], policy(random.Random(0)))
    for w in ws.workers:
        ws.mark_alive(w)
    return ws


def test_pick_skips_dead_workers_and_names_why_when_none_is_left():
    ws = decode_set(2)
    ws.mark_dead(ws.workers[0], "GET /health answered 503")
    assert {ws.pick().worker.url for _ in range(4)} == {"http://d1:1"}
    ws.mark_dead(ws.workers[1], "connection failed: refused")
    with pytest.raises(NoHealthyWorker) as e:
        ws.pick()
    assert e.value.role is Role.DECODE
    assert str(e.value) == ("no healthy decode worker (http://d0:1: GET /health answered 503; "
                            "http://d1:1: connection failed: refused)")


def test_workers_start_dead_until_checked():
    ws = make_worker_set(Role.PREFILL, ["http://p:1"], RoundRobinPolicy(random.Random(0)), [8998])
    with pytest.raises(NoHealthyWorker, match="http://p:1: not checked yet"):
        ws.pick()


def test_leases_count_in_flight_and_release_once():
    ws = decode_set(2, LeastLoadPolicy)
    a = ws.pick()
    b = ws.pick()
    assert a.worker is not b.worker  # least load spreads
    c = ws.pick()  # a tie: either
    expected = [2, 1] if c.worker is ws.workers[0] else [1, 2]
    assert [w.in_flight for w in ws.workers] == expected
    c.release()
    c.release()  # idempotent: cleanup paths may overlap
    a.release()
    b.release()
    assert [w.in_flight for w in ws.workers] == [0, 0]


def test_health_checker_marks_dead_and_alive_from_the_probe():
    prefill = make_worker_set(Role.PREFILL, ["http://p:1"], RoundRobinPolicy(random.Random(0)), [8998])
    decode = decode_set(2)
    verdicts = {"http://p:1": None, "http://d0:1": "GET /health answered 503", "http://d1:1": None}

    async def probe(worker):
        return verdicts[worker.url]

    checker = HealthChecker([prefill, decode], probe, interval_s=1.0)
    asyncio.run(checker.check_all())
    assert [w.healthy for w in prefill.workers + decode.workers] == [True, False, True]
    assert decode.workers[0].last_error == "GET /health answered 503"
    assert checker.ready()
    verdicts["http://d1:1"] = "GET /health failed: refused"
    asyncio.run(checker.check_all())
    assert not checker.ready()
    verdicts["http://d0:1"] = None
    asyncio.run(checker.check_all())
    assert [w.url for w in decode.healthy] == ["http://d0:1"]


def test_wait_ready_times_out_naming_the_missing_side():
    prefill = make_worker_set(Role.PREFILL, ["http://p:1"], RoundRobinPolicy(random.Random(0)), [8998])
    decode = make_worker_set(Role.DECODE, ["http://d:1"], RoundRobinPolicy(random.Random(0)))

    async def probe(worker):
        return None if worker.role is Role.PREFILL else "GET /health failed: refused"

    checker = HealthChecker([prefill, decode], probe, interval_s=1.0)
    with pytest.raises(TimeoutError, match=r"no healthy decode worker \(http://d:1: GET /health failed: refused\)"):
        asyncio.run(checker.wait_ready(timeout_s=0.2, interval_s=0.05))
