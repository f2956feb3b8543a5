"""Staging memory of packed KV transfers (``layout.plan_packed_writes``): a registered byte
buffer handed out in ranges, and the gather/scatter between HND pages and packed blocks.

Prefill packs a forward's head block of one layer into a range, posts one write from it and gets
the range back only once that write has settled (it is read until then). Decode lends a room a
range for the room's whole KV, scatters it into the room's pages once every write completed, and
gets it back then, or with the room's pages out of quarantine when the room was given up (a late
write may still land in it). A full buffer is never waited on: prefill then writes page by page
from its pool, decode asks for the room unpacked.

Legend: N layers, P pages, H local heads, S page size, D head dim, n pages of a room or forward,
Hr heads of one block.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve_kernels.kv_pack_ref import pack_heads, unpack_heads

ALIGN = 256  # ranges start on this many bytes: any dtype's view and a DMA engine's preference


class StagingPool:
    """``nbytes`` of registrable memory on ``device``, handed out first-fit in aligned ranges."""

    def __init__(self, nbytes: int, device: str | torch.device = "cpu"):
        if nbytes < ALIGN:
            raise ValueError(f"disaggregation_pack_staging_mb: a staging buffer needs at least {ALIGN} bytes")
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)  # [nbytes]; never read before written
        self.nbytes = nbytes
        self._free: list[tuple[int, int]] = [(0, nbytes)]  # (offset, size), sorted, coalesced
        self._used: dict[int, int] = {}  # offset -> size

    @property
    def addr(self) -> int:
        return self.buffer.data_ptr()

    @property
    def bytes_free(self) -> int:
        return sum(n for _, n in self._free)

    @property
    def ranges_in_use(self) -> int:
        return len(self._used)

    def alloc(self, nbytes: int) -> int | None:
        """The offset of a free range of ``nbytes``; None when no free range is that long."""
        size = -(-nbytes // ALIGN) * ALIGN
        for i, (off, n) in enumerate(self._free):
            if n >= size:
                self._free[i:i + 1] = [(off + size, n - size)] if n > size else []
                self._used[off] = size
                return off
        return None

    def free(self, offset: int) -> None:
        size = self._used.pop(offset)  # a double free fails here, loudly
        self._free.append((offset, size))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for off, n in self._free:
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((off, n))
        self._free = merged

    def view(self, offset: int, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        """The range at ``offset`` as a dense tensor of ``shape``."""
        count = 1
        for s in shape:
            count *= s
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        return self.buffer[offset:offset + nbytes].view(dtype).view(*shape)


def pack_block(pool: torch.Tensor, layer: int, pages: Sequence[int], h0: int, nheads: int,
               staging: StagingPool, offset: int) -> None:
    """Heads ``[h0, h0 + nheads)`` of ``pages`` of ``layer`` (pool [N, P, H, S, D]) into the range
    at ``offset``, as [1, n, Hr, S, D]."""
    _, _, _, S, D = pool.shape
    out = staging.view(offset, pool.dtype, (1, len(pages), nheads, S, D))  # [1, n, Hr, S, D]
    idx = torch.tensor(list(pages), dtype=torch.int64, device=pool.device)
    pack_heads(pool[layer:layer + 1], idx, h0, h0 + nheads, out)


def unpack_room(staging: StagingPool, offset: int, blocks, pools: dict[str, torch.Tensor],
                pages: Sequence[int]) -> None:
    """Scatter a room's staging region (``layout.staging_blocks``) into ``pages`` of ``pools``
    (by buffer name, each [N, P, H, S, D])."""
    idx = None
    for g, name, block_off in blocks:
        pool = pools[name]
        N, _, _, S, D = pool.shape
        if idx is None:
            idx = torch.tensor(list(pages), dtype=torch.int64, device=pool.device)
        buf = staging.view(offset + block_off, pool.dtype, (N, len(pages), g.nheads, S, D))  # [N, n, Hr, S, D]
        unpack_heads(buf, pool, idx, g.dst_head)


def pool_tensors(pool) -> dict[str, torch.Tensor]:
    """A GQA pool's buffers by the names its descriptors give them; empty for any other pool."""
    k, v = getattr(pool, "k", None), getattr(pool, "v", None)
    if isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor):
        return {"k": k, "v": v}
    return {}
