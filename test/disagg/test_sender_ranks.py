"""The senders of several prefill ranks (one real Mooncake engine per rank, in this process) move a
request's KV to several decode ranks (their own engines) as prefill ranks do: each posts only the
writes whose source is its rank, layer by layer, reports a completion for its own (source,
destination) pairs, and the first source of each destination alone writes its aux row. Decode's
bytes must equal pools filled locally with the same tokens."""

from __future__ import annotations

import time

import pytest
import torch

from pdserve.disagg.layout import KVLayout, expected_writes, staging_blocks, staging_bytes
from pdserve.disagg.protocol import KVRequest
from pdserve.disagg.sender import KVSender, RoomState
from pdserve.disagg.staging import StagingPool, pool_tensors, unpack_room
from pdserve.mem.kv_pool import GQAKVPool, MLAKVPool
from pdserve.transfer import MooncakeTransferBackend, mooncake_available

pytestmark = pytest.mark.skipif(not mooncake_available(), reason="mooncake cannot be imported: pip install -e '.[cpu]'")

L, S, T, HIDDEN = 3, 4, 22, 8  # layers, page size, prompt tokens, hidden size of the aux row
H, D, C, R = 4, 8, 6, 2  # GQA kv heads and head dim; MLA latent and rope dims
SRC_PAGES, DST_PAGES = [7, 2, 3, 4, 9, 0], [1, 2, 3, 5, 6, 4]  # T - 1 = 21 positions: 6 pages of 4


def slots(pages: list[int]) -> torch.Tensor:
    t = torch.arange(T - 1)
    return torch.tensor(pages)[t // S] * S + t % S


@pytest.fixture(scope="module")
def engines():
    """Four engines (two ranks a side), shared: starting and freeing one takes a while."""
    bes = [MooncakeTransferBackend() for _ in range(4)]
    yield bes[:2], bes[2:]
    for be in bes:
        be.close()


class Side:
    """One side's ranks: a pool (filled by ``fill(rank, pool)``) and an aux row each, registered
    with ``engines`` (one per rank) when given."""

    def __init__(self, kind: str, tp: int, fill, engines=(), staging_bytes: int = 0):
        self.pools = [GQAKVPool(10, S, L, H // tp, D, torch.float32) if kind == "gqa"
                      else MLAKVPool(10, S, L, C, R, torch.float32) for _ in range(tp)]
        for rank, pool in enumerate(self.pools):
            fill(rank, pool)
        self.layout = KVLayout.from_descriptors(kind, tp, H if kind == "gqa" else 1, S, "float32",
                                                self.pools[0].buffer_descriptors())
        self.engines = list(engines[:tp])
        self.aux = [torch.zeros(1, HIDDEN) for _ in range(tp)]  # [1, hidden] per rank
        self.staging = [StagingPool(staging_bytes) if staging_bytes else None for _ in range(tp)]
        for pool, be, row, st in zip(self.pools, self.engines, self.aux, self.staging):
            be.register([(d.base_addr, d.total_bytes) for d in pool.buffer_descriptors()]
                        + [(row.data_ptr(), row.numel() * 4)] + ([(st.addr, st.nbytes)] if st else []))

    def close(self) -> None:
        """Unregistered before the memory goes."""
        for be, pool, row, st in zip(self.engines, self.pools, self.aux, self.staging):
            be.unregister([d.base_addr for d in pool.buffer_descriptors()] + [row.data_ptr()]
                          + ([st.addr] if st else []))


def gqa_fill(k: torch.Tensor, v: torch.Tensor, pages: list[int], tp: int):
    """k, v [L, T-1, H, D]: rank r holds heads [r*H/tp, (r+1)*H/tp) of ``pages``."""
    def fill(rank: int, pool) -> None:
        heads = slice(rank * H // tp, (rank + 1) * H // tp)
        for layer in range(L):
            if pages:
                pool.set_kv(layer, slots(pages), k[layer, :, heads], v[layer, :, heads])
    return fill


def mla_fill(latent: torch.Tensor, pages: list[int]):
    def fill(_rank: int, pool) -> None:
        for layer in range(L):
            if pages:
                pool.set_latent(layer, slots(pages), latent[layer])
    return fill


def transfer(src: Side, dst: Side, room: int, hidden: torch.Tensor, chunks=(T - 1,)) -> list[KVSender]:
    """Every prefill rank's sender over one room, as the ranks run it (one forward per end
    position of ``chunks``); returns them drained. Packed when ``dst`` has staging buffers."""
    lent = [st.alloc(staging_bytes(dst.layout, len(DST_PAGES))) if st else None for st in dst.staging]
    kvs = {d: KVRequest(room, 1, "decode", d, be.session_id, [b.base_addr for b in dst.pools[d].buffer_descriptors()],
                        dst.layout, DST_PAGES, 0, T - 1, dst.aux[d].data_ptr(), HIDDEN * 4, "tcp://127.0.0.1:1",
                        *((dst.staging[d].addr + lent[d], staging_bytes(dst.layout, len(DST_PAGES)))
                          if lent[d] is not None else (0, 0)))
           for d, be in enumerate(dst.engines)}
    senders = [KVSender(be, src.layout, r, {b.name: b.base_addr for b in src.pools[r].buffer_descriptors()},
                        src.aux[r], seed=5, pools=pool_tensors(src.pools[r]), staging=src.staging[r])
               for r, be in enumerate(src.engines)]
    for s in senders:
        s.open(room, kvs, T - 1, time.monotonic())
    for end in chunks:
        for s in senders:
            s.stage(room, SRC_PAGES, end)
        for layer in range(L):
            for s in senders:
                s.on_layer(layer)
        for s in senders:
            s.forward_done()
    for s in senders:
        s.finish(room, hidden)
    deadline = time.monotonic() + 60
    while any(s.poll(room) is RoomState.DRAINING for s in senders):
        assert time.monotonic() < deadline, "writes did not settle"
        time.sleep(0.001)
    for d, at in enumerate(lent):  # decode's scatter once the room's writes completed
        if at is not None:
            blocks = staging_blocks(src.layout, dst.layout, d, len(DST_PAGES), room=room, seed=5)
            unpack_room(dst.staging[d], at, blocks, pool_tensors(dst.pools[d]), DST_PAGES)
            dst.staging[d].free(at)
    return senders


def check_reports(senders: list[KVSender], src: Side, dst: Side, room: int, forwards: int = 1) -> None:
    """Each rank reports exactly its pairs of the plan, with the planned page-writes, and posted one
    batch per forward, layer and own pair, plus an aux row for the destinations it is the first
    source of."""
    want = expected_writes(src.layout, dst.layout, len(DST_PAGES), room=room, seed=5)
    for s in senders:
        r = s.rooms[room]
        assert r.state is RoomState.DONE, r.error
        mine = s.own_pairs(room)
        assert {(s.rank, d) for d in mine} == {k for k in want if k[0] == s.rank}
        assert {d: r.writes[d] for d in mine} == {d: want[(s.rank, d)] for d in mine}
        firsts = [d for d in mine if min(k[0] for k in want if k[1] == d) == s.rank]
        assert len(r.handles) == forwards * L * len(mine) + len(firsts)


@pytest.mark.parametrize("src_tp, dst_tp", [(2, 1), (1, 2), (2, 2)])
def test_gqa_head_ranges_rebuilt_across_tp_sizes(engines, src_tp, dst_tp):
    k, v = torch.randn(L, T - 1, H, D), torch.randn(L, T - 1, H, D)
    hidden = torch.randn(HIDDEN)
    src = Side("gqa", src_tp, gqa_fill(k, v, SRC_PAGES, src_tp), engines[0])
    dst = Side("gqa", dst_tp, gqa_fill(k, v, [], dst_tp), engines[1])
    want = Side("gqa", dst_tp, gqa_fill(k, v, DST_PAGES, dst_tp))
    try:
        senders = transfer(src, dst, room=3, hidden=hidden)
        check_reports(senders, src, dst, room=3)
        for got, ref, aux in zip(dst.pools, want.pools, dst.aux):
            assert torch.equal(got.k, ref.k) and torch.equal(got.v, ref.v)
            assert torch.equal(aux[0], hidden)
    finally:
        for side in (src, dst, want):
            side.close()


@pytest.mark.parametrize("src_tp, dst_tp, prefill_staging", [(2, 1, 1 << 16), (1, 2, 1 << 16), (2, 1, 256)])
def test_gqa_packed_head_ranges_unpack_to_the_same_pages(engines, src_tp, dst_tp, prefill_staging):
    """Packed (decode lent staging), over two forwards: decode's pages after its scatter equal the
    local fill, page-writes are the plan's, and each (forward, layer, buffer, head block) is one
    network write. With a prefill staging buffer too small for a block, the blocks go page by
    page into the same staging range, with the same bytes; every staging range comes back."""
    k, v = torch.randn(L, T - 1, H, D), torch.randn(L, T - 1, H, D)
    src = Side("gqa", src_tp, gqa_fill(k, v, SRC_PAGES, src_tp), engines[0], staging_bytes=prefill_staging)
    dst = Side("gqa", dst_tp, gqa_fill(k, v, [], dst_tp), engines[1], staging_bytes=1 << 16)
    want = Side("gqa", dst_tp, gqa_fill(k, v, DST_PAGES, dst_tp))
    try:
        senders = transfer(src, dst, room=3, hidden=torch.randn(HIDDEN), chunks=(8, T - 1))  # pages [0, 2), [2, 6)
        check_reports(senders, src, dst, room=3, forwards=2)
        for got, ref in zip(dst.pools, want.pools):
            assert torch.equal(got.k, ref.k) and torch.equal(got.v, ref.v)
        blocks = 2 * L * 2 * max(src_tp, dst_tp)  # forwards x layers x buffers x head blocks
        posted = sum(s.writes_posted for s in senders)
        packed = prefill_staging > 256
        assert posted == (blocks if packed else 2 * L * 2 * max(src_tp, dst_tp) * len(SRC_PAGES) // 2)
        assert sum(s.packed_writes for s in senders) == (blocks if packed else 0)
        for s in senders:
            s.close_room(3)
        assert [st.ranges_in_use for st in (*src.staging, *dst.staging) if st] == [0] * (src_tp + dst_tp)
    finally:
        for side in (src, dst, want):
            side.close()


def test_mla_latent_leaves_from_one_random_rank_to_every_decode_rank(engines):
    latent = torch.randn(L, T - 1, C + R)
    src = Side("mla", 2, mla_fill(latent, SRC_PAGES), engines[0])
    dst = Side("mla", 2, mla_fill(latent, []), engines[1])
    want = Side("mla", 1, mla_fill(latent, DST_PAGES))
    sources = set()
    try:
        for room in (11, 12, 13, 14):
            for pool in dst.pools:
                pool.latent.zero_()
            senders = transfer(src, dst, room, torch.full((HIDDEN,), float(room)))
            check_reports(senders, src, dst, room)
            (source,) = [s.rank for s in senders if s.own_pairs(room)]
            assert not senders[1 - source].rooms[room].handles  # the other replica posts nothing
            sources.add(source)
            for got, aux in zip(dst.pools, dst.aux):
                assert torch.equal(got.latent, want.pools[0].latent) and aux[0, 0] == room
        assert sources == {0, 1}, "rooms 11-14 should draw both replicas"
    finally:
        for side in (src, dst, want):
            side.close()
