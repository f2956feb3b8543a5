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


def test_health_checker_marks_dead_and_alive_from_the_probe_and_reports_each_round():
    prefill = make_worker_set(Role.PREFILL, ["http://p:1"], RoundRobinPolicy(random.Random(0)), [8998])
    decode = make_worker_set(Role.DECODE, ["http://d0:1", "http://d1:1"], RoundRobinPolicy(random.Random(0)))
    verdicts = {"http://p:1": None, "http://d0:1": "GET /health answered 503", "http://d1:1": None}

    async def probe(worker):
        return verdicts[worker.url]

    checker = HealthChecker([prefill, decode], probe, interval_s=1.0)
    rounds = []
    checker.after_check.append(lambda: rounds.append([w.healthy for w in decode.workers]))
    asyncio.run(checker.check_all())
    assert [w.healthy for w in prefill.workers + decode.workers] == [True, False, True]
    assert decode.workers[0].last_error == "GET /health answered 503"
    assert [w.url for w in decode.waiting_for] == ["http://d0:1"]  # never seen healthy yet
    verdicts["http://d1:1"] = "GET /health failed: refused"
    asyncio.run(checker.check_all())
    assert decode.healthy == [] and decode.waiting_for == [decode.workers[0]]  # d1 was up once: not awaited
    verdicts["http://d0:1"] = None
    asyncio.run(checker.check_all())
    assert [w.url for w in decode.healthy] == ["http://d0:1"] and decode.waiting_for == []
    assert rounds == [[False, True], [False, False], [True, False]]


def test_pick_avoids_the_worker_named():
    ws = decode_set(2)
    for w in ws.workers:
        ws.mark_alive(w)
    assert {ws.pick(avoid=ws.workers[0]).worker.url for _ in range(3)} == {"http://d1:1"}
    ws.mark_dead(ws.workers[1], "gone")
    with pytest.raises(NoHealthyWorker):
        ws.pick(avoid=ws.workers[0])


def test_health_thresholds_need_consecutive_results_and_a_draining_worker_leaves_at_once():
    decode = make_worker_set(Role.DECODE, ["http://d0:1", "http://d1:1"], RoundRobinPolicy(random.Random(0)))
    prefill = make_worker_set(Role.PREFILL, [], RoundRobinPolicy(random.Random(0)))
    d0, d1 = decode.workers
    verdicts = {d0.url: None, d1.url: None}

    async def probe(worker):
        return verdicts[worker.url]

    checker = HealthChecker([prefill, decode], probe, 1.0, failure_threshold=3, success_threshold=2)

    def check(**new):
        verdicts.update({w.url: v for w, v in ((d0, new.get("d0", verdicts[d0.url])),
                                               (d1, new.get("d1", verdicts[d1.url])))})
        asyncio.run(checker.check_all())
        return [w.healthy for w in (d0, d1)]

    assert check() == [True, True]  # never seen healthy: the first pass is enough
    for flip in ("503", None, "503", "503"):  # a pass in between resets the count
        assert check(d0=flip) == [True, True]
    assert check(d0="503") == [False, True] and d0.last_error == "503"
    assert check(d0=None) == [False, True]  # one pass is not two
    assert check(d0="refused") == [False, True] and d0.last_error == "refused"  # the reason stays current
    assert check(d0=None) == [False, True]
    assert check(d0=None) == [True, True]
    d1.draining = True  # its /health said "draining: switching ...": out at the first failure
    assert check(d1="answered 503") == [True, False]
