"""The torch twins of ``kv_pack`` (HND head-range pack/unpack), and the device dispatch the KV
transfer calls: CUDA tensors go through the Triton kernel, anything else through the twin, so a
CPU host never imports triton for a transfer.

Legend: N layers, P pages, H heads in the pool, S page size, D head dim, n pages moved,
Hr heads moved.
"""

from __future__ import annotations

import torch


def pack_heads_ref(pool: torch.Tensor, pages: torch.Tensor, h0: int, h1: int,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """pool [N, P, H, S, D], pages [n] -> [N, n, h1-h0, S, D] (into ``out`` when given)."""
    if out is None:
        return pool[:, pages, h0:h1].contiguous()
    torch.index_select(pool[:, :, h0:h1], 1, pages, out=out)  # no temporary: ``out`` is the staging buffer
    return out


def unpack_heads_ref(buf: torch.Tensor, pool: torch.Tensor, pages: torch.Tensor, h0: int) -> None:
    """buf [N, n, Hr, S, D] into pool [N, P, H, S, D] at ``pages``, heads [h0, h0+Hr)."""
    pool[:, pages, h0:h0 + buf.shape[2]] = buf


def pack_heads(pool: torch.Tensor, pages: torch.Tensor, h0: int, h1: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """``pack_heads_ref``'s contract; the Triton kernel on CUDA."""
    if pool.is_cuda:
        from pdserve_kernels import kv_pack

        return kv_pack.pack_heads(pool, pages, h0, h1, out)
    return pack_heads_ref(pool, pages, h0, h1, out)


def unpack_heads(buf: torch.Tensor, pool: torch.Tensor, pages: torch.Tensor, h0: int) -> None:
    """``unpack_heads_ref``'s contract; the Triton kernel on CUDA."""
    if pool.is_cuda:
        from pdserve_kernels import kv_pack

        kv_pack.unpack_heads(buf, pool, pages, h0)
        return
    unpack_heads_ref(buf, pool, pages, h0)
