"""Per-worker circuit breakers and the retry back-off (pure: an injected clock, an injected RNG).

A breaker watches the outcomes of the requests sent to one worker (sgl-model-gateway's states):

* closed: requests flow; ``failure_threshold`` failures in a row open it (a success resets the count);
* open: the worker is not picked; after ``timeout_s`` it turns half-open;
* half-open: requests flow again as probes; ``success_threshold`` successes in a row close it, any
  failure opens it again for another ``timeout_s``.

What counts (``answer_verdict``): connection failures, timeouts and answers 502, 503 and 504 (the
worker or what stands behind it is down, overloaded or gone) are failures. A 4xx is the client's
fault and a 500 is what one request made the worker do (a request that crashed a parser): neither
says the worker is unwell, and counting them would let one client open every breaker and deny
the deployment to everyone (issue 33). A 4xx is a success (the worker answered); a 500 or another
5xx leaves the breaker as it is.

It complements the health checks: ``GET /health`` can pass while requests fail (a wedged
scheduler behind a live frontend, a proxy whose backend died), and only the requests see that.

Retries (``Backoff``): a request whose connection failed before any byte reached the client is
sent again, to a newly chosen pair, after ``initial * multiplier**attempt`` (at most ``max``)
seconds, spread by +-``jitter`` so that the requests of one failure do not come back in step.
"""

from __future__ import annotations

import enum
import random
import time
from collections.abc import Callable
from dataclasses import dataclass


class BreakerState(str, enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"

    @property
    def code(self) -> int:
        """The gauge value (sgl-model-gateway's: 0 closed, 1 open, 2 half-open)."""
        return {BreakerState.CLOSED: 0, BreakerState.OPEN: 1, BreakerState.HALF_OPEN: 2}[self]


@dataclass(frozen=True)
class BreakerConfig:
    failure_threshold: int = 10
    success_threshold: int = 3
    timeout_s: float = 60.0

    def __post_init__(self):
        if self.failure_threshold < 1 or self.success_threshold < 1:
            raise ValueError("breaker thresholds must be >= 1")
        if not self.timeout_s > 0:
            raise ValueError(f"breaker timeout_s: must be > 0, got {self.timeout_s}")


# the answers that are the worker's failure, not the request's
WORKER_FAILURE_STATUSES = frozenset({502, 503, 504})


def answer_verdict(status: int) -> bool | None:
    """What an HTTP answer says about the worker: True (it served), False (it failed), None (nothing:
    a 500 or other 5xx one request caused)."""
    if status in WORKER_FAILURE_STATUSES:
        return False
    return True if status < 500 else None


# called with (old state, new state, why) on every transition
OnTransition = Callable[[BreakerState, BreakerState, str], None]


class CircuitBreaker:
    """One worker's breaker. Invariants: ``failures`` counts consecutive failures while closed,
    ``successes`` consecutive successes while half-open; ``opened_at`` is set while open."""

    def __init__(self, config: BreakerConfig, on_transition: OnTransition | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.on_transition = on_transition
        self.clock = clock
        self._state = BreakerState.CLOSED
        self.failures = 0
        self.successes = 0
        self.opened_at: float | None = None

    @property
    def state(self) -> BreakerState:
        """The state now: an open breaker whose time is up reads (and turns) half-open."""
        if self._state is BreakerState.OPEN and self.opened_at is not None \
                and self.clock() - self.opened_at >= self.config.timeout_s:
            self._move(BreakerState.HALF_OPEN, f"open for {self.config.timeout_s:g} s: probing")
        return self._state

    @property
    def allows(self) -> bool:
        """Whether the worker may be picked now."""
        return self.state is not BreakerState.OPEN

    def record(self, ok: bool, why: str = "") -> None:
        """The outcome of one request the worker served (``why``: what failed)."""
        state = self.state
        if ok:
            self.failures = 0
            if state is BreakerState.HALF_OPEN:
                self.successes += 1
                if self.successes >= self.config.success_threshold:
                    self._move(BreakerState.CLOSED, f"{self.successes} probe(s) succeeded")
            return
        self.successes = 0
        if state is BreakerState.HALF_OPEN:
            self._open(f"a probe failed: {why}")
        elif state is BreakerState.CLOSED:
            self.failures += 1
            if self.failures >= self.config.failure_threshold:
                self._open(f"{self.failures} failures in a row, the last: {why}")

    def _open(self, why: str) -> None:
        self.opened_at = self.clock()
        self._move(BreakerState.OPEN, why)

    def _move(self, new: BreakerState, why: str) -> None:
        old, self._state = self._state, new
        self.failures = self.successes = 0
        if new is not BreakerState.OPEN:
            self.opened_at = None
        if self.on_transition is not None:
            self.on_transition(old, new, why)


@dataclass(frozen=True)
class Backoff:
    """Retry budget and delays (sglang-router's --retry-* flags; ``max_retries`` 0: no retry)."""

    max_retries: int = 5
    initial_s: float = 0.05
    max_s: float = 30.0
    multiplier: float = 1.5
    jitter: float = 0.2

    def __post_init__(self):
        if self.max_retries < 0 or self.initial_s < 0 or self.max_s < self.initial_s:
            raise ValueError("backoff: need max_retries >= 0 and 0 <= initial_s <= max_s")
        if self.multiplier < 1.0 or not 0.0 <= self.jitter <= 1.0:
            raise ValueError("backoff: need multiplier >= 1 and jitter in [0, 1]")

    def delay(self, attempt: int, rng: random.Random) -> float:
        """Seconds to wait before retry number ``attempt`` (0-based)."""
        base = min(self.initial_s * self.multiplier ** attempt, self.max_s)
        return max(0.0, base * (1.0 + rng.uniform(-self.jitter, self.jitter)))
