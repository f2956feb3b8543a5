"""The radix cache's KV events: what insert, evict and reset report, with the hashes a router
computes from token ids alone (``router.kv_index``), and an index fed by them agreeing with the tree."""

from __future__ import annotations

import pytest

from pdserve.mem.allocator import PageAllocator
from pdserve.mem.radix_cache import RadixCache
from pdserve.obs.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBuffer, event_dict
from pdserve.router.kv_index import KVIndex, prompt_block_hashes

PAGE = 4


def cache_with_events(num_pages: int = 16) -> tuple[RadixCache, EventBuffer]:
    sink = EventBuffer()
    return RadixCache(PageAllocator(num_pages), PAGE, sink=sink), sink


def insert(cache: RadixCache, tokens: list[int]) -> None:
    pages = cache.allocator.alloc(len(tokens) // PAGE)
    assert pages is not None
    cache.allocator.free(cache.insert(tokens, pages).released)  # the caller frees what the cache returns


def evict(cache: RadixCache, n: int) -> int:
    pages = cache.evict(n)
    cache.allocator.free(pages)
    return len(pages)


def test_insert_reports_the_new_blocks_chained_from_the_cached_parent():
    cache, sink = cache_with_events()
    insert(cache, list(range(8)))
    insert(cache, list(range(12)))  # two blocks cached already: one new block
    first, second = sink.take()
    assert first == BlockStored(cache.block_hashes(range(8)), None, list(range(8)), PAGE)
    assert second.parent_block_hash == first.block_hashes[-1]
    assert second.block_hashes == cache.block_hashes(range(12))[2:] and second.token_ids == [8, 9, 10, 11]
    assert event_dict(second)["type"] == "BlockStored" and second.medium == "GPU"
    insert(cache, list(range(8)))  # nothing new: no event
    assert sink.take() == []


def test_evict_and_reset_report_what_left():
    cache, sink = cache_with_events()
    insert(cache, list(range(12)))
    insert(cache, [7] * 4)
    sink.take()
    assert evict(cache, 2) == 2
    (removed,) = sink.take()
    assert isinstance(removed, BlockRemoved) and len(removed.block_hashes) == 2
    pages = cache.reset()
    assert pages is not None
    cache.allocator.free(pages)
    assert sink.take() == [AllBlocksCleared("GPU")]


def test_router_hashes_match_and_an_index_follows_the_tree():
    """A router hashing prompt[:-1] by pages gets the server's block hashes; an index fed the events
    holds exactly the blocks of ``cached_blocks`` (the snapshot's content)."""
    cache, sink = cache_with_events(8)
    index, seq = KVIndex(), 0
    index.load_snapshot({"seq": 0, "blocks": []})
    prompts = [list(range(13)), list(range(9)) + [50] * 4, [9] * 17, list(range(100, 125))]
    for tokens in prompts:
        if not cache.allocator.num_free >= len(tokens) // PAGE:
            evict(cache, len(tokens) // PAGE)
        insert(cache, tokens[:len(tokens) // PAGE * PAGE])
        seq += 1
        assert index.apply(seq, [event_dict(e) for e in sink.take()])
        assert index.blocks["GPU"] == {h for h, _ in cache.cached_blocks()}
    assert prompt_block_hashes(prompts[-1], PAGE) == cache.block_hashes(prompts[-1][:24])
    assert index.matched_blocks(prompt_block_hashes(prompts[-1], PAGE)) == 6


def test_index_refuses_a_gap_and_skips_what_a_snapshot_covers():
    index = KVIndex()
    assert not index.apply(1, [])  # nothing known yet: resync first
    index.load_snapshot({"seq": 5, "blocks": [{"block_hash": 1, "parent_block_hash": None}]})
    assert index.apply(4, [{"type": "AllBlocksCleared", "medium": None}])  # already in the snapshot: skipped
    assert index.blocks == {"GPU": {1}}
    assert not index.apply(7, [])  # batch 6 was lost
    assert index.apply(6, [{"type": "BlockStored", "block_hashes": [2], "medium": "GPU"}])
    assert index.matched_blocks([1, 2, 3]) == 2
    with pytest.raises(ValueError, match="unknown type"):
        index.apply(7, [{"type": "Nonsense"}])
