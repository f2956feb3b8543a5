"""Build ForwardBatches by hand for model tests: a few requests over successive forwards,
each given random, non-contiguous pages (so a layout bug cannot hide behind slot == position)."""

from __future__ import annotations

import random

import torch

from pdserve.layers.attention.torch_native import TorchNativeBackend
from pdserve.layers.forward_batch import ForwardBatch, ForwardMode
from pdserve.mem.kv_pool import GQAKVPool, MLAKVPool


def make_pool(hf_config, page_size: int, num_tokens: int = 256, dtype=torch.float32):
    """Room for ``num_tokens`` tokens even if every request wastes a partly filled page."""
    num_pages = num_tokens // page_size + 16
    c = hf_config
    if hasattr(c, "kv_lora_rank"):
        return MLAKVPool(num_pages, page_size, c.num_hidden_layers, c.kv_lora_rank, c.qk_rope_head_dim, dtype)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return GQAKVPool(num_pages, page_size, c.num_hidden_layers, c.num_key_value_heads, head_dim, dtype)


class PagedRequests:
    """Tracks each request's slots across forwards; pages are drawn in a shuffled order."""

    def __init__(self, pool, seed: int = 0, backend=None):
        self.pool = pool
        self.backend = backend or TorchNativeBackend()
        self.free_pages = list(range(pool.num_pages))
        random.Random(seed).shuffle(self.free_pages)
        self.slots: dict[object, list[int]] = {}

    def _append(self, rid, n: int) -> list[int]:
        S = self.pool.page_size
        slots = self.slots.setdefault(rid, [])
        new = []
        for _ in range(n):
            page = self.free_pages.pop() if len(slots) % S == 0 else slots[-1] // S
            slots.append(page * S + len(slots) % S)
            new.append(slots[-1])
        return new

    def batch(self, reqs: list[tuple[object, list[int]]], decode: bool = False) -> ForwardBatch:
        """One step: each ``(request id, new token ids)`` extends that request's sequence."""
        prefix = [len(self.slots.get(rid, [])) for rid, _ in reqs]
        out_loc = [s for rid, toks in reqs for s in self._append(rid, len(toks))]
        ext = [len(toks) for _, toks in reqs]
        seq = [p + e for p, e in zip(prefix, ext)]
        kv = torch.zeros(len(reqs), max(seq), dtype=torch.int64)
        for b, (rid, _) in enumerate(reqs):
            kv[b, :seq[b]] = torch.tensor(self.slots[rid])
        t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
        positions = [p + i for p, e in zip(prefix, ext) for i in range(e)]
        ids = [tok for _, toks in reqs for tok in toks]
        mode = ForwardMode.DECODE if decode else ForwardMode.EXTEND
        return ForwardBatch(mode, t(ids), t(positions), t(out_loc), t(prefix), t(ext), t(seq), kv,
                            self.pool, self.backend)
