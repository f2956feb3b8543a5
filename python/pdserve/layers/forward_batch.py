"""The per-step description every layer reads: which tokens, where their KV goes.

Legend: T tokens in this step, B requests, L longest KV length in the batch.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pdserve.mem.kv_pool import KVPool

if TYPE_CHECKING:  # base.py imports this module
    from pdserve.layers.attention.base import AttentionBackend, AttentionMetadata


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill, possibly on top of a cached prefix, possibly one chunk
    DECODE = "decode"  # exactly one new token per request


# Called as hook(layer_id, forward_batch) right after layer ``layer_id`` has written
# this step's KV into the pool; disaggregation streams KV from here, layer by layer.
LayerHook = Callable[[int, "ForwardBatch"], None]


@dataclass
class ForwardBatch:
    """Filled by the model runner from a scheduled batch; read-only for layers.

    Invariants: ``extend_lens.sum() == T``; ``seq_lens == prefix_lens + extend_lens``;
    ``kv_slots[b, :seq_lens[b]]`` are the pool slots of request b's tokens in
    position order, and the last ``extend_lens[b]`` of them equal that request's
    part of ``out_cache_loc``. Slots follow pages: position p of a request lives at
    offset ``p % page_size`` of its ``p // page_size``-th page, so backends may
    gather whole pages (``kv_slots[:, ::page_size] // page_size``).
    """

    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64 pool slot (page * page_size + offset) of each new token
    prefix_lens: torch.Tensor  # [B] int64 tokens already in the pool before this step
    extend_lens: torch.Tensor  # [B] int64 new tokens this step (1 each for DECODE)
    seq_lens: torch.Tensor  # [B] int64 prefix + new
    kv_slots: torch.Tensor  # [B, L] int64 slots of all tokens, padded with 0
    kv_pool: KVPool
    attn_backend: AttentionBackend
    layer_hook: LayerHook | None = None
    # Identity of the requests in order (Req.uid: unique for the scheduler's life, never a
    # client-chosen rid); lets a backend recognise the same decode batch across steps.
    req_uids: tuple[int, ...] | None = None
    # Rows of the req->token table, in order: the slot of a per-request record (DeepSeek-V4's
    # bounded state, mem/region_pool.py), which the cache manager gives and takes with the row.
    req_rows: tuple[int, ...] | None = None
    # Set once per forward by the model runner: ``attn_backend.prepare(self)``.
    attn_metadata: AttentionMetadata | None = None
    # DP attention: tokens of every attention group this step ([attn DP size]), agreed by the
    # ranks before the forward (engine/rank_group.py); the MLPs gather that many rows.
    dp_num_tokens: list[int] | None = None

    @classmethod
    def idle(cls, kv_pool: KVPool, attn_backend: AttentionBackend, dp_num_tokens: list[int]) -> ForwardBatch:
        """A step with no tokens for this attention group while others have some (DP attention):
        the model only takes part in the layers shared across groups. Never ``prepare``d."""
        empty = torch.zeros(0, dtype=torch.int64, device=kv_pool.device)
        return cls(ForwardMode.DECODE, empty, empty, empty, empty, empty, empty, empty.view(0, 0), kv_pool,
                   attn_backend, dp_num_tokens=dp_num_tokens)

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def is_decode(self) -> bool:
        return self.mode is ForwardMode.DECODE

    def last_token_index(self) -> torch.Tensor:
        """[B] index into the T tokens of each request's last token (whose logits are sampled)."""
        return torch.cumsum(self.extend_lens, 0) - 1

    def kv_written(self, layer_id: int) -> None:
        """Attention calls this once the layer's new KV is in the pool."""
        if self.layer_hook is not None:
            self.layer_hook(layer_id, self)
