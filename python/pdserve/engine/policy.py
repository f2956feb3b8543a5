"""Scheduling policies kept apart from the loop so they can be unit-tested."""

from __future__ import annotations

from collections.abc import Callable

from pdserve.engine.request import Req

# Above this queue length, prefix matching every waiting request costs more than it saves.
LPM_MAX_QUEUE = 128


def order_waiting(waiting: list[Req], policy: str, match_len: Callable[[Req], int]) -> list[Req]:
    """Order in which waiting requests are considered for admission.

    ``fcfs``: retracted requests first (they already waited), then arrival.
    ``lpm``: longest cached prefix first, ties by arrival; falls back to fcfs on long queues.
    """
    if policy == "lpm" and len(waiting) <= LPM_MAX_QUEUE:
        return sorted(waiting, key=lambda r: (-match_len(r), r.arrival))
    return sorted(waiting, key=lambda r: (r.num_retractions == 0, r.arrival))


def chunk_len(remaining: int, budget: int, kv_len: int, page_size: int) -> int:
    """Tokens to prefill now: everything if it fits, else the largest run that ends on a
    page boundary, so every page is written once per layer (disaggregation relies on it)."""
    if remaining <= budget:
        return remaining
    end = (kv_len + budget) // page_size * page_size
    return max(0, end - kv_len)


def pages_needed(kv_len_after: int, pages_held: int, page_size: int) -> int:
    return max(0, -(-kv_len_after // page_size) - pages_held)


def pick_retraction(running: list[Req]) -> Req:
    """Retract the most recently arrived request: the oldest keep their progress (FCFS fairness)."""
    return max(running, key=lambda r: r.arrival)
