"""A progress bar for the benchmark: tqdm when it is installed, else a one-line text bar on stderr."""

from __future__ import annotations

import sys
import time


class TextBar:
    """``done/total`` with a bar, redrawn at most every ``every_s`` seconds and at the end."""

    def __init__(self, total: int, desc: str = "", stream=None, every_s: float = 0.5):
        self.total, self.desc, self.n = total, desc, 0
        self.stream = stream or sys.stderr
        self.every_s = every_s
        self.started = self.drawn = time.monotonic()

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self.drawn >= self.every_s or self.n >= self.total:
            self.drawn = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        frac = self.n / self.total if self.total else 1.0
        bar = "#" * int(30 * frac)
        self.stream.write(f"\r{self.desc}{self.n}/{self.total} [{bar:<30}] {now - self.started:6.1f}s")
        self.stream.flush()

    def close(self) -> None:
        self.stream.write("\n")
        self.stream.flush()


class NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, disable: bool = False, desc: str = ""):
    """An object with ``update(n)`` and ``close()``."""
    if disable:
        return NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return TextBar(total, desc)
    return tqdm(total=total, desc=desc or None)
