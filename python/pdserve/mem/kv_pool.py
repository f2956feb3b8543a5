"""KV-cache pools: paged device memory the attention backends read and write.

Slots: token slot ``s`` lives at page ``s // page_size``, offset ``s % page_size``.
Legend: P pages, S page_size, H kv heads (local to this TP rank), D head dim,
C kv_lora_rank, R qk_rope_head_dim, N layers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from pdserve.transfer.base import BufferDescriptor


class KVPool(ABC):
    """Owns the KV tensors; knows nothing of requests or who owns which page.

    Writers pass slot indices handed out by the page allocator; the pool never
    checks ownership (the allocator and page table do).
    """

    def __init__(self, num_pages: int, page_size: int, num_layers: int, dtype: torch.dtype,
                 device: str | torch.device = "cpu"):
        if num_pages < 1 or page_size < 1 or num_layers < 1:
            raise ValueError(f"num_pages, page_size, num_layers must be >= 1, got "
                             f"{num_pages}, {page_size}, {num_layers}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_layers = num_layers
        self.dtype = dtype
        self.device = torch.device(device)

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @abstractmethod
    def buffer_descriptors(self) -> list[BufferDescriptor]:
        """Buffers to register with a transfer engine, in a fixed order."""

    @abstractmethod
    def page_buffers(self) -> list[tuple[str, torch.Tensor]]:
        """The KV tensors, each ``[N, P, ...]`` (layer, page, then one page's shape), in the
        order of ``buffer_descriptors``: what a host copy of a page must hold."""

    def _split(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.div(slots, self.page_size, rounding_mode="floor"), slots % self.page_size


class GQAKVPool(KVPool):
    """K and V per layer in HND layout ``[P, H, S, D]``.

    HND keeps one head's slice of one page contiguous, so a page sharded by
    heads over TP ranks moves in one write per head range, not one per token.
    """

    def __init__(self, num_pages, page_size, num_layers, num_kv_heads, head_dim, dtype, device="cpu"):
        super().__init__(num_pages, page_size, num_layers, dtype, device)
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        shape = (num_layers, num_pages, num_kv_heads, page_size, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=self.device)  # [N, P, H, S, D]
        self.v = torch.zeros(shape, dtype=dtype, device=self.device)

    def set_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """loc [T]; k, v [T, H, D]."""
        page, off = self._split(loc)
        self.k[layer][page, :, off] = k.to(self.dtype)
        self.v[layer][page, :, off] = v.to(self.dtype)

    def get_kv_pages(self, layer: int, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """pages [B, Lp]; returns k, v [B, H, Lp * S, D], token j of row b at column j.

        Gathers whole pages (one contiguous H*S*D block each) rather than single
        tokens: far fewer, larger copies, which is what bounds decode on CPU.
        """
        B, Lp = pages.shape
        out = []
        for buf in (self.k[layer], self.v[layer]):
            g = buf[pages]  # [B, Lp, H, S, D]
            out.append(g.transpose(1, 2).reshape(B, self.num_kv_heads, Lp * self.page_size, self.head_dim))
        return out[0], out[1]

    def page_buffers(self) -> list[tuple[str, torch.Tensor]]:
        return [("k", self.k), ("v", self.v)]

    def buffer_descriptors(self) -> list[BufferDescriptor]:
        out = []
        for name, buf in (("k", self.k), ("v", self.v)):
            item = buf.element_size()
            out.append(BufferDescriptor(name, buf.data_ptr(), buf.stride(1) * item,
                                        buf.stride(0) * item, self.num_layers, self.num_pages))
        return out


class MLAKVPool(KVPool):
    """One latent row per token per layer ``[P, S, C + R]``, the same on every attention-TP rank."""

    def __init__(self, num_pages, page_size, num_layers, kv_lora_rank, rope_dim, dtype, device="cpu"):
        super().__init__(num_pages, page_size, num_layers, dtype, device)
        self.kv_lora_rank = kv_lora_rank
        self.rope_dim = rope_dim
        self.latent = torch.zeros((num_layers, num_pages, page_size, kv_lora_rank + rope_dim),
                                  dtype=dtype, device=self.device)  # [N, P, S, C+R]

    def _flat(self, layer: int) -> torch.Tensor:
        return self.latent[layer].view(self.num_slots, -1)  # [P*S, C+R]

    def set_latent(self, layer: int, loc: torch.Tensor, latent: torch.Tensor) -> None:
        """loc [T]; latent [T, C + R] (compressed KV then rotated k_pe)."""
        self._flat(layer)[loc] = latent.to(self.dtype)

    def get_latent_pages(self, layer: int, pages: torch.Tensor) -> torch.Tensor:
        """pages [B, Lp]; returns [B, Lp * S, C + R], token j of row b at column j."""
        B, Lp = pages.shape
        return self.latent[layer][pages].view(B, Lp * self.page_size, -1)

    def page_buffers(self) -> list[tuple[str, torch.Tensor]]:
        return [("latent", self.latent)]

    def buffer_descriptors(self) -> list[BufferDescriptor]:
        buf = self.latent
        item = buf.element_size()
        return [BufferDescriptor("latent", buf.data_ptr(), buf.stride(1) * item,
                                 buf.stride(0) * item, self.num_layers, self.num_pages)]
