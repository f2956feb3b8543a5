"""HND head-range pack/unpack: one contiguous buffer per transfer destination.

When prefill and decode run different TP sizes, a destination rank holds a head range
[h0, h1) of each page. In the HND pool [N, P, H, S, D] that range of one page is one
contiguous run of (h1-h0)*S*D elements, but there is still one run per (layer, page). Packing
gathers them into a single buffer [N, n, h1-h0, S, D] that moves in one write; the receiver
unpacks it into its own pages (where the head range may start at another offset).

Legend: N layers, P pages, H heads in the pool, S page size, D head dim, n pages moved,
Hr = h1 - h0 heads moved.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve_kernels import kv_pack_ref


@triton.jit
def _copy_kernel(Pool, Buf, Pages, n_pages, sp_l, sp_p, sp_h, sb_l, sb_p, sb_h, h0, run,
                 UNPACK: tl.constexpr, BLOCK: tl.constexpr):
    ln = tl.program_id(0)  # layer * n + i
    layer = ln // n_pages
    i = ln % n_pages
    hr = tl.program_id(1)
    page = tl.load(Pages + i)
    src = Pool + layer * sp_l + page * sp_p + (h0 + hr) * sp_h
    dst = Buf + layer * sb_l + i * sb_p + hr * sb_h
    for c in range(0, run, BLOCK):
        offs = c + tl.arange(0, BLOCK)
        mask = offs < run
        if UNPACK:
            tl.store(src + offs, tl.load(dst + offs, mask=mask), mask=mask)
        else:
            tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


def _launch(pool, buf, pages, h0, unpack: bool) -> None:
    N, _, _, S, D = pool.shape
    n, Hr = buf.shape[1], buf.shape[2]
    if n == 0 or Hr == 0:
        return
    assert pool.stride(3) == D and pool.stride(4) == 1 and buf.is_contiguous(), "HND pages must be dense"
    _copy_kernel[(N * n, Hr)](pool, buf, pages, n, pool.stride(0), pool.stride(1), pool.stride(2),
                              buf.stride(0), buf.stride(1), buf.stride(2), h0, S * D,
                              UNPACK=unpack, BLOCK=min(1024, triton.next_power_of_2(S * D)))


def pack_heads(pool: torch.Tensor, pages: torch.Tensor, h0: int, h1: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """pool [N, P, H, S, D], pages [n] -> [N, n, h1-h0, S, D]: ``out`` (contiguous; a staging
    buffer the caller owns) or a new buffer."""
    N, _, _, S, D = pool.shape
    buf = torch.empty(N, pages.shape[0], h1 - h0, S, D, dtype=pool.dtype, device=pool.device) if out is None else out
    _launch(pool, buf, pages, h0, unpack=False)
    return buf


def unpack_heads(buf: torch.Tensor, pool: torch.Tensor, pages: torch.Tensor, h0: int) -> None:
    """buf [N, n, Hr, S, D] into pool [N, P, H, S, D] at ``pages``, heads [h0, h0+Hr)."""
    _launch(pool, buf.contiguous(), pages, h0, unpack=True)


pack_heads_ref = kv_pack_ref.pack_heads_ref
unpack_heads_ref = kv_pack_ref.unpack_heads_ref
