"""Page allocator: hands out KV page ids; knows nothing of requests or tensors."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from operator import index


class PageAllocator:
    """Hands out page ids ``0 .. num_pages - 1``.

    Ownership: a page returned by :meth:`alloc` belongs to the caller until the
    caller passes it to :meth:`free`. Device pages are freed only by
    ``KVCacheManager`` (the caches return pages to it; see mem/README.md). Freeing a page that is already free, or
    an id outside the pool, raises ``RuntimeError``: a double free means two
    owners believed they held the page, which must never pass silently.

    Free pages sit on a stack; lowest ids come out first from a fresh pool and
    the most recently freed pages are reused first, so allocation order is
    deterministic for a given sequence of calls.
    """

    def __init__(self, num_pages: int):
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        self.num_pages = num_pages
        self.reset()

    @property
    def num_free(self) -> int:
        return len(self._stack)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._stack)

    def is_free(self, page: int) -> bool:
        return bool(self._is_free[self._checked_id(page)])

    def first_free(self, pages: Sequence[int]) -> int | None:
        """Index of the first of ``pages`` that is free (None: all are held), in one pass."""
        if pages and not (0 <= min(pages) and max(pages) < self.num_pages):
            bad = next(p for p in pages if not 0 <= p < self.num_pages)
            raise RuntimeError(f"page id {bad} out of range [0, {self.num_pages})")
        free = self._is_free
        return next((i for i, p in enumerate(pages) if free[p]), None)

    def alloc(self, n: int) -> list[int] | None:
        """Take ``n`` pages, or return ``None`` (and take nothing) if fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n == 0:
            return []
        if n > len(self._stack):
            return None
        pages = self._stack[-n:]
        del self._stack[-n:]
        pages.reverse()  # top of the stack first
        for p in pages:
            self._is_free[p] = 0
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Return pages to the pool. Validates all ids first, so a bad call changes nothing."""
        pages = [self._checked_id(p) for p in pages]
        for p in pages:
            if self._is_free[p]:
                raise RuntimeError(f"double free of page {p}")
        if len(set(pages)) != len(pages):
            raise RuntimeError(f"double free: page listed twice in one free() call: {sorted(pages)}")
        for p in pages:
            self._is_free[p] = 1
        # Reversed so the first page of this batch is the next one handed out.
        self._stack.extend(reversed(pages))

    def reset(self) -> None:
        """Mark every page free (callers must have dropped every page they held)."""
        self._stack = list(range(self.num_pages - 1, -1, -1))
        self._is_free = bytearray(b"\x01") * self.num_pages

    def _checked_id(self, page: int) -> int:
        p = index(page)
        if not 0 <= p < self.num_pages:
            raise RuntimeError(f"page id {p} out of range [0, {self.num_pages})")
        return p

    def __repr__(self) -> str:
        return f"PageAllocator(num_pages={self.num_pages}, num_free={self.num_free})"
