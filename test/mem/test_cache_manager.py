import pytest

from pdserve.engine.request import Req, SamplingParams
from pdserve.mem.cache_manager import KVCacheManager

PS = 4  # page size


def make(num_pages=16, max_reqs=4, context=64, disable=False):
    return KVCacheManager(num_pages, PS, max_reqs, context, disable_radix_cache=disable)


def req(tokens, rid="r"):
    return Req(rid, list(tokens), SamplingParams(max_new_tokens=4))


def prefill(kv, r, n=None):
    """Admit ``r`` against the cache and give it pages for ``n`` tokens (all by default), as computed."""
    n = len(r.fill_ids) if n is None else n
    assert kv.admit(r, r.fill_ids)
    assert kv.grow(r, n)
    r.kv_len = n
    return r


def row_slots(kv, r, n):
    return kv.req_to_token[r.row, :n].tolist()


def test_admit_reserve_release_then_hit():
    kv = make()
    a = prefill(kv, req(range(10)))
    assert len(a.pages) == 3 and a.num_cached_pages == 0 and a.row is not None
    assert row_slots(kv, a, 10) == kv.slots(a, 0, 10)
    kv.check([a])
    kv.release(a, a.kv_len)  # 2 full pages cached, the partial third freed
    assert (a.row, a.pages, a.kv_len, a.cache_node) == (None, [], 0, None)
    assert kv.num_cached_pages == 2 and kv.num_free_pages == 14
    kv.check([])

    b = req(list(range(10)) + [99], "b")
    assert kv.match_len(b.fill_ids) == 8
    assert kv.admit(b, b.fill_ids)
    assert (b.kv_len, b.cached_len, b.num_cached_pages) == (8, 8, 2)
    assert row_slots(kv, b, 8) == kv.slots(b, 0, 8)  # the hit's slots are in b's row already
    assert kv.num_evictable_pages == 0  # locked while b uses them
    assert kv.grow(b, 11)
    assert len(b.pages) == 3 and row_slots(kv, b, 11) == kv.slots(b, 0, 11)
    kv.check([b])
    kv.drop(b)  # nothing of b cached; its prefix stays the cache's, unlocked
    assert kv.num_cached_pages == 2 and kv.num_evictable_pages == 2
    kv.check([])


def test_refusals_take_nothing():
    kv = make(num_pages=4, max_reqs=1)
    a = req(range(8))
    assert kv.admit(a, a.fill_ids)
    assert not kv.admit(req(range(8), "b"), range(8))  # no row left
    assert not kv.grow(a, 20)  # 5 pages > 4
    assert not kv.grow(a, 8, headroom=3)  # 2 pages + 3 kept free > 4
    assert a.pages == [] and kv.num_free_pages == 4
    kv.check([a])
    assert kv.grow(a, 8, headroom=2)
    kv.check([a])
    with pytest.raises(RuntimeError, match="pages of its own"):
        kv.unadmit(a)
    kv.drop(a)
    kv.check([])


def test_unadmit_after_a_refused_grow():
    kv = make(num_pages=2)
    c = prefill(kv, req(range(8)))
    kv.release(c, 8)
    r = req(list(range(8)) + [7] * 9)
    assert kv.admit(r, r.fill_ids)
    assert not kv.grow(r, len(r.fill_ids))
    kv.unadmit(r)
    assert kv.num_evictable_pages == 2 and kv.table.num_free_rows == kv.table.max_reqs
    kv.check([])


def test_grow_each_is_all_or_nothing():
    kv = make(num_pages=3)
    a, b = prefill(kv, req([1] * 4, "a")), prefill(kv, req([2] * 4, "b"))
    assert not kv.grow_each([a, b])  # two pages wanted, one free
    assert len(a.pages) == len(b.pages) == 1
    assert kv.grow_each([a])
    assert len(a.pages) == 2 and kv.num_free_pages == 0
    kv.check([a, b])
    b.kv_len = 3
    loc = kv.write_next_slots([a, b])  # a's position 4 is on its second page
    assert loc == [a.pages[1] * PS, b.pages[0] * PS + 3]
    assert kv.req_to_token[a.row, 4] == loc[0] and kv.req_to_token[b.row, 3] == loc[1]


def test_double_release_fails_loudly():
    kv = make()
    a = prefill(kv, req(range(8)))
    kv.release(a, 8)
    for end in (lambda: kv.release(a, 8), lambda: kv.drop(a), lambda: kv.quarantine(a), lambda: kv.unadmit(a)):
        with pytest.raises(RuntimeError, match="holds no KV memory"):
            end()
    kv.check([])
    b = req(range(4), "b")
    assert kv.admit(b, b.fill_ids)
    with pytest.raises(RuntimeError, match="already holds"):
        kv.admit(b, b.fill_ids)


def test_quarantine_keeps_pages_until_freed_once():
    kv = make()
    c = prefill(kv, req(range(4), "c"))
    kv.release(c, 4)  # one cached page, the prefix of r
    r = req(list(range(4)) + [5] * 8)
    assert kv.admit(r, r.fill_ids[:-1]) and kv.grow(r, len(r.fill_ids) - 1)
    own = r.pages[r.num_cached_pages:]
    assert len(own) == 2
    assert kv.quarantine(r) == own
    assert r.row is None and r.pages == [] and kv.num_quarantined_pages == 2
    assert kv.num_evictable_pages == 1  # the prefix lock went with the request
    kv.check([])  # quarantined pages are still accounted
    assert all(not kv.allocator.is_free(p) for p in own)
    kv.free_quarantined(own[:1])
    kv.check([])
    with pytest.raises(RuntimeError, match="not quarantined"):
        kv.free_quarantined(own)  # own[0] is back in the pool already
    assert kv.num_quarantined_pages == 1  # the refused call changed nothing
    kv.free_quarantined(own[1:])
    assert kv.num_quarantined_pages == 0 and kv.num_free_pages == 15
    kv.check([])


def test_eviction_goes_through_the_owner():
    kv = make(num_pages=4)
    old = prefill(kv, req(range(12), "old"))
    kv.release(old, 12)
    assert kv.num_cached_pages == 3 and kv.num_free_pages == 1
    seen = []
    kv.cache.on_evict = lambda pages: (seen.append(list(pages)), kv._evicted(pages))
    r = req([7] * 12)
    assert kv.admit(r, r.fill_ids) and kv.grow(r, 12)  # one free page, two evicted (LRU leaves first)
    assert len(seen) == 1 and len(seen[0]) == 2 and kv.num_evicted_pages == 2
    assert set(seen[0]) <= set(r.pages) and kv.num_cached_pages == 1
    assert kv.match_len(range(12)) == 4  # the root-side page survives
    kv.check([r])
    kv.cache.check_invariants()


def test_locked_prefix_is_never_evicted():
    kv = make(num_pages=3)
    old = prefill(kv, req(range(8), "old"))
    kv.release(old, 8)
    user = req(range(9), "user")
    assert kv.admit(user, user.fill_ids)  # locks both cached pages
    other = req([5] * 8)
    assert kv.admit(other, other.fill_ids)
    assert not kv.grow(other, 8)  # one free page, nothing evictable
    assert kv.num_cached_pages == 2 and kv.num_evicted_pages == 0
    kv.check([user, other])


def test_flush_refused_while_locked():
    kv = make()
    a = prefill(kv, req(range(8)))
    kv.release(a, 8)
    b = req(range(8), "b")
    assert kv.admit(b, b.fill_ids)
    assert not kv.flush()
    kv.drop(b)
    assert kv.flush() and kv.num_cached_pages == 0 and kv.num_free_pages == 16
    kv.check([])


def test_disabled_cache_frees_on_release():
    kv = make(disable=True)
    a = prefill(kv, req(range(8)))
    kv.release(a, 8)
    assert kv.num_cached_pages == 0 and kv.num_free_pages == 16
    kv.check([])


def test_check_catches_a_leak_and_a_lost_row():
    kv = make()
    a = prefill(kv, req(range(8)))
    with pytest.raises(RuntimeError, match="page accounting broken"):
        kv.check([])  # a's pages are not accounted by anyone
    kv.table.alloc_row()
    with pytest.raises(RuntimeError, match="table rows broken"):
        kv.check([a])
