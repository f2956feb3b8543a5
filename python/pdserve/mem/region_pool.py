"""A KV pool of named regions, each held by the layers that have that kind of state.

The one-page-table case of docs/kv-cache.md ("One layout, many kinds of state"): every region
lives in the request's pages, so the allocator, page table and radix cache carry all of them with
no branch of their own. A region of rate ``r`` keeps one row per ``r`` source tokens: a page holds
``ceil(S / r)`` of them, and the row of the token at slot ``s`` (the last token of its group of
``r``) is sub-slot ``(s % S) // r`` of page ``s // S``. DeepSeek-V4 is its first user (its regions:
models/deepseek_v4_attention.py). P/D and the tiers move the buffers as any pool's (``buffer_layers``
tells P/D which layers each holds; a page's bytes follow from the buffer's shape).
Legend: P pages, S page_size, U rows per page (S for rate 1), N layers holding the region, X region
width, T tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.mem.kv_pool import KVPool
from pdserve.transfer.base import BufferDescriptor


@dataclass(frozen=True)
class RegionSpec:
    """One kind of state: its name, the model layers that keep it, its row width, and its rate (source
    tokens per row: 1 for per-token rows, 4 or 128 for DeepSeek-V4's compressed entries)."""

    name: str
    layers: tuple[int, ...]
    width: int
    rate: int = 1

    def __post_init__(self):
        if not self.layers or self.width < 1 or self.rate < 1:
            raise ValueError(f"region {self.name}: needs at least one layer, width >= 1 and rate >= 1, "
                             f"got layers {self.layers}, width {self.width}, rate {self.rate}")

    def rows_per_page(self, page_size: int) -> int:
        return -(-page_size // self.rate)


@dataclass(frozen=True)
class BoundedState:
    """The bounded layout's per-token rows kept outside the pages (docs/kv-cache.md, "The bounded
    layout"). ``rings``: region -> rows its per-request ring keeps (what a step may still need, plus
    the rows a rolled-back speculative step may have written past it); ``tails``: region -> rows before
    a reusable boundary a prefix resumed there needs; ``reuse_tokens``: the boundaries' spacing, a
    multiple of page_size. A tail of L rows is kept in the pages of the block it closes,
    ``ceil(L * S / reuse_tokens)`` rows a page."""

    rings: dict[str, int]
    tails: dict[str, int]
    reuse_tokens: int
    record_slots: int  # one per request-table row

    def tail_rows_per_page(self, region: str, page_size: int) -> int:
        return -(-self.tails[region] * page_size // self.reuse_tokens)


class RegionKVPool(KVPool):
    """One buffer ``[N, P, U, X]`` per region, in the compute dtype (no FP8 regions yet).

    Readers and writers name the region and the model layer and pass token slots; a rate-``r``
    region maps the slot of a group's last token to its row (a slot inside a group would share the
    row of that group's last token: callers pass only group ends). A layer that does not keep the
    region is a programming error and raises, naming both.
    """

    def __init__(self, num_pages: int, page_size: int, num_layers: int, regions: tuple[RegionSpec, ...],
                 dtype: torch.dtype, device: str | torch.device = "cpu", bounded: BoundedState | None = None):
        """``bounded``: the regions it names keep rings (records, ``[N, slots, ring, X]``, not pages) and
        tails (``<region>_tail`` page buffers); None: every rate-1 region keeps every token's row."""
        super().__init__(num_pages, page_size, num_layers, dtype, device)
        self.regions = regions
        self.bounded = bounded
        self.buffers: dict[str, torch.Tensor] = {}
        self.records: dict[str, torch.Tensor] = {}
        self.rows: dict[str, dict[int, int]] = {}  # region -> model layer -> row of its buffer
        self.rates: dict[str, int] = {}
        # record slot -> layer -> the position after the last row its rings hold; forgotten when the
        # cache manager gives the row to another request (take_row drops a row's dict in one step, so
        # an overlapped forward writing other rows never sees the dict change under it)
        self._held: dict[int, dict[int, int]] = {}
        for spec in regions:
            if spec.name in self.buffers or spec.name in self.records:
                raise ValueError(f"region {spec.name}: declared twice")
            if max(spec.layers) >= num_layers or min(spec.layers) < 0:
                raise ValueError(f"region {spec.name}: layers {spec.layers} outside 0..{num_layers - 1}")
            self.rows[spec.name] = {layer: i for i, layer in enumerate(spec.layers)}
            self.rates[spec.name] = spec.rate
            if bounded is not None and spec.name in bounded.rings:
                self.records[spec.name] = self._zeros(len(spec.layers), bounded.record_slots, bounded.rings[spec.name],
                                                      spec.width)
                if spec.name in bounded.tails:
                    tail = f"{spec.name}_tail"
                    self.buffers[tail] = self._zeros(len(spec.layers), num_pages,
                                                     bounded.tail_rows_per_page(spec.name, page_size), spec.width)
                    self.rows[tail], self.rates[tail] = self.rows[spec.name], 1
            else:
                self.buffers[spec.name] = self._zeros(len(spec.layers), num_pages, spec.rows_per_page(page_size),
                                                      spec.width)

    def _zeros(self, *shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    @property
    def reuse_tokens(self) -> int:
        return self.bounded.reuse_tokens if self.bounded is not None else self.page_size

    def take_row(self, row: int) -> None:
        self._held.pop(row, None)

    def request_state(self, layer: int, slots: torch.Tensor, p0: int, n: int, row: int | None) -> RequestState:
        """How ``layer`` of one request reads the rows before its step (positions ``< p0``) and keeps
        the step's ``n`` rows; ``slots`` [>= p0 + n] the request's token slots, ``row`` its record slot."""
        if self.bounded is None:
            return PageState(self, layer, slots, p0, n)
        if row is None:
            raise ValueError("request_state: the bounded layout needs the request's table row (ForwardBatch.req_rows)")
        return RecordState(self, layer, slots, p0, n, row)

    def _flat(self, region: str, layer: int) -> torch.Tensor:
        rows = self.rows.get(region)
        if rows is None:
            raise KeyError(f"region {region!r}: not in this pool (has {', '.join(self.buffers)})")
        if layer not in rows:
            raise KeyError(f"region {region!r}: layer {layer} does not keep it (layers {tuple(rows)})")
        buf = self.buffers[region][rows[layer]]  # [P, U, X]
        return buf.view(-1, buf.shape[-1])  # [P*U, X]

    def _row_index(self, region: str, slots: torch.Tensor) -> torch.Tensor:
        """Token slots [...] -> row indices [...] of the flat ``[P*U, X]`` buffer."""
        rate = self.rates[region]
        if rate == 1:
            return slots
        S = self.page_size
        return slots // S * (-(-S // rate)) + slots % S // rate

    def set_rows(self, region: str, layer: int, loc: torch.Tensor, rows: torch.Tensor) -> None:
        """loc [T] token slots (group ends for a rate > 1 region); rows [T, X] written at their rows."""
        flat = self._flat(region, layer)
        flat[self._row_index(region, loc)] = rows.to(self.dtype)

    def get_rows(self, region: str, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """slots [...] token slots -> the rows stored for them, [..., X]."""
        flat = self._flat(region, layer)
        return flat[self._row_index(region, slots)]

    def page_buffers(self) -> list[tuple[str, torch.Tensor]]:
        return list(self.buffers.items())

    def buffer_layers(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(self.rows[name]) for name in self.buffers}

    def buffer_descriptors(self) -> list[BufferDescriptor]:
        out = []
        for name, buf in self.page_buffers():
            item = buf.element_size()
            out.append(BufferDescriptor(name, buf.data_ptr(), buf.stride(1) * item, buf.stride(0) * item,
                                        buf.shape[0], self.num_pages))
        return out


class RequestState:
    """One layer of one request in one step: ``prior(region, lo)`` -> rows of positions ``lo..p0-1``
    (read before ``keep`` overwrites anything); ``keep(region, rows)`` the step's rows [n, X];
    ``done()`` once every region of the layer is kept."""

    def __init__(self, pool: RegionKVPool, layer: int, slots: torch.Tensor, p0: int, n: int):
        self.pool, self.layer, self.slots, self.p0, self.n = pool, layer, slots, p0, n

    def prior(self, region: str, lo: int) -> torch.Tensor:
        raise NotImplementedError

    def keep(self, region: str, rows: torch.Tensor) -> None:
        raise NotImplementedError

    def done(self) -> None:
        pass


class PageState(RequestState):
    """Every token's rows in its slot of the pages."""

    def prior(self, region: str, lo: int) -> torch.Tensor:
        return self.pool.get_rows(region, self.layer, self.slots[lo:self.p0])

    def keep(self, region: str, rows: torch.Tensor) -> None:
        self.pool.set_rows(region, self.layer, self.slots[self.p0:self.p0 + self.n], rows)


class RecordState(RequestState):
    """The bounded layout: rows in the request's ring (row p at p % ring), and the rows a reusable
    boundary's continuation needs in that boundary's tail. A step resumes from its own ring when the
    ring holds its start (at most ``ring - needed`` rows past it, a rolled-back speculative step), else
    from the tail of a reusable boundary; any other start is a hit the radix cache must not give."""

    def __init__(self, pool: RegionKVPool, layer: int, slots: torch.Tensor, p0: int, n: int, row: int):
        super().__init__(pool, layer, slots, p0, n)
        assert pool.bounded is not None
        self.bounded, self.row = pool.bounded, row
        held = pool._held.get(row, {}).get(layer)
        self.held = held if held is not None else 0
        self.from_ring = held is not None and p0 <= held
        if not self.from_ring and p0 % self.bounded.reuse_tokens:
            have = "nothing" if held is None else f"rows up to position {held}"
            raise RuntimeError(f"layer {layer}: a step starting at position {p0} has neither its own record "
                               f"(it holds {have}) nor a reusable boundary (multiples of "
                               f"{self.bounded.reuse_tokens}) to resume from")

    def prior(self, region: str, lo: int) -> torch.Tensor:
        positions = torch.arange(lo, self.p0, device=self.slots.device)
        if self.from_ring:
            ring = self.pool.records[region][self.pool.rows[region][self.layer], self.row]  # [R, X]
            if lo < self.held - ring.shape[0]:  # overwritten by the rows after it
                raise RuntimeError(f"{region}: layer {self.layer} needs rows from position {lo}, its ring of "
                                   f"{ring.shape[0]} holds them from {self.held - ring.shape[0]}")
            return ring[positions % ring.shape[0]]
        if lo == self.p0:
            return self.pool.records[region].new_zeros(0, self.pool.records[region].shape[-1])
        rows = self._tail(f"{region}_tail")[self._tail_rows(region, positions)]
        # into the ring too: a step shorter than the tail leaves some of them for the next step to read
        ring = self.pool.records[region][self.pool.rows[region][self.layer], self.row]  # [R, X]
        ring[positions[-ring.shape[0]:] % ring.shape[0]] = rows[-ring.shape[0]:]
        return rows

    def keep(self, region: str, rows: torch.Tensor) -> None:
        ring = self.pool.records[region][self.pool.rows[region][self.layer], self.row]  # [R, X]
        R = ring.shape[0]
        positions = torch.arange(self.p0, self.p0 + self.n, device=self.slots.device)
        ring[positions[-R:] % R] = rows[-R:].to(ring.dtype)
        if region not in self.bounded.tails:
            return
        B, L = self.bounded.reuse_tokens, self.bounded.tails[region]
        in_tail = positions % B >= B - L
        if in_tail.any():
            self._tail(f"{region}_tail")[self._tail_rows(region, positions[in_tail])] = rows[in_tail].to(ring.dtype)

    def done(self) -> None:
        self.pool._held.setdefault(self.row, {})[self.layer] = self.p0 + self.n

    def _tail(self, name: str) -> torch.Tensor:
        buf = self.pool.buffers[name][self.pool.rows[name][self.layer]]  # [P, c, X]
        return buf.view(-1, buf.shape[-1])  # [P*c, X]

    def _tail_rows(self, region: str, positions: torch.Tensor) -> torch.Tensor:
        """Positions in the last L of their block -> rows of the flat tail buffer: tail row j of the
        block starting at s lives in the block's page j // c, at row j % c (c rows a page)."""
        B, L, S = self.bounded.reuse_tokens, self.bounded.tails[region], self.pool.page_size
        c = self.bounded.tail_rows_per_page(region, S)
        start = positions - positions % B
        j = positions % B - (B - L)
        pages = self.slots[start + j // c * S] // S
        return pages * c + j % c
