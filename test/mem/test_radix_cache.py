import random

import pytest

from pdserve.mem.allocator import PageAllocator
from pdserve.mem.radix_cache import RadixCache, hash_block, hash_chain


class Harness:
    """Allocator + cache + the pages callers hold, with the page-conservation check. It frees
    what the cache returns (as ``KVCacheManager`` does): the cache itself never frees a page."""

    def __init__(self, num_pages=64, page_size=4, disable=False):
        self.alloc = PageAllocator(num_pages)
        self.cache = RadixCache(self.alloc, page_size, disable=disable)
        self.page_size = page_size
        self.held: set[int] = set()

    def take(self, n):
        pages = self.alloc.alloc(n)
        assert pages is not None
        self.held.update(pages)
        return pages

    def insert(self, tokens, pages, salt=""):
        result = self.cache.insert(tokens, pages, salt)
        self.alloc.free(result.released)
        self.held.difference_update(pages)  # the cache owns them now, or they are free again
        self.check()
        return result.num_new

    def evict(self, n):
        pages = self.cache.evict(n)
        self.alloc.free(pages)
        return len(pages)

    def reset(self):
        pages = self.cache.reset()
        if pages is None:
            return False
        self.alloc.free(pages)
        return True

    def check(self):
        assert self.alloc.num_free + self.cache.num_cached_pages + len(self.held) == self.alloc.num_pages
        self.cache.check_invariants()


def seq(n, start=0):
    return list(range(start, start + n))


@pytest.mark.parametrize("page_size", [1, 4])
def test_match_and_insert(page_size):
    h = Harness(page_size=page_size)
    tokens = seq(5 * page_size, 100)
    assert h.cache.match_prefix(tokens).num_tokens == 0
    pages = h.take(5)
    assert h.insert(tokens, pages) == 5
    m = h.cache.match_prefix(tokens)
    assert m.pages == pages and m.num_tokens == 5 * page_size
    m = h.cache.match_prefix(tokens[:3 * page_size] + [9999] * page_size)
    assert m.pages == pages[:3] and m.num_tokens == 3 * page_size
    assert h.cache.match_prefix([9999] + tokens).pages == []
    assert h.cache.num_cached_pages == 5


def test_partial_tail_is_ignored():
    h = Harness(page_size=4)
    tokens = seq(8)
    h.insert(tokens, h.take(2))
    m = h.cache.match_prefix(tokens + [1, 2, 3])  # 3-token tail cannot match a page
    assert m.num_tokens == 8
    assert h.cache.match_prefix(tokens[:7]).num_tokens == 4
    assert h.cache.match_prefix(tokens[:3]).num_tokens == 0
    assert len(h.cache.block_hashes(tokens + [1, 2, 3])) == 2


def test_insert_requires_full_pages():
    h = Harness(page_size=4)
    pages = h.take(2)
    with pytest.raises(ValueError, match="full pages"):
        h.cache.insert(seq(7), pages)
    assert h.cache.num_cached_pages == 0  # rejected call took nothing
    h.insert(seq(8), pages)


def test_insert_extends_a_cached_prefix_with_the_same_pages():
    h = Harness(page_size=2)
    first = h.take(2)
    h.insert(seq(4), first)
    m = h.cache.match_prefix(seq(8))
    assert m.pages == first
    h.cache.lock(m.node)
    new = h.take(2)
    # Borrowed pages go back in as "same page" blocks: left as is, not freed.
    assert h.insert(seq(8), m.pages + new) == 2
    h.cache.unlock(m.node)
    h.check()
    assert h.cache.match_prefix(seq(8)).pages == first + new
    assert h.alloc.num_free == 64 - 4


def test_duplicate_insert_frees_the_duplicate_page():
    h = Harness(page_size=4)
    a = h.take(2)
    h.insert(seq(8), a)
    b = h.take(3)  # another request computed the same 2 blocks plus one more
    free_before = h.alloc.num_free
    assert h.insert(seq(12), b) == 1
    assert h.alloc.num_free == free_before + 2
    assert all(h.alloc.is_free(p) for p in b[:2])
    assert h.cache.match_prefix(seq(12)).pages == a + [b[2]]


def test_insert_rejects_pages_it_cannot_own():
    h = Harness(page_size=1)
    p = h.take(2)
    h.insert([1, 2], p)
    q = h.take(1)
    with pytest.raises(ValueError, match="already owned"):
        h.cache.insert([7, 8], [q[0], p[0]])  # p[0] belongs to the cache for another block
    with pytest.raises(ValueError, match="twice"):
        h.cache.insert([7, 8], [q[0], q[0]])
    h.alloc.free(q)
    h.held.clear()
    with pytest.raises(ValueError, match="free in the allocator"):
        h.cache.insert([7], q)
    h.check()


def test_lock_prevents_eviction():
    h = Harness(page_size=1)
    h.insert(seq(3), h.take(3))
    m = h.cache.match_prefix(seq(3))
    h.cache.lock(m.node)
    assert h.cache.num_evictable_pages == 0
    assert h.evict(10) == 0
    h.cache.lock(m.node)
    h.cache.unlock(m.node)
    assert h.evict(10) == 0
    h.cache.unlock(m.node)
    assert h.cache.num_evictable_pages == 3
    assert h.evict(10) == 3
    h.check()
    assert h.alloc.num_free == 64


def test_lock_on_inner_node_protects_ancestors_only():
    h = Harness(page_size=1)
    h.insert(seq(4), h.take(4))
    m = h.cache.match_prefix(seq(2))
    h.cache.lock(m.node)
    assert h.cache.num_evictable_pages == 2
    assert h.evict(10) == 2  # the two blocks below the locked node
    assert h.cache.match_prefix(seq(4)).num_tokens == 2
    h.cache.unlock(m.node)
    h.check()


def test_unlock_below_zero_raises():
    h = Harness(page_size=1)
    h.insert(seq(2), h.take(2))
    m = h.cache.match_prefix(seq(2))
    with pytest.raises(RuntimeError, match="not locked"):
        h.cache.unlock(m.node)
    with pytest.raises(RuntimeError, match="not locked"):
        h.cache.unlock(h.cache.root)
    h.check()


def test_the_cache_returns_pages_and_never_frees_them():
    h = Harness(page_size=2)
    a = h.take(3)
    h.insert(seq(6), a)
    b = h.take(3)  # the same three blocks computed again
    assert h.cache.insert(seq(6), b).released == b
    assert not any(h.alloc.is_free(p) for p in b)  # returned, not freed: the caller frees
    h.alloc.free(b)
    h.held.difference_update(b)
    evicted = h.cache.evict(2)
    assert evicted == a[1:][::-1] and not any(h.alloc.is_free(p) for p in evicted)
    h.alloc.free(evicted)
    assert h.cache.reset() == [a[0]] and not h.alloc.is_free(a[0])
    h.alloc.free([a[0]])
    h.check()


def test_locking_an_evicted_node_raises():
    h = Harness(page_size=1)
    h.insert(seq(2), h.take(2))
    m = h.cache.match_prefix(seq(2))
    h.evict(1)
    with pytest.raises(RuntimeError, match="no longer in the cache"):
        h.cache.lock(m.node)
    h.check()


def test_lru_order():
    h = Harness(page_size=2)
    for start in (0, 100, 200):  # three disjoint 1-page sequences
        h.insert(seq(2, start), h.take(1))
    h.cache.match_prefix(seq(2, 0))  # 0 is now the most recent, 100 the least
    assert h.evict(1) == 1
    assert h.cache.match_prefix(seq(2, 100)).num_tokens == 0
    assert h.cache.match_prefix(seq(2, 0)).num_tokens == 2  # touches 0 again
    assert h.evict(1) == 1
    assert h.cache.match_prefix(seq(2, 200)).num_tokens == 0
    assert h.cache.match_prefix(seq(2, 0)).num_tokens == 2
    h.check()


def test_evict_cascades_to_parents():
    h = Harness(page_size=1)
    h.insert([1, 2, 3], h.take(3))  # chain 1-2-3, oldest
    h.insert([9], h.take(1))  # newer leaf
    assert h.evict(3) == 3  # the whole old chain goes before the newer leaf
    assert h.cache.match_prefix([1]).num_tokens == 0
    assert h.cache.match_prefix([9]).num_tokens == 1
    h.check()


def test_evict_shared_prefix_parent_waits_for_all_children():
    h = Harness(page_size=1)
    h.insert([1, 2], h.take(2))
    h.insert([1, 3], h.take(2))  # block [1] is a duplicate
    assert h.cache.num_cached_pages == 3
    assert h.evict(2) == 2  # two leaves, parent [1] stays
    assert h.cache.match_prefix([1]).num_tokens == 1
    assert h.evict(5) == 1
    assert h.cache.num_cached_pages == 0
    h.check()


def test_reset_refused_while_locked():
    h = Harness(page_size=2)
    h.insert(seq(6), h.take(3))
    m = h.cache.match_prefix(seq(4))
    h.cache.lock(m.node)
    assert h.reset() is False
    assert h.cache.num_cached_pages == 3
    h.cache.unlock(m.node)
    assert h.reset() is True
    assert h.cache.num_cached_pages == 0
    assert h.alloc.num_free == 64
    with pytest.raises(RuntimeError, match="no longer in the cache"):
        h.cache.lock(m.node)
    h.check()


def test_root_lock_survives_reset():
    h = Harness(page_size=2)
    h.insert(seq(4), h.take(2))
    miss = h.cache.match_prefix([7, 7])
    assert miss.node is h.cache.root
    h.cache.lock(miss.node)
    assert h.cache.num_evictable_pages == 2
    assert h.reset() is True  # no cached page is locked
    h.cache.unlock(miss.node)
    h.check()


def test_disabled_cache_matches_nothing_and_frees_inserted_pages():
    h = Harness(page_size=2, disable=True)
    assert h.insert(seq(4), h.take(2)) == 0
    assert h.alloc.num_free == 64
    m = h.cache.match_prefix(seq(4))
    assert m.pages == [] and m.num_tokens == 0
    h.cache.lock(m.node)
    h.cache.unlock(m.node)
    assert h.cache.num_cached_pages == 0


def test_hashes_are_stable_and_chained():
    h = Harness(page_size=4)
    a = seq(16)
    ha = h.cache.block_hashes(a)
    assert len(ha) == 4 and len(set(ha)) == 4
    assert ha == RadixCache(PageAllocator(1), 4).block_hashes(a)
    # Pinned value: the hash must not change across processes or versions (a tiered pool keys on it).
    assert ha[0] == hash_block(0, [0, 1, 2, 3]) == 0x52263D4E44FF75FF
    b = list(a)
    b[13] = 999  # differs in the last block only
    hb = h.cache.block_hashes(b)
    assert hb[:3] == ha[:3] and hb[3] != ha[3]
    c = list(a)
    c[1] = 999  # differs in the first block: every later hash changes
    hc = h.cache.block_hashes(c)
    assert all(x != y for x, y in zip(ha, hc))
    assert h.cache.block_hashes(a[4:8]) != ha[1:2]  # same block at another depth, another hash


@pytest.mark.parametrize("key", [b"", b"k" * 32])
def test_hash_chain_is_hash_block_chained(key):
    """The one-pass chain (what insert hashes with) is the slow twin's fold, blocks of mixed lengths too."""
    rng = random.Random(7)
    blocks = [[rng.randrange(-2**31, 2**31) for _ in range(n)] for n in (1, 1, 4, 4, 2, 1)]
    h, expect = 99, []
    for b in blocks:
        h = hash_block(h, b, key)
        expect.append(h)
    assert hash_chain(99, blocks, key) == expect
    assert hash_chain(99, [], key) == []
    with pytest.raises(ValueError, match="int32"):
        hash_chain(0, [[2**31]], key)


def test_node_hashes_match_block_hashes():
    h = Harness(page_size=2)
    tokens = seq(10, 5)
    h.insert(tokens, h.take(5))
    m = h.cache.match_prefix(tokens)
    chain, node = [], m.node
    while node is not h.cache.root:
        chain.append(node.hash)
        node = node.parent
    assert chain[::-1] == h.cache.block_hashes(tokens)


def test_accepts_tensor_token_ids():
    import torch

    h = Harness(page_size=2)
    h.insert(torch.arange(6), h.take(3))
    assert h.cache.match_prefix(torch.arange(6)).num_tokens == 6
    assert h.cache.block_hashes(torch.arange(6)) == h.cache.block_hashes(list(range(6)))


def test_evict_thousands_of_nodes_is_fast():
    import time

    h = Harness(num_pages=8192, page_size=1)
    rng = random.Random(0)
    for _ in range(1000):
        toks = [rng.randrange(50) for _ in range(8)]
        m = h.cache.match_prefix(toks)
        h.alloc.free(h.cache.insert(toks, m.pages + h.alloc.alloc(8 - m.num_tokens)).released)
    assert h.cache.num_cached_pages > 5000
    h.check()
    t = time.perf_counter()
    while h.evict(7):
        pass
    assert time.perf_counter() - t < 2.0
    assert h.cache.num_cached_pages == 0 and h.alloc.num_free == 8192


@pytest.mark.parametrize("seed,page_size", [(0, 1), (1, 2), (2, 4)])
def test_randomized_page_conservation(seed, page_size):
    """Requests match, lock, allocate, insert and unlock under memory pressure; after every
    op free + cached + held == total, and the allocator would catch any double free."""
    rng = random.Random(seed)
    h = Harness(num_pages=48, page_size=page_size)
    prefixes = [[rng.randrange(6) for _ in range(rng.randrange(1, 6) * page_size)] for _ in range(4)]
    running = []  # (tokens, borrowed match, own pages)
    for _ in range(400):
        op = rng.random()
        if op < 0.45:
            tokens = rng.choice(prefixes) + [rng.randrange(6) for _ in range(rng.randrange(0, 12))]
            m = h.cache.match_prefix(tokens)
            h.cache.lock(m.node)
            need = len(tokens) // page_size - len(m.pages)
            if h.alloc.num_free < need:
                h.evict(need - h.alloc.num_free)
            own = h.alloc.alloc(need)
            if own is None:
                h.cache.unlock(m.node)
            else:
                h.held.update(own)
                running.append((tokens, m, own))
        elif op < 0.85 and running:
            tokens, m, own = running.pop(rng.randrange(len(running)))
            full = len(tokens) // page_size * page_size
            h.insert(tokens[:full], m.pages + own)  # borrowed pages come back as "same page"
            h.cache.unlock(m.node)
        elif op < 0.95:
            h.evict(rng.randrange(1, 8))
        else:
            locked = bool(running)
            assert h.reset() is (not locked or all(r[1].node is h.cache.root for r in running))
        h.check()
        assert h.cache.num_evictable_pages <= h.cache.num_cached_pages
    for _tokens, m, own in running:
        h.alloc.free(own)
        h.held.difference_update(own)
        h.cache.unlock(m.node)
    h.check()
    assert h.reset()
    assert h.alloc.num_free == h.alloc.num_pages


# ---- cache isolation (cache_salt) ----------------------------------------------------
def test_different_salts_never_share_a_prefix_page():
    """vLLM's cache_salt: a request matches only pages its own salt inserted; the same prompt under
    another salt (or none) is a miss, the same salt a hit, and each salt's chain has its own hashes."""
    h = Harness()
    prompt = seq(16, 300)
    assert h.insert(prompt, h.take(4), salt="tenant-a") == 4
    assert h.cache.match_prefix(prompt, "tenant-a").num_tokens == 16  # same salt: hit
    assert h.cache.match_prefix(prompt, "tenant-b").num_tokens == 0  # another salt: miss
    assert h.cache.match_prefix(prompt).num_tokens == 0  # unsalted: miss
    assert h.insert(prompt, h.take(4)) == 4  # unsalted copy: new pages, not a duplicate
    assert h.insert(prompt, h.take(4), salt="tenant-b") == 4
    chains = [h.cache.block_hashes(prompt, salt) for salt in ("", "tenant-a", "tenant-b")]
    assert len({x for c in chains for x in c}) == 12  # no block hash shared between the trees
    assert sorted(hh for hh, _ in h.cache.cached_blocks()) == sorted(x for c in chains for x in c)
    assert all(p is None for hh, p in h.cache.cached_blocks() if hh in {c[0] for c in chains})


def test_a_salted_tree_locks_evicts_and_goes_when_empty():
    h = Harness(num_pages=8)
    prompt = seq(8, 50)
    h.insert(prompt, h.take(2), salt="s")
    m = h.cache.match_prefix(prompt, "s")
    h.cache.lock(m.node)
    assert h.evict(8) == 0  # locked
    h.cache.unlock(m.node)
    assert h.evict(8) == 2
    h.check()  # the empty salted root went with its last page
    assert h.cache.match_prefix(prompt, "s").num_tokens == 0
    miss = h.cache.match_prefix(prompt, "s")
    h.cache.lock(miss.node)  # a miss locks the default root, which never goes
    h.insert(prompt, h.take(2), salt="s")
    h.cache.unlock(miss.node)
    assert h.reset() and h.cache.match_prefix(prompt, "s").num_tokens == 0
    h.check()
