"""The router's mode (ok / degraded / starting / down), /health's answer, and that each change
and each awaited worker is logged once (injected clock)."""

from __future__ import annotations

import logging
import random

from pdserve.router.policy import RoundRobinPolicy
from pdserve.router.state import Mode, RouterState
from pdserve.router.workers import Role, Worker, make_worker_set


def sets():
    prefill = make_worker_set(Role.PREFILL, ["http://p:1"], RoundRobinPolicy(random.Random(0)), [8998])
    decode = make_worker_set(Role.DECODE, ["http://d:1"], RoundRobinPolicy(random.Random(0)))
    return prefill, decode


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_modes_and_health(caplog):
    prefill, decode = sets()
    clock = Clock()
    state = RouterState(prefill, decode, startup_timeout_s=60, clock=clock)
    caplog.set_level(logging.INFO, "pdserve.router.state")
    assert state.update() is Mode.STARTING
    status, body = state.health()
    assert status == 503 and body["status"] == "starting" and body["waiting_for"] == ["http://p:1", "http://d:1"]
    decode.mark_alive(decode.workers[0])
    assert state.update() is Mode.DEGRADED and state.health()[0] == 200
    assert state.health()[1]["waiting_for"] == ["http://p:1"]
    state.update()
    prefill.mark_alive(prefill.workers[0])
    assert state.update() is Mode.OK
    assert state.health() == (200, {"status": "ok", "waiting_for": [], "unhealthy": []})
    prefill.mark_dead(prefill.workers[0], "GET /health failed")
    assert state.update() is Mode.DEGRADED
    decode.mark_dead(decode.workers[0], "GET /health answered 503")
    assert state.update() is Mode.DOWN and state.health()[1]["status"] == "down"
    messages = [r.getMessage() for r in caplog.records]
    assert sum(m.startswith("degraded: no healthy prefill worker") for m in messages) == 2  # once per transition
    assert sum(m.startswith("serving disaggregated again") for m in messages) == 1
    assert any(m.startswith("down: no healthy decode worker (http://d:1: GET /health answered 503)") for m in messages)


def test_awaited_workers_are_named_then_reported_at_the_timeout(caplog):
    prefill, decode = sets()
    clock = Clock()
    state = RouterState(prefill, decode, startup_timeout_s=10, clock=clock)
    caplog.set_level(logging.INFO, "pdserve.router.state")
    prefill.mark_dead(prefill.workers[0], "GET /health failed: refused")
    decode.mark_alive(decode.workers[0])
    state.update()
    state.update()  # same set, too soon: not repeated
    clock.t = 11
    state.update()
    state.update()
    messages = [r.getMessage() for r in caplog.records]
    assert messages.count("waiting for prefill worker http://p:1 (GET /health failed: refused)") == 1
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == ["worker startup: still waiting for http://p:1 after 10 s; serving with the workers that "
                      "are up and probing the others"]


def test_workers_going_away_while_the_router_stops_is_no_outage(caplog):
    """Ctrl-C of a deployment: the router is told first (``stopping``; its health rounds stop too),
    then its workers stop; their going away is logged at info, not as a degraded or down router."""
    prefill, decode = sets()
    state = RouterState(prefill, decode, startup_timeout_s=60, clock=Clock())
    prefill.mark_alive(prefill.workers[0])
    decode.mark_alive(decode.workers[0])
    assert state.update() is Mode.OK
    caplog.set_level(logging.INFO, "pdserve.router.state")
    state.stopping = True
    prefill.mark_dead(prefill.workers[0], "GET /health failed")
    assert state.update() is Mode.DEGRADED
    decode.mark_dead(decode.workers[0], "GET /health failed")
    assert state.update() is Mode.DOWN
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "pdserve.router.state"]
    assert said == [(logging.INFO, "stopping: degraded (http://p:1: GET /health failed)"),
                    (logging.INFO, "stopping: down (http://d:1: GET /health failed)")]
def test_each_awaited_worker_has_its_own_startup_timeout(caplog):
    """A worker discovery adds later is awaited from when it was added, not from the router's start;
    /health names the workers whose start-up timeout passed until they come up."""
    prefill, decode = sets()
    clock = Clock()
    state = RouterState(prefill, decode, startup_timeout_s=10, clock=clock)
    caplog.set_level(logging.INFO, "pdserve.router.state")
    prefill.mark_alive(prefill.workers[0])
    decode.mark_alive(decode.workers[0])
    state.update()
    clock.t = 50
    decode.add(Worker("http://d:2", Role.DECODE, 0))  # discovered: never seen healthy yet
    state.update()
    clock.t = 59
    state.update()
    assert "startup_timed_out" not in state.health()[1]
    clock.t = 60
    state.update()
    state.update()
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == ["worker startup: still waiting for http://d:2 after 10 s; serving with the workers that "
                      "are up and probing the others"]
    assert state.health()[1]["startup_timed_out"] == ["http://d:2"]
    decode.mark_alive(decode.workers[1])
    state.update()
    assert state.health() == (200, {"status": "ok", "waiting_for": [], "unhealthy": []})
