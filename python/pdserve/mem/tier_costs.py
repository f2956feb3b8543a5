"""When loading a cached prefix from a lower tier is slower than recomputing it.

A load of ``n`` tokens costs ``latency + n * bytes_per_token / bytes_per_s`` per leg it
crosses (a storage hit is read into host memory and then copied up, so it pays both legs);
recomputing costs ``n / prefill_tokens_per_s``. ``break_even_tokens`` is the shortest hit for
which loading wins; a shorter hit is recomputed. The legs are measured once at start-up
(``measure_copy``); prefill speed is what the engine observes on its own extends (the best
batch seen, so a cold first pass cannot make every load look worthwhile), or pinned by the
``prefill_tokens_per_s`` extra config key. Until prefill has been seen nothing is skipped.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

MIN_PREFILL_SAMPLE_TOKENS = 64  # smaller extends are dominated by per-pass overhead, not per-token cost


@dataclass(frozen=True)
class LegSpeed:
    """One copy leg: fixed cost per load and sustained bandwidth."""

    latency_s: float
    bytes_per_s: float

    def seconds(self, num_bytes: float) -> float:
        return self.latency_s + num_bytes / self.bytes_per_s


def break_even_tokens(legs: Sequence[LegSpeed], bytes_per_token: float, prefill_tokens_per_s: float | None) -> float:
    """Shortest hit (tokens) whose load through ``legs`` beats recomputing it; ``inf`` when
    loading never wins, 0 when prefill speed is unknown (load everything)."""
    if prefill_tokens_per_s is None or prefill_tokens_per_s <= 0:
        return 0.0
    gain = 1.0 / prefill_tokens_per_s - sum(bytes_per_token / leg.bytes_per_s for leg in legs)
    if gain <= 0:
        return math.inf
    return sum(leg.latency_s for leg in legs) / gain


def measure_copy(copy: Callable[[int], None], small: int, large: int, unit_bytes: int,
                 repeats: int = 3) -> LegSpeed:
    """Time ``copy(n)`` for ``small`` and ``large`` units of ``unit_bytes`` (best of ``repeats``):
    the slope is the bandwidth, the rest of the small copy its latency."""
    t_small = _best(copy, small, repeats)
    t_large = _best(copy, large, repeats)
    extra = (large - small) * unit_bytes
    if large > small and t_large > t_small:
        bw = extra / (t_large - t_small)
    else:  # too fast to tell apart: charge everything to bandwidth
        bw = large * unit_bytes / max(t_large, 1e-9)
    return LegSpeed(latency_s=max(0.0, t_small - small * unit_bytes / bw), bytes_per_s=bw)


def _best(copy: Callable[[int], None], n: int, repeats: int) -> float:
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        copy(n)
        best = min(best, time.perf_counter() - t0)
    return best


class TierCosts:
    """The measured legs, the observed prefill speed and the skip rule built from them."""

    def __init__(self, bytes_per_token: float, host: LegSpeed | None = None, storage: LegSpeed | None = None,
                 prefill_tokens_per_s: float | None = None) -> None:
        self.bytes_per_token = bytes_per_token
        self.host = host
        self.storage = storage
        self.pinned_prefill = prefill_tokens_per_s
        self.observed_prefill: float | None = None

    @property
    def prefill_tokens_per_s(self) -> float | None:
        return self.pinned_prefill if self.pinned_prefill is not None else self.observed_prefill

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens >= MIN_PREFILL_SAMPLE_TOKENS and seconds > 0:
            self.observed_prefill = max(self.observed_prefill or 0.0, tokens / seconds)

    def legs(self, tier: str) -> list[LegSpeed]:
        """The legs a hit from ``tier`` ("host" or "storage") crosses on its way to the device."""
        legs = [self.storage] if tier == "storage" else []
        return [leg for leg in legs + [self.host] if leg is not None]

    def break_even(self, tier: str) -> float:
        return break_even_tokens(self.legs(tier), self.bytes_per_token, self.prefill_tokens_per_s)

    def worth_loading(self, tier: str, tokens: int) -> bool:
        return tokens > 0 and tokens >= self.break_even(tier)

    def info(self) -> dict[str, float]:
        """Server-info numbers (bandwidths in bytes/s, latencies and break-evens; -1: unknown)."""
        out: dict[str, float] = {"tier_prefill_tokens_per_s": self.prefill_tokens_per_s or -1.0}
        for name, leg in (("host", self.host), ("storage", self.storage)):
            if leg is None:
                continue
            be = self.break_even(name)
            out.update({f"tier_{name}_bytes_per_s": leg.bytes_per_s, f"tier_{name}_latency_s": leg.latency_s,
                        f"tier_{name}_break_even_tokens": -1.0 if math.isinf(be) else be})
        return out
