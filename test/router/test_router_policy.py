"""Worker-choice policies: pure functions of the candidates (and a seeded RNG)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from pdserve.router.policy import (
    POLICIES,
    CacheAwarePolicy,
    Candidate,
    LeastLoadPolicy,
    RandomPolicy,
    RoundRobinPolicy,
    make_policy,
)


def cands(*loads: int, positions: list[int] | None = None) -> list[Candidate]:
    positions = positions if positions is not None else list(range(len(loads)))
    return [Candidate(p, f"http://w{p}", load) for p, load in zip(positions, loads)]


def test_random_covers_every_candidate_and_nothing_else():
    policy = RandomPolicy(random.Random(0))
    picks = Counter(policy.pick(cands(0, 0, 0)) for _ in range(300))
    assert set(picks) == {0, 1, 2}
    assert min(picks.values()) > 50  # 300 draws over 3: each far from starved


def test_random_is_reproducible_with_a_seed():
    a, b = RandomPolicy(random.Random(7)), RandomPolicy(random.Random(7))
    assert [a.pick(cands(0, 0, 0, 0)) for _ in range(20)] == [b.pick(cands(0, 0, 0, 0)) for _ in range(20)]


def test_round_robin_cycles_in_configuration_order():
    policy = RoundRobinPolicy(random.Random(0))
    assert [policy.pick(cands(5, 0, 9)) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_round_robin_skips_a_dead_worker_without_repeating_the_others():
    policy = RoundRobinPolicy(random.Random(0))
    all3 = cands(0, 0, 0)
    without_1 = cands(0, 0, positions=[0, 2])
    picks = [all3[policy.pick(all3)].position]  # 0
    picks.append(without_1[policy.pick(without_1)].position)  # 1 is dead: 2
    picks.append(without_1[policy.pick(without_1)].position)  # wraps: 0
    picks.append(all3[policy.pick(all3)].position)  # 1 is back and next in order
    picks.append(all3[policy.pick(all3)].position)
    assert picks == [0, 2, 0, 1, 2]


def test_round_robin_when_the_last_picked_worker_dies():
    policy = RoundRobinPolicy(random.Random(0))
    all3 = cands(0, 0, 0)
    for _ in range(2):
        policy.pick(all3)  # last picked: position 1
    without_1 = cands(0, 0, positions=[0, 2])
    assert without_1[policy.pick(without_1)].position == 2


def test_least_load_picks_the_minimum():
    policy = LeastLoadPolicy(random.Random(0))
    for _ in range(50):
        assert policy.pick(cands(3, 1, 2, 5)) == 1


def test_least_load_breaks_ties_at_random_among_the_least_only():
    policy = LeastLoadPolicy(random.Random(0))
    picks = Counter(policy.pick(cands(2, 0, 4, 0, 0)) for _ in range(300))
    assert set(picks) == {1, 3, 4}


def test_make_policy_names_the_bad_value():
    assert set(POLICIES) == {"random", "round_robin", "least_load", "cache_aware"}
    assert isinstance(make_policy("least_load", random.Random(0)), LeastLoadPolicy)
    aware = make_policy("cache_aware", random.Random(0), 8, 2.0)
    assert isinstance(aware, CacheAwarePolicy) and (aware.abs_threshold, aware.rel_threshold) == (8, 2.0)
    with pytest.raises(ValueError, match="policy: 'prefix'"):
        make_policy("prefix", random.Random(0))


def aware(*specs: tuple[int, int], free: tuple[int, ...] = (), blocks: int = 10) -> list[Candidate]:
    """(in_flight, cached_blocks) per worker; ``blocks``: the prompt's."""
    free = free or (0,) * len(specs)
    return [Candidate(i, f"http://w{i}", load, cached, 0, f, blocks)
            for i, ((load, cached), f) in enumerate(zip(specs, free))]


def test_cache_aware_takes_the_longest_cached_prefix_ties_by_load():
    policy = CacheAwarePolicy(random.Random(0), abs_threshold=4, rel_threshold=1.5)
    assert policy.pick(aware((3, 5), (0, 9), (0, 2))) == 1 and policy.reason == "cache_hit"
    assert policy.pick(aware((3, 9), (1, 9), (0, 2))) == 1  # same prefix: the less loaded
    assert policy.pick(aware((4, 9), (0, 0))) == 0  # 4 more in flight: not more than abs_threshold


def test_cache_aware_balances_past_both_thresholds_and_by_load_without_a_hit():
    policy = CacheAwarePolicy(random.Random(0), abs_threshold=4, rel_threshold=1.5)
    assert policy.pick(aware((10, 9), (2, 0), (1, 0))) == 2 and policy.reason == "balance"
    assert policy.pick(aware((10, 9), (8, 0))) == 0  # 2 more: within abs_threshold
    assert policy.pick(aware((0, 0), (0, 0), (1, 0), free=(3, 7, 9))) == 1 and policy.reason == "load"
    picks = Counter(policy.pick(aware((0, 0), (1, 0), (0, 0))) for _ in range(200))
    assert set(picks) == {0, 2}  # equal load, pages and cache: at random
    decodes = [Candidate(0, "http://d0", 1, running=0, free_pages=9), Candidate(1, "http://d1", 1, running=3),
               Candidate(2, "http://d2", 1, running=0, free_pages=2)]
    assert policy.pick(decodes) == 0  # same in flight: fewer running, then more free pages
    assert policy.pick(aware((1, 2), (0, 0), blocks=10)) == 1 and policy.reason == "load"  # 20% < cache_threshold
    assert policy.pick(aware((1, 3), (0, 0), blocks=10)) == 0 and policy.reason == "cache_hit"


class Observer:
    """What the router's cache view tells cache_aware: the prompt's key; it learns each choice."""

    def __init__(self, key: int | None):
        self.key = key
        self.seen: list[str] = []

    def prompt_key(self) -> int | None:
        return self.key

    def placed(self, candidate: Candidate) -> None:
        self.seen.append(candidate.url)


def test_cache_aware_breaks_ties_by_the_prompt_so_replicas_agree():
    """Two policies with different RNGs (two router replicas): the same choice for each prompt key,
    and over many keys both workers; without a key, at random."""
    a, b = (CacheAwarePolicy(random.Random(seed)) for seed in (1, 2))
    picks = []
    for key in range(40):
        a.observer, b.observer = Observer(key), Observer(key)
        pick = a.pick(aware((0, 0), (0, 0)))
        assert b.pick(aware((0, 0), (0, 0))) == pick and a.reason == "load"
        assert a.observer.seen == [f"http://w{pick}"]
        picks.append(pick)
    assert set(picks) == {0, 1}
    a.observer = Observer(None)
    assert set(Counter(a.pick(aware((0, 0), (0, 0))) for _ in range(100))) == {0, 1}
    a.observer = Observer(7)
    assert a.pick(aware((1, 0), (0, 0))) == 1  # the key only breaks ties: load first
    assert a.pick(aware((0, 2), (0, 9), blocks=10)) == 1 and a.reason == "cache_hit"
