"""Pure worker-choice policies: which of the healthy workers of one side gets a request.

No I/O and no clock: a policy sees the candidates (URL and the router's in-flight
count for each) and returns an index. Randomness comes from an injected
``random.Random``, so tests seed it.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    """A healthy worker as a policy sees it."""

    position: int  # index in the configured worker list (stable while workers die and rejoin)
    url: str
    in_flight: int  # requests this router sent it that have not finished


class Policy(ABC):
    """Chooses one worker per request.

    ``pick`` gets a non-empty sequence of candidates in configuration order
    (increasing ``position``), dead workers left out, and returns an index into
    it. A policy may keep state between calls (round robin's cursor)
    but must not do I/O.
    """

    def __init__(self, rng: random.Random):
        self.rng = rng

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


POLICIES: dict[str, type[Policy]] = {
    "random": RandomPolicy,
    "round_robin": RoundRobinPolicy,
    "least_load": LeastLoadPolicy,
}


def make_policy(name: str, rng: random.Random) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"policy: {name!r} is not one of {tuple(POLICIES)}")
    return POLICIES[name](rng)
