"""Pure planning of KV writes: which bytes each source rank writes to each destination rank.

Legend: L layers, P pages, H kv heads (model total), h local heads of one rank, S page_size,
D head_dim. A GQA buffer ("k" or "v") of one rank is ``[L, P, h, S, D]`` (HND), an MLA buffer
("latent") ``[L, P, S, C+R]``; layer ``l``'s page ``p`` starts at ``l*layer_stride + p*page_bytes``
and one local head's slice of a page is ``head_bytes = S*D*dtype_bytes`` long.

Ranks: attention rank ``r = dp_rank * tp_size + tp_rank``. With H >= tp, tp rank ``t`` holds heads
``[t*H/tp, (t+1)*H/tp)``; with H < tp the heads are replicated, rank ``t`` holding head
``t*H//tp`` (``layers.linear.QKVParallelLinear``), so ``tp/H`` ranks form each replica set.

A request's transfer is a list of position-aligned pages: ``src_pages[i]`` on the source and
``dst_pages[i]`` on the destination hold the same token positions. Whole pages move (the tail
of a last, partial page is junk the destination overwrites later), never single tokens.

The write count both sides agree on is in **page-writes**: an op covering ``k`` pages counts
``k``. Decode can compute it from its own page count and the two layouts alone; the number of
network writes also depends on how prefill's pages and chunks fall (runs merge only where both
sides are contiguous), which decode cannot see.

Regions (docs/kv-cache.md, "One layout, many kinds of state"): an MLA pool may hold further
replicated regions of the same pages beside its latent (DeepSeek-V3.2's ``index_k``). Each is
one more buffer ``[L, P, ...]`` with its own page bytes, layer stride and dtype (``KVLayout.regions``);
it moves like the latent (whole pages from the request's random source rank), and its writes are
counted like the latent's, so a region not sent leaves the room short of its expected writes.

A ``regions`` layout (``mem.region_pool.RegionKVPool``, DeepSeek-V4) has no buffer of its own: every
buffer is such a region, replicated like MLA's latent, and a region may be kept by only some layers
(``Region.layers``): its buffer's row ``i`` is model layer ``layers[i]``, so layer ``l``'s writes are
those of the regions that layer keeps, and the count both sides expect sums exactly those.

Records (``KVLayout.records``; DeepSeek-V4's bounded layout, docs/kv-cache.md): per-request state
outside the pages, one slot per request-table row. A record buffer is ``[N, slots, ...]``: layer
``l``'s slot ``s`` is ``page_bytes`` at ``row(l) * layer_stride + s * page_bytes``. A request's record
moves whole, once, after the last chunk of its layer has written it (``plan_record_writes``), from the
same random source rank as its pages, into the slot decode's KV request names; each (layer, record)
write counts one in the page-write count both sides agree on, so a record left out leaves the room short.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from pdserve.config import PACK_POLICIES

KINDS = ("gqa", "mla", "regions")
BUFFERS: dict[str, tuple[str, ...]] = {"gqa": ("k", "v"), "mla": ("latent",), "regions": ()}
REPLICATED = ("mla", "regions")  # one KV head kept whole on every TP rank: one source rank per request
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}
MAX_RANKS = 4096  # attention ranks of one side: far above any cluster, low enough to list


class LayoutError(ValueError):
    """The two sides cannot exchange KV as laid out; the message names the field."""


@dataclass(frozen=True)
class Region:
    """A replicated region of the layout's pages beside the kind's own buffers (``index_k``):
    layer ``l``'s page ``p`` is ``page_bytes`` at ``l * layer_stride + p * page_bytes`` of its buffer."""

    name: str
    dtype: str  # what the region holds (index keys stay in the model dtype under an FP8 latent)
    page_bytes: int
    layer_stride: int  # from one row of the buffer to the next
    layers: tuple[int, ...] = ()  # model layers keeping it, row i holding layers[i]; (): every layer

    def describe(self) -> str:
        held = f", layers {','.join(map(str, self.layers))}" if self.layers else ""
        return f"{self.name} ({self.dtype}, {self.page_bytes} B/page{held})"


@dataclass(frozen=True)
class KVLayout:
    """One side's KV pool as the transfer sees it; every rank of the side has the same geometry.

    ``page_bytes`` and ``layer_stride`` are per buffer (K and V share them; see
    ``mem.kv_pool.BufferDescriptor``).
    """

    kind: str  # "gqa" (HND pages), "mla" (latent pages, identical on every tp rank) or "regions" (only regions)
    tp_size: int  # attention-TP ranks sharing one request's KV
    num_kv_heads: int  # the model's KV heads (1 for MLA)
    page_size: int
    dtype: str
    num_layers: int
    num_pages: int
    page_bytes: int  # one page of one layer in one buffer, all local heads
    layer_stride: int  # bytes from layer l to l + 1 in one buffer
    dp_size: int = 1  # attention-DP groups (decode's DP attention)
    regions: tuple[Region, ...] = field(default=())  # replicated regions after the kind's buffers
    records: tuple[Region, ...] = field(default=())  # per-request records (a "page" is one record slot)
    record_slots: int = 0  # record slots of each record buffer (the side's request-table rows)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise LayoutError(f"kind: {self.kind!r} is not one of {KINDS}")
        if self.dtype not in DTYPE_BYTES:
            raise LayoutError(f"dtype: {self.dtype!r} is not one of {tuple(DTYPE_BYTES)}")
        for name in ("tp_size", "num_kv_heads", "page_size", "num_layers", "num_pages", "page_bytes", "dp_size"):
            if getattr(self, name) < 1:
                raise LayoutError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.tp_size * self.dp_size > MAX_RANKS:
            raise LayoutError(f"tp_size, dp_size: {self.tp_size} x {self.dp_size} ranks (at most {MAX_RANKS})")
        if self.kind in REPLICATED and self.num_kv_heads != 1:
            what = "an MLA latent" if self.kind == "mla" else "a regions layout (DeepSeek-V4's K=V head)"
            raise LayoutError(f"num_kv_heads: {what} is one head, got {self.num_kv_heads}")
        H, p = self.num_kv_heads, self.tp_size
        if H % p and p % H:
            raise LayoutError(f"num_kv_heads: {H} heads cannot be split over tp_size {p} "
                              f"(one must divide the other)")
        if self.page_bytes % self.local_heads:
            raise LayoutError(f"page_bytes: {self.page_bytes} is not a multiple of {self.local_heads} local heads")
        if self.layer_stride < self.num_pages * self.page_bytes:
            raise LayoutError(f"layer_stride: {self.layer_stride} < num_pages * page_bytes "
                              f"({self.num_pages} * {self.page_bytes})")
        self._check_regions()

    def _check_regions(self) -> None:
        if self.regions and self.kind not in REPLICATED:
            raise LayoutError(f"regions: only an MLA layout (or a regions layout) has replicated regions, "
                              f"got {self.kind} with {[r.name for r in self.regions]}")
        if self.kind == "regions" and not self.regions:
            raise LayoutError("regions: a regions layout needs at least one region")
        if self.records and self.kind not in REPLICATED:
            raise LayoutError(f"records: only a replicated layout moves per-request records, got {self.kind}")
        if bool(self.records) != (self.record_slots > 0) or self.record_slots < 0:
            raise LayoutError(f"record_slots: {self.record_slots} for records {[r.name for r in self.records]}")
        names = [r.name for r in self.regions + self.records]
        if len(set(names)) != len(names) or set(names) & set(BUFFERS[self.kind]):
            raise LayoutError(f"regions, records: {names} repeat a buffer name")
        for field_name, group, count in (("regions", self.regions, self.num_pages),
                                         ("records", self.records, self.record_slots)):
            for r in group:
                self._check_region(field_name, r, count)

    def _check_region(self, field_name: str, r: Region, count: int) -> None:
        if r.dtype not in DTYPE_BYTES:
            raise LayoutError(f"{field_name}.{r.name}.dtype: {r.dtype!r} is not one of {tuple(DTYPE_BYTES)}")
        if r.page_bytes < 1 or r.layer_stride < count * r.page_bytes:
            raise LayoutError(f"{field_name}.{r.name}: page_bytes {r.page_bytes}, layer_stride {r.layer_stride} "
                              f"do not hold {count} {'pages' if field_name == 'regions' else 'slots'}")
        if list(r.layers) != sorted(set(r.layers)) or any(not 0 <= x < self.num_layers for x in r.layers):
            raise LayoutError(f"{field_name}.{r.name}.layers: {r.layers} are not distinct ascending layers "
                              f"of [0, {self.num_layers})")

    @classmethod
    def from_descriptors(cls, kind: str, tp_size: int, num_kv_heads: int, page_size: int, dtype: str,
                         descriptors: Sequence, dp_size: int = 1,
                         region_dtypes: Mapping[str, str] | None = None,
                         region_layers: Mapping[str, tuple[int, ...]] | None = None,
                         num_layers: int | None = None, records: Sequence = ()) -> KVLayout:
        """From a pool's ``buffer_descriptors()``: the kind's buffers first (sharing one geometry),
        then any replicated regions (``region_dtypes``: their dtypes by name, else ``dtype``;
        ``region_layers``: the model layers keeping each, else every one of ``num_layers``, which
        defaults to the first buffer's rows). A regions layout's own geometry is its first region's.
        ``records``: the pool's ``record_descriptors()`` (dtypes and layers from the same mappings)."""
        own = BUFFERS.get(kind, ())
        names = tuple(d.name for d in descriptors)
        if kind in BUFFERS and names[:len(own)] != own:
            raise LayoutError(f"descriptors: a {kind} pool has buffers {own} first, got {names}")
        first = descriptors[0]
        num_layers = first.num_layers if num_layers is None else num_layers
        held = region_layers or {}
        for d in descriptors[1:]:
            rows = len(held[d.name]) if d.name in held else num_layers
            if (d.num_layers, d.num_pages) != (rows, first.num_pages) or (
                    d.name in own and (d.page_bytes, d.layer_stride) != (first.page_bytes, first.layer_stride)):
                raise LayoutError(f"descriptors: buffer {d.name!r} has another geometry than {first.name!r}")
        dtypes = region_dtypes or {}
        regions = tuple(Region(d.name, dtypes.get(d.name, dtype), d.page_bytes, d.layer_stride,
                               _held_layers(held.get(d.name), num_layers))
                        for d in descriptors[len(own):])
        kept = tuple(Region(d.name, dtypes.get(d.name, dtype), d.page_bytes, d.layer_stride,
                            _held_layers(held.get(d.name), num_layers)) for d in records)
        slots = {d.num_pages for d in records}
        if len(slots) > 1:
            raise LayoutError(f"records: buffers with different slot counts {sorted(slots)}")
        return cls(kind, tp_size, num_kv_heads, page_size, dtype, num_layers, first.num_pages,
                   first.page_bytes, first.layer_stride, dp_size, regions, kept, slots.pop() if slots else 0)

    @property
    def buffers(self) -> tuple[str, ...]:
        """Every registered buffer, pages then records (the order of a side's buffer addresses)."""
        return self.paged + tuple(r.name for r in self.records)

    @property
    def paged(self) -> tuple[str, ...]:
        """The buffers of the pages (the kind's own, then its regions)."""
        return BUFFERS[self.kind] + tuple(r.name for r in self.regions)

    @property
    def record_bytes(self) -> int:
        """Bytes of one request's records over every layer keeping them (what a room moves beside its pages)."""
        return sum(self.rows(r.name) * r.page_bytes for r in self.records)

    def geometry(self, buffer: str) -> tuple[int, int]:
        """``(page_bytes, layer_stride)`` of ``buffer``: the kind's buffers share the layout's (a record's
        "page" is one slot)."""
        for r in self.regions + self.records:
            if r.name == buffer:
                return r.page_bytes, r.layer_stride
        if buffer not in BUFFERS[self.kind]:
            raise LayoutError(f"buffer: {buffer!r} is not one of {self.buffers}")
        return self.page_bytes, self.layer_stride

    def row(self, buffer: str, layer: int) -> int | None:
        """The row of ``buffer`` holding model ``layer``; None where that layer keeps no such buffer."""
        for r in self.regions + self.records:
            if r.name == buffer and r.layers:
                return r.layers.index(layer) if layer in r.layers else None
        return layer

    def rows(self, buffer: str) -> int:
        """How many layers keep ``buffer`` (its rows)."""
        for r in self.regions + self.records:
            if r.name == buffer and r.layers:
                return len(r.layers)
        return self.num_layers

    def layer_buffers(self, layer: int) -> tuple[str, ...]:
        """The page buffers model ``layer`` keeps, in ``paged`` order (what its page writes cover)."""
        return tuple(b for b in self.paged if self.row(b, layer) is not None)

    def layer_records(self, layer: int) -> tuple[str, ...]:
        """The record buffers model ``layer`` keeps (one write each per request)."""
        return tuple(r.name for r in self.records if self.row(r.name, layer) is not None)

    def describe_regions(self) -> str:
        """The buffers as a peer's refusal names them: ``latent+index_k (float32, 2048 B/page)``."""
        return "+".join([*BUFFERS[self.kind], *(r.describe() for r in self.regions)])

    def describe_records(self) -> str:
        """The records as a peer's refusal names them: ``none`` for a layout keeping every state in pages."""
        return "+".join(r.describe().replace("B/page", "B/slot") for r in self.records) or "none"

    @property
    def local_heads(self) -> int:
        return max(1, self.num_kv_heads // self.tp_size)

    @property
    def head_bytes(self) -> int:
        return self.page_bytes // self.local_heads

    @property
    def num_ranks(self) -> int:
        return self.dp_size * self.tp_size

    def head_range(self, tp_rank: int) -> tuple[int, int]:
        """Global heads ``[lo, hi)`` held by ``tp_rank``."""
        H, p = self.num_kv_heads, self.tp_size
        lo = tp_rank * H // p
        return lo, lo + self.local_heads

    def holders(self, head: int) -> range:
        """TP ranks holding global ``head`` (several when heads are replicated)."""
        H, p = self.num_kv_heads, self.tp_size
        if H >= p:
            per = H // p
            return range(head // per, head // per + 1)
        return range(head * p // H, (head + 1) * p // H)

    def group(self, dp_rank: int) -> range:
        """Attention ranks of DP group ``dp_rank``."""
        if not 0 <= dp_rank < self.dp_size:
            raise LayoutError(f"dp_rank: {dp_rank} outside [0, {self.dp_size})")
        return range(dp_rank * self.tp_size, (dp_rank + 1) * self.tp_size)


@dataclass(frozen=True)
class WriteOp:
    """Copy ``nbytes`` from ``src_rank``'s buffer at ``src_offset`` to ``dst_rank``'s same-named
    buffer at ``dst_offset`` (offsets from each buffer's base); covers ``pages`` token pages."""

    src_rank: int
    dst_rank: int
    buffer: str
    layer: int
    src_offset: int
    dst_offset: int
    nbytes: int
    pages: int


@dataclass(frozen=True)
class Segment:
    """A head block one source rank sends to one destination rank: ``nheads`` heads starting at
    local head ``src_head`` there and ``dst_head`` here. ``full``: the block is every local head
    on both sides, so it is a whole page and consecutive pages are one contiguous block."""

    src_rank: int
    dst_rank: int
    src_head: int
    dst_head: int
    nheads: int
    full: bool


def check_compatible(src: KVLayout, dst: KVLayout) -> None:
    """Raise LayoutError naming the first field that makes the transfer impossible."""
    for name in ("kind", "num_kv_heads", "page_size", "dtype", "num_layers", "head_bytes"):
        a, b = getattr(src, name), getattr(dst, name)
        if a != b:
            raise LayoutError(f"{name}: prefill has {a}, decode has {b}")
    if [(r.name, r.dtype, r.page_bytes, r.layers) for r in src.regions] != [
            (r.name, r.dtype, r.page_bytes, r.layers) for r in dst.regions]:
        raise LayoutError(f"regions: prefill has {src.describe_regions()}, decode has {dst.describe_regions()}")
    if [(r.name, r.dtype, r.page_bytes, r.layers) for r in src.records] != [
            (r.name, r.dtype, r.page_bytes, r.layers) for r in dst.records]:
        raise LayoutError(f"records: prefill has {src.describe_records()}, decode has {dst.describe_records()}")


def _held_layers(layers: tuple[int, ...] | None, num_layers: int) -> tuple[int, ...]:
    """A region's ``layers`` as the layout records them: () when every layer keeps it."""
    if layers is None or tuple(layers) == tuple(range(num_layers)):
        return ()
    return tuple(layers)


def source_pick(seed: int, room: int) -> int:
    """The request's reproducible random draw (both sides compute it from the same inputs)."""
    return random.Random(seed ^ room).getrandbits(32)


def segments(src: KVLayout, dst: KVLayout, *, room: int = 0, seed: int = 0,
             src_dp_rank: int = 0, dst_dp_rank: int = 0) -> list[Segment]:
    """Who sends which heads to whom for one request; every destination head exactly once.

    MLA: one source rank, drawn at random among the replicas, feeds every destination rank.
    GQA: head-range intersections; where the source replicates a head, destination rank ``j``
    takes replica ``(pick + j) % replicas`` so replicas share the load.
    """
    check_compatible(src, dst)
    src_ranks, dst_ranks = src.group(src_dp_rank), dst.group(dst_dp_rank)
    pick = source_pick(seed, room)
    if src.kind in REPLICATED:
        s = src_ranks[pick % src.tp_size]
        return [Segment(s, d, 0, 0, 1, True) for d in dst_ranks]
    out: list[Segment] = []
    for j, d in enumerate(dst_ranks):
        lo, hi = dst.head_range(j)
        for head in range(lo, hi):
            reps = src.holders(head)
            t = reps[(pick + j) % len(reps)]
            src_head = head - src.head_range(t)[0]
            last = out[-1] if out and out[-1].dst_rank == d else None
            if last and last.src_rank == src_ranks[t] and last.src_head + last.nheads == src_head:
                out[-1] = Segment(last.src_rank, d, last.src_head, last.dst_head, last.nheads + 1, False)
            else:
                out.append(Segment(src_ranks[t], d, src_head, head - lo, 1, False))
    return [Segment(g.src_rank, g.dst_rank, g.src_head, g.dst_head, g.nheads,
                    g.nheads == src.local_heads == dst.local_heads) for g in out]


def page_runs(src_pages: Sequence[int], dst_pages: Sequence[int]) -> list[tuple[int, int]]:
    """Maximal ``(start index, length)`` runs over which both page lists count up by one."""
    runs: list[tuple[int, int]] = []
    for i in range(len(src_pages)):
        if runs and src_pages[i] == src_pages[i - 1] + 1 and dst_pages[i] == dst_pages[i - 1] + 1:
            start, n = runs[-1]
            runs[-1] = (start, n + 1)
        else:
            runs.append((i, 1))
    return runs


def _check_pages(layout: KVLayout, pages: Sequence[int], field: str) -> None:
    for i, p in enumerate(pages):
        if not 0 <= p < layout.num_pages:
            raise LayoutError(f"{field}[{i}]: page {p} outside the pool's [0, {layout.num_pages})")


def _check_layers(layout: KVLayout, layers: Sequence[int]) -> None:
    for layer in layers:
        if not 0 <= layer < layout.num_layers:
            raise LayoutError(f"layers: {layer} outside [0, {layout.num_layers})")


def plan_writes(src: KVLayout, dst: KVLayout, src_pages: Sequence[int], dst_pages: Sequence[int],
                layers: Iterable[int] | None = None, *, room: int = 0, seed: int = 0,
                src_dp_rank: int = 0, dst_dp_rank: int = 0) -> list[WriteOp]:
    """Every write of one request (or one chunk of it) for ``layers`` (default: all), ordered by
    layer, buffer, segment, page. Raises LayoutError on anything that cannot be sent."""
    if len(src_pages) != len(dst_pages):
        raise LayoutError(f"dst_pages: {len(dst_pages)} pages for {len(src_pages)} source pages")
    _check_pages(src, src_pages, "src_pages")
    _check_pages(dst, dst_pages, "dst_pages")
    layers = list(range(src.num_layers)) if layers is None else list(layers)
    _check_layers(src, layers)
    segs = segments(src, dst, room=room, seed=seed, src_dp_rank=src_dp_rank, dst_dp_rank=dst_dp_rank)
    runs = page_runs(src_pages, dst_pages)
    ops: list[WriteOp] = []
    for layer in layers:
        for buffer in src.layer_buffers(layer):
            for g in segs:
                ops.extend(_segment_ops(src, dst, g, buffer, layer, src_pages, dst_pages, runs))
    return ops


def _segment_ops(src: KVLayout, dst: KVLayout, g: Segment, buffer: str, layer: int,
                 src_pages: Sequence[int], dst_pages: Sequence[int], runs) -> list[WriteOp]:
    """One op per page run when the block is whole pages, else one per page (one head block)."""
    (s_page, s_layer), (d_page, d_layer) = src.geometry(buffer), dst.geometry(buffer)
    hb = s_page // src.local_heads
    row = src.row(buffer, layer)  # the same on both sides (check_compatible compares the regions' layers)
    assert row is not None, f"layer {layer} keeps no {buffer}"

    def op(i: int, n: int) -> WriteOp:
        so = row * s_layer + src_pages[i] * s_page + g.src_head * hb
        do = row * d_layer + dst_pages[i] * d_page + g.dst_head * hb
        return WriteOp(g.src_rank, g.dst_rank, buffer, layer, so, do, n * g.nheads * hb, n)

    if g.full:
        return [op(start, n) for start, n in runs]
    return [op(i, 1) for i in range(len(src_pages))]


def plan_record_writes(src: KVLayout, dst: KVLayout, src_slot: int, dst_slot: int,
                       layers: Iterable[int] | None = None, *, room: int = 0, seed: int = 0,
                       src_dp_rank: int = 0, dst_dp_rank: int = 0) -> list[WriteOp]:
    """The record writes of one request for ``layers`` (default: all): each record a layer keeps,
    whole, from the source slot (prefill's request-table row) to ``dst_slot`` (decode's), one page-write
    each, from the request's source rank; ordered by layer, record, destination."""
    for field_name, layout, slot in (("src_slot", src, src_slot), ("dst_slot", dst, dst_slot)):
        if not 0 <= slot < layout.record_slots:
            raise LayoutError(f"{field_name}: record slot {slot} outside [0, {layout.record_slots})")
    layers = list(range(src.num_layers)) if layers is None else list(layers)
    _check_layers(src, layers)
    segs = segments(src, dst, room=room, seed=seed, src_dp_rank=src_dp_rank, dst_dp_rank=dst_dp_rank)
    ops: list[WriteOp] = []
    for layer in layers:
        for name in src.layer_records(layer):
            (s_bytes, s_stride), (d_bytes, d_stride) = src.geometry(name), dst.geometry(name)
            row = src.row(name, layer)
            assert row is not None
            ops.extend(WriteOp(g.src_rank, g.dst_rank, name, layer, row * s_stride + src_slot * s_bytes,
                               row * d_stride + dst_slot * d_bytes, s_bytes, 1) for g in segs)
    return ops


def expected_writes(src: KVLayout, dst: KVLayout, num_pages: int, layers: Iterable[int] | None = None, *,
                    room: int = 0, seed: int = 0, src_dp_rank: int = 0,
                    dst_dp_rank: int = 0) -> dict[tuple[int, int], int]:
    """Page-writes per ``(src_rank, dst_rank)`` for a request of ``num_pages`` pages: what
    ``count_writes(plan_writes(...))`` gives, whatever the page ids and chunking, plus one per record
    a layer keeps (``plan_record_writes``: a request's records always move whole)."""
    layers = list(range(src.num_layers)) if layers is None else list(layers)
    _check_layers(src, layers)
    out: Counter = Counter()
    per_request = sum(num_pages * len(src.layer_buffers(x)) + len(src.layer_records(x)) for x in layers)
    for g in segments(src, dst, room=room, seed=seed, src_dp_rank=src_dp_rank, dst_dp_rank=dst_dp_rank):
        out[(g.src_rank, g.dst_rank)] += per_request
    return dict(out)


def count_writes(ops: Iterable[WriteOp]) -> dict[tuple[int, int], int]:
    """Page-writes per ``(src_rank, dst_rank)`` in ``ops`` (what the completion message reports)."""
    out: Counter = Counter()
    for op in ops:
        out[(op.src_rank, op.dst_rank)] += op.pages
    return dict(out)


def op_addresses(ops: Iterable[WriteOp], src_bases: Mapping[str, int],
                 dst_bases: Mapping[str, int]) -> tuple[list[int], list[int], list[int]]:
    """``(srcs, dsts, lens)`` for a transfer backend, from ops of one (src_rank, dst_rank) pair and
    each side's buffer base address by buffer name."""
    srcs, dsts, lens = [], [], []
    for op in ops:
        srcs.append(src_bases[op.buffer] + op.src_offset)
        dsts.append(dst_bases[op.buffer] + op.dst_offset)
        lens.append(op.nbytes)
    return srcs, dsts, lens


# ------------------------------------------------------------------- packed transfers
# Between different TP sizes a destination's head block is a part of a source page (or the other
# way round), so the plan above has one write per page, layer, buffer and head block. The packed
# path moves each (layer, buffer, head block) of a forward's pages in one write instead: prefill
# gathers the block's heads of those pages into a contiguous staging buffer, the write lands in a
# staging region decode lent for the room, and decode scatters it into its pages once the room's
# writes completed. Decode's staging region for a room is, per head block to it (``segments``
# order) and buffer, a block ``[L, n, nheads, S, D]``, n the room's pages: a forward's pages
# ``[i0, i1)`` of one layer are one contiguous range in it.



@dataclass(frozen=True)
class PackedWrite:
    """Heads ``[src_head, src_head + nheads)`` of ``src_pages`` in ``src_rank``'s ``buffer`` at
    ``layer``, gathered and written as one block to ``dst_offset`` in ``dst_rank``'s staging region."""

    src_rank: int
    dst_rank: int
    buffer: str
    layer: int
    src_head: int
    nheads: int
    src_pages: tuple[int, ...]
    dst_offset: int
    nbytes: int

    @property
    def pages(self) -> int:
        return len(self.src_pages)


def staging_bytes(dst: KVLayout, num_pages: int) -> int:
    """Bytes of a destination rank's staging region for a room of ``num_pages`` pages (what decode
    lends and prefill checks): every layer and buffer (regions included) of those pages, all local heads."""
    return num_pages * sum(dst.rows(b) * dst.geometry(b)[0] for b in dst.paged)


def staging_blocks(src: KVLayout, dst: KVLayout, dst_rank: int, num_pages: int, *, room: int = 0, seed: int = 0,
                   src_dp_rank: int = 0, dst_dp_rank: int = 0) -> list[tuple[Segment, str, int]]:
    """``(head block, buffer, offset)`` of each ``[L, n, nheads, S, D]`` block in ``dst_rank``'s
    staging region for a room of ``num_pages`` pages."""
    out, off = [], 0
    for g in segments(src, dst, room=room, seed=seed, src_dp_rank=src_dp_rank, dst_dp_rank=dst_dp_rank):
        if g.dst_rank != dst_rank:
            continue
        for b in dst.paged:
            out.append((g, b, off))
            off += dst.num_layers * num_pages * g.nheads * dst.head_bytes
    return out


def packing_pays(src: KVLayout, dst: KVLayout, num_pages: int, policy: str) -> bool:
    """Whether decode lends a staging region for a room of ``num_pages`` pages. ``auto``: GQA whose
    head blocks are parts of pages (the TP sizes differ and no side replicates whole pages), over
    two pages or more, where one write per forward replaces one per page; ``on``: every GQA room."""
    if policy not in PACK_POLICIES:
        raise LayoutError(f"disaggregation_transfer_pack: {policy!r} is not one of {PACK_POLICIES}")
    if policy == "off" or src.kind != "gqa" or num_pages < 1:
        return False
    split = src.local_heads != dst.local_heads
    return policy == "on" or (split and num_pages >= 2)


def plan_packed_writes(src: KVLayout, dst: KVLayout, src_pages: Sequence[int], first: int, num_pages: int,
                       layers: Iterable[int] | None = None, *, room: int = 0, seed: int = 0,
                       src_dp_rank: int = 0, dst_dp_rank: int = 0) -> list[PackedWrite]:
    """The packed writes of pages ``[first, first + len(src_pages))`` of a room of ``num_pages``
    pages, ordered by layer, destination, block: one per (layer, buffer, head block). Page-writes
    (``count_writes``) equal ``plan_writes``'s for the same pages."""
    if first < 0 or first + len(src_pages) > num_pages:
        raise LayoutError(f"src_pages: pages [{first}, {first + len(src_pages)}) outside the room's {num_pages}")
    if src.kind != "gqa":
        raise LayoutError("kind: packed transfers move GQA head ranges (HND pages)")
    _check_pages(src, src_pages, "src_pages")
    layers = list(range(src.num_layers)) if layers is None else list(layers)
    _check_layers(src, layers)
    blocks = [blk for d in dst.group(dst_dp_rank)
              for blk in staging_blocks(src, dst, d, num_pages, room=room, seed=seed, src_dp_rank=src_dp_rank,
                                        dst_dp_rank=dst_dp_rank)]
    hb, n = src.head_bytes, len(src_pages)
    ops: list[PackedWrite] = []
    for layer in layers:
        for g, b, off in blocks:
            at = off + (layer * num_pages + first) * g.nheads * hb
            ops.append(PackedWrite(g.src_rank, g.dst_rank, b, layer, g.src_head, g.nheads, tuple(src_pages), at,
                                   n * g.nheads * hb))
    return ops


def unpacked_writes(src: KVLayout, w: PackedWrite) -> list[WriteOp]:
    """``w`` as one write per page from the source pages themselves (into the same staging
    range): what prefill posts when its own staging buffer has no room for the block."""
    hb = src.head_bytes
    return [WriteOp(w.src_rank, w.dst_rank, w.buffer, w.layer,
                    w.layer * src.layer_stride + p * src.page_bytes + w.src_head * hb,
                    w.dst_offset + i * w.nheads * hb, w.nheads * hb, 1) for i, p in enumerate(w.src_pages)]
