"""Pure: the router's guess of one prefill worker's cache, from its own routing decisions.

A worker that publishes no KV events (or whose events went stale) still caches what it was sent.
The router remembers the block hashes of every prompt it routed to each worker and forgets the
least recently used ones once the worker's pool (``total_pages`` in its ``/get_server_info``)
is full, as the worker's radix cache evicts (sglang-router's approximate tree, over block hashes).

Chains: a prompt's blocks are touched leaf first, root last, so a block is always more recently
used than the blocks that extend it and the LRU forgets a chain from its tail, never cutting a
cached prefix in the middle (the radix cache too evicts leaves first).

Without a tokenizer the blocks are the prompt's text in chunks of ``CHARS_PER_TOKEN * page_size``
characters (``text_block_hashes``): the same prefix property, measured in characters instead of
tokens, in a hash space of its own (a worker's KV events cannot be matched against it).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

CHARS_PER_TOKEN = 4  # a text block stands for about one page of tokens (sizes the LRU in pages)
TEXT_ROOT = 0


def text_block_hashes(text: str, block_chars: int) -> list[int]:
    """Chained 64-bit hashes of the full ``block_chars``-character blocks of ``text`` (a partial
    last block is left out, as a partial page is never shared)."""
    if block_chars < 1:
        raise ValueError(f"block_chars: must be >= 1, got {block_chars}")
    hashes, h = [], TEXT_ROOT
    for start in range(0, len(text) - block_chars + 1, block_chars):
        chunk = text[start:start + block_chars].encode("utf-8", "surrogatepass")
        h = int.from_bytes(hashlib.blake2b(h.to_bytes(8, "little") + chunk, digest_size=8).digest(), "little")
        hashes.append(h)
    return hashes


class ApproxIndex:
    """Block hashes a worker was sent, least recently used first; at most ``capacity`` of them.
    Invariant: ``len(self) <= capacity``."""

    def __init__(self, capacity: int):
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.capacity = 0
        self.evicted = 0  # blocks forgotten to stay within the capacity
        self.resize(capacity)

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    def resize(self, capacity: int) -> None:
        """A new capacity (the worker reported another pool size); forgets the oldest blocks beyond it."""
        if capacity < 1:
            raise ValueError(f"capacity: must be >= 1 block, got {capacity}")
        self.capacity = capacity
        self._evict()

    def insert(self, hashes: Sequence[int]) -> None:
        """The worker was sent a prompt with these chained block hashes: they are now its most
        recently used blocks (the root block the most recent of all)."""
        for h in reversed(hashes):
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        self._evict()

    def matched_blocks(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of ``hashes`` the worker is believed to hold (stops at the first miss).
        Matching does not touch: only a routing decision (``insert``) makes blocks recent."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def clear(self) -> None:
        self._blocks.clear()

    def _evict(self) -> None:
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)
            self.evicted += 1
