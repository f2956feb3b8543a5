"""KV pools: HND layout and the buffer descriptors a transfer engine will write through."""

import ctypes

import pytest
import torch

from pdserve.mem.kv_pool import GQAKVPool, MLAKVPool


def _bytes_at(addr: int, n: int) -> bytes:
    return ctypes.string_at(addr, n)


def test_gqa_descriptor_addresses_point_at_each_layers_page():
    pool = GQAKVPool(num_pages=6, page_size=4, num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    loc = torch.tensor([9, 10, 11])  # page 2, offsets 1..3
    k = torch.randn(3, 2, 8)
    v = torch.randn(3, 2, 8)
    pool.set_kv(1, loc, k, v)
    kd, vd = pool.buffer_descriptors()
    assert (kd.name, vd.name) == ("k", "v")
    assert kd.page_bytes == 2 * 4 * 8 * 4 and kd.num_layers == 3 and kd.num_pages == 6
    assert kd.total_bytes == pool.k.numel() * 4
    for desc, src, buf in ((kd, k, pool.k), (vd, v, pool.v)):
        raw = _bytes_at(desc.page_addr(1, 2), desc.page_bytes)
        page = torch.frombuffer(bytearray(raw), dtype=torch.float32).view(2, 4, 8)  # [H, S, D]
        assert torch.equal(page, buf[1, 2])
        assert torch.equal(page[:, 1:].transpose(0, 1), src)  # token t, head h at [h, 1 + t]


def test_gqa_head_slice_of_a_page_is_contiguous():
    # HND: head h of page p is one run of S*D elements, so a TP-sharded head range moves in one write.
    pool = GQAKVPool(num_pages=3, page_size=4, num_layers=1, num_kv_heads=4, head_dim=2, dtype=torch.float32)
    head = pool.k[0, 1, 2]  # layer 0, page 1, head 2 -> [S, D]
    assert head.is_contiguous()
    assert head.data_ptr() == pool.buffer_descriptors()[0].page_addr(0, 1) + 2 * 4 * 2 * 4


def test_mla_pool_roundtrip_and_descriptor():
    pool = MLAKVPool(num_pages=5, page_size=2, num_layers=2, kv_lora_rank=6, rope_dim=2, dtype=torch.float32)
    lat = torch.randn(2, 8)
    pool.set_latent(1, torch.tensor([6, 7]), lat)  # page 3
    (d,) = pool.buffer_descriptors()
    assert d.name == "latent" and d.page_bytes == 2 * 8 * 4
    raw = torch.frombuffer(bytearray(_bytes_at(d.page_addr(1, 3), d.page_bytes)), dtype=torch.float32)
    assert torch.equal(raw.view(2, 8), lat)
    pages = torch.tensor([[3, 0]])
    assert torch.equal(pool.get_latent_pages(1, pages)[0, :2], lat)


@pytest.mark.parametrize("bad", [dict(num_pages=0), dict(page_size=0), dict(num_layers=0)])
def test_pool_rejects_empty_shapes(bad):
    kw = dict(num_pages=2, page_size=2, num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32) | bad
    with pytest.raises(ValueError):
        GQAKVPool(**kw)
