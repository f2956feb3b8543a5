"""Per-request timeline: arrival, token arrivals and finish, in ``time.perf_counter`` seconds.

The frontend stamps it as outputs arrive from the scheduler, so TTFT, ITL and
E2E include the IPC hop (what a client sees, minus the HTTP write).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class ReqTimeline:
    """Timestamps of one request. ``itls`` holds one gap per token after the first;
    a message carrying k tokens spreads its gap evenly over them."""

    arrival: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    itls: list[float] = field(default_factory=list)

    def on_tokens(self, n: int, now: float | None = None) -> None:
        if n <= 0:
            return
        now = time.perf_counter() if now is None else now
        if self.first_token is None:
            self.first_token = now
            n -= 1
        elif n:
            gap = (now - self.last_token) / n
            self.itls.extend([gap] * n)
        self.last_token = now

    def on_finish(self, now: float | None = None) -> None:
        self.finished = time.perf_counter() if now is None else now

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival
