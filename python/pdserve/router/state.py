"""What the router can serve right now, and the log lines an operator needs about it.

``ok``: a prefill and a decode worker are healthy (requests are disaggregated).
``degraded``: decode workers are healthy but no prefill is; requests go to a decode alone,
which prefills them itself (slower first tokens, same tokens). ``/health`` stays 200.
``starting``: no decode is healthy yet and some were never seen healthy; ``/health`` is 503.
``down``: no decode is healthy (requests are refused with 503).

Each change of state is logged once (at info once the router is stopping: its workers going
away then is a shutdown, not an outage); workers the router still waits for (never seen healthy)
are named when the set changes and again every ``WAITING_LOG_INTERVAL_S``, and once more as an
error when their start-up timeout (``--worker-startup-timeout-secs``, counted from when the router
started, or from when discovery added the worker) passes: ``/health`` then names them under
``startup_timed_out``; the router keeps serving and keeps probing them.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable

from pdserve.router.workers import Worker, WorkerSet

logger = logging.getLogger(__name__)

WAITING_LOG_INTERVAL_S = 30.0


class Mode(str, enum.Enum):
    OK = "ok"
    DEGRADED = "degraded"
    STARTING = "starting"
    DOWN = "down"

    @property
    def serves(self) -> bool:
        return self in (Mode.OK, Mode.DEGRADED)


def current_mode(prefill: WorkerSet, decode: WorkerSet) -> Mode:
    """Pure: the mode the worker sets' health implies."""
    if not decode.healthy:
        return Mode.STARTING if decode.waiting_for else Mode.DOWN
    return Mode.OK if prefill.healthy else Mode.DEGRADED


class RouterState:
    """Tracks the mode and the workers still awaited; ``update`` after every health round and
    whenever a request finds no healthy prefill (so a transition is logged before it matters)."""

    def __init__(self, prefill: WorkerSet, decode: WorkerSet, startup_timeout_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self.prefill = prefill
        self.decode = decode
        self.clock = clock
        self.started = clock()
        self.startup_timeout_s = startup_timeout_s
        self.mode: Mode | None = None
        self._waiting: tuple[str, ...] | None = None
        self._waiting_logged_at = 0.0
        self.stopping = False  # the router was asked to stop: workers going away is no outage
        # when each awaited worker was first awaited, and those whose start-up timeout passed
        self._awaited_since = {w.url: self.started for w in self.waiting_for}
        self.timed_out: set[str] = set()

    @property
    def waiting_for(self) -> list[Worker]:
        return self.prefill.waiting_for + self.decode.waiting_for

    def update(self) -> Mode:
        mode = current_mode(self.prefill, self.decode)
        if mode is not self.mode:
            self._log_transition(self.mode, mode)
            self.mode = mode
        self._log_waiting()
        return mode

    def health(self) -> tuple[int, dict]:
        """``/health``'s status code and body."""
        mode = current_mode(self.prefill, self.decode)
        body: dict = {"status": mode.value,
                      "waiting_for": [w.url for w in self.waiting_for],
                      "unhealthy": [{"url": w.url, "role": w.role.value,
                                     "last_error": w.last_error or "not checked yet"}
                                    for s in (self.prefill, self.decode) for w in s.workers if not w.healthy]}
        overdue = [url for url in body["waiting_for"] if url in self.timed_out]
        if overdue:
            body["startup_timed_out"] = overdue
        if mode is Mode.DEGRADED:
            body["detail"] = "no healthy prefill worker: decode workers prefill requests themselves"
        elif not mode.serves:
            body["detail"] = "no healthy decode worker: requests are refused"
        return (200 if mode.serves else 503), body

    def _log_transition(self, old: Mode | None, new: Mode) -> None:
        if self.stopping:
            logger.info("stopping: %s (%s)", new.value, _reasons(self.decode if new is Mode.DOWN else self.prefill))
        elif new is Mode.DEGRADED:
            logger.warning("degraded: no healthy prefill worker (%s); requests go to decode workers alone, "
                           "which prefill them locally", _reasons(self.prefill))
        elif new is Mode.DOWN:
            logger.error("down: no healthy decode worker (%s); requests are refused", _reasons(self.decode))
        elif new is Mode.OK and old is not None:
            logger.info("serving disaggregated again: prefill %s healthy", [w.url for w in self.prefill.healthy])

    def _log_waiting(self) -> None:
        waiting = tuple(w.url for w in self.waiting_for)
        now = self.clock()
        if waiting and (waiting != self._waiting or now - self._waiting_logged_at >= WAITING_LOG_INTERVAL_S):
            for w in self.waiting_for:
                logger.info("waiting for %s worker %s (%s)", w.role.value, w.url, w.last_error or "not checked yet")
            self._waiting_logged_at = now
        self._awaited_since = {url: self._awaited_since.get(url, now) for url in waiting}
        self.timed_out &= set(waiting)
        overdue = [url for url, since in self._awaited_since.items()
                   if now - since >= self.startup_timeout_s and url not in self.timed_out]
        if overdue:
            self.timed_out.update(overdue)
            logger.error("worker startup: still waiting for %s after %g s; serving with the workers that are up "
                         "and probing the others", ", ".join(overdue), self.startup_timeout_s)
        self._waiting = waiting


def _reasons(ws: WorkerSet) -> str:
    if not ws.workers:
        return "none known: discovery has found none yet"
    return "; ".join(f"{w.url}: {w.last_error or 'not checked yet'}" for w in ws.workers if not w.healthy)
