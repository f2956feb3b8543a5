"""The one owner of KV memory: pages, table rows, prefix-cache locks, quarantined pages.

The scheduler and every disaggregation mode go through ``KVCacheManager``; none of them calls
the allocator, the request -> slot table or the radix cache's locks directly, so a cache tier
(host memory, storage) can later be added here without touching the loop or the modes. The
caches below it never free a device page either: they return what they let go of, and this
module (with the allocator itself) is the only code that calls the device allocator's ``free``
(test/mem/test_cache_manager.py checks both). See mem/README.md.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from pdserve.mem.allocator import PageAllocator
from pdserve.mem.hicache_storage import StorageLeg
from pdserve.mem.hiradix_cache import PROBE_PAGES, HiRadixCache, LoadHandle
from pdserve.mem.host_pool import HostKVPool, host_page_bytes
from pdserve.mem.page_table import ReqToTokenTable
from pdserve.mem.radix_cache import RadixCache, RadixNode
from pdserve.obs.kv_events import KVEventSink

if TYPE_CHECKING:
    import torch

    from pdserve.config import HiCacheConfig
    from pdserve.mem.kv_pool import KVPool

TIERS = ("device", "host", "storage")
DEFAULT_STORAGE_GB = 4.0  # --hicache-storage-size-gb 0

# Every rank's row of ints, in rank order (a collective: every rank of the group calls it alike).
AgreeFn = Callable[[list[int]], list[list[int]]]


class ReqMemory(Protocol):
    """The memory fields of a request (``engine.request.Req`` has them and documents them),
    declared here so that mem/ needs nothing from the engine above it."""

    rid: str
    uid: int | None
    fill_ids: list[int]
    cache_salt: str  # which prefix tree it matches and fills (mem/radix_cache.py, cache isolation)
    row: int | None
    cache_node: RadixNode | None
    pages: list[int]
    num_cached_pages: int
    kv_len: int
    cached_len: int
    cached_by_tier: dict[str, int]

    @property
    def table_row(self) -> int: ...


class HitDivergedError(RuntimeError):
    """Ranks in lock step found different device prefixes for one request: their states diverged."""


class KVCacheManager:
    """Pages move allocator -> request -> radix cache -> allocator, and only through here.

    A request's memory (the fields ``engine.request.Req`` documents: ``row``, ``cache_node``, ``pages``,
    ``num_cached_pages``, ``kv_len``, ``cached_len``) has one life:

    * ``admit(req, tokens)``: a table row and the longest cached prefix of ``tokens``, locked
      (``pages[:num_cached_pages]`` stay the cache's; the request must not free them).
      ``unadmit`` undoes an admission that took no pages of its own.
    * ``grow(req, n, headroom)`` / ``grow_each(reqs)``: own pages, all or nothing, evicting
      unlocked cache pages only when actually short. Own pages belong to the request.
    * It ends exactly once, by one of:
      ``release(req, cache_len)``: full pages of ``fill_ids[:cache_len]`` join the radix cache
      (duplicates freed by it), the other own pages are freed;
      ``drop(req)``: every own page freed, nothing cached (KV never written or not trusted);
      ``quarantine(req, keep_row)``: own pages leave the request but stay allocated (a late remote
      write may still land on them) until ``free_quarantined`` gets them back, once each; with
      ``keep_row`` the table row too (a remote write may still land on its per-request record).
      Each unlocks the prefix and frees the row (unless kept). Ending a request that holds no row (never
      admitted, or already ended) raises: a double release means two owners.

    With a hierarchical cache (``hicache`` enabled, ``pool`` given) evicted pages move to a host
    pool, and a waiting request whose prefix continues there must pass ``prepare`` before
    ``admit``: it loads that continuation back into fresh device pages and answers False until
    the copy has landed. ``forget(req)`` gives up a waiting request's load (abort).

    With several scheduler ranks (``agree_hits_with``) each rank's host pool and storage shard
    hold what they hold, so ``prepare`` first gathers every rank's hit (device pages, pages
    continuing them in host memory or storage) and every rank loads up to the minimum: all of
    them admit the request with the same cached prefix and compute the rest (docs/hicache.md).

    ``check(live)``: ``free + cached + own pages of live requests + quarantined + loading ==
    total``, the same over host pages (``free + cached + in flight == total``), and every row
    held by a live request or quarantined; a leak or double count raises.

    ``record_received(req)``: the request's record (its row's, in a pool with per-request records)
    was written by P/D: the pool's rings hold the state before ``req.kv_len``.
    """

    def __init__(self, num_pages: int, page_size: int, max_reqs: int, max_context_len: int,
                 disable_radix_cache: bool = False, hicache: HiCacheConfig | None = None,
                 pool: KVPool | None = None, storage_compat: Mapping[str, object] | None = None,
                 hash_key: bytes = b""):
        self.page_size = page_size
        self.hash_key = hash_key  # of the block hash chain (mem/radix_cache.py) and the storage namespace
        self.allocator = PageAllocator(num_pages)
        self.pool = pool  # told when a table row changes hands (a per-request record lives there)
        # The cache returns the pages it lets go of (evicted, duplicates, flushed); freed here only.
        self.cache: RadixCache = self._make_cache(disable_radix_cache, hicache, pool, storage_compat)
        self.table = ReqToTokenTable(max_reqs, max_context_len, page_size)
        self._quarantined: set[int] = set()
        self._quarantined_rows: set[int] = set()
        self._loads: dict[int | None, LoadHandle] = {}  # Req.uid -> the load-back it waits for
        self._agree: AgreeFn | None = None  # None: one rank, its hits need no agreement
        self.num_evicted_pages = 0
        self.hit_tokens = dict.fromkeys(TIERS, 0)

    def _make_cache(self, disable: bool, hicache: HiCacheConfig | None, pool: KVPool | None,
                    compat: Mapping[str, object] | None) -> RadixCache:
        if hicache is None or not hicache.enabled:
            return RadixCache(self.allocator, self.page_size, disable=disable, hash_key=self.hash_key,
                              reuse_tokens=pool.reuse_tokens if pool is not None else self.page_size)
        if pool is None:
            raise ValueError("enable_hierarchical_cache: the host tier needs the device KV pool")
        host = HostKVPool(pool, hicache.num_host_pages(self.allocator.num_pages, host_page_bytes(pool)),
                          hicache.mem_layout)
        storage = self._make_storage(hicache, compat) if hicache.storage_backend else None
        # Lent for the start-up copy timing only: the cache writes into them and keeps none.
        probe = self.allocator.alloc(min(PROBE_PAGES, self.allocator.num_free)) or []
        try:
            return HiRadixCache(self.allocator, self.page_size, host, hicache.write_policy, storage=storage,
                                prefill_tokens_per_s=hicache.pinned_prefill_tokens_per_s(), probe_pages=probe,
                                hash_key=self.hash_key, reuse_tokens=pool.reuse_tokens)
        finally:
            self.allocator.free(probe)

    def _make_storage(self, hicache: HiCacheConfig, compat: Mapping[str, object] | None) -> StorageLeg:
        from pdserve.mem.storage import create_page_store, namespace

        if not compat:
            raise ValueError("hicache_storage_backend: the storage tier needs the KV compatibility record")
        assert hicache.storage_backend is not None
        # Keyed deployments key their stored pages too: a storage key is a chain over the tokens
        # (mem/storage/keys.py), which whoever lists the store's keys could otherwise test guesses against.
        ns = namespace(compat, self.hash_key.hex() if self.hash_key else None)
        store = create_page_store(hicache.storage_backend, directory=self._rank_dir(hicache.storage_dir, compat),
                                  size_gb=hicache.storage_size_gb or DEFAULT_STORAGE_GB, namespace=ns,
                                  extra_config=hicache.store_extra_config(), auth_token=hicache.auth_token,
                                  host=hicache.host)
        return StorageLeg(store, ns, hicache.chunk_tokens(self.page_size), self.page_size,
                          policy=hicache.prefetch_policy())

    @staticmethod
    def _rank_dir(directory: str | None, compat: Mapping[str, object]) -> str | None:
        """Each TP rank's shard of the file tier in its own folder (a folder has one owner)."""
        tp_size, tp_rank = compat.get("tp_size", 1), compat.get("tp_rank", 0)
        if not directory or tp_size == 1:
            return directory
        return os.path.join(directory, f"tp{tp_rank}-of-{tp_size}")

    def agree_hits_with(self, agree: AgreeFn) -> None:
        """This manager is one rank of several in lock step (one attention group): ``prepare``
        agrees on hit lengths through ``agree``, and copies between tiers complete at the same
        loop point on every rank, so their device trees stay identical."""
        self._agree = agree
        if self.hicache is not None:
            self.hicache.sync_copies = True

    @property
    def hicache(self) -> HiRadixCache | None:
        return self.cache if isinstance(self.cache, HiRadixCache) else None

    # ---------------------------------------------------------------- queries
    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def num_free_pages(self) -> int:
        return self.allocator.num_free

    @property
    def num_cached_pages(self) -> int:
        return self.cache.num_cached_pages

    @property
    def num_evictable_pages(self) -> int:
        return self.cache.num_evictable_pages

    @property
    def num_quarantined_pages(self) -> int:
        return len(self._quarantined)

    @property
    def req_to_token(self) -> torch.Tensor:
        """[max_reqs, context] slot ids the attention backend gathers from (read-only to callers)."""
        return self.table.table

    def match_len(self, tokens: Sequence[int], salt: str = "") -> int:
        """Tokens of ``tokens`` the prefix cache holds now in ``salt``'s tree (marks them used; locks nothing)."""
        return self.cache.match_prefix(tokens, salt).num_tokens

    def can_allocate(self, n: int) -> bool:
        """``n`` pages are free or evictable now."""
        return n <= self.allocator.num_free + self.cache.num_evictable_pages

    # -------------------------------------------------------------- load-back
    def prepare(self, req: ReqMemory, tokens: Sequence[int]) -> bool:
        """Before ``admit``: True when ``req`` may be admitted now. When the cached prefix of
        ``tokens`` continues in host memory (or storage), loads it into fresh device pages and
        answers False until the copy has landed (no layer may read KV that has not arrived).
        With several ranks, every rank loads only as far as every rank can (``_agreed_hit``)."""
        hi = self.hicache
        if hi is None:
            return True
        hi.poll()
        handle = self._loads.get(req.uid)
        if handle is not None:
            self._free_redundant(handle)
            return handle.finished  # the same on every rank: their copies complete in lock step
        match = hi.match_tiers(tokens, req.cache_salt)
        from_storage: int | None = 0
        if not match.busy:
            # its storage read runs on the storage thread; None: the prefetch policy says wait
            from_storage = hi.prefetch(req.uid, tokens, match, req.cache_salt)
            if from_storage:
                match = hi.match_tiers(tokens, req.cache_salt)
        waiting = match.busy or from_storage is None  # busy: another request loads the same pages
        from_storage = from_storage or 0
        # host: what to load, up to a reusable boundary; ahead: device pages it resumes after
        device, host = len(match.device.pages), hi.usable_host(match)
        ahead = len(match.ahead) if host else 0
        # A host hit too short to beat recomputation is recomputed (stored chunks, already read, are
        # always taken). Each rank judges by its own measured costs; the agreement takes the minimum.
        worth = host == 0 or from_storage > 0 or hi.costs.worth_loading("host", host * self.page_size)
        if not worth:
            hi.counters.host_loads_skipped += 1
        agreed = self._agreed_hit(req, device, ahead + host if worth else 0, waiting)
        if agreed is None:
            return False  # a load or storage read in flight (on some rank): wait for it
        take = agreed - device - ahead
        if take <= 0:
            return True
        # Storage pages continue the host ones: those of the first ``take`` that came from storage.
        return self._start_load(req, hi, match.host[:take], max(0, take - (len(match.host) - from_storage)))

    def _agreed_hit(self, req: ReqMemory, device: int, host: int, busy: bool) -> int | None:
        """Pages of ``req``'s prefix every rank holds (device, then host/storage), None while any
        rank must wait for a load in flight. One rank: its own."""
        if self._agree is None:
            return None if busy else device + host
        rows = self._agree([device, host, int(busy)])
        if any(b for _, _, b in rows):
            return None
        if len({d for d, _, _ in rows}) != 1:
            raise HitDivergedError(f"{req.rid}: ranks hold different device prefixes "
                                   f"{[d for d, _, _ in rows]} pages: their KV caches diverged")
        return min(d + h for d, h, _ in rows)

    def _start_load(self, req: ReqMemory, hi: HiRadixCache, nodes: list[RadixNode], from_storage: int) -> bool:
        hi.lock(nodes[-1])  # before reserving: the eviction it may cause must spare this path
        pages = self._reserve(len(nodes))
        if pages is None:
            hi.unlock(nodes[-1])
            return True  # no room to load into: admit on the device prefix, recompute the rest
        handle = hi.start_load(nodes, pages)
        handle.storage_pages = from_storage
        self._loads[req.uid] = handle
        return handle.finished

    def forget(self, req: ReqMemory) -> None:
        """``req`` will never be admitted (aborted while waiting): give up its load-back. A copy
        in flight is waited for, so its pages land in the cache instead of leaking."""
        handle = self._loads.pop(req.uid, None)
        hi = self.hicache
        if hi is not None:
            hi.cancel_prefetch(req.uid)
        if handle is None or hi is None:
            return
        if not handle.finished:
            handle.op.wait()
            hi.poll()
        self._free_redundant(handle)
        hi.unlock(handle.nodes[-1])

    def _free_redundant(self, handle: LoadHandle) -> None:
        """Free the pages of a load whose blocks were recomputed and cached while it ran."""
        if handle.redundant:
            self.allocator.free(handle.redundant)
            handle.redundant = []

    def _take_load(self, req: ReqMemory) -> tuple[int, int]:
        """After ``admit`` locked the prefix: drop the load's own lock; tokens it brought up
        from host memory and, of those, first from storage."""
        handle = self._loads.pop(req.uid, None)
        if handle is None:
            return 0, 0
        assert self.hicache is not None and handle.finished
        self._free_redundant(handle)
        self.hicache.unlock(handle.nodes[-1])
        return len(handle.nodes) * self.page_size, handle.storage_pages * self.page_size

    # -------------------------------------------------------------- admission
    def admit(self, req: ReqMemory, tokens: Sequence[int]) -> bool:
        """A table row and the cached prefix of ``tokens`` (locked); False (nothing taken) when
        no row is free. Sets ``kv_len = cached_len`` to the hit and writes its slots."""
        if req.row is not None:
            raise RuntimeError(f"admit: {req.rid} already holds table row {req.row}")
        row = self.table.alloc_row()
        if row is None:
            return False
        if self.pool is not None:
            self.pool.take_row(row)
        match = self.cache.match_prefix(tokens, req.cache_salt)
        self.cache.lock(match.node)
        req.row, req.cache_node = row, match.node
        req.pages, req.num_cached_pages = list(match.pages), len(match.pages)
        req.kv_len = req.cached_len = match.num_tokens
        if match.pages:
            self.table.write(row, 0, self.table.slots_for(req.pages, 0, req.kv_len))
        loaded, stored = self._take_load(req)
        loaded = min(loaded, req.cached_len)
        stored = min(stored, loaded)
        req.cached_by_tier = {"device": req.cached_len - loaded, "host": loaded - stored, "storage": stored}
        return True

    def unadmit(self, req: ReqMemory) -> None:
        """Undo ``admit`` of a request that took no pages of its own."""
        if len(req.pages) != req.num_cached_pages:
            raise RuntimeError(f"unadmit: {req.rid} holds {len(req.pages) - req.num_cached_pages} pages of its own")
        self._unpin(req, "unadmit")

    # ------------------------------------------------------------------ pages
    def grow(self, req: ReqMemory, num_tokens: int, headroom: int = 0) -> bool:
        """Own pages so ``req`` can hold ``num_tokens`` positions, provided ``headroom`` more
        pages stay free or evictable; writes the slots of ``[kv_len, num_tokens)``. False (nothing
        taken) when they do not fit."""
        need = max(0, -(-num_tokens // self.page_size) - len(req.pages))
        pages = self._reserve(need, headroom)
        if pages is None:
            return False
        req.pages.extend(pages)
        self.write_slots(req, req.kv_len, num_tokens)
        return True

    def grow_each(self, reqs: Sequence[ReqMemory]) -> bool:
        """One more page for each of ``reqs`` (decode growth), all or nothing."""
        pages = self._reserve(len(reqs))
        if pages is None:
            return False
        for r, p in zip(reqs, pages):
            r.pages.append(p)
        return True

    def _reserve(self, n: int, headroom: int = 0) -> list[int] | None:
        """n pages, evicting unlocked cache pages if needed, provided ``headroom`` more pages stay
        free or evictable (evicted only once actually needed)."""
        if not self.can_allocate(n + headroom):
            return None
        short = n - self.allocator.num_free
        if short > 0:
            self.evict(short)
        return self.allocator.alloc(n)

    def evict(self, num_pages: int) -> int:
        """Push up to ``num_pages`` unlocked pages out of the device cache (least recently used
        first; with a host tier they stay findable there) and free them; returns how many."""
        pages = self.cache.evict(num_pages)
        self.num_evicted_pages += len(pages)
        self.allocator.free(pages)
        return len(pages)

    def set_event_sink(self, sink: KVEventSink | None) -> None:
        """Who hears the cache's KV events (blocks stored, removed, cleared); each tier reports its own
        ``medium``. None: nobody."""
        self.cache.sink = sink

    def cached_blocks(self) -> list[tuple[int, int | None]]:
        """(hash, parent hash) of every cached block, parents first: a KV-event snapshot."""
        return self.cache.cached_blocks()

    # ------------------------------------------------------------------ slots
    def slots(self, req: ReqMemory, start: int, end: int) -> list[int]:
        """Pool slots of ``req``'s positions ``[start, end)``."""
        return self.table.slots_for(req.pages, start, end)

    def write_slots(self, req: ReqMemory, start: int, end: int) -> None:
        if end > start:
            self.table.write(req.table_row, start, self.slots(req, start, end))

    def write_next_slots(self, reqs: Sequence[ReqMemory], positions: Sequence[int] | None = None) -> list[int]:
        """Decode: the slot of each request's next position (``kv_len``, or ``positions``: an
        overlapped step writes one past a step still in flight), written to its row."""
        ps = self.page_size
        pos = [r.kv_len for r in reqs] if positions is None else list(positions)
        loc = [r.pages[p // ps] * ps + p % ps for r, p in zip(reqs, pos)]
        self.table.write_one_each([r.table_row for r in reqs], pos, loc)
        return loc

    # ---------------------------------------------------------------- release
    def release(self, req: ReqMemory, cache_len: int) -> None:
        """End ``req``: the full pages of ``fill_ids[:cache_len]`` (KV computed and trusted) go to
        the radix cache, which frees duplicates; the rest of its own pages are freed."""
        self._check_held(req, "release")
        # Whole reusable blocks only: a block's last pages write tail rows into its first ones
        # (DeepSeek-V4's bounded layout), so a partial block's pages must never stand for the block.
        full = cache_len // self.page_size // self.cache.reuse_pages * self.cache.reuse_pages
        inserted = self.cache.insert(req.fill_ids[:full * self.page_size], req.pages[:full], req.cache_salt)
        self.allocator.free(inserted.released)
        self.allocator.free(req.pages[full:])
        self._unpin(req, "release")

    def drop(self, req: ReqMemory) -> None:
        """End ``req`` without caching anything: its own pages are freed."""
        self._check_held(req, "drop")
        self.allocator.free(req.pages[req.num_cached_pages:])
        self._unpin(req, "drop")

    def quarantine(self, req: ReqMemory, keep_row: bool = False) -> list[int]:
        """End ``req`` but keep its own pages allocated (returned) until ``free_quarantined``:
        a write may still land on them. ``keep_row``: its table row too (the row's record may be
        written), kept out of use until ``free_quarantined`` names it."""
        self._check_held(req, "quarantine")
        own = req.pages[req.num_cached_pages:]
        self._quarantined.update(own)
        row = req.table_row
        self._unpin(req, "quarantine", free_row=not keep_row)
        if keep_row:
            self._quarantined_rows.add(row)
        return own

    def free_quarantined(self, pages: Sequence[int], row: int | None = None) -> None:
        """Quarantined pages (and ``row``) no write can reach any more go back to the pool."""
        stray = [p for p in pages if p not in self._quarantined]
        if stray or len(set(pages)) != len(pages):
            raise RuntimeError(f"free_quarantined: pages {sorted(stray or pages)} are not quarantined "
                               f"(freed twice, or never quarantined)")
        if row is not None and row not in self._quarantined_rows:
            raise RuntimeError(f"free_quarantined: table row {row} is not quarantined")
        self._quarantined.difference_update(pages)
        self.allocator.free(pages)
        if row is not None:
            self._quarantined_rows.discard(row)
            self.table.free_row(row)

    def record_received(self, req: ReqMemory) -> None:
        if self.pool is None:
            raise RuntimeError("record_received: this manager was built without its pool")
        self.pool.record_filled(req.table_row, req.kv_len)

    def flush(self) -> bool:
        """Empty the prefix cache (every tier); refused (False) while a request locks part of it."""
        if self._loads:
            return False
        pages = self.cache.reset()
        if pages is None:
            return False
        self.allocator.free(pages)
        return True

    def count_hit(self, by_tier: dict[str, int]) -> None:
        """A request's first admission hit ``by_tier`` tokens (the server's per-tier counters)."""
        for tier, n in by_tier.items():
            self.hit_tokens[tier] += n

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = {f"cache_hit_tokens_{t}": n for t, n in self.hit_tokens.items()}
        hi = self.hicache
        if hi is not None:
            c = hi.counters
            out.update(host_total_pages=hi.host.num_pages, host_cached_pages=hi.num_host_cached_pages,
                       host_free_pages=hi.host.allocator.num_free, host_load_bytes=c.host_load_bytes,
                       host_backup_bytes=c.host_backup_bytes, host_evicted_pages=c.host_evicted_pages,
                       device_demoted_pages=c.device_demoted_pages, storage_hit_pages=c.storage_hit_pages,
                       host_loads_skipped=c.host_loads_skipped, storage_prefetch_skipped=c.storage_prefetch_skipped,
                       storage_prefetching=hi.num_prefetching)
            out.update(hi.costs.info())
            if hi.storage is not None:
                out.update(hi.storage.stats())
        return out

    def close(self) -> None:
        """Stop the storage thread and close the store (the server is ending)."""
        hi = self.hicache
        if hi is not None and hi.storage is not None:
            hi.storage.close()

    def _check_held(self, req: ReqMemory, what: str) -> None:
        if req.row is None:
            raise RuntimeError(f"{what}: {req.rid} holds no KV memory (released twice, or never admitted)")

    def _unpin(self, req: ReqMemory, what: str, free_row: bool = True) -> None:
        """Let go of the prefix lock and the row (unless quarantined); the request holds nothing after."""
        self._check_held(req, what)
        if req.cache_node is None:
            raise RuntimeError(f"{what}: {req.rid} holds a table row but no prefix lock")
        self.cache.unlock(req.cache_node)
        if free_row:
            self.table.free_row(req.table_row)
        req.row, req.cache_node, req.pages, req.num_cached_pages = None, None, [], 0
        req.kv_len = req.cached_len = 0

    # ----------------------------------------------------------------- checks
    def pages_held(self, live: Sequence[ReqMemory]) -> int:
        """Pages owned outside the allocator and the cache: ``live`` requests' own, quarantined,
        those a load-back is filling, and a finished load's redundant copies not yet freed."""
        loading = self.hicache.num_loading_pages if self.hicache is not None else 0
        loading += sum(len(h.redundant) for h in self._loads.values())
        return sum(len(r.pages) - r.num_cached_pages for r in live) + len(self._quarantined) + loading

    def check(self, live: Sequence[ReqMemory]) -> None:
        """Raise on a leak or double count; ``live``: every request that holds memory."""
        held = self.pages_held(live)
        if self.allocator.num_free + self.cache.num_cached_pages + held != self.allocator.num_pages:
            raise RuntimeError(f"page accounting broken: free {self.allocator.num_free} + cached "
                               f"{self.cache.num_cached_pages} + held {held} (quarantined "
                               f"{len(self._quarantined)}) != total {self.allocator.num_pages}")
        if self.hicache is not None:
            self.hicache.check_host_pages()
        rows = sum(r.row is not None for r in live)
        if self.table.num_free_rows + rows + len(self._quarantined_rows) != self.table.max_reqs:
            raise RuntimeError(f"table rows broken: free {self.table.num_free_rows} + held by live requests {rows} "
                               f"+ quarantined {len(self._quarantined_rows)} != {self.table.max_reqs}")
