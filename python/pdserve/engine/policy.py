"""Scheduling policies kept apart from the loop so they can be unit-tested."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from pdserve.engine.request import Req

# Above this queue length, prefix matching every waiting request costs more than it saves.
LPM_MAX_QUEUE = 128


def order_waiting(waiting: list[Req], policy: str, match_len: Callable[[Req], int],
                  admitted: Mapping[str, int] | None = None) -> list[Req]:
    """Order in which waiting requests are considered for admission.

    ``fcfs``: retracted requests first (they already waited), then arrival.
    ``lpm``: longest cached prefix first, ties by arrival; falls back to fcfs on long queues.

    Before either, groups take turns (``group_turns``): the sequences of one API call (a batch of
    prompts, n samples) would otherwise all go before a call that arrived after them, and one
    request of thousands of sequences would hold every later client for its whole run. With one
    sequence per group (or none) every turn is 0 and the order is the policy's alone.
    ``admitted``: sequences per group already admitted (running, prefilling, handed to a mode).
    """
    turns = group_turns(waiting, admitted or {})
    if policy == "lpm" and len(waiting) <= LPM_MAX_QUEUE:
        return sorted(waiting, key=lambda r: (turns[r], -match_len(r), r.arrival))
    return sorted(waiting, key=lambda r: (r.num_retractions == 0, turns[r], r.arrival))


def group_turns(waiting: list[Req], admitted: Mapping[str, int]) -> dict[Req, int]:
    """Each waiting request's turn: how many of its group go before it, counting those admitted
    and those waiting that arrived earlier (retracted ones first). Ordering by turn interleaves the
    groups round-robin, and a group already holding slots lets the others through first. A request
    without a group is a group of its own (turn 0)."""
    turns: dict[Req, int] = {}
    seen: dict[str, int] = {}
    for r in sorted(waiting, key=lambda r: (r.num_retractions == 0, r.arrival)):
        if r.group is None:
            turns[r] = 0
            continue
        k = seen.get(r.group, 0)
        turns[r] = admitted.get(r.group, 0) + k
        seen[r.group] = k + 1
    return turns


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


@dataclass(frozen=True)
class Growth:
    """What one admitted request may still add to the KV pool."""

    kv_len: int  # tokens with KV in the pool (or about to be, for the chunk being admitted)
    pages_held: int
    remaining: int  # KV slots it writes until max_new_tokens: one per token still to decode


# A remaining budget above this counts as this much: a request rarely uses all of a large
# max_new_tokens, and counting it in full would block admission behind one such request.
RESERVE_CLIP_TOKENS = 4096


def reserved_pages(reqs: Iterable[Growth], ratio: float, page_size: int) -> int:
    """Pages the requests are expected to need as they decode: ``ceil(ratio * remaining)``
    more tokens each (remaining clipped to RESERVE_CLIP_TOKENS; at least one while any remain,
    the next step's), beyond the pages they hold."""
    total = 0
    for g in reqs:
        remaining = min(g.remaining, RESERVE_CLIP_TOKENS)
        expected = min(remaining, max(1, math.ceil(ratio * remaining))) if remaining > 0 else 0
        total += pages_needed(g.kv_len + expected, g.pages_held, page_size)
    return total


@dataclass
class NewTokenRatio:
    """The share of its remaining ``max_new_tokens`` a running request is expected to decode
    (SGLang's new-token ratio); admission keeps that much KV free for every running request.

    Requests often stop early (EOS, stop strings), so the estimate starts below 1 and decays
    each decode step toward ``floor``, admitting more as long as that works out. A retraction
    proves it too low: it jumps to ``after_retract`` (1: reserve the worst case), so the
    retracted request is not re-admitted only to be retracted again. With nothing running it
    returns to ``init``.
    """

    init: float = 0.7
    floor: float = 0.1
    decay_per_step: float = 0.001
    after_retract: float = 1.0
    value: float = field(default=-1.0)

    def __post_init__(self):
        if not 0 < self.floor <= self.init <= self.after_retract <= 1:
            raise ValueError(f"new token ratio: need 0 < floor <= init <= after_retract <= 1, got "
                             f"{self.floor}, {self.init}, {self.after_retract}")
        if self.value < 0:
            self.value = self.init

    def decay(self) -> None:
        """After each decode step."""
        self.value = max(self.floor, self.value - self.decay_per_step)

    def on_retract(self) -> None:
        self.value = max(self.value, self.after_retract)

    def on_idle(self) -> None:
        self.value = self.init
