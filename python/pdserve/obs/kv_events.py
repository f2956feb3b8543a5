"""KV cache events: what a cache tier reports when blocks enter or leave it (no I/O here).

Field names follow vLLM's and Dynamo's KV events (``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``), so a router written for those reads ours. A block is one page;
its hash is the radix cache's chained ``hash_block``, so a router that tokenizes a prompt
computes the same hashes from token ids alone. ``medium`` names the tier holding the block
("GPU" for device pages, "CPU" for a host tier), as in vLLM/Dynamo.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

MEDIUM_GPU = "GPU"  # device KV pages (the pool the radix cache owns)
MEDIUM_CPU = "CPU"  # a host-memory tier


@dataclass(frozen=True)
class BlockStored:
    """Blocks ``block_hashes`` (a chain: each extends the one before) now cached, the first extending
    ``parent_block_hash`` (None: it starts a sequence); ``token_ids`` are all their tokens."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    medium: str = MEDIUM_GPU
    lora_id: int | None = None
    type: str = field(default="BlockStored", init=False)


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str = MEDIUM_GPU
    type: str = field(default="BlockRemoved", init=False)


@dataclass(frozen=True)
class AllBlocksCleared:
    medium: str | None = None  # None: every tier
    type: str = field(default="AllBlocksCleared", init=False)


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
EVENT_TYPES = ("BlockStored", "BlockRemoved", "AllBlocksCleared")


def event_dict(event: KVEvent) -> dict:
    return asdict(event)


class KVEventSink(ABC):
    """Receives a cache tier's changes as they happen, on the thread that changes the cache (the
    scheduler's): implementations must only record, never block or do I/O."""

    @abstractmethod
    def stored(self, parent_hash: int | None, hashes: Sequence[int], token_ids: Sequence[int], block_size: int,
               medium: str) -> None: ...

    @abstractmethod
    def removed(self, hashes: Sequence[int], medium: str) -> None: ...

    @abstractmethod
    def cleared(self, medium: str | None) -> None: ...


class EventBuffer(KVEventSink):
    """Collects events until ``take``; what a publisher sends as one batch per scheduler step."""

    def __init__(self) -> None:
        self.events: list[KVEvent] = []

    def stored(self, parent_hash: int | None, hashes: Sequence[int], token_ids: Sequence[int], block_size: int,
               medium: str) -> None:
        self.events.append(BlockStored(list(hashes), parent_hash, list(token_ids), block_size, medium))

    def removed(self, hashes: Sequence[int], medium: str) -> None:
        self.events.append(BlockRemoved(list(hashes), medium))

    def cleared(self, medium: str | None) -> None:
        self.events.append(AllBlocksCleared(medium))

    def take(self) -> list[KVEvent]:
        out, self.events = self.events, []
        return out
