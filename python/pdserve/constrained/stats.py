"""Grammar figures a process reports (plain values, so a scheduler's travel in its stats dict):
compile time and per-step mask time as histogram bucket counts, cache hits and misses, failures,
timeouts. SGLang's metric names are given where obs/metrics.py renders them."""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

COMPILE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
MASK_BUCKETS = (5e-05, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)


@dataclass
class Buckets:
    """A histogram's counts: ``counts[i]`` observations <= ``bounds[i]`` and > the bound before
    (the last: above every bound), their sum and number."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self):
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.n += 1

    def to_dict(self) -> dict:
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.total, "count": self.n}


class GrammarStats:
    """Thread-safe: compile threads and the scheduler (or the frontend's event loop) update it."""

    def __init__(self):
        self._lock = threading.Lock()
        self.compile = Buckets(COMPILE_BUCKETS)
        self.mask = Buckets(MASK_BUCKETS)
        # busy: refused, the client had its most compiles queued; abandoned: dropped, nobody waited any more;
        # killed: a running compile's child process killed, nobody waited any more (constrained/isolation.py)
        self.counters = {"requests": 0, "cache_hits": 0, "cache_misses": 0, "compile_failures": 0,
                         "timeouts": 0, "busy": 0, "abandoned": 0, "killed": 0}

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def observe_compile(self, seconds: float) -> None:
        with self._lock:
            self.compile.observe(seconds)

    def observe_mask(self, seconds: float) -> None:
        with self._lock:
            self.mask.observe(seconds)

    def to_dict(self) -> dict:
        with self._lock:
            return {**self.counters, "compile_seconds": self.compile.to_dict(), "mask_seconds": self.mask.to_dict()}
