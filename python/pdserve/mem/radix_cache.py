"""Radix prefix cache over page-aligned token blocks.

Each node below the root is one full page: ``page_size`` tokens (its key) and the
page id holding their KV. Children are keyed by their block's token tuple, so a
path from the root spells a page-aligned token prefix. Each node also carries a
chained block hash, ``hash_i = H_k(hash_{i-1}, block_i)``, stable across processes that share
the key ``k``, which KV events publish and a router matches prompts against.

Why keyed: an unkeyed chain is a dictionary attack away from the prompt. With page size 1 a
block is one token, so whoever sees a hash tries the vocabulary against its parent's hash and
reads the prompt token by token. Keyed (BLAKE2b's MAC mode), a hash says nothing to whoever
lacks ``k``: the servers and the router of one deployment share it (``--kv-hash-key-file``,
``pdserve up`` makes one); ``k = b""`` is the unkeyed chain.

Cache isolation: a request's ``salt`` (its ``cache_salt``, or its client under
``--cache-salt-per-client``) picks the tree it matches and fills. The default tree hangs from the
root; each salt has its own root whose hash is the salt's, so requests with different salts never
share a page, and their chains differ from the first block. A salted root lives while it has
children.

Partial blocks are never cached: a prompt's tail shorter than a page is
recomputed, which keeps every cached page immutable and shareable.
"""

from __future__ import annotations

import hashlib
import heapq
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from pdserve.mem.allocator import PageAllocator
from pdserve.obs.kv_events import MEDIUM_GPU, KVEventSink

ROOT_HASH = 0  # hash_{-1}: what the first block chains from


def hash_block(parent_hash: int, block: Sequence[int], key: bytes = b"") -> int:
    """64-bit chained hash of one block: blake2b keyed with ``key`` (up to 64 bytes; b"": unkeyed)
    over parent hash as u64 LE || tokens as i32 LE (``hash_chain`` of one block)."""
    return hash_chain(parent_hash, [block], key)[0]


@lru_cache(maxsize=16)
def _block_struct(n: int) -> struct.Struct:
    return struct.Struct(f"<Q{n}i")


def hash_chain(parent_hash: int, blocks: Sequence[Sequence[int]], key: bytes = b"") -> list[int]:
    """``hash_block`` chained over ``blocks`` (each hash the next block's parent), in one pass: one
    compiled struct per block length and a copy of the keyed BLAKE2b state instead of keying each
    block anew. A finished request inserts one block per page, a token each at page size 1."""
    base = hashlib.blake2b(digest_size=8, key=key)
    from_bytes, hashes, h, n, pack = int.from_bytes, [], parent_hash, 1, _block_struct(1).pack
    try:
        for block in blocks:
            if len(block) != n:  # one struct per run of equal lengths (all of a tree's blocks are a page)
                n, pack = len(block), _block_struct(len(block)).pack
            m = base.copy()
            m.update(pack(h, *block))
            h = from_bytes(m.digest(), "little")
            hashes.append(h)
    except struct.error as e:
        raise ValueError(f"token ids must fit in int32 ({e})") from None
    return hashes


def salt_hash(salt: str, key: bytes = b"") -> int:
    """hash_{-1} of a salted chain: what its first block chains from (``ROOT_HASH`` unsalted)."""
    if not salt:
        return ROOT_HASH
    digest = hashlib.blake2b(b"pdserve cache salt\0" + salt.encode(), digest_size=8, key=key).digest()
    return int.from_bytes(digest, "little")


def key_check(key: bytes) -> int:
    """A value that tells two parties whether they hash under the same key, and nothing about the
    key or any prompt: the hash of a block no prompt has (token id -1)."""
    return hash_block(ROOT_HASH, [-1], key)


def _token_list(token_ids: Sequence[int]) -> list[int]:
    # Accept tensors/arrays too: their elements would not hash like ints.
    return token_ids.tolist() if hasattr(token_ids, "tolist") else list(token_ids)


class RadixNode:
    """One cached page. ``lock_ref`` counts requests using this node or a descendant.

    ``page`` is the device page (None once a hierarchical cache moved it to host memory only),
    ``host_page`` its host copy (None without one); a node always has at least one of them.
    ``busy``: a copy to or from this node's pages is in flight. ``hits``: times matched.
    """

    __slots__ = ("key", "page", "hash", "parent", "children", "lock_ref", "last_access", "id", "host_page",
                 "busy", "hits", "stored", "salt")

    def __init__(self, key: tuple[int, ...], page: int | None, hash_: int,
                 parent: RadixNode | None, node_id: int):
        self.key = key
        self.page = page
        self.hash = hash_
        self.parent = parent
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.lock_ref = 0
        self.last_access = 0
        self.id = node_id
        self.host_page: int | None = None
        self.busy = False
        self.hits = 0
        self.stored = False  # its chunk was handed to the storage tier
        self.salt = ""  # a root's: the salt of the tree below it

    @property
    def is_root(self) -> bool:
        """The default root or a salt's (only roots hold no tokens)."""
        return not self.key

    @property
    def cached_page(self) -> int:
        """The device page this node caches (the root and host-only nodes have none)."""
        if self.page is None:
            raise RuntimeError(f"node caches no device page (the root, or host-only): {self!r}")
        return self.page

    @property
    def tree_parent(self) -> RadixNode:
        """The parent of a node still in the tree (the root and evicted or flushed nodes have none)."""
        if self.parent is None:
            raise RuntimeError(f"node has no parent (the root, or evicted or flushed): {self!r}")
        return self.parent

    def __lt__(self, other: RadixNode) -> bool:  # heap tie-break: older node first
        return self.id < other.id

    def __repr__(self) -> str:
        return (f"RadixNode(page={self.page}, host_page={self.host_page}, lock_ref={self.lock_ref}, "
                f"last_access={self.last_access}, children={len(self.children)})")


@dataclass
class MatchResult:
    """Longest cached prefix: ``pages[i]`` holds tokens ``[i*page_size, (i+1)*page_size)``.

    ``node`` is the deepest matched node (the root on a miss); lock it before the
    cache can next evict, and unlock it when the request lets go of ``pages``.
    """

    pages: list[int]
    num_tokens: int
    node: RadixNode


@dataclass
class InsertResult:
    """What ``RadixCache.insert`` did: ``num_new`` pages joined the tree; ``released`` are pages
    passed in that the cache did not keep (duplicates of cached blocks, or every page when the
    cache is disabled): the caller frees them (``KVCacheManager`` does, and is the only one)."""

    num_new: int
    released: list[int]


class RadixCache:
    """Prefix cache that owns the pages in its tree, and never frees a page itself.

    Ownership contract (the caller is ``KVCacheManager``, the one code that frees device pages;
    the cache reads ``allocator`` only to check the pages it is handed):

    * Pages in the tree belong to the cache. ``match_prefix`` lends them out;
      the borrower must ``lock(result.node)`` while using them and ``unlock``
      afterwards, and must never free them itself.
    * ``insert`` takes every page passed: pages for new blocks join the tree,
      pages duplicating an already cached block come back in
      ``InsertResult.released`` and the caller must free those (and only those).
    * ``evict`` takes pages out of the tree and returns them; ``reset`` empties
      the tree and returns its pages. The caller must free what they return.
      Locked nodes (and so their ancestors) are never evicted.

    So at all times ``allocator.num_free + num_cached_pages + pages held by
    callers == allocator.num_pages`` once the caller has freed what a call returned.

    ``sink`` (optional) hears every change of the tree as KV events: blocks stored by
    ``insert``, removed by ``evict``, all cleared by ``reset``, each under ``medium``.
    ``hash_key``: the key of the block hash chain (see the module's docstring).
    """

    def __init__(self, allocator: PageAllocator, page_size: int, disable: bool = False,
                 sink: KVEventSink | None = None, medium: str = MEDIUM_GPU, hash_key: bytes = b"",
                 reuse_tokens: int | None = None):
        """``reuse_tokens``: a match is shortened to a multiple of it (``KVPool.reuse_tokens``: where the
        pool keeps what a prefix's continuation needs; a page by default)."""
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        reuse_tokens = reuse_tokens or page_size
        if reuse_tokens % page_size:
            raise ValueError(f"reuse_tokens: {reuse_tokens} is not a multiple of page_size {page_size}")
        self.reuse_pages = reuse_tokens // page_size
        if len(hash_key) > 64:
            raise ValueError(f"hash_key: at most 64 bytes (BLAKE2b's key), got {len(hash_key)}")
        self.hash_key = hash_key
        self.allocator = allocator
        self.sink = sink
        self.medium = medium
        self.page_size = page_size
        self.disable = disable
        self._clock = 0
        self._next_id = 0
        self._root = RadixNode((), None, ROOT_HASH, None, self._new_id())
        self._salted: dict[str, RadixNode] = {}  # salt -> the root of its tree (while it has children)
        self._page_owner: dict[int, RadixNode] = {}
        self._leaves: set[RadixNode] = set()  # non-root nodes without children
        self._num_locked = 0  # non-root nodes with a device page and lock_ref > 0

    # ---- queries -----------------------------------------------------------------

    @property
    def num_cached_pages(self) -> int:
        return len(self._page_owner)

    @property
    def num_evictable_pages(self) -> int:
        return len(self._page_owner) - self._num_locked

    @property
    def root(self) -> RadixNode:
        return self._root

    def block_hashes(self, token_ids: Sequence[int], salt: str = "") -> list[int]:
        """Chained hashes of the full blocks of ``token_ids`` (the partial tail is ignored)."""
        return hash_chain(salt_hash(salt, self.hash_key), self._blocks(_token_list(token_ids)), self.hash_key)

    def match_prefix(self, token_ids: Sequence[int], salt: str = "") -> MatchResult:
        """Longest page-aligned prefix cached on the device in ``salt``'s tree; marks the matched path
        as just used. A miss answers the default root (a salted root may go once it is empty)."""
        node = self._root_for(salt)
        pages: list[int] = []
        if node is None:
            return MatchResult(pages, 0, self._root)
        if not self.disable:
            now = self._tick()
            path = [node]
            for key in self._blocks(_token_list(token_ids)):
                child = node.children.get(key)
                if child is None or child.page is None:
                    break
                child.last_access = now
                child.hits += 1
                pages.append(child.cached_page)
                node = child
                path.append(node)
            # A hit ends only where the pool can restore the state (a reusable boundary), never past it.
            del pages[len(pages) // self.reuse_pages * self.reuse_pages:]
            node = path[len(pages)]
        return MatchResult(pages, len(pages) * self.page_size, node if pages else self._root)

    # ---- locking -----------------------------------------------------------------

    def lock(self, node: RadixNode) -> None:
        """``lock_ref += 1`` on ``node`` and every ancestor; locked nodes are never evicted."""
        for n in self._path_to_root(node):
            if n.lock_ref == 0 and n.page is not None:
                self._num_locked += 1
            n.lock_ref += 1

    def unlock(self, node: RadixNode) -> None:
        """Undo one :meth:`lock`. Raises ``RuntimeError`` if ``node`` is not locked."""
        path = self._path_to_root(node)
        if any(n.lock_ref <= 0 for n in path):
            raise RuntimeError(f"unlock of a node that is not locked: {node!r}")
        for n in path:
            n.lock_ref -= 1
            if n.lock_ref == 0 and n.page is not None:
                self._num_locked -= 1

    # ---- mutation ----------------------------------------------------------------

    def insert(self, token_ids: Sequence[int], pages: Sequence[int], salt: str = "") -> InsertResult:
        """Cache ``token_ids`` (full pages only) backed by ``pages``.

        Takes every page in ``pages``: a block already cached with the same page is
        left as is, one cached with a different page returns the passed page as a
        duplicate (in ``released``, for the caller to free), new blocks become nodes.
        Validation happens before any change, so a ``ValueError`` leaves both the tree
        and the pages untouched (the caller still holds them).
        """
        tokens, pages = _token_list(token_ids), [int(p) for p in pages]
        if len(tokens) != len(pages) * self.page_size:
            raise ValueError(f"insert needs full pages: {len(tokens)} tokens for {len(pages)} "
                             f"pages of size {self.page_size}")
        if self.disable:
            return InsertResult(0, pages)
        keys = self._blocks(tokens)
        if not keys:
            return InsertResult(0, [])
        path = self._walk(keys, salt)
        self._check_insert_pages(pages, path)
        duplicates = [p for p, n in zip(pages, path) if p != n.page and n.page is not None]
        now = self._tick()
        back_on_device = []
        for n, p in zip(path, pages):
            n.last_access = now
            if n.page is None:  # only on host: the fresh device copy makes it device-resident again
                self._set_device_page(n, p)
                back_on_device.append(n)
        self._announce_stored(back_on_device)
        node = path[-1] if path else self._root_for(salt, create=True)
        assert node is not None
        parent_hash = node.hash if path else None
        hashes = self._add_chain(node, keys[len(path):], pages[len(path):], now)
        if hashes and self.sink is not None:
            self.sink.stored(parent_hash, hashes, tokens[len(path) * self.page_size:], self.page_size, self.medium)
        return InsertResult(len(pages) - len(path), duplicates)

    def evict(self, num_pages: int) -> list[int]:
        """Take up to ``num_pages`` pages from unlocked leaves, least recently used first.

        Evicting a leaf can turn its parent into an evictable leaf, which then
        competes by its own ``last_access``. Returns the evicted pages, which the
        caller must free.
        """
        heap = [(n.last_access, n) for n in self._leaves if n.lock_ref == 0]
        heapq.heapify(heap)
        freed: list[int] = []
        hashes: list[int] = []
        while heap and len(freed) < num_pages:
            _, leaf = heapq.heappop(heap)
            parent = leaf.tree_parent
            hashes.append(leaf.hash)
            page = self._remove_leaf(leaf)
            assert page is not None, "a cache without host tier holds device pages only"
            freed.append(page)
            if not parent.is_root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent))
        if freed and self.sink is not None:
            self.sink.removed(hashes, self.medium)
        return freed

    def reset(self) -> list[int] | None:
        """Flush the cache: empty the tree and return every page it held (the caller frees them).

        Refused (returns None, changes nothing) while any cached node is locked.
        Locks on the bare root (from empty matches) survive a flush. Node handles
        from before the flush are detached, so locking one raises.
        """
        if self._num_locked > 0:
            return None
        pages = list(self._page_owner)
        for node in self._page_owner.values():
            node.parent = None
        self._root.children = {}
        self._salted.clear()
        self._page_owner.clear()
        self._leaves.clear()
        if self.sink is not None:
            self.sink.cleared(self.medium)
        return pages

    def _announce_stored(self, nodes: Sequence[RadixNode]) -> None:
        """KV events for blocks already in the tree that (again) hold a page in this cache's medium."""
        if self.sink is None:
            return
        for n in nodes:
            parent = n.tree_parent
            self.sink.stored(None if parent.is_root else parent.hash, [n.hash], list(n.key),
                             self.page_size, self.medium)

    def cached_blocks(self) -> list[tuple[int, int | None]]:
        """(block hash, parent block hash or None) of every cached block, parents first: the
        tree as a KV-event subscriber rebuilds it from a snapshot."""
        out: list[tuple[int, int | None]] = []
        level: list[tuple[RadixNode, int | None]] = [(c, None) for r in self._roots() for c in r.children.values()
                                                     if c.page is not None]
        while level:
            out.extend((n.hash, parent) for n, parent in level)
            # only device-resident blocks (a hierarchical cache's host-only nodes are not in this medium);
            # they form a subtree from the root
            level = [(c, n.hash) for n, _ in level for c in n.children.values() if c.page is not None]
        return out

    # ---- checks ------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Recompute every counter from the tree and assert it matches (tests, debugging)."""
        owners: dict[int, RadixNode] = {}
        leaves: set[RadixNode] = set()
        locked = 0
        for salt, root in self._salted.items():
            assert root.children and root.salt == salt and root.hash == salt_hash(salt, self.hash_key)
        stack = [c for r in self._roots() for c in r.children.values()]
        while stack:
            n = stack.pop()
            assert n.page is not None or n.host_page is not None, f"node with no copy: {n!r}"
            if n.page is not None:
                assert n.page not in owners, f"page {n.page} held by two nodes"
                assert not self.allocator.is_free(n.page), f"cached page {n.page} is free"
                assert n.tree_parent.is_root or n.tree_parent.page is not None, f"device page under host-only: {n!r}"
                owners[n.page] = n
                locked += n.lock_ref > 0
            assert n.hash == hash_block(n.tree_parent.hash, n.key, self.hash_key)
            assert n.lock_ref >= sum(c.lock_ref for c in n.children.values())
            if not n.children:
                leaves.add(n)
            stack.extend(n.children.values())
        assert owners == self._page_owner
        assert leaves == self._leaves
        assert locked == self._num_locked
        assert self._root.lock_ref >= sum(c.lock_ref for c in self._root.children.values())

    # ---- internals ---------------------------------------------------------------

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _blocks(self, tokens: list[int]) -> list[tuple[int, ...]]:
        """The full blocks of ``tokens``, each its children's dict key."""
        s = self.page_size
        if s == 1:
            return [(t,) for t in tokens]
        return [tuple(tokens[start:start + s]) for start in range(0, len(tokens) - s + 1, s)]

    def _roots(self) -> list[RadixNode]:
        return [self._root, *self._salted.values()]

    def _root_for(self, salt: str, create: bool = False) -> RadixNode | None:
        """The root of ``salt``'s tree (the default root unsalted); None if it has none and not ``create``."""
        if not salt:
            return self._root
        root = self._salted.get(salt)
        if root is None and create:
            root = RadixNode((), None, salt_hash(salt, self.hash_key), None, self._new_id())
            root.salt = salt
            self._salted[salt] = root
        return root

    def _walk(self, keys: list[tuple[int, ...]], salt: str = "") -> list[RadixNode]:
        """Nodes matching the leading ``keys`` in ``salt``'s tree, stopping at the first miss."""
        node = self._root_for(salt)
        path: list[RadixNode] = []
        if node is None:
            return path
        for key in keys:
            child = node.children.get(key)
            if child is None:
                break
            path.append(child)
            node = child
        return path

    def _check_insert_pages(self, pages: list[int], path: list[RadixNode]) -> None:
        if len(set(pages)) != len(pages):
            raise ValueError(f"insert got the same page twice: {pages}")
        i = self.allocator.first_free(pages)
        if i is not None:
            raise ValueError(f"page {pages[i]} (block {i}) is free in the allocator; "
                             f"insert only pages you hold")
        owner = self._page_owner
        for i, p in enumerate(pages):
            if p in owner and not (i < len(path) and path[i].page == p):
                raise ValueError(f"page {p} (block {i}) is already owned by the cache "
                                 f"for a different block")

    def _add_chain(self, parent: RadixNode, keys: list[tuple[int, ...]], pages: list[int], now: int) -> list[int]:
        """Hang a chain of new nodes (``keys`` backed by ``pages``) below ``parent``; returns their hashes.
        ``_add_child`` over the chain, with the hashes in one pass and the leaf set touched once: a
        finished request adds a node per page here, thousands at page size 1."""
        hashes = hash_chain(parent.hash, keys, self.hash_key)
        node, owner, node_id = parent, self._page_owner, self._next_id
        for key, page, h in zip(keys, pages, hashes):
            node_id += 1
            child = RadixNode(key, page, h, node, node_id)
            child.last_access = now
            node.children[key] = child
            owner[page] = child
            node = child
        self._next_id = node_id
        if node is not parent:
            self._leaves.discard(parent)
            self._leaves.add(node)
        return hashes

    def _set_device_page(self, node: RadixNode, page: int) -> None:
        node.page = page
        self._page_owner[page] = node
        if node.lock_ref > 0:
            self._num_locked += 1

    def _remove_leaf(self, leaf: RadixNode) -> int | None:
        """Take ``leaf`` out of the tree; returns its device page (None if it had none)."""
        parent = leaf.tree_parent
        del parent.children[leaf.key]
        self._leaves.discard(leaf)
        if not parent.is_root and not parent.children:
            self._leaves.add(parent)
        if parent.salt and not parent.children:  # an empty salted tree: its root goes too
            del self._salted[parent.salt]
        page = leaf.page
        if page is not None:
            del self._page_owner[page]
        leaf.parent = None
        return page

    def _path_to_root(self, node: RadixNode) -> list[RadixNode]:
        """``node`` and its ancestors, root included; raises if ``node`` was evicted."""
        path: list[RadixNode] = []
        n: RadixNode | None = node
        while n is not None:
            path.append(n)
            n = n.parent
        if path[-1] is not self._root and self._salted.get(path[-1].salt) is not path[-1]:
            raise RuntimeError(f"node is no longer in the cache (evicted or flushed): {node!r}")
        return path
