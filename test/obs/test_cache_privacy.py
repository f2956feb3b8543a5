"""Cache privacy: what the KV block hashes (snapshot, events) tell whoever reads them.

The attack of issue 33: with page size 1 a block is one token, so a reader of an unkeyed hash
chain tries every token of the vocabulary against each hash and its parent's, and reads the
cached prompt back token by token. Keyed (``--kv-hash-key-file``), the same attack finds nothing.
"""

from __future__ import annotations

from pdserve.mem.allocator import PageAllocator
from pdserve.mem.radix_cache import ROOT_HASH, RadixCache, hash_block
from pdserve.obs.kv_events import BlockStored, EventBuffer
from pdserve.router.kv_index import prompt_block_hashes

VOCAB = 2000
SECRET_PROMPT = [1, 734, 4, 1503, 88, 12, 1999, 0, 417, 417]  # "My bank PIN is 4417 ..." as token ids
KEY = bytes(range(32))


def rebuild(blocks: list[tuple[int, int | None]], guess_key: bytes = b"") -> list[int]:
    """The attacker: each block's token, found by trying the vocabulary against the block's hash and
    its parent's (hashing as the attacker believes the server does). Stops at the first miss."""
    by_parent = {(p if p is not None else ROOT_HASH): h for h, p in blocks}
    tokens, h = [], ROOT_HASH
    while h in by_parent:
        child = by_parent[h]
        found = next((t for t in range(VOCAB) if hash_block(h, [t], guess_key) == child), None)
        if found is None:
            break
        tokens.append(found)
        h = child
    return tokens


def cached(hash_key: bytes) -> tuple[RadixCache, EventBuffer]:
    alloc = PageAllocator(64)
    sink = EventBuffer()
    cache = RadixCache(alloc, 1, sink=sink, hash_key=hash_key)
    cache.insert(SECRET_PROMPT, alloc.alloc(len(SECRET_PROMPT)))
    return cache, sink


def event_blocks(sink: EventBuffer) -> list[tuple[int, int | None]]:
    """(hash, parent) of every stored block as an events subscriber sees them (no token ids)."""
    out = []
    for e in sink.take():
        assert isinstance(e, BlockStored)
        parent = e.parent_block_hash
        for h in e.block_hashes:
            out.append((h, parent))
            parent = h
    return out


def test_unkeyed_hashes_give_the_prompt_away():
    """The attack on an unkeyed cache (the old code): the snapshot and the events both spell the prompt."""
    cache, sink = cached(b"")
    assert rebuild(cache.cached_blocks()) == SECRET_PROMPT
    assert rebuild(event_blocks(sink)) == SECRET_PROMPT


def test_keyed_hashes_give_nothing_without_the_key():
    cache, sink = cached(KEY)
    snapshot, events = cache.cached_blocks(), event_blocks(sink)
    assert len(snapshot) == len(events) == len(SECRET_PROMPT)
    for blocks in (snapshot, events):
        assert rebuild(blocks) == []  # the attacker hashing unkeyed
        assert rebuild(blocks, guess_key=bytes(32)) == []  # or under a wrong key
    assert rebuild(snapshot, guess_key=KEY) == SECRET_PROMPT  # the key is all that protects them


def test_the_router_hashes_prompts_under_the_workers_key():
    cache, _ = cached(KEY)
    prompt = SECRET_PROMPT + [5]  # the last token is never served from the cache
    assert prompt_block_hashes(prompt, 1, KEY) == cache.block_hashes(SECRET_PROMPT)
    assert set(prompt_block_hashes(prompt, 1)).isdisjoint(cache.block_hashes(SECRET_PROMPT))


def test_a_salted_prompt_hashes_alike_on_the_router_and_the_worker():
    alloc = PageAllocator(64)
    cache = RadixCache(alloc, 1, hash_key=KEY)
    cache.insert(SECRET_PROMPT, alloc.alloc(len(SECRET_PROMPT)), salt="tenant-a")
    prompt = SECRET_PROMPT + [5]
    assert prompt_block_hashes(prompt, 1, KEY, "tenant-a") == cache.block_hashes(SECRET_PROMPT, "tenant-a")
    assert [h for h, _ in cache.cached_blocks()] == cache.block_hashes(SECRET_PROMPT, "tenant-a")
    assert rebuild(cache.cached_blocks(), guess_key=KEY) == []  # the salt is needed too, not only the key
