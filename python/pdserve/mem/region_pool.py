"""A KV pool of named per-token regions, each held by the layers that have that kind of state.

The one-page-group case of docs/kv-cache.md ("One layout, many kinds of state"): every region is
rate 1 (one row per token slot) with retention ``all``, so slot ``s`` of every region belongs to
the same token and the allocator, page table and radix cache carry all of them with no branch of
their own. DeepSeek-V4 is its first user (its regions: models/deepseek_v4_attention.py). P/D and
the tiers move the buffers as any pool's (``buffer_layers`` tells P/D which layers each holds).
Legend: P pages, S page_size, N layers holding the region, X region width, T tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.mem.kv_pool import KVPool
from pdserve.transfer.base import BufferDescriptor


@dataclass(frozen=True)
class RegionSpec:
    """One kind of per-token state: its name, the model layers that keep it, its row width."""

    name: str
    layers: tuple[int, ...]
    width: int

    def __post_init__(self):
        if not self.layers or self.width < 1:
            raise ValueError(f"region {self.name}: needs at least one layer and width >= 1, "
                             f"got layers {self.layers}, width {self.width}")


class RegionKVPool(KVPool):
    """One buffer ``[N, P, S, X]`` per region, in the compute dtype (no FP8 regions yet).

    Readers and writers name the region and the model layer; a layer that does not keep the
    region is a programming error and raises, naming both.
    """

    def __init__(self, num_pages: int, page_size: int, num_layers: int, regions: tuple[RegionSpec, ...],
                 dtype: torch.dtype, device: str | torch.device = "cpu"):
        super().__init__(num_pages, page_size, num_layers, dtype, device)
        self.regions = regions
        self.buffers: dict[str, torch.Tensor] = {}
        self.rows: dict[str, dict[int, int]] = {}  # region -> model layer -> row of its buffer
        for spec in regions:
            if spec.name in self.buffers:
                raise ValueError(f"region {spec.name}: declared twice")
            if max(spec.layers) >= num_layers or min(spec.layers) < 0:
                raise ValueError(f"region {spec.name}: layers {spec.layers} outside 0..{num_layers - 1}")
            self.buffers[spec.name] = torch.zeros((len(spec.layers), num_pages, page_size, spec.width),
                                                  dtype=dtype, device=self.device)
            self.rows[spec.name] = {layer: i for i, layer in enumerate(spec.layers)}

    def _flat(self, region: str, layer: int) -> torch.Tensor:
        rows = self.rows.get(region)
        if rows is None:
            raise KeyError(f"region {region!r}: not in this pool (has {', '.join(self.buffers)})")
        if layer not in rows:
            raise KeyError(f"region {region!r}: layer {layer} does not keep it (layers {tuple(rows)})")
        return self.buffers[region][rows[layer]].view(self.num_slots, -1)  # [P*S, X]

    def set_rows(self, region: str, layer: int, loc: torch.Tensor, rows: torch.Tensor) -> None:
        """loc [T] slots; rows [T, X] written there."""
        self._flat(region, layer)[loc] = rows.to(self.dtype)

    def get_rows(self, region: str, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """slots [...] -> the rows stored there, [..., X]."""
        return self._flat(region, layer)[slots]

    def page_buffers(self) -> list[tuple[str, torch.Tensor]]:
        return list(self.buffers.items())

    def buffer_layers(self) -> dict[str, tuple[int, ...]]:
        return {spec.name: spec.layers for spec in self.regions}

    def buffer_descriptors(self) -> list[BufferDescriptor]:
        out = []
        for name, buf in self.page_buffers():
            item = buf.element_size()
            out.append(BufferDescriptor(name, buf.data_ptr(), buf.stride(1) * item, buf.stride(0) * item,
                                        buf.shape[0], self.num_pages))
        return out
