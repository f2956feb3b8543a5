"""Sharded KV pools moved by the layout plan through the real transfer engine.

Prefill TP2 lives in this process (one Mooncake engine, or NIXL agent, per rank, real
``mem.kv_pool`` pools); decode TP1 is another process. After every write polled DONE, decode's bytes must equal a
decode pool filled locally with the same tokens. Writes are posted layer by layer, the way the
sender will stream them.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from pdserve.disagg.layout import KVLayout, count_writes, expected_writes, op_addresses, plan_writes
from pdserve.mem.kv_pool import GQAKVPool, MLAKVPool
from pdserve.transfer import WriteState, create_transfer_backend, mooncake_available, nixl_available
from transfer.transfer_peer import Peer

BACKENDS = [pytest.param("mooncake", marks=pytest.mark.skipif(not mooncake_available(), reason="needs mooncake")),
            pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available(), reason="needs nixl"))]

L, S, T = 3, 16, 40  # layers, page size, tokens (the last page is partial)
SRC_PAGES, DST_PAGES = [5, 6, 2], [1, 2, 3]


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def decode(backend):
    p = Peer(1 << 20, backend)
    yield p
    p.stop()


@pytest.fixture(scope="module")
def engines(backend, decode):
    bes = [create_transfer_backend(backend), create_transfer_backend(backend)]
    for be in bes:
        decode.link(be)
    yield bes
    for be in bes:
        be.close()


def slots(pages: list[int]) -> torch.Tensor:
    t = torch.arange(T)
    return torch.tensor(pages)[t // S] * S + t % S


def bases(pool) -> dict[str, int]:
    return {d.name: d.base_addr for d in pool.buffer_descriptors()}


def stream(engines, pools, src: KVLayout, dst: KVLayout, dst_bases: dict, decode: Peer, room: int) -> dict:
    """Post each layer's writes per source rank, wait for all; returns page-writes per pair."""
    handles, ops_all = [], []
    for layer in range(L):
        ops = plan_writes(src, dst, SRC_PAGES, DST_PAGES, [layer], room=room)
        ops_all += ops
        for rank, (be, pool) in enumerate(zip(engines, pools)):
            mine = [op for op in ops if op.src_rank == rank]
            if mine:
                handles.append((be, be.post_writes(decode.session, *op_addresses(mine, bases(pool), dst_bases))))
    for be, h in handles:
        assert be.wait(h, 60) is WriteState.DONE, h.error
    return count_writes(ops_all)


@contextlib.contextmanager
def registered(engines, pools):
    """Each rank's pool registered with its engine, unregistered before the memory goes."""
    for be, pool in zip(engines, pools):
        be.register([(d.base_addr, d.total_bytes) for d in pool.buffer_descriptors()])
    try:
        yield
    finally:
        for be, pool in zip(engines, pools):
            be.unregister([d.base_addr for d in pool.buffer_descriptors()])


def test_gqa_prefill_tp2_to_decode_tp1(engines, decode):
    H, D = 4, 8
    k, v = torch.randn(L, T, H, D), torch.randn(L, T, H, D)
    pools = [GQAKVPool(8, S, L, H // 2, D, torch.float32) for _ in range(2)]
    for r, pool in enumerate(pools):
        for layer in range(L):
            pool.set_kv(layer, slots(SRC_PAGES), k[layer, :, 2 * r:2 * r + 2], v[layer, :, 2 * r:2 * r + 2])
    want = GQAKVPool(6, S, L, H, D, torch.float32)
    for layer in range(L):
        want.set_kv(layer, slots(DST_PAGES), k[layer], v[layer])
    src = KVLayout.from_descriptors("gqa", 2, H, S, "float32", pools[0].buffer_descriptors())
    dst = KVLayout.from_descriptors("gqa", 1, H, S, "float32", want.buffer_descriptors())
    kbytes = want.k.numel() * 4
    decode.call("fill", 0, 2 * kbytes, 0)
    with registered(engines, pools):
        counts = stream(engines, pools, src, dst, {"k": decode.base, "v": decode.base + kbytes}, decode, room=3)
    assert counts == expected_writes(src, dst, len(DST_PAGES), room=3)
    got = decode.call("bytes", 0, 2 * kbytes)
    assert got[:kbytes] == want.k.numpy().tobytes()
    assert got[kbytes:] == want.v.numpy().tobytes()


def test_mla_prefill_tp2_to_decode_tp1_from_one_random_rank(engines, decode):
    C, R = 6, 2
    latent = torch.randn(L, T, C + R)
    pools = [MLAKVPool(8, S, L, C, R, torch.float32) for _ in range(2)]
    for pool in pools:  # the latent is replicated on every attention-TP rank
        for layer in range(L):
            pool.set_latent(layer, slots(SRC_PAGES), latent[layer])
    want = MLAKVPool(6, S, L, C, R, torch.float32)
    for layer in range(L):
        want.set_latent(layer, slots(DST_PAGES), latent[layer])
    src = KVLayout.from_descriptors("mla", 2, 1, S, "float32", pools[0].buffer_descriptors())
    dst = KVLayout.from_descriptors("mla", 1, 1, S, "float32", want.buffer_descriptors())
    nbytes = want.latent.numel() * 4
    senders = set()
    with registered(engines, pools):
        for room in (11, 12, 13, 14):
            decode.call("fill", 0, nbytes, 0)
            counts = stream(engines, pools, src, dst, {"latent": decode.base}, decode, room=room)
            assert counts == expected_writes(src, dst, len(DST_PAGES), room=room)
            (pair,) = counts
            senders.add(pair[0])
            assert decode.call("bytes", 0, nbytes) == want.latent.numpy().tobytes()
    assert senders == {0, 1}, "rooms 11-14 should draw both replicas"
