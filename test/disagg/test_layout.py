"""layout.py against a byte-by-byte reference: simulated rank buffers, ops applied, every
destination byte compared with a buffer built token by token, head by head."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import numpy as np
import pytest
import torch

from pdserve.disagg.layout import (
    KVLayout,
    LayoutError,
    check_compatible,
    count_writes,
    expected_writes,
    packing_pays,
    page_runs,
    plan_packed_writes,
    plan_writes,
    segments,
    staging_blocks,
    staging_bytes,
    unpacked_writes,
)

ROW = 4  # bytes of one token of one head (head_dim 2, bfloat16)
PAD = 8  # bytes between layers beyond the pages, so a wrong layer stride shows
TPS = (1, 2, 4, 8)


def layout(kind: str, tp: int, heads: int, page_size: int, *, dp: int = 1, pages: int = 12, layers: int = 2,
           dtype: str = "bfloat16") -> KVLayout:
    local = max(1, heads // tp)
    page_bytes = local * page_size * ROW
    return KVLayout(kind, tp, heads, page_size, dtype, layers, pages, page_bytes, pages * page_bytes + PAD, dp)


def row_offset(lay: KVLayout, layer: int, page: int, local_head: int, slot: int) -> int:
    return layer * lay.layer_stride + page * lay.page_bytes + local_head * lay.head_bytes + slot * ROW


class Sim:
    """Every rank's buffers as byte arrays; the source filled from one logical KV per request."""

    def __init__(self, src: KVLayout, dst: KVLayout, src_pages, dst_pages, seed: int,
                 src_dp: int = 0, dst_dp: int = 0):
        rng = np.random.default_rng(seed)
        self.src, self.dst, self.src_pages, self.dst_pages = src, dst, src_pages, dst_pages
        self.src_dp, self.dst_dp = src_dp, dst_dp
        n_tok = len(src_pages) * src.page_size
        # logical[buffer][layer, token, head, byte]
        self.logical = {b: rng.integers(0, 256, (src.num_layers, n_tok, src.num_kv_heads, ROW), dtype=np.uint8)
                        for b in src.buffers}
        size_s, size_d = src.layer_stride * src.num_layers, dst.layer_stride * dst.num_layers
        self.sbuf = {(r, b): rng.integers(0, 256, size_s, dtype=np.uint8)
                     for r in range(src.num_ranks) for b in src.buffers}
        self.dbuf = {(r, b): rng.integers(0, 256, size_d, dtype=np.uint8)
                     for r in range(dst.num_ranks) for b in dst.buffers}
        self.initial = {k: v.copy() for k, v in self.dbuf.items()}
        self.hits = {k: np.zeros(size_d, dtype=np.int32) for k in self.dbuf}
        for r in src.group(src_dp):
            self._place(self.sbuf, src, r - src.group(src_dp)[0], r, src_pages)

    def _place(self, bufs, lay: KVLayout, tp_rank: int, rank: int, pages) -> None:
        """Write the logical KV into one rank's buffers, token by token, head by head."""
        lo, hi = lay.head_range(tp_rank)
        for b, logical in self.logical.items():
            for layer, (i, page), h, slot in itertools.product(
                    range(lay.num_layers), enumerate(pages), range(lo, hi), range(lay.page_size)):
                at = row_offset(lay, layer, page, h - lo, slot)
                bufs[(rank, b)][at:at + ROW] = logical[layer, i * lay.page_size + slot, h]

    def apply(self, ops) -> None:
        for op in ops:
            s = self.sbuf[(op.src_rank, op.buffer)][op.src_offset:op.src_offset + op.nbytes]
            assert len(s) == op.nbytes, f"{op} reads past the source buffer"
            self.dbuf[(op.dst_rank, op.buffer)][op.dst_offset:op.dst_offset + op.nbytes] = s
            self.hits[(op.dst_rank, op.buffer)][op.dst_offset:op.dst_offset + op.nbytes] += 1

    def check(self) -> None:
        """Destination = initial bytes with the logical KV placed; written bytes exactly once."""
        want = {k: v.copy() for k, v in self.initial.items()}
        for r in self.dst.group(self.dst_dp):
            self._place(want, self.dst, r - self.dst.group(self.dst_dp)[0], r, self.dst_pages)
        for k in self.dbuf:
            assert np.array_equal(self.dbuf[k], want[k]), f"destination {k} differs from the reference"
            covered = self._covered(k)
            assert (self.hits[k][covered] == 1).all(), f"{k}: a byte written twice or never"
            assert not self.hits[k][~covered].any(), f"{k}: bytes outside the request were written"

    def _covered(self, key) -> np.ndarray:
        """Bytes the reference places: the request's pages, this rank's heads, every layer."""
        rank, _ = key
        mask = np.zeros_like(self.hits[key], dtype=bool)
        if rank not in self.dst.group(self.dst_dp):
            return mask
        lo, hi = self.dst.head_range(rank - self.dst.group(self.dst_dp)[0])
        for layer, page, h in itertools.product(range(self.dst.num_layers), self.dst_pages, range(hi - lo)):
            at = row_offset(self.dst, layer, page, h, 0)
            mask[at:at + self.dst.head_bytes] = True
        return mask


def scattered_pages(rng: random.Random, n: int, pool: int) -> list[int]:
    """Mostly runs of consecutive pages with jumps: both merged and unmerged cases."""
    start = rng.randrange(pool - n + 1)
    pages = list(range(start, start + n))
    if n > 2:  # break the run somewhere by swapping two pages
        i = rng.randrange(n - 1)
        pages[i], pages[-1] = pages[-1], pages[i]
    return pages


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads", [8, 4, 2, 1])
def test_gqa_every_destination_byte_written_once(page_size, heads):
    rng = random.Random(page_size * 100 + heads)
    for sp, dp in itertools.product(TPS, TPS):
        src, dst = layout("gqa", sp, heads, page_size), layout("gqa", dp, heads, page_size)
        n = rng.randint(1, 6)
        src_pages, dst_pages = scattered_pages(rng, n, 12), scattered_pages(rng, n, 12)
        room = rng.getrandbits(63)
        sim = Sim(src, dst, src_pages, dst_pages, seed=room % 1000)
        ops = plan_writes(src, dst, src_pages, dst_pages, room=room, seed=7)
        sim.apply(ops)
        sim.check()
        assert count_writes(ops) == expected_writes(src, dst, n, room=room, seed=7)


@pytest.mark.parametrize("page_size", [1, 16])
def test_mla_every_destination_byte_written_once(page_size):
    rng = random.Random(page_size)
    for sp, dp, ddp in itertools.product(TPS, TPS, (1, 2)):
        src, dst = layout("mla", sp, 1, page_size), layout("mla", dp, 1, page_size, dp=ddp)
        n = rng.randint(1, 6)
        src_pages, dst_pages = scattered_pages(rng, n, 12), scattered_pages(rng, n, 12)
        room, dst_dp = rng.getrandbits(63), ddp - 1
        sim = Sim(src, dst, src_pages, dst_pages, seed=room % 1000, dst_dp=dst_dp)
        ops = plan_writes(src, dst, src_pages, dst_pages, room=room, seed=3, dst_dp_rank=dst_dp)
        sim.apply(ops)
        sim.check()
        assert len({op.src_rank for op in ops}) == 1, "MLA sends from one source rank per request"
        assert {op.dst_rank for op in ops} == set(dst.group(dst_dp))
        assert count_writes(ops) == expected_writes(src, dst, n, room=room, seed=3, dst_dp_rank=dst_dp)


def test_gqa_dp_attention_decode_and_dp_prefill():
    src, dst = layout("gqa", 2, 4, 16, dp=2), layout("gqa", 4, 4, 16, dp=2)
    sim = Sim(src, dst, [3, 4, 9], [0, 1, 2], seed=1, src_dp=1, dst_dp=1)
    ops = plan_writes(src, dst, [3, 4, 9], [0, 1, 2], room=5, src_dp_rank=1, dst_dp_rank=1)
    sim.apply(ops)
    sim.check()
    assert {op.src_rank for op in ops} == {2, 3} and {op.dst_rank for op in ops} == {4, 5, 6, 7}


def intersections(src: KVLayout, dst: KVLayout) -> int:
    """Non-empty (src rank, dst rank) head-range intersections, replicas resolved to one source."""
    if src.num_kv_heads < src.tp_size:  # replicated source: one source per destination head
        return sum(dst.local_heads for _ in range(dst.tp_size))
    n = 0
    for i, j in itertools.product(range(src.tp_size), range(dst.tp_size)):
        (a, b), (c, d) = src.head_range(i), dst.head_range(j)
        n += max(a, c) < min(b, d)
    return n


@pytest.mark.parametrize("heads", [8, 2])
def test_ops_per_page_run_equal_intersections(heads):
    for sp, dp, page_size in itertools.product(TPS, TPS, (1, 16)):
        src, dst = layout("gqa", sp, heads, page_size), layout("gqa", dp, heads, page_size)
        ops = plan_writes(src, dst, [2, 3, 4, 5], [7, 8, 9, 10], layers=[1])  # one run of 4 pages
        per_buffer = Counter(op.buffer for op in ops)
        segs = segments(src, dst)
        assert len(segs) == intersections(src, dst)
        pages_per_op = 4 if all(g.full for g in segs) else 1
        assert per_buffer == {"k": len(segs) * 4 // pages_per_op, "v": len(segs) * 4 // pages_per_op}
        assert all(op.nbytes >= src.head_bytes for op in ops), "no op smaller than one head's page"
        if sp == dp and (heads >= sp):
            assert all(g.full for g in segs) and len(ops) == 2 * sp, "matched TP: one op per rank per run"


def test_full_blocks_merge_only_where_both_sides_are_contiguous():
    src, dst = layout("gqa", 2, 8, 16), layout("gqa", 2, 8, 16)
    assert page_runs([1, 2, 3, 7, 8], [4, 5, 9, 10, 11]) == [(0, 2), (2, 1), (3, 2)]
    ops = plan_writes(src, dst, [1, 2, 3, 7, 8], [4, 5, 9, 10, 11], layers=[0])
    assert [(op.src_rank, op.buffer, op.pages) for op in ops] == [
        (0, "k", 2), (0, "k", 1), (0, "k", 2), (1, "k", 2), (1, "k", 1), (1, "k", 2),
        (0, "v", 2), (0, "v", 1), (0, "v", 2), (1, "v", 2), (1, "v", 1), (1, "v", 2)]


def test_more_prefill_shards_rebuild_a_decode_page_from_several_sources():
    src, dst = layout("gqa", 4, 8, 16), layout("gqa", 1, 8, 16)
    segs = segments(src, dst)
    assert [(g.src_rank, g.dst_head, g.nheads) for g in segs] == [(0, 0, 2), (1, 2, 2), (2, 4, 2), (3, 6, 2)]
    src, dst = layout("gqa", 1, 8, 16), layout("gqa", 4, 8, 16)
    assert [(g.src_rank, g.dst_rank, g.src_head) for g in segments(src, dst)] == [(0, 0, 0), (0, 1, 2),
                                                                                  (0, 2, 4), (0, 3, 6)]


def test_replicated_source_heads_spread_over_replicas():
    src, dst = layout("gqa", 8, 2, 16), layout("gqa", 8, 2, 16)  # 4 replicas of each head
    used = Counter()
    for room in range(400):
        segs = segments(src, dst, room=room)
        assert sorted(g.dst_rank for g in segs) == list(range(8)), "each destination fed exactly once"
        for g in segs:
            assert g.dst_rank * 2 // 8 == g.src_rank * 2 // 8, "fed from a replica of its own head"
            used[g.src_rank] += 1
    assert set(used) == set(range(8))


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_mla_source_rank_spread_and_reproducible(tp):
    src, dst = layout("mla", tp, 1, 16), layout("mla", 1, 1, 16)
    rooms = _rooms(1000)
    picks = [segments(src, dst, room=room, seed=11)[0].src_rank for room in rooms]
    counts = Counter(picks)
    assert set(counts) == set(range(tp))
    for rank, c in counts.items():
        assert abs(c - 1000 / tp) <= 0.2 * 1000 / tp, f"rank {rank} chosen {c} times of 1000"
    assert picks == [segments(src, dst, room=room, seed=11)[0].src_rank for room in rooms]
    assert picks != [segments(src, dst, room=room, seed=12)[0].src_rank for room in rooms]


def _rooms(n: int) -> list[int]:
    """Room ids as the router makes them: random 63-bit values."""
    rng = random.Random(2024)
    return [rng.getrandbits(63) for _ in range(n)]


def test_write_count_ignores_page_ids_and_chunking():
    src, dst = layout("gqa", 2, 4, 1, pages=40), layout("gqa", 4, 4, 1, pages=40)
    rng = random.Random(0)
    src_pages, dst_pages = rng.sample(range(40), 20), sorted(rng.sample(range(40), 20))
    whole = count_writes(plan_writes(src, dst, src_pages, dst_pages, room=9))
    chunked = Counter()
    for a in range(0, 20, 6):  # chunks of 6 pages planned separately
        chunked.update(count_writes(plan_writes(src, dst, src_pages[a:a + 6], dst_pages[a:a + 6], room=9)))
    assert whole == dict(chunked) == expected_writes(src, dst, 20, room=9)


@pytest.mark.parametrize("field,src_kw,dst_kw", [
    ("page_size", {}, {"page_size": 1}),
    ("dtype", {}, {"dtype": "float32"}),
    ("num_kv_heads", {}, {"heads": 4}),
    ("num_layers", {}, {"layers": 3}),
    ("kind", {}, {"kind": "mla", "heads": 1}),
])
def test_mismatch_is_refused_naming_the_field(field, src_kw, dst_kw):
    base = {"kind": "gqa", "tp": 2, "heads": 8, "page_size": 16}
    src = layout(**{**base, **src_kw})
    dst = layout(**{**base, **dst_kw})
    with pytest.raises(LayoutError, match=f"^{field}: prefill has"):
        check_compatible(src, dst)
    with pytest.raises(LayoutError, match=f"^{field}"):
        plan_writes(src, dst, [0], [0])


def test_bad_layouts_and_inputs_are_refused():
    with pytest.raises(LayoutError, match="num_kv_heads: 6 heads cannot be split over tp_size 4"):
        layout("gqa", 4, 6, 16)
    with pytest.raises(LayoutError, match="kind"):
        layout("nhd", 1, 8, 16)
    with pytest.raises(LayoutError, match="num_kv_heads: an MLA latent"):
        layout("mla", 1, 8, 16)
    src = layout("gqa", 2, 8, 16)
    with pytest.raises(LayoutError, match=r"dst_pages\[1\]: page 12 outside"):
        plan_writes(src, src, [0, 1], [0, 12])
    with pytest.raises(LayoutError, match="dst_pages: 1 pages for 2"):
        plan_writes(src, src, [0, 1], [0])
    with pytest.raises(LayoutError, match="layers: 2 outside"):
        plan_writes(src, src, [0], [0], layers=[2])
    with pytest.raises(LayoutError, match="dp_rank: 1 outside"):
        plan_writes(src, src, [0], [0], dst_dp_rank=1)


def test_layout_from_pool_descriptors():
    import torch

    from pdserve.mem.kv_pool import GQAKVPool, MLAKVPool

    pool = GQAKVPool(10, 16, 3, 2, 8, torch.bfloat16)
    lay = KVLayout.from_descriptors("gqa", 4, 8, 16, "bfloat16", pool.buffer_descriptors())
    assert (lay.page_bytes, lay.layer_stride, lay.head_bytes, lay.num_pages) == (2 * 16 * 8 * 2, 10 * 512, 256, 10)
    mla = MLAKVPool(10, 16, 3, 6, 2, torch.bfloat16)
    lay = KVLayout.from_descriptors("mla", 2, 1, 16, "bfloat16", mla.buffer_descriptors())
    assert lay.page_bytes == 16 * 8 * 2 and lay.buffers == ("latent",)
    with pytest.raises(LayoutError, match="descriptors"):
        KVLayout.from_descriptors("mla", 2, 1, 16, "bfloat16", pool.buffer_descriptors())


def test_a_sides_layout_names_its_pools_storage_dtype():
    """roles.kv_layout: an fp8 pool publishes float8_e4m3fn pages of a quarter of the bytes, and a
    float32 side cannot take them (the layout check names dtype)."""
    import torch

    from pdserve.config import ServerArgs
    from pdserve.disagg.roles import kv_layout
    from pdserve.mem.kv_pool import FP8_DTYPE, GQAKVPool

    mc = ServerArgs(model_path="tiny-llama", dtype="float32").model_config()
    full = kv_layout(mc, GQAKVPool(8, 4, mc.num_layers, 2, mc.head_dim, torch.float32))
    fp8 = kv_layout(mc, GQAKVPool(8, 4, mc.num_layers, 2, mc.head_dim, FP8_DTYPE, compute_dtype=torch.float32))
    assert (full.dtype, fp8.dtype) == ("float32", "float8_e4m3fn")
    assert fp8.page_bytes * 4 == full.page_bytes and fp8.head_bytes * 4 == full.head_bytes
    with pytest.raises(LayoutError, match="^dtype: prefill has float8_e4m3fn, decode has float32"):
        check_compatible(fp8, full)


# ------------------------------------------------------------------ packed transfers
def _apply(ops, src_bufs, dst_bufs) -> None:
    for op in ops:
        data = src_bufs[(op.src_rank, op.buffer)][op.src_offset:op.src_offset + op.nbytes]
        dst_bufs[(op.dst_rank, op.buffer)][op.dst_offset:op.dst_offset + op.nbytes] = data


@pytest.mark.parametrize("src_tp, dst_tp", [(2, 1), (1, 2), (4, 2), (2, 8), (8, 1)])
def test_packed_writes_cut_the_write_count_and_unpack_to_the_same_bytes(src_tp, dst_tp):
    """Packed, a head block of a forward's pages is one write instead of one per page (page-writes,
    what decode counts, unchanged); gathered on the source, scattered from the staging region
    (``staging_blocks``), every destination byte equals the per-page plan's, and the staging
    region is covered exactly once."""
    src, dst = layout("gqa", src_tp, 8, 4, pages=12), layout("gqa", dst_tp, 8, 4, pages=12)
    src_pages, dst_pages = [7, 2, 3, 4, 9, 0, 11], [1, 2, 3, 5, 6, 4, 10]
    chunks = [(0, 3), (3, 7)]  # two forwards
    n, rng = len(src_pages), np.random.default_rng(0)
    unpacked, packed = [], []
    for a, b in chunks:
        unpacked += plan_writes(src, dst, src_pages[a:b], dst_pages[a:b], room=5, seed=1)
        packed += plan_packed_writes(src, dst, src_pages[a:b], a, n, room=5, seed=1)
    segs = segments(src, dst, room=5, seed=1)
    assert len(packed) == src.num_layers * len(src.buffers) * len(segs) * len(chunks)
    assert len(packed) < len(unpacked) == src.num_layers * len(src.buffers) * len(segs) * n  # per page
    assert count_writes(packed) == count_writes(unpacked) == expected_writes(src, dst, n, room=5, seed=1)
    assert packing_pays(src, dst, n, "auto") and not packing_pays(src, dst, n, "off")
    assert not packing_pays(src, dst, 1, "auto") and packing_pays(src, dst, 1, "on")

    sbuf = {(r, b): rng.integers(0, 256, src.layer_stride * src.num_layers, dtype=np.uint8)
            for r in range(src.num_ranks) for b in src.buffers}
    want = {(r, b): np.zeros(dst.layer_stride * dst.num_layers, dtype=np.uint8)
            for r in range(dst.num_ranks) for b in dst.buffers}
    got = {k: v.copy() for k, v in want.items()}
    _apply(unpacked, sbuf, want)
    size = staging_bytes(dst, n)
    staging = {r: np.zeros(size, dtype=np.uint8) for r in range(dst.num_ranks)}
    hits = {r: np.zeros(size, dtype=np.int32) for r in range(dst.num_ranks)}
    for w in packed:  # the gather prefill's kernel does, then one write
        block = np.concatenate([sbuf[(w.src_rank, w.buffer)][o.src_offset:o.src_offset + o.nbytes]
                                for o in unpacked_writes(src, w)])
        assert len(block) == w.nbytes and 0 <= w.dst_offset and w.dst_offset + w.nbytes <= size
        staging[w.dst_rank][w.dst_offset:w.dst_offset + w.nbytes] = block
        hits[w.dst_rank][w.dst_offset:w.dst_offset + w.nbytes] += 1
    assert all((h == 1).all() for h in hits.values())
    hb = dst.head_bytes
    for d in range(dst.num_ranks):  # decode's scatter
        for g, b, off in staging_blocks(src, dst, d, n, room=5, seed=1):
            for layer, (i, page) in itertools.product(range(dst.num_layers), enumerate(dst_pages)):
                at = off + (layer * n + i) * g.nheads * hb
                to = layer * dst.layer_stride + page * dst.page_bytes + g.dst_head * hb
                got[(d, b)][to:to + g.nheads * hb] = staging[d][at:at + g.nheads * hb]
    assert all(np.array_equal(got[k], want[k]) for k in want)


def test_packed_plans_refuse_what_they_cannot_move():
    src, dst = layout("gqa", 2, 8, 4), layout("gqa", 1, 8, 4)
    with pytest.raises(LayoutError, match="src_pages: pages"):
        plan_packed_writes(src, dst, [1, 2, 3], 2, 4)
    mla = layout("mla", 2, 1, 4)
    with pytest.raises(LayoutError, match="kind: packed"):
        plan_packed_writes(mla, layout("mla", 1, 1, 4), [1], 0, 1)
    assert not packing_pays(mla, layout("mla", 1, 1, 4), 8, "on")
    with pytest.raises(LayoutError, match="disaggregation_transfer_pack"):
        packing_pays(src, dst, 4, "sometimes")


# ------------------------------------------------------------------ regions (DeepSeek-V3.2's index keys)
def _v32_pools(n: int, seed: int, pages: int = 12, index_head_dim: int = 8):
    """``n`` MLA pools with index keys (a region of the latent's pages), each filled at random."""
    from pdserve.mem.kv_pool import MLAKVPool

    g = torch.Generator().manual_seed(seed)
    pools = [MLAKVPool(pages, 4, 3, 6, 2, torch.float32, index_head_dim=index_head_dim) for _ in range(n)]
    for p in pools:
        for _, buf in p.page_buffers():
            buf.copy_(torch.randn(buf.shape, generator=g))
    return pools


def _v32_layout(pool, tp: int, dp: int = 1) -> KVLayout:
    dtypes = {name: str(buf.dtype).removeprefix("torch.") for name, buf in pool.page_buffers()}
    return KVLayout.from_descriptors("mla", tp, 1, pool.page_size, "float32", pool.buffer_descriptors(), dp,
                                     region_dtypes=dtypes)


@pytest.mark.parametrize("src_tp, dst_tp, dst_dp", [(1, 1, 1), (2, 1, 1), (2, 1, 2), (1, 2, 1)])
def test_index_keys_move_with_the_latent_from_the_random_source_rank(src_tp, dst_tp, dst_dp):
    """The index keys are one more region of the latent's pages: the writes carry both from the
    request's random source rank, every destination rank of the group gets the same pages of both,
    nothing else is touched, and decode's expected count covers the region (twice the latent's)."""
    srcs, dsts = _v32_pools(src_tp, seed=1), _v32_pools(dst_tp * dst_dp, seed=2)
    src, dst = _v32_layout(srcs[0], src_tp), _v32_layout(dsts[0], dst_tp, dst_dp)
    assert src.buffers == ("latent", "index_k") and src.geometry("index_k")[0] == 4 * 8 * 4
    before = [{name: buf.clone() for name, buf in p.page_buffers()} for p in dsts]
    src_pages, dst_pages, dst_group = [3, 4, 9], [0, 7, 8], dst_dp - 1
    for room in range(6):
        ops = plan_writes(src, dst, src_pages, dst_pages, room=room, seed=5, dst_dp_rank=dst_group)
        assert {op.buffer for op in ops} == {"latent", "index_k"}
        assert count_writes(ops) == expected_writes(src, dst, 3, room=room, seed=5, dst_dp_rank=dst_group)
        assert sum(count_writes(ops).values()) == 2 * 3 * src.num_layers * dst.tp_size
        (source,) = {op.src_rank for op in ops}
        for op in ops:
            s = dict(srcs[op.src_rank].page_buffers())[op.buffer].view(-1).view(torch.uint8)
            d = dict(dsts[op.dst_rank].page_buffers())[op.buffer].view(-1).view(torch.uint8)
            d[op.dst_offset:op.dst_offset + op.nbytes] = s[op.src_offset:op.src_offset + op.nbytes]
        for r in dst.group(dst_group):
            for name, buf in dsts[r].page_buffers():
                want = before[r][name].clone()
                want[:, dst_pages] = dict(srcs[source].page_buffers())[name][:, src_pages]
                assert buf.equal(want), (room, r, name)


def test_a_layout_without_index_keys_never_takes_one_with_them():
    """A V3 side (latent only) and a V3.2 side (latent + index_k) cannot exchange KV: the check
    names the regions; so do index keys of another width."""
    (v32,) = _v32_pools(1, seed=0)
    (other,) = _v32_pools(1, seed=0, index_head_dim=16)
    (v3,) = _v32_pools(1, seed=0, index_head_dim=0)
    with pytest.raises(LayoutError, match=r"^regions: prefill has latent, decode has latent\+index_k \(float32"):
        check_compatible(_v32_layout(v3, 1), _v32_layout(v32, 1))
    with pytest.raises(LayoutError, match="^regions: prefill has latent"):
        check_compatible(_v32_layout(v32, 1), _v32_layout(other, 1))
    check_compatible(_v32_layout(v32, 2), _v32_layout(v32, 1))


def test_regions_are_checked_and_survive_the_wire():
    from pdserve.disagg import protocol
    from pdserve.disagg.layout import Region

    (pool,) = _v32_pools(1, seed=0)
    lay = _v32_layout(pool, 2, 2)
    assert protocol.from_dict(KVLayout, json_round_trip(lay), "layout") == lay
    with pytest.raises(LayoutError, match="^regions: only an MLA layout"):
        KVLayout("gqa", 1, 2, 4, "float32", 2, 4, 64, 256, regions=(Region("index_k", "float32", 16, 64),))
    with pytest.raises(LayoutError, match="^regions.index_k: page_bytes 16, layer_stride 32"):
        KVLayout("mla", 1, 1, 4, "float32", 2, 4, 64, 256, regions=(Region("index_k", "float32", 16, 32),))


def json_round_trip(obj) -> dict:
    import dataclasses
    import json

    return json.loads(json.dumps(dataclasses.asdict(obj)))


# ------------------------------------------------------------------ a regions layout (DeepSeek-V4's state)
V4_SPECS = (("window_kv", (0, 1, 2), 6), ("csa_src", (1,), 8), ("csa_kv", (1,), 2), ("hca_kv", (2,), 3))


def _v4_pools(n: int, seed: int, pages: int = 12, specs=V4_SPECS):
    """``n`` region pools (every region one row per token, kept by its own layers), filled at random."""
    from pdserve.mem.region_pool import RegionKVPool, RegionSpec

    g = torch.Generator().manual_seed(seed)
    pools = [RegionKVPool(pages, 4, 3, tuple(RegionSpec(*s) for s in specs), torch.float32) for _ in range(n)]
    for p in pools:
        for _, buf in p.page_buffers():
            buf.copy_(torch.randn(buf.shape, generator=g))
    return pools


def _v4_layout(pool, tp: int, dp: int = 1) -> KVLayout:
    return KVLayout.from_descriptors("regions", tp, 1, pool.page_size, "float32", pool.buffer_descriptors(), dp,
                                     region_layers=pool.buffer_layers(), num_layers=pool.num_layers)


@pytest.mark.parametrize("src_tp, dst_tp, dst_dp", [(1, 1, 1), (2, 1, 1), (2, 1, 2), (1, 2, 1)])
def test_every_region_moves_on_the_layers_keeping_it_from_the_random_source_rank(src_tp, dst_tp, dst_dp):
    """Each region's rows of a page move for exactly the layers that keep it, whole pages from the
    request's random source rank to every destination rank of the group; layer by layer, a layer's
    writes are its own regions'; decode's expected count is those writes, page by page."""
    srcs, dsts = _v4_pools(src_tp, seed=1), _v4_pools(dst_tp * dst_dp, seed=2)
    src, dst = _v4_layout(srcs[0], src_tp), _v4_layout(dsts[0], dst_tp, dst_dp)
    assert src.buffers == ("window_kv", "csa_src", "csa_kv", "hca_kv") and src.num_layers == 3
    assert [src.layer_buffers(x) for x in range(3)] == [("window_kv",), ("window_kv", "csa_src", "csa_kv"),
                                                        ("window_kv", "hca_kv")]
    before = [{name: buf.clone() for name, buf in p.page_buffers()} for p in dsts]
    src_pages, dst_pages, dst_group = [3, 4, 9], [0, 7, 8], dst_dp - 1
    for room in range(6):
        ops = [op for layer in range(3)
               for op in plan_writes(src, dst, src_pages, dst_pages, [layer], room=room, seed=5, dst_dp_rank=dst_group)]
        assert ops == plan_writes(src, dst, src_pages, dst_pages, room=room, seed=5, dst_dp_rank=dst_group)
        assert {(op.layer, op.buffer) for op in ops} == {(x, b) for x in range(3) for b in src.layer_buffers(x)}
        assert count_writes(ops) == expected_writes(src, dst, 3, room=room, seed=5, dst_dp_rank=dst_group)
        assert sum(count_writes(ops).values()) == 3 * (3 + 2 + 1) * dst.tp_size
        (source,) = {op.src_rank for op in ops}
        for op in ops:
            s = dict(srcs[op.src_rank].page_buffers())[op.buffer].view(-1).view(torch.uint8)
            d = dict(dsts[op.dst_rank].page_buffers())[op.buffer].view(-1).view(torch.uint8)
            d[op.dst_offset:op.dst_offset + op.nbytes] = s[op.src_offset:op.src_offset + op.nbytes]
        for r in dst.group(dst_group):
            for name, buf in dsts[r].page_buffers():
                want = before[r][name].clone()
                want[:, dst_pages] = dict(srcs[source].page_buffers())[name][:, src_pages]
                assert buf.equal(want), (room, r, name)
    per_page = sum(len(layers) * 4 * width * 4 for _, layers, width in V4_SPECS)
    assert staging_bytes(dst, 3) == 3 * per_page


def test_a_regions_layout_pairs_only_with_the_same_regions_on_the_same_layers():
    """A V3.2 layout, or the same regions kept by other layers, cannot take a regions layout's pages:
    the check names the regions with their layers. Layers are checked and survive the wire."""
    from pdserve.disagg import protocol
    from pdserve.disagg.layout import Region

    (v4,) = _v4_pools(1, seed=0)
    (moved,) = _v4_pools(1, seed=0, specs=(V4_SPECS[0], ("csa_src", (2,), 8), ("csa_kv", (2,), 2),
                                           ("hca_kv", (1,), 3)))
    (v32,) = _v32_pools(1, seed=0)
    lay = _v4_layout(v4, 2, 2)
    with pytest.raises(LayoutError, match=r"^regions: prefill has window_kv \(float32, 96 B/page\)\+csa_src "
                                          r"\(float32, 128 B/page, layers 1\)\+.*decode has .*csa_src \(float32, "
                                          r"128 B/page, layers 2\)"):
        check_compatible(_v4_layout(v4, 1), _v4_layout(moved, 1))
    with pytest.raises(LayoutError, match="^kind: prefill has mla, decode has regions"):
        check_compatible(_v32_layout(v32, 1), _v4_layout(v4, 1))
    assert protocol.from_dict(KVLayout, json_round_trip(lay), "layout") == lay
    assert lay.regions[0].layers == () and lay.regions[1].layers == (1,)  # () : every layer keeps it
    with pytest.raises(LayoutError, match=r"^regions.csa_kv.layers: \(2, 1\) are not distinct ascending"):
        KVLayout("regions", 1, 1, 4, "float32", 3, 4, 64, 256, regions=(Region("csa_kv", "float32", 64, 256, (2, 1)),))
    with pytest.raises(LayoutError, match=r"^regions.csa_kv.layers: \(3,\)"):
        KVLayout("regions", 1, 1, 4, "float32", 3, 4, 64, 256, regions=(Region("csa_kv", "float32", 64, 256, (3,)),))
    with pytest.raises(LayoutError, match="^regions: a regions layout needs at least one region"):
        KVLayout("regions", 1, 1, 4, "float32", 3, 4, 64, 256)
    with pytest.raises(LayoutError, match="^num_kv_heads: a regions layout"):
        KVLayout("regions", 1, 2, 4, "float32", 3, 4, 64, 256, regions=(Region("w", "float32", 64, 256),))


# ------------------------------------------------------------------ records (DeepSeek-V4's bounded layout)
def _bounded_pools(n: int, seed: int, slots: int = 5):
    """``n`` pools of V4_SPECS whose window and CSA sources are records (rings of 3 and 5 rows), filled
    at random, records included."""
    from pdserve.mem.region_pool import BoundedState, RegionKVPool, RegionSpec

    g = torch.Generator().manual_seed(seed)
    bounded = BoundedState({"window_kv": 3, "csa_src": 5}, {"window_kv": 3}, 16, slots)
    pools = [RegionKVPool(12, 4, 3, tuple(RegionSpec(*s) for s in V4_SPECS), torch.float32, bounded=bounded)
             for _ in range(n)]
    for p in pools:
        for _, buf in p.page_buffers() + p.record_buffers():
            buf.copy_(torch.randn(buf.shape, generator=g))
    return pools


def _bounded_layout(pool, tp: int, dp: int = 1) -> KVLayout:
    return KVLayout.from_descriptors("regions", tp, 1, pool.page_size, "float32", pool.buffer_descriptors(), dp,
                                     region_layers={**pool.buffer_layers(), **pool.record_layers()},
                                     num_layers=pool.num_layers, records=pool.record_descriptors())


@pytest.mark.parametrize("src_tp, dst_tp, dst_dp", [(1, 1, 1), (2, 1, 1), (1, 2, 2)])
def test_a_requests_record_moves_whole_from_the_random_source_rank_and_is_counted(src_tp, dst_tp, dst_dp):
    """Each layer's slot of each record it keeps moves whole, once, from the page writes' source rank into
    decode's slot on every rank of the group; decode's expected count adds one page-write per (layer,
    record); other slots are untouched."""
    from pdserve.disagg.layout import plan_record_writes

    srcs, dsts = _bounded_pools(src_tp, seed=1), _bounded_pools(dst_tp * dst_dp, seed=2)
    src, dst = _bounded_layout(srcs[0], src_tp), _bounded_layout(dsts[0], dst_tp, dst_dp)
    assert src.paged == ("window_kv_tail", "csa_kv", "hca_kv") and src.record_slots == 5
    assert src.buffers == src.paged + ("window_kv", "csa_src")
    assert [src.layer_records(x) for x in range(3)] == [("window_kv",), ("window_kv", "csa_src"), ("window_kv",)]
    assert src.record_bytes == 3 * 3 * 6 * 4 + 5 * 8 * 4
    before = [{name: buf.clone() for name, buf in p.record_buffers()} for p in dsts]
    group = dst_dp - 1
    for room in range(4):
        ops = plan_record_writes(src, dst, 2, 4, room=room, seed=5, dst_dp_rank=group)
        pages = plan_writes(src, dst, [3], [7], room=room, seed=5, dst_dp_rank=group)
        assert {op.src_rank for op in ops} == {op.src_rank for op in pages}  # the request's one source
        assert count_writes(ops + pages) == expected_writes(src, dst, 1, room=room, seed=5, dst_dp_rank=group)
        assert sum(count_writes(ops).values()) == 4 * dst.tp_size
        for op in ops:
            s = dict(srcs[op.src_rank].record_buffers())[op.buffer].view(-1).view(torch.uint8)
            d = dict(dsts[op.dst_rank].record_buffers())[op.buffer].view(-1).view(torch.uint8)
            d[op.dst_offset:op.dst_offset + op.nbytes] = s[op.src_offset:op.src_offset + op.nbytes]
        (source,) = {op.src_rank for op in ops}
        for r in dst.group(group):
            for name, buf in dsts[r].record_buffers():
                want = before[r][name].clone()
                want[:, 4] = dict(srcs[source].record_buffers())[name][:, 2]
                assert buf.equal(want), (room, r, name)
    with pytest.raises(LayoutError, match=r"^dst_slot: record slot 5 outside \[0, 5\)"):
        plan_record_writes(src, dst, 0, 5)


def test_a_layout_with_records_pairs_only_with_the_same_records():
    """A side keeping the window in pages (no records) never takes a side's records, or the reverse; the
    check names both; records survive the wire."""
    import dataclasses

    from pdserve.disagg import protocol
    from pdserve.disagg.layout import Region

    (bounded,) = _bounded_pools(1, seed=0)
    (paged,) = _v4_pools(1, seed=0)
    lay = _bounded_layout(bounded, 1)
    with pytest.raises(LayoutError, match="^(head_bytes|regions): prefill has"):  # their pages differ already
        check_compatible(_v4_layout(paged, 1), lay)
    stripped = dataclasses.replace(lay, records=(), record_slots=0)
    with pytest.raises(LayoutError, match=r"^records: prefill has window_kv \(float32, 72 B/slot\)\+csa_src "
                                          r"\(float32, 160 B/slot, layers 1\), decode has none"):
        check_compatible(lay, stripped)
    assert protocol.from_dict(KVLayout, json_round_trip(lay), "layout") == lay
    with pytest.raises(LayoutError, match="^record_slots: 0 for records"):
        dataclasses.replace(lay, record_slots=0)
    with pytest.raises(LayoutError, match="^records: only a replicated layout"):
        KVLayout("gqa", 1, 1, 4, "float32", 3, 4, 64, 256, records=(Region("w", "float32", 8, 64),), record_slots=2)
