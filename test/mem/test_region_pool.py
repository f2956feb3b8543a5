"""RegionKVPool's bounded layout (DeepSeek-V4's window and open windows as per-request records, tails
kept at reusable boundaries; docs/kv-cache.md "The bounded layout"), driven by hand: every row holds
its position, so a read says exactly which rows it got."""

from __future__ import annotations

import pytest
import torch

from pdserve.mem.allocator import PageAllocator
from pdserve.mem.radix_cache import RadixCache
from pdserve.mem.region_pool import BoundedState, RegionKVPool, RegionSpec

S, W, REUSE = 4, 6, 32  # page size, window (a ring of W - 1 rows and a tail of W - 1), reusable boundary


def _pool(rollback: int = 0) -> RegionKVPool:
    bounded = BoundedState({"win": W - 1 + rollback}, {"win": W - 1}, REUSE, record_slots=2)
    return RegionKVPool(40, S, 1, (RegionSpec("win", (0,), 2),), torch.float32, bounded=bounded)


def _slots(pages: list[int]) -> torch.Tensor:
    return torch.tensor([p * S + o for p in pages for o in range(S)])


def _rows(lo: int, hi: int) -> torch.Tensor:
    return torch.arange(lo, hi, dtype=torch.float32)[:, None].expand(-1, 2)


def _step(pool: RegionKVPool, slots: torch.Tensor, p0: int, n: int, row: int = 0) -> torch.Tensor:
    """One step of positions p0..p0+n-1: the rows before it (the window's), then its own kept."""
    io = pool.request_state(0, slots, p0, n, row)
    prior = io.prior("win", max(0, p0 - W + 1))
    io.keep("win", _rows(p0, p0 + n))
    io.done()
    return prior[:, 0]


def test_ring_gives_each_step_the_window_before_it_and_nothing_is_kept_per_token():
    pool = _pool()
    assert "win" not in pool.buffers and pool.records["win"].shape == (1, 2, W - 1, 2)
    assert pool.buffers["win_tail"].shape == (1, 40, 1, 2)  # ceil(5 * 4 / 32) = 1 tail row a page
    slots = _slots(list(range(39, 19, -1)))  # 80 positions on pages given in reverse
    p0 = 0
    for n in (3, 1, 9, 1, 1, 20, 7):  # prefill chunks longer and shorter than the ring, decode steps
        got = _step(pool, slots, p0, n)
        assert got.tolist() == list(range(max(0, p0 - W + 1), p0))
        p0 += n


def test_a_request_resumes_at_a_boundary_from_its_tail_and_nowhere_else():
    pool = _pool()
    slots = _slots(list(range(20)))
    for p0 in range(0, 2 * REUSE + 3, 5):
        _step(pool, slots, p0, 5)
    pool.take_row(0)  # the row's next owner shares the first 2 blocks (a radix hit)
    assert _step(pool, slots, 2 * REUSE, 4).tolist() == list(range(2 * REUSE - W + 1, 2 * REUSE))
    pool.take_row(0)
    with pytest.raises(RuntimeError, match=r"starting at position 36 has neither its own record .* nor a reusable "
                                           r"boundary \(multiples of 32\)"):
        _step(pool, slots, REUSE + 4, 1)


def test_a_rolled_back_step_reads_its_window_from_a_ring_with_room_for_it():
    """A speculative verify writes k + 1 rows and keeps fewer: with ``rollback`` rows more in the ring the
    next step still finds its window; without them it raises instead of reading a rejected row."""
    for rollback, ok in ((3, True), (0, False)):
        pool = _pool(rollback)
        slots = _slots(list(range(10)))
        _step(pool, slots, 0, 10)
        _step(pool, slots, 10, 4)  # verify: 1 + 3 drafts, of which only position 10 is accepted
        if ok:
            assert _step(pool, slots, 11, 4).tolist() == list(range(6, 11))
        else:
            with pytest.raises(RuntimeError, match="needs rows from position 6, its ring of 5 holds them from 9"):
                _step(pool, slots, 11, 4)


def test_radix_hits_are_shortened_to_the_pools_reusable_boundary():
    alloc = PageAllocator(40)
    cache = RadixCache(alloc, S, reuse_tokens=REUSE)
    tokens = list(range(3 * REUSE - 4))
    pages = alloc.alloc(len(tokens) // S)
    cache.insert(tokens, pages)
    assert cache.match_prefix(tokens).num_tokens == 2 * REUSE
    assert cache.match_prefix(tokens[:REUSE + 12]).num_tokens == REUSE
    assert cache.match_prefix(tokens[:REUSE - 1]).num_tokens == 0
    with pytest.raises(ValueError, match="reuse_tokens: 30 is not a multiple of page_size 4"):
        RadixCache(alloc, S, reuse_tokens=30)
