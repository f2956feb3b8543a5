"""Request -> token-slot table: row r, column p holds the pool slot of request r's token p.

Attention gathers a whole batch's KV slots with one index op on this table
instead of rebuilding per-request slot lists every step.
"""

from __future__ import annotations

import torch


class ReqToTokenTable:
    """Rows are handed to admitted requests and returned when they release memory.

    The table only records slots; rows and pages are handed out and taken back by
    their one owner, ``mem.cache_manager.KVCacheManager``.
    """

    def __init__(self, max_reqs: int, max_context_len: int, page_size: int):
        if max_reqs < 1 or max_context_len < 1:
            raise ValueError(f"max_reqs and max_context_len must be >= 1, got {max_reqs}, {max_context_len}")
        self.page_size = page_size
        self.max_context_len = max_context_len
        self.table = torch.zeros((max_reqs, max_context_len), dtype=torch.int64)
        self._free_rows = list(range(max_reqs - 1, -1, -1))

    @property
    def max_reqs(self) -> int:
        return self.table.shape[0]

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def alloc_row(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free_row(self, row: int) -> None:
        if row in self._free_rows:
            raise RuntimeError(f"row {row} freed twice")
        self._free_rows.append(row)

    def slots_for(self, pages: list[int], start: int, end: int) -> list[int]:
        """Slots of token positions [start, end) given the request's page list."""
        ps = self.page_size
        return [pages[p // ps] * ps + p % ps for p in range(start, end)]

    def write(self, row: int, start: int, slots: list[int]) -> None:
        if start + len(slots) > self.max_context_len:
            raise ValueError(f"position {start + len(slots)} exceeds context length {self.max_context_len}")
        self.table[row, start:start + len(slots)] = torch.tensor(slots, dtype=torch.int64)

    def write_one_each(self, rows: list[int], positions: list[int], slots: list[int]) -> None:
        """One new token per row (decode): the three lists as one tensor, one scatter (every step)."""
        row_t, pos_t, slot_t = torch.tensor((rows, positions, slots), dtype=torch.int64).unbind(0)  # 3 x [B]
        self.table[row_t, pos_t] = slot_t
