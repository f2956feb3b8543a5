import ast
import sys
from pathlib import Path

import pytest
import torch

from pdserve.config import HiCacheConfig
from pdserve.engine.request import Req, SamplingParams
from pdserve.mem import cache_manager
from pdserve.mem.allocator import PageAllocator
from pdserve.mem.cache_manager import KVCacheManager
from pdserve.mem.kv_pool import GQAKVPool

MEM = Path(cache_manager.__file__).parent
# The only modules that may free device pages: the allocator and its one owner.
FREES_DEVICE_PAGES = {"allocator.py", "cache_manager.py"}
# The host pool's pages belong to the hierarchical cache, its only user: it frees them itself.
HOST_ALLOCATOR = "self.host.allocator"

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


def test_a_quarantined_row_stays_out_of_use_until_freed_with_the_pages():
    """A row whose per-request record a late P/D write may still reach (keep_row) is not handed to the
    next request; it comes back with the pages, once."""
    kv = make(max_reqs=2)
    r = prefill(kv, req(range(8)))
    row, own = r.row, r.pages[r.num_cached_pages:]
    assert kv.quarantine(r, keep_row=True) == own and r.row is None
    kv.check([])  # the kept row is accounted
    a = req(range(20, 24), "a")
    assert kv.admit(a, a.fill_ids) and a.row != row
    assert not kv.admit(req(range(30, 34), "b"), range(30, 34))  # the other row is still quarantined
    kv.free_quarantined(own, row=row)
    kv.check([a])
    with pytest.raises(RuntimeError, match=f"table row {row} is not quarantined"):
        kv.free_quarantined([], row=row)
    b = req(range(30, 34), "b")
    assert kv.admit(b, b.fill_ids) and b.row == row


def test_eviction_goes_through_the_owner():
    kv = make(num_pages=4)
    old = prefill(kv, req(range(12), "old"))
    kv.release(old, 12)
    assert kv.num_cached_pages == 3 and kv.num_free_pages == 1
    seen = []
    evict = kv.cache.evict
    kv.cache.evict = lambda n: seen.append(evict(n)) or seen[-1]  # type: ignore[method-assign]
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


def test_evicted_pages_come_back_through_the_manager():
    kv = make(num_pages=4)
    old = prefill(kv, req(range(12), "old"))
    pages = list(old.pages)
    kv.release(old, 12)
    assert kv.evict(2) == 2 and kv.num_evicted_pages == 2  # the two deepest blocks, LRU leaves first
    assert kv.allocator.is_free(pages[2]) and kv.allocator.is_free(pages[1]) and kv.num_cached_pages == 1
    kv.check([])
    # The cache alone takes the page out of the tree but frees nothing: were the manager to drop
    # what eviction returns, the page would be lost, and the accounting says so.
    assert kv.cache.evict(1) == [pages[0]] and not kv.allocator.is_free(pages[0])
    with pytest.raises(RuntimeError, match="page accounting broken"):
        kv.check([])


def _device_allocator_frees(path: Path) -> list[str]:
    """``<...>allocator.free`` in ``path``, called or passed on (a bound method handed to a cache
    frees as surely as a call); the host pool's allocator is not the device's."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr == "free":
            owner = ast.unparse(node.value)
            if owner.endswith("allocator") and owner != HOST_ALLOCATOR:
                found.append(f"{path.relative_to(MEM)}:{node.lineno} {owner}.free")
    return found


def test_only_the_manager_frees_device_pages_in_mem():
    found = [hit for path in sorted(MEM.rglob("*.py")) if path.name not in FREES_DEVICE_PAGES
             for hit in _device_allocator_frees(path)]
    assert found == [], "the caches return pages for KVCacheManager to free; these free them directly"
    assert _device_allocator_frees(MEM / "cache_manager.py")  # the check sees the frees that must be there


class _RecordingAllocator(PageAllocator):
    """Notes the module of every ``free`` caller."""

    def __init__(self, num_pages: int) -> None:
        super().__init__(num_pages)
        self.callers: list[str] = []

    def free(self, pages) -> None:
        self.callers.append(Path(sys._getframe(1).f_code.co_filename).name)
        super().free(pages)


def _hicache_manager(num_pages: int = 16) -> KVCacheManager:
    pool = GQAKVPool(num_pages, 2, 1, 1, 4, torch.float32)
    return KVCacheManager(num_pages, 2, 4, 64, hicache=HiCacheConfig(enabled=True), pool=pool)


def _served(kv, tokens, rid):
    r = Req(rid, list(tokens), SamplingParams(max_new_tokens=4), uid=hash(rid) % 1000)
    assert kv.prepare(r, tokens) and kv.admit(r, tokens) and kv.grow(r, len(tokens))
    r.kv_len = len(tokens)
    return r


def _radix_workload():
    kv = make(num_pages=5)
    a, b = prefill(kv, req(range(8), "a")), prefill(kv, req(range(8), "b"))  # the same blocks, twice
    kv.release(a, 8)
    kv.release(b, 8)  # b's pages duplicate a's: returned by insert, freed by the manager
    c = prefill(kv, req([9] * 16, "c"))  # four pages: three free, one evicted
    kv.free_quarantined(kv.quarantine(c))
    d = prefill(kv, req([5] * 8, "d"))
    kv.drop(d)
    assert kv.num_evicted_pages == 1 and kv.flush()
    kv.check([])
    return kv


def _hicache_workload():
    kv = _hicache_manager()
    tokens = list(range(3, 15))  # 6 pages of 2
    first = _served(kv, tokens, "first")
    kv.release(first, len(tokens))
    assert kv.evict(6) == 6  # on host only now
    hi = kv.hicache
    assert hi is not None
    gate = _delay_next_load(hi)
    waiting = Req("waiting", list(tokens), SamplingParams(max_new_tokens=4), uid=1)
    assert not kv.prepare(waiting, tokens)  # its load-back is in flight
    again = Req("again", list(tokens), SamplingParams(max_new_tokens=4), uid=2)
    assert kv.admit(again, tokens) and kv.grow(again, len(tokens))  # recomputes the same blocks meanwhile
    again.kv_len = len(tokens)
    kv.release(again, len(tokens))
    gate.landed = True
    hi.poll()  # as an eviction's poll would: the load lands, its copies are redundant
    assert kv.pages_held([]) == 6  # held by the load until the manager frees them, and counted meanwhile
    kv.check([])
    assert kv.prepare(waiting, tokens) and kv.admit(waiting, tokens)
    assert waiting.cached_len == len(tokens)
    kv.drop(waiting)
    assert kv.flush()
    kv.check([])
    return kv


class _Gate:
    def __init__(self) -> None:
        self.landed = False

    def query(self) -> bool:
        return self.landed

    def synchronize(self) -> None:
        self.landed = True


def _delay_next_load(hi):
    """The next load-back lands only once the returned gate opens (a slow device copy)."""
    real, gate = hi.host.load, _Gate()

    def load(host_pages, device_pages):
        hi.host.load = real
        op = real(host_pages, device_pages)
        op.event = gate
        return op

    hi.host.load = load
    return gate


@pytest.mark.parametrize("workload", [_radix_workload, _hicache_workload])
def test_every_device_page_is_freed_by_the_manager(monkeypatch, workload):
    monkeypatch.setattr(cache_manager, "PageAllocator", _RecordingAllocator)
    kv = workload()
    assert kv.allocator.num_free == kv.num_pages
    callers = kv.allocator.callers
    assert len(callers) >= 5 and set(callers) == {"cache_manager.py"}, callers
