import pytest

from pdserve.engine import policy
from pdserve.engine.request import Req, SamplingParams


def _req(rid, arrival, retracted=0):
    r = Req(rid, [1, 2, 3], SamplingParams(), arrival=arrival)
    r.num_retractions = retracted
    return r


def test_fcfs_puts_retracted_first_then_arrival():
    a, b, c = _req("a", 0), _req("b", 1), _req("c", 2, retracted=1)
    assert [r.rid for r in policy.order_waiting([b, c, a], "fcfs", lambda r: 0)] == ["c", "a", "b"]


def test_lpm_orders_by_match_then_arrival():
    a, b, c = _req("a", 0), _req("b", 1), _req("c", 2)
    match = {"a": 0, "b": 4, "c": 4}
    assert [r.rid for r in policy.order_waiting([a, b, c], "lpm", lambda r: match[r.rid])] == ["b", "c", "a"]


def test_chunk_len_is_page_aligned_when_split():
    assert policy.chunk_len(10, 32, 0, 16) == 10  # fits: no alignment needed
    assert policy.chunk_len(100, 40, 0, 16) == 32
    assert policy.chunk_len(100, 40, 16, 16) == 32  # 16 + 40 = 56 -> boundary 48
    assert policy.chunk_len(100, 8, 0, 16) == 0  # budget below one page: nothing this step


def test_pages_needed():
    assert policy.pages_needed(17, 1, 16) == 1
    assert policy.pages_needed(16, 1, 16) == 0
    assert policy.pages_needed(0, 0, 4) == 0


def test_pick_retraction_takes_newest():
    rs = [_req("a", 0), _req("b", 5), _req("c", 3)]
    assert policy.pick_retraction(rs).rid == "b"


def test_reserved_pages_counts_expected_growth_beyond_held_pages():
    G = policy.Growth
    # 10 tokens in 3 pages of 4 (room for 2 more); 20 remaining at ratio 0.5 -> 10 more -> 20 tokens -> 5 pages
    assert policy.reserved_pages([G(10, 3, 20)], 0.5, 4) == 2
    assert policy.reserved_pages([G(10, 3, 20)], 1.0, 4) == 5  # 30 tokens -> 8 pages
    # at least the next step's token while any remain, even at a tiny ratio
    assert policy.reserved_pages([G(12, 3, 5)], 0.01, 4) == 1
    assert policy.reserved_pages([G(12, 3, 0)], 1.0, 4) == 0  # finished growing
    assert policy.reserved_pages([G(10, 3, 20), G(12, 3, 5)], 0.5, 4) == 2 + 1  # 12 + 3 = 15 tokens -> 4 pages
    assert policy.reserved_pages([], 1.0, 4) == 0
    clip = policy.RESERVE_CLIP_TOKENS
    assert policy.reserved_pages([G(0, 0, 10 * clip)], 1.0, 1) == clip  # a huge budget counts as the clip


def test_new_token_ratio_decays_to_floor_jumps_on_retraction_and_resets_when_idle():
    r = policy.NewTokenRatio(init=0.5, floor=0.2, decay_per_step=0.1, after_retract=1.0)
    assert r.value == 0.5
    for _ in range(10):
        r.decay()
    assert r.value == 0.2
    r.on_retract()
    assert r.value == 1.0
    r.decay()
    assert abs(r.value - 0.9) < 1e-9
    r.on_idle()
    assert r.value == 0.5


def test_new_token_ratio_refuses_inconsistent_bounds():
    with pytest.raises(ValueError, match="new token ratio"):
        policy.NewTokenRatio(init=0.05, floor=0.1)


# ------------------------------------------------------------ fair admission between API calls
def _seq(rid, arrival, group, retracted=0):
    r = _req(rid, arrival, retracted)
    r.group = group
    return r


def test_a_later_call_takes_turns_with_a_big_one_instead_of_waiting_behind_it():
    """One call's sequences (a batch of prompts, n samples) share a group; the k-th waiting one of a
    group ranks as if k of its own went first, so a later call of one sequence is not queued behind
    all of them."""
    big = [_seq(f"big{i}", i, "big") for i in range(5)]
    small = _seq("small", 5, "small")
    order = policy.order_waiting(big + [small], "fcfs", lambda r: 0)
    assert [r.rid for r in order] == ["big0", "small", "big1", "big2", "big3", "big4"]


def test_a_group_with_sequences_admitted_already_yields_its_turn():
    big = [_seq(f"big{i}", i, "big") for i in range(3)]
    small = _seq("small", 3, "small")
    order = policy.order_waiting(big + [small], "fcfs", lambda r: 0, admitted={"big": 4})
    assert [r.rid for r in order] == ["small", "big0", "big1", "big2"]
    # the same under lpm, where turns come before the cached prefix
    order = policy.order_waiting(big + [small], "lpm", lambda r: 10 if r.rid.startswith("big") else 0,
                                 admitted={"big": 4})
    assert [r.rid for r in order] == ["small", "big0", "big1", "big2"]


def test_calls_of_one_sequence_keep_arrival_order():
    """One sequence per call (or no group: the offline Engine): the order is FCFS (or LPM) as before."""
    seqs = [_seq("a", 0, "g0"), _seq("b", 1, "g1"), _seq("c", 2, None), _seq("d", 3, "g3", retracted=1)]
    assert [r.rid for r in policy.order_waiting(seqs, "fcfs", lambda r: 0)] == ["d", "a", "b", "c"]
    match = {"a": 0, "b": 4, "c": 2, "d": 0}
    assert [r.rid for r in policy.order_waiting(seqs, "lpm", lambda r: match[r.rid])] == ["b", "c", "a", "d"]


def test_group_turns_count_admitted_then_arrival_within_the_group():
    a0, a1, b0 = _seq("a0", 0, "a"), _seq("a1", 1, "a"), _seq("b0", 2, "b")
    loner = _seq("x", 3, None)
    turns = policy.group_turns([a1, b0, a0, loner], {"a": 2, "b": 0})
    assert [turns[r] for r in (a0, a1, b0, loner)] == [2, 3, 0, 0]
