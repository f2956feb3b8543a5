"""Where a streamed token waits between the scheduler and the HTTP response (the frontend's half
of ``/get_server_info``'s ``handoff``; ``benchmark/handoff_profile.py`` reads it).

Stages of one step's tokens, each timed on the frontend with the system-wide monotonic clock
(the scheduler stamps ``BatchTokenOutput.sent_at`` with the same clock, so on one machine the
socket stage spans both processes):

- ``emit``: the step's oldest token sampled -> the scheduler sends the step's message (the rest of
  the step: stop checks, outputs, and with overlap scheduling the scheduler's wait for the worker;
  stamped by the scheduler as ``BatchTokenOutput.sampled_at``);
- ``socket``: the scheduler's send -> the frontend holds the decoded message (encode, ZMQ, the
  frontend's wake-up, decode);
- ``route``: the step's outputs to their requests, waking their coroutines (once per step);
- ``wake``: a request's outputs routed -> its coroutine runs (the event loop's queue);
- ``detokenize``: the incremental detokenizer's text of the chunk;
- ``write``: the chunk handed to the HTTP layer -> it asks for the next (SSE framing, the socket write).
"""

from __future__ import annotations

import time
from collections import deque

STAGES = ("emit", "socket", "route", "wake", "detokenize", "write")
WINDOW = 4096  # the latest samples of each stage kept for percentiles
MAX_CROSS_PROCESS_S = 60.0  # a socket stage beyond this is two clocks (another node), not a wait


class HandoffProfile:
    """Recent samples (seconds) of each stage; ``summary`` gives milliseconds."""

    def __init__(self, window: int = WINDOW):
        self.samples: dict[str, deque[float]] = {s: deque(maxlen=window) for s in STAGES}
        self.counts = dict.fromkeys(STAGES, 0)

    def add(self, stage: str, seconds: float) -> None:
        self.samples[stage].append(seconds)
        self.counts[stage] += 1

    def socket(self, sent_at: float, now: float, sampled_at: float = 0.0) -> None:
        """A frame stamped ``sent_at`` by the scheduler (its oldest token sampled at ``sampled_at``)
        arrived ``now`` (all ``time.monotonic``)."""
        if sent_at > 0 and 0 <= now - sent_at < MAX_CROSS_PROCESS_S:
            self.add("socket", now - sent_at)
            if 0 < sampled_at <= sent_at:
                self.add("emit", sent_at - sampled_at)

    def summary(self) -> dict[str, dict[str, float]]:
        """Per stage: samples seen, and mean / p50 / p90 / p99 / max of the recent ones, in ms."""
        out: dict[str, dict[str, float]] = {}
        for stage, xs in self.samples.items():
            if not xs:
                out[stage] = {"count": float(self.counts[stage])}
                continue
            s = sorted(xs)
            out[stage] = {"count": float(self.counts[stage]), "mean_ms": sum(s) / len(s) * 1e3,
                          **{f"p{q}_ms": _quantile(s, q / 100) * 1e3 for q in (50, 90, 99)}, "max_ms": s[-1] * 1e3}
        return out

    def reset(self) -> None:
        for stage in STAGES:
            self.samples[stage].clear()
            self.counts[stage] = 0


def _quantile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def now() -> float:
    """The stages' clock: system-wide on Linux, so two processes on one machine agree."""
    return time.monotonic()
