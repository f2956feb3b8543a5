"""Per-request timeline: arrival, token arrivals and finish, in ``time.perf_counter`` seconds.

The frontend stamps it as outputs arrive from the scheduler, so TTFT, ITL and
E2E include the IPC hop (what a client sees, minus the HTTP write).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

# Where a request's time to first token goes (server side, in this order).
STAGES = ("queue", "prefill", "transfer", "decode_scheduling")


@dataclass
class ReqTimeline:
    """Timestamps of one request. ``itls`` holds one gap per token after the first;
    a message carrying k tokens spreads its gap evenly over them."""

    arrival: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    itls: list[float] = field(default_factory=list)
    stages: dict[str, float] | None = None  # TTFT breakdown, summing to ``ttft``

    def set_stages(self, scheduler_side: dict[str, float]) -> None:
        """The scheduler's breakdown of its part of the TTFT; what the frontend spent around it
        (tokenizing, the IPC hops) counts as queueing, so the parts sum to this TTFT."""
        stages = {k: scheduler_side.get(k, 0.0) for k in STAGES}
        if self.ttft is not None:
            stages["queue"] = max(0.0, stages["queue"] + self.ttft - sum(stages.values()))
        self.stages = stages

    def on_tokens(self, n: int, now: float | None = None) -> None:
        if n <= 0:
            return
        now = time.perf_counter() if now is None else now
        if self.first_token is None:
            self.first_token = now
            n -= 1
        elif n and self.last_token is not None:  # set with first_token
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



@dataclass
class StageClock:
    """Scheduler-side stamps of one request up to its first token (``time.monotonic`` seconds),
    turned into the TTFT breakdown of ``STAGES`` whose parts sum to first token - arrival.

    Colocated: the prefill runs from its first to its last forward. Disaggregated (decode side):
    "prefill" starts when the KV request leaves and ends when the KV has landed; the prefill
    server reports how long the room queued there and how long its forward passes took, and the
    rest of that span is the transfer.
    """

    arrived: float = field(default_factory=time.monotonic)
    prefill_start: float | None = None
    prefill_end: float | None = None
    remote_queue: float = 0.0  # disaggregated: prefill-side wait before its first forward
    remote_prefill: float = 0.0  # disaggregated: prefill-side forward passes up to the last layer
    transferred: bool = False

    def start_prefill(self, now: float | None = None) -> None:
        if self.prefill_start is None:
            self.prefill_start = time.monotonic() if now is None else now

    def end_prefill(self, now: float | None = None) -> None:
        self.prefill_end = time.monotonic() if now is None else now

    def restart(self) -> None:
        """The transfer failed: what it cost counts as queueing for the local prefill."""
        self.prefill_start = self.prefill_end = None
        self.remote_queue = self.remote_prefill = 0.0
        self.transferred = False

    def breakdown(self, first_token: float | None = None) -> dict[str, float]:
        now = time.monotonic() if first_token is None else first_token
        start = self.prefill_start if self.prefill_start is not None else now
        end = self.prefill_end if self.prefill_end is not None else start
        span = end - start
        remote = min(span, self.remote_queue + self.remote_prefill) if self.transferred else 0.0
        queue_remote = min(self.remote_queue, remote)
        return {"queue": start - self.arrived + queue_remote,
                "prefill": remote - queue_remote if self.transferred else span,
                "transfer": span - remote if self.transferred else 0.0,
                "decode_scheduling": now - end}
