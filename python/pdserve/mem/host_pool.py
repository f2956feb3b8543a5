"""Host-memory KV pool: the tier below the device pool in the hierarchical cache.

Each host page holds exactly what one device page holds (every layer's K and V heads in HND,
or the MLA latent rows), in one of two layouts:

* ``layer_first``: ``[N, Ph, ...]`` like the device pool, so a page list copies as one
  gather per buffer;
* ``page_first``: ``[Ph, N, ...]``, so one page of every layer is contiguous: a storage object
  is a plain byte slice.

Legend: N layers, P device pages, Ph host pages, "..." one page of one layer (H, S, D for GQA;
S, C + R for MLA).

The pool owns its page ids (its own ``PageAllocator``) and the copies; which radix node holds
which host page is the hierarchical radix cache's business.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.mem.allocator import PageAllocator
from pdserve.mem.kv_pool import KVPool


@dataclass
class CopyOp:
    """One batch of page copies between the tiers; ``done`` once every byte has landed.

    On CUDA the copy runs on a side stream and ``event`` marks its end; on CPU the copy is
    synchronous and ``event`` is None.
    """

    src_pages: list[int]
    dst_pages: list[int]
    num_bytes: int
    event: torch.cuda.Event | None = None

    def done(self) -> bool:
        return self.event is None or bool(self.event.query())

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


def host_page_bytes(device_pool: KVPool) -> int:
    """Bytes one page of ``device_pool`` takes over every layer and buffer."""
    return sum(buf[:, 0].numel() * buf.element_size() for _, buf in device_pool.page_buffers())


class HostKVPool:
    """Host copies of device pages, ``num_pages`` of them, in ``layout``."""

    def __init__(self, device_pool: KVPool, num_pages: int, layout: str = "layer_first"):
        if layout not in ("layer_first", "page_first"):
            raise ValueError(f"hicache_mem_layout: {layout!r} is not one of ('layer_first', 'page_first')")
        self.device_pool = device_pool
        self.num_pages = num_pages
        self.layout = layout
        self.allocator = PageAllocator(num_pages)
        on_cuda = device_pool.device.type == "cuda"
        # Pinned memory lets the side stream copy without a staging buffer (and asynchronously).
        self.buffers: list[torch.Tensor] = [self._alloc(buf, on_cuda) for _, buf in device_pool.page_buffers()]
        self._stream = torch.cuda.Stream(device_pool.device) if on_cuda else None

    def _alloc(self, dev: torch.Tensor, pin: bool) -> torch.Tensor:
        n, _, *page = dev.shape  # [N, P, ...]
        shape = (n, self.num_pages, *page) if self.layout == "layer_first" else (self.num_pages, n, *page)
        return torch.zeros(shape, dtype=dev.dtype, pin_memory=pin)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over every layer and buffer (one storage payload per page)."""
        return host_page_bytes(self.device_pool)

    def _host_page(self, buf: torch.Tensor, page: int) -> torch.Tensor:
        """One host page of every layer: ``[N, ...]``."""
        return buf[:, page] if self.layout == "layer_first" else buf[page]

    # ------------------------------------------------------------------ copies
    def backup(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> CopyOp:
        """Copy device pages down (device_pages[i] -> host_pages[i]); the device pages must not
        be reused until the op is done."""
        return self._copy(list(device_pages), list(host_pages), to_host=True)

    def load(self, host_pages: Sequence[int], device_pages: Sequence[int]) -> CopyOp:
        """Copy host pages up (host_pages[i] -> device_pages[i]); no layer may read the device
        pages, and the host pages must stay, until the op is done."""
        return self._copy(list(host_pages), list(device_pages), to_host=False)

    def _copy(self, src: list[int], dst: list[int], to_host: bool) -> CopyOp:
        if len(src) != len(dst):
            raise ValueError(f"copy of {len(src)} pages into {len(dst)}")
        op = CopyOp(src, dst, len(src) * self.page_bytes)
        if not src:
            return op
        if self._stream is None:
            self._copy_pages(src, dst, to_host, non_blocking=False)
            return op
        # The side stream first waits for the forward that wrote (or last read) these pages.
        self._stream.wait_stream(torch.cuda.current_stream(self.device_pool.device))
        with torch.cuda.stream(self._stream):
            self._copy_pages(src, dst, to_host, non_blocking=True)
            op.event = torch.cuda.Event()
            op.event.record(self._stream)
        return op

    def _copy_pages(self, src: list[int], dst: list[int], to_host: bool, non_blocking: bool) -> None:
        for (_, dev), host in zip(self.device_pool.page_buffers(), self.buffers):
            for s, d in zip(src, dst):
                if to_host:
                    self._host_page(host, d).copy_(dev[:, s], non_blocking=non_blocking)
                else:
                    dev[:, d].copy_(self._host_page(host, s), non_blocking=non_blocking)

    # ------------------------------------------------------------ storage bytes
    def page_payload(self, host_pages: Sequence[int]) -> bytes:
        """The pages as page_first bytes (page, then buffer, then layer): one storage object."""
        parts = [self._host_page(buf, p).contiguous().view(torch.uint8).numpy().tobytes()
                 for p in host_pages for buf in self.buffers]
        return b"".join(parts)

    def set_page_payload(self, host_pages: Sequence[int], payload: bytes) -> None:
        """Inverse of ``page_payload``; raises ValueError when the length does not match."""
        if len(payload) != len(host_pages) * self.page_bytes:
            raise ValueError(f"payload of {len(payload)} bytes for {len(host_pages)} pages of {self.page_bytes}")
        raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        off = 0
        for p in host_pages:
            for buf in self.buffers:
                dst = self._host_page(buf, p)
                n = dst.numel() * dst.element_size()
                dst.copy_(raw[off:off + n].view(buf.dtype).view(dst.shape))
                off += n
