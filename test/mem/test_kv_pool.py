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


# ---------------------------------------------------------------- FP8 pages (--kv-cache-dtype fp8_e4m3)
from pdserve.mem.kv_pool import FP8_DTYPE, FP8_MAX  # noqa: E402


def test_fp8_gqa_pool_round_trip_saturates_and_applies_its_scales():
    """Writes store x / scale in e4m3 (saturated at +-448, never NaN or inf), reads give stored *
    scale in the compute dtype, within e4m3's rounding (3 mantissa bits: 2^-4 relative)."""
    pool = GQAKVPool(6, 4, 2, 2, 8, FP8_DTYPE, compute_dtype=torch.float32, k_scale=0.01, v_scale=4.0)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(5, 2, 8, generator=g), torch.randn(5, 2, 8, generator=g) * 100
    k[0, 0, :3] = torch.tensor([1e3, -float("inf"), float("inf")])  # past 448 * 0.01
    v[1, 1, 0] = -1e9
    loc = torch.tensor([1, 2, 9, 13, 22])
    pool.set_kv(1, loc, k, v)
    assert pool.k.dtype == FP8_DTYPE and pool.k.float().isfinite().all() and pool.v.float().isfinite().all()
    page, off = loc // 4, loc % 4
    assert pool.k[1, page[0], 0, off[0], :3].float().tolist() == [FP8_MAX, -FP8_MAX, FP8_MAX]
    kr, vr = pool.get_kv_pages(1, torch.tensor([[0, 2, 3, 5]]))  # [1, H, 16, D]
    assert kr.dtype == torch.float32
    got_k = kr[0][:, [1, 2, 5, 9, 14]].transpose(0, 1)
    got_v = vr[0][:, [1, 2, 5, 9, 14]].transpose(0, 1)
    assert got_k[0, 0, :3].tolist() == pytest.approx([4.48, -4.48, 4.48])
    assert got_v[1, 1, 0].item() == -FP8_MAX * 4.0
    fine = k.abs() < 4.0  # inside the range at scale 0.01 and not the subnormal tail
    torch.testing.assert_close(got_k[fine], k[fine], rtol=2 ** -4, atol=0.01 * 2 ** -9)
    torch.testing.assert_close(got_v[v.abs() < 1000], v[v.abs() < 1000], rtol=2 ** -4, atol=4.0 * 2 ** -9)
    rk, rv = pool.round_trip_kv(k, v)
    assert torch.equal(rk, got_k) and torch.equal(rv, got_v)


def test_fp8_mla_pool_round_trip_and_a_quarter_of_the_bytes():
    full = MLAKVPool(5, 2, 2, 6, 2, torch.float32)
    pool = MLAKVPool(5, 2, 2, 6, 2, FP8_DTYPE, compute_dtype=torch.bfloat16, latent_scale=0.5)
    lat = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    lat[0, 0] = 1e4
    pool.set_latent(1, torch.tensor([6, 7]), lat)  # page 3
    got = pool.get_latent_pages(1, torch.tensor([[3, 0]]))[0, :2]
    assert got.dtype == torch.bfloat16 and got[0, 0].item() == FP8_MAX * 0.5
    torch.testing.assert_close(got[:, 1:].float(), lat[:, 1:], rtol=2 ** -4, atol=0.5 * 2 ** -9)
    assert torch.equal(pool.round_trip_latent(lat), got)
    (d,), (df,) = pool.buffer_descriptors(), full.buffer_descriptors()
    assert d.page_bytes * 4 == df.page_bytes and d.total_bytes * 4 == df.total_bytes
    raw = _bytes_at(d.page_addr(1, 3), d.page_bytes)  # the transfer's bytes are the stored e4m3 values
    assert raw == pool.latent[1, 3].contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("kw,field", [(dict(dtype=torch.float32, k_scale=0.5), "k_scale"),
                                      (dict(dtype=FP8_DTYPE, compute_dtype=torch.float32, v_scale=0.0), "v_scale"),
                                      (dict(dtype=FP8_DTYPE), "compute_dtype")])
def test_pool_refuses_meaningless_scales_and_an_fp8_compute_dtype(kw, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        GQAKVPool(2, 2, 1, 1, 2, **kw)


def test_mla_pool_index_keys_are_a_second_region_of_the_same_pages():
    """DeepSeek-V3.2: slot s holds token s's latent and its index key; both regions are listed."""
    pool = MLAKVPool(num_pages=5, page_size=2, num_layers=2, kv_lora_rank=6, rope_dim=2, dtype=torch.float32,
                     index_head_dim=4)
    loc = torch.tensor([6, 7])  # page 3
    lat, idx = torch.randn(2, 8), torch.randn(2, 4)
    pool.set_latent(1, loc, lat)
    pool.set_index_k(1, loc, idx)
    assert [name for name, _ in pool.page_buffers()] == ["latent", "index_k"]
    latent_d, index_d = pool.buffer_descriptors()
    assert index_d.name == "index_k" and index_d.page_bytes == 2 * 4 * 4 and index_d.num_pages == latent_d.num_pages
    raw = torch.frombuffer(bytearray(_bytes_at(index_d.page_addr(1, 3), index_d.page_bytes)), dtype=torch.float32)
    assert torch.equal(raw.view(2, 4), idx)
    assert torch.equal(pool.get_index_k_slots(1, loc), idx) and torch.equal(pool.get_latent_slots(1, loc), lat)
    assert not pool.get_index_k_slots(0, loc).any()  # another layer's region is untouched


@pytest.mark.parametrize("fp8", [False, True])
def test_latent_rows_read_by_slot_take_the_slots_shape(fp8):
    """A sparse read (DeepSeek-V3.2's chosen tokens, [B, Q, k] slots) returns each slot's row as the
    page read does, in the compute dtype, slots in any order and repeated."""
    kw = dict(dtype=FP8_DTYPE, compute_dtype=torch.bfloat16, latent_scale=0.5) if fp8 else dict(dtype=torch.float32)
    pool = MLAKVPool(5, 2, 2, 6, 2, **kw)
    pool.set_latent(0, torch.arange(10), torch.randn(10, 8, generator=torch.Generator().manual_seed(2)))
    pages = pool.get_latent_pages(0, torch.arange(5)[None])[0]  # [10, 8], slot s at row s
    slots = torch.tensor([[[9, 0, 4], [4, 4, 1]], [[2, 3, 8], [7, 6, 5]]])  # [B 2, Q 2, k 3]
    got = pool.get_latent_slots(0, slots)
    assert got.shape == (2, 2, 3, 8) and got.dtype == pages.dtype
    assert torch.equal(got, pages[slots])

def test_mla_pool_without_index_keys_refuses_them():
    pool = MLAKVPool(num_pages=2, page_size=2, num_layers=1, kv_lora_rank=4, rope_dim=2, dtype=torch.float32)
    assert [d.name for d in pool.buffer_descriptors()] == ["latent"]
    with pytest.raises(RuntimeError, match="index_k: this MLA pool was built without index keys"):
        pool.set_index_k(0, torch.tensor([0]), torch.zeros(1, 4))
