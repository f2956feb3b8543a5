"""Typed messages only a multi-rank engine answers (through ``engine/codec.py`` like ``io_struct``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CheckMemoryReq:
    """Ask every rank to check its page accounting (``Scheduler.check_memory``)."""


@dataclass
class RankMemory:
    """One rank's page accounting; ``error`` is the check's message when it failed."""

    rank: int
    dp_rank: int
    total_pages: int
    free_pages: int
    cached_pages: int
    has_work: bool
    error: str | None = None


@dataclass
class CheckMemoryResp:
    ranks: list[RankMemory] = field(default_factory=list)


MESSAGES: tuple[type, ...] = (CheckMemoryReq, CheckMemoryResp)
