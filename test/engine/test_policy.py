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
