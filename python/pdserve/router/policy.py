"""Pure worker-choice policies: which of the healthy workers of one side gets a request.

No I/O and no clock: a policy sees the candidates (URL, the router's in-flight count, and
for cache_aware the blocks of this prompt each one caches and its free KV pages) and
returns an index. Randomness comes from an injected ``random.Random``, so tests seed it.

cache_aware breaks a tie between equally loaded workers by the prompt (rendezvous hashing of a
key of the prompt with each worker's URL), not at random, when its observer knows the prompt:
router replicas that see the same KV events then make the same choices (docs/router.md).
"""

from __future__ import annotations

import hashlib
import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Candidate:
    """A healthy worker as a policy sees it."""

    position: int  # index in the configured worker list (stable while workers die and rejoin)
    url: str
    in_flight: int  # requests this router sent it that have not finished
    cached_blocks: int = 0  # leading blocks of this request's prompt the worker caches (KV events)
    indexed_blocks: int = 0  # blocks it caches in all (a smaller cache has more room)
    free_pages: int = 0  # free KV pages it last reported
    prompt_blocks: int = 0  # full pages in this request's prompt (the same for every candidate)
    running: int = 0  # requests it last reported running (from every client, not only this router)


class PickObserver(Protocol):
    """Told of cache_aware's choices (``router.cache_view.CacheView``: it records what was sent where)."""

    def prompt_key(self) -> int | None:
        """A key of the prompt being placed, the same in every router replica (None: not known)."""

    def placed(self, candidate: Candidate) -> None:
        """The prompt being placed goes to ``candidate``."""


class Policy(ABC):
    """Chooses one worker per request.

    ``pick`` gets a non-empty sequence of candidates in configuration order
    (increasing ``position``), dead workers left out, and returns an index into
    it. A policy may keep state between calls (round robin's cursor)
    but must not do I/O.
    """

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.reason = "load"  # why the last pick went where it did (the router's decision metrics)

    @abstractmethod
    def pick(self, candidates: Sequence[Candidate]) -> int: ...


class RandomPolicy(Policy):
    def pick(self, candidates: Sequence[Candidate]) -> int:
        return self.rng.randrange(len(candidates))


class RoundRobinPolicy(Policy):
    """Takes the workers in configuration order, one request each. A worker leaving or
    rejoining the set does not make the others repeat or get skipped."""

    def __init__(self, rng: random.Random):
        super().__init__(rng)
        self.last_position = -1

    def pick(self, candidates: Sequence[Candidate]) -> int:
        index = next((i for i, c in enumerate(candidates) if c.position > self.last_position), 0)
        self.last_position = candidates[index].position
        return index


class LeastLoadPolicy(Policy):
    """Fewest in-flight requests from this router; ties broken at random."""

    def pick(self, candidates: Sequence[Candidate]) -> int:
        least = min(c.in_flight for c in candidates)
        return self.rng.choice([i for i, c in enumerate(candidates) if c.in_flight == least])


class CacheAwarePolicy(Policy):
    """The worker caching the longest prefix of the prompt (ties: fewer in flight), unless its load
    is out of balance with the least loaded one (sglang-router's rule: more than ``abs_threshold``
    requests more AND more than ``rel_threshold`` times as many); then, and when no worker caches
    at least ``cache_threshold`` of the prompt's pages (a shared template head alone must not pull
    every new conversation to one worker), the least loaded one (ties: more free KV pages, a
    smaller cache, then by the prompt's rendezvous hash, or at random when the prompt is not known;
    decode workers: fewer in flight, fewer reported running, more free pages). ``reason``:
    "cache_hit", "balance" or "load". ``observer`` learns each choice and keys the tie-break."""

    def __init__(self, rng: random.Random, abs_threshold: int = 64, rel_threshold: float = 1.5,
                 cache_threshold: float = 0.3):
        super().__init__(rng)
        self.abs_threshold = abs_threshold
        self.rel_threshold = rel_threshold
        self.cache_threshold = cache_threshold
        self.observer: PickObserver | None = None  # set by the router's cache view (prefill side)

    def pick(self, candidates: Sequence[Candidate]) -> int:
        key = self.observer.prompt_key() if self.observer is not None else None
        index = self._choose(candidates, key)
        if self.observer is not None:
            self.observer.placed(candidates[index])
        return index

    def _choose(self, candidates: Sequence[Candidate], key: int | None) -> int:
        least = min(c.in_flight for c in candidates)
        best = max(range(len(candidates)), key=lambda i: (candidates[i].cached_blocks, -candidates[i].in_flight))
        load, cached = candidates[best].in_flight, candidates[best].cached_blocks
        if cached > 0 and cached >= self.cache_threshold * candidates[best].prompt_blocks:
            if not (load - least > self.abs_threshold and load > least * self.rel_threshold):
                self.reason = "cache_hit"
                return best
            self.reason = "balance"
        else:
            self.reason = "load"
        return self._least_loaded(candidates, key)

    def _least_loaded(self, candidates: Sequence[Candidate], key: int | None) -> int:
        def load(c: Candidate) -> tuple[int, int, int, int]:
            return c.in_flight, c.running, -c.free_pages, c.indexed_blocks

        lowest = min(load(c) for c in candidates)
        tied = [i for i, c in enumerate(candidates) if load(c) == lowest]
        if key is None or len(tied) == 1:
            return self.rng.choice(tied)
        return max(tied, key=lambda i: rendezvous(key, candidates[i].url))


def rendezvous(key: int, url: str) -> int:
    """A stable (unsalted, process-independent) score of ``url`` for ``key``: the highest wins."""
    data = key.to_bytes(8, "little", signed=key < 0) + url.encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


POLICIES: dict[str, type[Policy]] = {
    "random": RandomPolicy,
    "round_robin": RoundRobinPolicy,
    "least_load": LeastLoadPolicy,
    "cache_aware": CacheAwarePolicy,
}


def make_policy(name: str, rng: random.Random, balance_abs_threshold: int = 64,
                balance_rel_threshold: float = 1.5, cache_threshold: float = 0.3) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"policy: {name!r} is not one of {tuple(POLICIES)}")
    if name == "cache_aware":
        return CacheAwarePolicy(rng, balance_abs_threshold, balance_rel_threshold, cache_threshold)
    return POLICIES[name](rng)
