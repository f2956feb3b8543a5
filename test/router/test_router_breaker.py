"""Circuit breakers (closed -> open after N failures in a row, half-open after the cool-down, closed
after M probes succeed, open again on a failed probe) and the retry back-off (growth, cap, jitter),
with an injected clock and a seeded RNG; a worker whose breaker is open is not picked."""

from __future__ import annotations

import random

import pytest

from pdserve.router.breaker import Backoff, BreakerConfig, BreakerState, CircuitBreaker, answer_verdict
from pdserve.router.policy import RoundRobinPolicy
from pdserve.router.workers import NoHealthyWorker, Role, make_worker_set


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def breaker(failures=3, successes=2, timeout=10.0):
    clock, moves = Clock(), []
    cb = CircuitBreaker(BreakerConfig(failures, successes, timeout), lambda old, new, why: moves.append(new),
                        clock)
    return cb, clock, moves


def test_opens_after_consecutive_failures_only():
    cb, _, moves = breaker(failures=3)
    for ok in (False, False, True, False, False):  # a success resets the count
        cb.record(ok, "connect")
    assert cb.state is BreakerState.CLOSED and cb.allows and moves == []
    cb.record(False, "connect")
    assert cb.state is BreakerState.OPEN and not cb.allows and moves == [BreakerState.OPEN]


def test_half_open_after_the_timeout_then_closes_on_successes():
    cb, clock, moves = breaker(failures=1, successes=2, timeout=10.0)
    cb.record(False, "broken")
    clock.t += 9.9
    assert cb.state is BreakerState.OPEN
    cb.record(True)  # a request started before it opened ends well: no effect while open
    assert cb.state is BreakerState.OPEN
    clock.t += 0.1
    assert cb.state is BreakerState.HALF_OPEN and cb.allows
    cb.record(True)
    assert cb.state is BreakerState.HALF_OPEN
    cb.record(True)
    assert cb.state is BreakerState.CLOSED
    assert moves == [BreakerState.OPEN, BreakerState.HALF_OPEN, BreakerState.CLOSED]
    assert cb.state.code == 0


def test_a_failed_probe_opens_it_again_for_a_whole_timeout():
    cb, clock, moves = breaker(failures=2, successes=1, timeout=5.0)
    cb.record(False)
    cb.record(False)
    clock.t += 5
    assert cb.state is BreakerState.HALF_OPEN
    cb.record(False, "answered 503")
    assert cb.state is BreakerState.OPEN and cb.state.code == 1
    clock.t += 4.9
    assert not cb.allows
    clock.t += 0.1
    assert cb.state.code == 2
    assert moves == [BreakerState.OPEN, BreakerState.HALF_OPEN, BreakerState.OPEN, BreakerState.HALF_OPEN]


def test_an_open_breaker_keeps_its_worker_out_of_the_picks():
    ws = make_worker_set(Role.DECODE, ["http://d0:1", "http://d1:1"], RoundRobinPolicy(random.Random(0)))
    clock = Clock()
    for w in ws.workers:
        ws.mark_alive(w)
        w.breaker = CircuitBreaker(BreakerConfig(1, 1, 30.0), clock=clock)
    ws.workers[0].breaker.record(False, "connect")
    assert [ws.pick().worker.url for _ in range(3)] == ["http://d1:1"] * 3
    ws.workers[1].breaker.record(False, "connect")
    with pytest.raises(NoHealthyWorker) as e:
        ws.pick()
    assert "http://d0:1: circuit breaker open" in str(e.value)
    clock.t += 30
    assert ws.pick().worker.url == "http://d0:1"  # half-open: probes go through


def test_backoff_grows_caps_and_jitters_within_its_factor():
    b = Backoff(max_retries=5, initial_s=0.05, max_s=0.2, multiplier=2.0, jitter=0.0)
    rng = random.Random(0)
    assert [b.delay(i, rng) for i in range(4)] == [0.05, 0.1, 0.2, 0.2]
    jittery = Backoff(max_retries=5, initial_s=1.0, max_s=10.0, multiplier=1.5, jitter=0.2)
    delays = [jittery.delay(1, random.Random(seed)) for seed in range(200)]
    assert all(1.5 * 0.8 <= d <= 1.5 * 1.2 for d in delays)
    assert max(delays) - min(delays) > 0.3  # it does spread them
    with pytest.raises(ValueError):
        Backoff(jitter=1.5)


@pytest.mark.parametrize(("status", "verdict"), [(200, True), (400, True), (413, True), (422, True), (429, True),
                                                 (500, None), (501, None), (502, False), (503, False),
                                                 (504, False), (505, None)])
def test_only_gateway_answers_count_against_a_worker(status, verdict):
    """A 4xx is the client's, a 500 what one request did: neither opens a breaker (issue 33)."""
    assert answer_verdict(status) is verdict
