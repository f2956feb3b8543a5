"""The radix prefix cache over two tiers: device pages and their host-memory copies.

A node's page lives on the device (``page``), in host memory (``host_page``), or both. The
device-resident nodes form a subtree under the root (a device page's parent is on the device
too), so a match is a device prefix followed by a host-only continuation.

Copies and the invariants they keep:

* down (write-through after ``insert``, or demotion when the device evicts): a node gets its
  ``host_page`` only once the copy has landed; while it runs the node is locked, so its device
  page cannot be evicted and reused under the copy;
* up (``start_load``): the caller reserved fresh device pages and locked the path; the nodes
  get their device pages only once the copy has landed (never findable half-loaded), and the
  lock keeps their host pages from being evicted while the copy reads them.

The cache never frees a device page: eviction and ``reset`` return the pages they take, and a
load-back whose blocks were recomputed meanwhile leaves its copies on the handle
(``LoadHandle.redundant``); ``KVCacheManager`` frees them all. Host pages are this cache's own
(it is the host pool's only user) and it frees those itself.

``poll`` completes finished copies. On CPU every copy is synchronous and completes at once.
With ``sync_copies`` (several scheduler ranks) ``poll`` waits for every copy in flight first, so
a copy completes at the same point of the loop on every rank, never when one rank's side stream
happens to finish: ranks in lock step must keep identical device trees (evictability, locks).

Storage reads (``prefetch``) run on the storage thread while the request waits; the chunks
that landed join the tree (as host-only nodes) only when the request stops waiting, so a
prefetch given up (``cancel_prefetch``) leaves nothing behind. ``costs`` (measured at start-up)
decides whether a hit is long enough to be worth loading rather than recomputing.
"""

from __future__ import annotations

import hashlib
import heapq
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.mem.allocator import PageAllocator
from pdserve.mem.hicache_storage import Prefetch, StorageLeg, prefetch_can_stop
from pdserve.mem.host_pool import CopyOp, HostKVPool
from pdserve.mem.radix_cache import InsertResult, MatchResult, RadixCache, RadixNode, _token_list, hash_block
from pdserve.mem.tier_costs import LegSpeed, TierCosts, measure_copy

logger = logging.getLogger(__name__)

# write_through_selective backs a page up once it has been matched this often.
SELECTIVE_HIT_THRESHOLD = 2
PROBE_PAGES = 8  # pages per timed copy when measuring the host leg at start-up


@dataclass
class TierMatch:
    """``device``: the device-resident prefix (as ``RadixCache.match_prefix``, ending on a reusable
    boundary); ``ahead``: device nodes past that boundary (the start of a block whose rest is only in
    host memory; empty when every page is reusable); ``host``: the host-only nodes that continue
    them; ``busy``: the continuation is being loaded by another request (wait for it rather than
    load it twice)."""

    device: MatchResult
    host: list[RadixNode]
    busy: bool
    ahead: list[RadixNode] = field(default_factory=list)

    @property
    def num_pages(self) -> int:
        """Pages of every tier in the match, reusable or not (where a storage read continues)."""
        return len(self.device.pages) + len(self.ahead) + len(self.host)

    @property
    def last(self) -> RadixNode | None:
        """The deepest node of the match; None when it is empty."""
        deeper = self.host or self.ahead
        return deeper[-1] if deeper else self.device.node if self.device.pages else None


@dataclass
class _Backup:
    nodes: list[RadixNode]
    host_pages: list[int]
    lock: RadixNode
    op: CopyOp


@dataclass
class LoadHandle:
    """A load-back of ``nodes`` into ``device_pages``. The path stays locked (by the caller's
    lock on ``nodes[-1]``) until the caller unlocks it; ``finished`` once the pages are in.
    ``redundant``: device pages the cache did not keep because their blocks were recomputed and
    cached while the copy ran; they stay the caller's (``KVCacheManager`` frees them)."""

    nodes: list[RadixNode]
    device_pages: list[int]
    op: CopyOp
    finished: bool = False
    storage_pages: int = 0  # how many of ``nodes`` came from the storage tier first
    redundant: list[int] = field(default_factory=list)


@dataclass
class TierCounters:
    host_hit_pages: int = 0
    host_load_bytes: int = 0
    host_backup_bytes: int = 0
    host_evicted_pages: int = 0
    device_demoted_pages: int = 0
    storage_hit_pages: int = 0
    host_loads_skipped: int = 0  # host hits shorter than the break-even length, recomputed
    storage_prefetch_skipped: int = 0  # storage reads not started: loading never beats recomputing


class HiRadixCache(RadixCache):
    """``RadixCache`` whose evicted device pages move to ``host`` instead of vanishing.

    ``write_policy``: ``write_through`` copies every inserted page down at once (eviction is
    then free), ``write_through_selective`` only pages matched SELECTIVE_HIT_THRESHOLD times,
    ``write_back`` only when the device evicts them (eviction waits for the copy). A page the
    host pool has no room for is dropped as in the one-tier cache.

    ``probe_pages``: free device pages the caller lends for the start-up copy timing (it writes
    into them and keeps none; the caller frees them after construction). Fewer than 2: not timed.

    ``reuse_tokens`` (``KVPool.reuse_tokens``): the device match is shortened to a multiple of it as in
    the one-tier cache; ``match_tiers`` answers the whole host continuation and ``usable_host`` how
    much of it ends on such a boundary (the tiers hold a boundary's tail rows in its block's pages,
    as the device does: DeepSeek-V4's bounded layout, docs/kv-cache.md).
    """

    def __init__(self, allocator: PageAllocator, page_size: int, host: HostKVPool, write_policy: str,
                 storage: StorageLeg | None = None, prefill_tokens_per_s: float | None = None,
                 probe_pages: Sequence[int] = (), hash_key: bytes = b"", reuse_tokens: int | None = None):
        super().__init__(allocator, page_size, hash_key=hash_key, reuse_tokens=reuse_tokens)
        self.host = host
        self.write_policy = write_policy
        self.storage = storage
        self._host_owner: dict[int, RadixNode] = {}
        self._backups: list[_Backup] = []
        self._loads: list[LoadHandle] = []
        self._prefetches: dict[object, Prefetch] = {}
        self.counters = TierCounters()
        self.sync_copies = False
        self.costs = self._measure_costs(prefill_tokens_per_s, list(probe_pages[:PROBE_PAGES]))

    # ------------------------------------------------------------ start-up
    def _measure_costs(self, prefill_tokens_per_s: float | None, probe_pages: list[int]) -> TierCosts:
        """Time the host -> device copy and a storage get once, so hits too short to beat
        recomputation are recomputed; logged once."""
        costs = TierCosts(self.host.page_bytes / self.page_size, self._measure_host(probe_pages),
                          self._measure_storage(), prefill_tokens_per_s)
        for name, leg in (("host->device", costs.host), ("storage get", costs.storage)):
            if leg is not None:
                logger.info("hicache %s: %.3g GB/s, %.3g ms per load", name, leg.bytes_per_s / 1e9,
                            leg.latency_s * 1e3)
        return costs

    def _measure_host(self, device: list[int]) -> LegSpeed | None:
        n = min(len(device), self.host.allocator.num_free)
        if n < 2:
            return None
        host = self.host.allocator.alloc(n)
        assert host is not None
        try:
            return measure_copy(lambda k: self.host.load(host[:k], device[:k]).wait(), 1, n, self.host.page_bytes)
        finally:
            self.host.allocator.free(host)

    def _measure_storage(self) -> LegSpeed | None:
        if self.storage is None:
            return None
        leg = self.storage
        key = hashlib.sha256(leg.namespace + b"pdserve tier probe").digest()  # no token chain hashes to it
        chunk_bytes = leg.chunk_pages * self.host.page_bytes
        if not leg.store.put(key, bytes(chunk_bytes)):
            return None
        return measure_copy(lambda k: leg.probe_get(key, k), 1, 2, chunk_bytes)

    # ---------------------------------------------------------------- queries
    @property
    def num_host_cached_pages(self) -> int:
        return len(self._host_owner)

    @property
    def num_host_in_flight(self) -> int:
        """Host pages taken for a copy down that has not landed yet."""
        return sum(len(b.host_pages) for b in self._backups)

    @property
    def num_loading_pages(self) -> int:
        """Device pages reserved for a load-back that has not landed yet."""
        return sum(len(h.device_pages) for h in self._loads)

    def match_tiers(self, token_ids: Sequence[int], salt: str = "") -> TierMatch:
        """The device prefix (marked used), the device nodes past its boundary and the host-only nodes
        continuing them, in ``salt``'s tree."""
        tokens = _token_list(token_ids)
        device = self.match_prefix(tokens, salt)
        node = device.node if device.pages else self._root_for(salt)
        ahead: list[RadixNode] = []
        host: list[RadixNode] = []
        for key in [] if node is None else list(self._blocks(tokens))[len(device.pages):]:
            assert node is not None
            child = node.children.get(key)
            if child is None or (child.page is None and child.host_page is None):
                break
            if child.page is not None and host:  # a device page under a host-only one: not a chain
                break
            (ahead if child.page is not None else host).append(child)
            node = child
        return TierMatch(device, host, any(n.busy for n in host), ahead)

    def usable_host(self, match: TierMatch) -> int:
        """Pages of ``match.host`` a request may load: up to the last reusable boundary, so a hit never
        resumes where the pages keep no tails (0 when that boundary is not past the ``ahead`` pages)."""
        end = match.num_pages // self.reuse_pages * self.reuse_pages
        return max(0, end - len(match.device.pages) - len(match.ahead))

    # --------------------------------------------------------------- mutation
    def insert(self, token_ids: Sequence[int], pages: Sequence[int], salt: str = "") -> InsertResult:
        result = super().insert(token_ids, pages, salt)
        if self.write_policy != "write_back" and not self.disable:
            self._write_through(self._walk(list(self._blocks(_token_list(token_ids))), salt))
        return result

    def _write_through(self, path: list[RadixNode]) -> None:
        selective = self.write_policy == "write_through_selective"
        todo = [n for n in path if n.host_page is None and not n.busy and n.page is not None
                and (not selective or n.hits >= SELECTIVE_HIT_THRESHOLD)]
        host_pages = self._alloc_host(len(todo), allow_fewer=True)
        if not host_pages:
            return
        todo = todo[:len(host_pages)]  # the shallowest: a deeper page is useless without them
        self.lock(todo[-1])
        for n in todo:
            n.busy = True
        op = self.host.backup([n.page for n in todo if n.page is not None], host_pages)
        self._backups.append(_Backup(todo, host_pages, todo[-1], op))
        self.poll()

    def start_load(self, nodes: list[RadixNode], device_pages: list[int]) -> LoadHandle:
        """Copy host-only ``nodes`` up into ``device_pages`` (allocated by the caller, who has
        locked ``nodes[-1]`` and keeps it locked until it is done with the handle)."""
        if nodes[-1].lock_ref <= 0:
            raise RuntimeError("start_load: lock the path before loading it")
        for n in nodes:
            if n.busy or n.host_page is None or n.page is not None:
                raise RuntimeError(f"start_load: {n!r} is not an idle host-only node")
            n.busy = True
        op = self.host.load([n.host_page for n in nodes if n.host_page is not None], device_pages)
        handle = LoadHandle(nodes, list(device_pages), op)
        self._loads.append(handle)
        self.counters.host_hit_pages += len(nodes)
        self.counters.host_load_bytes += op.num_bytes
        self.poll()
        return handle

    def poll(self) -> None:
        """Complete every copy that has landed (with ``sync_copies``: every copy, waited for)."""
        if self.sync_copies:
            for op in [b.op for b in self._backups] + [h.op for h in self._loads]:
                op.wait()
        for b in [b for b in self._backups if b.op.done()]:
            self._backups.remove(b)
            self._finish_backup(b)
        for h in [h for h in self._loads if h.op.done()]:
            self._loads.remove(h)
            self._finish_load(h)

    def drain(self) -> None:
        """Wait for every copy in flight, then complete them."""
        for op in [b.op for b in self._backups] + [h.op for h in self._loads]:
            op.wait()
        self.poll()

    def _finish_backup(self, b: _Backup) -> None:
        for n, hp in zip(b.nodes, b.host_pages):
            n.busy = False
            n.host_page = hp
            self._host_owner[hp] = n
        self.counters.host_backup_bytes += b.op.num_bytes
        self.unlock(b.lock)
        self._store_chunks(b.nodes)

    # ---------------------------------------------------------------- storage
    def _store_chunks(self, nodes: list[RadixNode]) -> None:
        """Hand every chunk that the new host copies of ``nodes`` complete to the storage tier
        (so storage holds a copy before host memory evicts it). Write-back demotes deepest
        first, so a chunk may complete at any of its nodes: look down to the chunk's end."""
        if self.storage is None:
            return
        cp = self.storage.chunk_pages
        for n in nodes:
            depth = len(self._path_from_root(n))
            level, end_depth = [n], -(-depth // cp) * cp
            for _ in range(end_depth - depth):
                level = [c for x in level for c in x.children.values() if c.host_page is not None]
            for end in level:
                self._store_chunk(end, cp)

    def _store_chunk(self, end: RadixNode, cp: int) -> None:
        assert self.storage is not None
        path = self._path_from_root(end)
        chunk = path[-cp:]
        if end.stored or any(c.host_page is None for c in chunk):
            return
        tokens = [t for c in path for t in c.key]
        key = self.storage.keys(tokens, path[0].tree_parent.salt)[-1]
        self.storage.put_async(key, self.host.page_payload([c.host_page for c in chunk if c.host_page is not None]))
        end.stored = True

    def _path_from_root(self, node: RadixNode) -> list[RadixNode]:
        return [n for n in reversed(self._path_to_root(node)) if not n.is_root]

    def prefetch(self, owner: object, token_ids: Sequence[int], match: TierMatch, salt: str = "") -> int | None:
        """Storage pages continuing ``match`` for ``owner`` (a waiting request). Starts the read
        on the storage thread if ``start_prefetch`` did not (then answers None: wait at least
        until the next scheduling pass); answers None while the prefetch policy says wait, then
        adds the chunks that landed as host-only nodes and answers how many pages they hold."""
        if self.storage is None or match.busy:
            return 0
        tokens = _token_list(token_ids)
        pf = self._prefetches.get(owner)
        if pf is None:
            return None if self.start_prefetch(owner, tokens, match, salt) else 0
        done = pf.done.is_set()
        if not prefetch_can_stop(self.storage.policy, done, time.monotonic() - pf.started,
                                 len(pf.keys) * self.storage.chunk_tokens):
            return None
        del self._prefetches[owner]
        pf.cancel()
        if not done:
            self.storage.count_stopped_early()
        return self._take_prefetch(tokens, pf, salt)

    def start_prefetch(self, owner: object, token_ids: Sequence[int], match: TierMatch, salt: str = "") -> bool:
        """Start ``owner``'s storage read (when it arrives) unless one runs; False when there is
        nothing worth reading after ``match``."""
        if owner in self._prefetches:
            return True
        if self.storage is None or match.busy:
            return False
        pf = self._start_prefetch(_token_list(token_ids), match, salt)
        if pf is not None:
            self._prefetches[owner] = pf
        return pf is not None

    def cancel_prefetch(self, owner: object) -> None:
        """``owner`` stops waiting (aborted): its read stops; nothing of it entered the cache."""
        pf = self._prefetches.pop(owner, None)
        if pf is not None:
            pf.cancel()

    @property
    def num_prefetching(self) -> int:
        return len(self._prefetches)

    def _start_prefetch(self, tokens: list[int], match: TierMatch, salt: str) -> Prefetch | None:
        assert self.storage is not None
        cp, have = self.storage.chunk_pages, match.num_pages
        keys = self.storage.keys(tokens, salt)
        first = have // cp
        if first >= len(keys):
            return None
        break_even = self.costs.break_even("storage")
        if math.isinf(break_even):
            self.counters.storage_prefetch_skipped += 1
            return None
        # The hit must reach have + break_even tokens (whole chunks from ``first``) to be worth it.
        need = -(-(have * self.page_size + math.ceil(break_even)) // self.storage.chunk_tokens) - first
        if first + need > len(keys):
            self.counters.storage_prefetch_skipped += 1
            return None
        return self.storage.prefetch(first, keys[first:], self.host.page_bytes, min_chunks=need)

    def _take_prefetch(self, tokens: list[int], pf: Prefetch, salt: str) -> int:
        """Hang the landed chunks of ``pf`` under the current match. The tree may have changed
        while they were read: a match now shorter than ``pf``'s first chunk leaves them
        unattached (dropped), a longer one skips the pages it already has."""
        assert self.storage is not None
        payloads = pf.landed()
        match = self.match_tiers(tokens, salt)
        cp, have = self.storage.chunk_pages, match.num_pages
        new = (pf.first + len(payloads)) * cp - have
        if match.busy or have < pf.first * cp or new <= 0:
            return 0
        node = match.last
        if node is not None:
            self.lock(node)  # the host eviction below must not take the path these pages hang from
        host_pages = self._alloc_host(new)
        if node is not None:
            self.unlock(node)
        if not host_pages:
            return 0
        # hung from the root: looked up (or made) after the eviction, which may have emptied a salted tree
        node = node or self._root_for(salt, create=True)
        assert node is not None
        skip = (have - pf.first * cp) * self.host.page_bytes
        self.host.set_page_payload(host_pages, b"".join(payloads)[skip:])
        blocks = list(self._blocks(tokens))[have:have + new]
        for key, hp in zip(blocks, host_pages):
            node = self._add_host_child(node, key, hp)
        self.counters.storage_hit_pages += new
        return new

    def _add_host_child(self, parent: RadixNode, key: tuple[int, ...], host_page: int) -> RadixNode:
        child = RadixNode(key, None, hash_block(parent.hash, key, self.hash_key), parent, self._new_id())
        child.last_access = self._tick()
        child.host_page, child.stored = host_page, True
        parent.children[key] = child
        self._leaves.discard(parent)
        self._leaves.add(child)
        self._host_owner[host_page] = child
        return child

    def _finish_load(self, h: LoadHandle) -> None:
        landed = []
        # Just used, whatever its host history (a storage fetch, a demotion): ranks whose host
        # tiers differ still order their device pages alike for eviction.
        now = self._tick()
        for n, dp in zip(h.nodes, h.device_pages):
            n.busy = False
            if n.page is None:
                n.last_access = now
                self._set_device_page(n, dp)
                landed.append(n)
            else:  # recomputed and inserted meanwhile: the loaded copy is redundant
                h.redundant.append(dp)
        self._announce_stored(landed)
        h.finished = True

    # --------------------------------------------------------------- eviction
    def evict(self, num_pages: int) -> list[int]:
        """Take up to ``num_pages`` device pages, least recently used device leaves first; each
        keeps (or gets) a host copy when the host pool has room, else leaves the tree. Returns
        the device pages taken, which the caller must free."""
        self.poll()
        heap = [(n.last_access, n) for n in self._page_owner.values() if self._device_leaf(n)]
        heapq.heapify(heap)
        freed: list[int] = []
        hashes: list[int] = []
        while heap and len(freed) < num_pages:
            _, node = heapq.heappop(heap)
            if not self._device_leaf(node):
                continue
            parent = node.parent
            hashes.append(node.hash)
            freed.append(self._evict_device(node))
            if parent is not None and not parent.is_root and self._device_leaf(parent):
                heapq.heappush(heap, (parent.last_access, parent))
        if freed and self.sink is not None:  # gone from the device, whether or not a host copy stays
            self.sink.removed(hashes, self.medium)
        return freed

    def _device_leaf(self, n: RadixNode) -> bool:
        return (n.page is not None and n.lock_ref == 0 and not n.busy
                and all(c.page is None for c in n.children.values()))

    def _evict_device(self, node: RadixNode) -> int:
        """Take ``node``'s device page away (returned, to be freed); demote it first if needed."""
        page = node.page
        assert page is not None
        if node.host_page is None:
            host_pages = self._alloc_host(1)
            if host_pages:
                # Write-back: the device page is freed only after this copy has landed.
                op = self.host.backup([page], host_pages)
                op.wait()
                node.host_page = host_pages[0]
                self._host_owner[host_pages[0]] = node
                self.counters.host_backup_bytes += op.num_bytes
                self.counters.device_demoted_pages += 1
                self._store_chunks([node])
        del self._page_owner[page]
        node.page = None
        if node.host_page is None:
            self._drop_subtree(node)
        return page

    def _alloc_host(self, n: int, allow_fewer: bool = False) -> list[int]:
        """``n`` host pages (evicting unlocked host copies if needed), or fewer with
        ``allow_fewer``, else none."""
        alloc = self.host.allocator
        if alloc.num_free < n:
            self._evict_host(n - alloc.num_free)
        take = min(n, alloc.num_free) if allow_fewer else n
        return alloc.alloc(take) or []

    def _evict_host(self, num_pages: int) -> int:
        """Free up to ``num_pages`` host pages, least recently used first: a host-only leaf
        leaves the tree, a page also on the device just loses its host copy."""
        heap = [(n.last_access, n) for n in self._host_owner.values() if self._host_evictable(n)]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_pages:
            _, node = heapq.heappop(heap)
            if not self._host_evictable(node):
                continue
            parent = node.parent
            self._free_host_page(node)
            freed += 1
            if node.page is None:
                self._detach(node)
                if parent is not None and not parent.is_root and self._host_evictable(parent):
                    heapq.heappush(heap, (parent.last_access, parent))
        self.counters.host_evicted_pages += freed
        return freed

    def _host_evictable(self, n: RadixNode) -> bool:
        return (n.host_page is not None and n.lock_ref == 0 and not n.busy
                and (n.page is not None or not n.children))

    def _free_host_page(self, node: RadixNode) -> None:
        hp = node.host_page
        assert hp is not None
        del self._host_owner[hp]
        node.host_page = None
        self.host.allocator.free([hp])

    def _drop_subtree(self, node: RadixNode) -> None:
        """Remove ``node`` (no device page left) and its host-only descendants from the tree."""
        stack, order = [node], []
        while stack:
            n = stack.pop()
            order.append(n)
            stack.extend(n.children.values())
        for n in reversed(order):  # leaves first, so each is a leaf when detached
            if n.host_page is not None:
                self._free_host_page(n)
            self._detach(n)

    def _detach(self, node: RadixNode) -> None:
        page = self._remove_leaf(node)
        assert page is None, f"detached a node that still holds device page {page}"

    def reset(self) -> list[int] | None:
        self.drain()
        host_nodes = list(self._host_owner.values())
        pages = super().reset()
        if pages is None:
            return None
        for n in host_nodes:
            n.parent = None
        self.host.allocator.free(list(self._host_owner))
        self._host_owner.clear()
        return pages

    # ----------------------------------------------------------------- checks
    def check_invariants(self) -> None:
        super().check_invariants()
        owners: dict[int, RadixNode] = {}
        stack = [c for r in self._roots() for c in r.children.values()]
        while stack:
            n = stack.pop()
            if n.host_page is not None:
                assert n.host_page not in owners, f"host page {n.host_page} held by two nodes"
                assert not self.host.allocator.is_free(n.host_page), f"cached host page {n.host_page} is free"
                owners[n.host_page] = n
            stack.extend(n.children.values())
        assert owners == self._host_owner

    def check_host_pages(self) -> None:
        """free + cached + in flight == total over the host pool; raises on a leak."""
        alloc = self.host.allocator
        cached, flight = len(self._host_owner), self.num_host_in_flight
        if alloc.num_free + cached + flight != alloc.num_pages:
            raise RuntimeError(f"host page accounting broken: free {alloc.num_free} + cached {cached} + in flight "
                               f"{flight} != total {alloc.num_pages}")
