"""Plain-C CPU kernels built on first use: the shared build, cache and load of ``*.c`` sources.

A kernel's source is compiled with the system compiler (``$PDSERVE_CC``, else ``cc``) into a per-user
cache (``$PDSERVE_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/pdserve/kernels``) keyed by the source, the
flags, the compiler and the CPU, then loaded with ctypes. No torch headers, so a build takes about a
second. A library whose build fails, or that has no compiler, loads as None (said once in the log):
its callers run their torch twin.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=gnu99")
BUILD_TIMEOUT_S = 120


def cache_dir() -> Path:
    """$PDSERVE_KERNEL_CACHE, else $XDG_CACHE_HOME/pdserve/kernels (default ~/.cache)."""
    if os.environ.get("PDSERVE_KERNEL_CACHE"):
        return Path(os.environ["PDSERVE_KERNEL_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pdserve" / "kernels"


def compiler() -> str:
    return os.environ.get("PDSERVE_CC") or "cc"


def cpu_id() -> str:
    """What -march=native compiles for (the first CPU's model and instruction-set flags): a library
    built on another CPU, or a VM that hides some extensions, may not run here."""
    seen: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name = line.split(":", 1)[0].strip()
            if name in ("model name", "flags", "Features", "CPU part") and name not in seen:
                seen[name] = line
    except OSError:
        pass
    return "\n".join(seen.values()) or platform.processor()


class CLibrary:
    """One C source built into one shared library. ``declare(lib)`` sets the argtypes and restype of
    its functions once the library is loaded; ``what`` names the kernel in ``log``'s lines. ``headers``:
    the local headers the source includes (their text joins the cache key, so editing one rebuilds)."""

    def __init__(self, source: Path, declare: Callable[[ctypes.CDLL], None], what: str,
                 flags: tuple[str, ...] = FLAGS, log: logging.Logger = logger, headers: tuple[Path, ...] = ()):
        self.source, self.declare, self.what, self.flags, self.log = source, declare, what, flags, log
        self.headers = headers
        self._loaded: dict[str, ctypes.CDLL | None] = {}
        self._lock = threading.Lock()

    def library_path(self, cc: str) -> Path:
        texts = [self.source.read_text(), *(h.read_text() for h in self.headers)]
        key = hashlib.sha256("\0".join([*texts, " ".join(self.flags), cc, platform.machine(),
                                        cpu_id()]).encode()).hexdigest()[:16]
        return cache_dir() / f"{self.source.stem}-{key}.so"

    def build(self, cc: str) -> Path:
        """The compiled library, built unless cached. Atomic: each build writes its own temporary
        file and renames it into place, so processes building at once each load a whole library."""
        out = self.library_path(cc)
        if out.exists():
            return out
        if shutil.which(cc) is None:
            raise FileNotFoundError(f"no C compiler {cc!r} (set PDSERVE_CC)")
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=out.stem + ".", suffix=".tmp.so", dir=out.parent)
        os.close(fd)
        try:
            done = subprocess.run([cc, *self.flags, "-o", tmp, str(self.source)], capture_output=True, text=True,
                                  timeout=BUILD_TIMEOUT_S)
            if done.returncode != 0:
                raise RuntimeError(f"{cc} exited {done.returncode}: {done.stderr.strip()[-2000:]}")
            os.replace(tmp, out)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return out

    def load(self, cc: str | None = None) -> ctypes.CDLL | None:
        """The library built with ``cc`` (default ``compiler()``), or None where that fails; the
        outcome is kept per compiler, so a failure is logged once."""
        cc = cc or compiler()
        lib = self._loaded.get(cc, self)  # lock-free once settled: kernels' callers ask on every call
        if lib is not self:
            return lib  # type: ignore[return-value]
        with self._lock:
            if cc not in self._loaded:
                self._loaded[cc] = self._open(cc)
            return self._loaded[cc]

    def _open(self, cc: str) -> ctypes.CDLL | None:
        try:
            lib = ctypes.CDLL(str(self.build(cc)))
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            self.log.warning("%s: the CPU kernel is unavailable (%s); the torch path runs instead", self.what, e)
            return None
        self.declare(lib)
        self.log.info("%s: CPU kernel %s", self.what, lib._name)
        return lib


def check_tensor(name: str, t: torch.Tensor, kernel: str, dtype: torch.dtype = torch.float32, dim: int | None = None,
                 layout: str = "contiguous") -> None:
    """An argument a plain-C kernel reads through its data pointer: a CPU tensor of ``dtype`` with
    ``dim`` dimensions (any, when None), laid out as ``layout``: "contiguous", "rows" (the last
    dimension contiguous, strides non-negative: the kernel is given them) or "any". Raises
    TypeError/ValueError naming the argument; ``kernel`` names the kernel ("CPU GEMM kernel")."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name}: the {kernel} needs a CPU tensor, got {t.device}")
    if t.dtype != dtype:
        raise TypeError(f"{name}: expected {dtype}, got {t.dtype}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name}: expected {dim} dimensions, got shape {tuple(t.shape)}")
    if layout == "contiguous" and not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous")
    if layout == "rows" and t.numel() and (t.stride(-1) != 1 or min(t.stride()) < 0):
        raise ValueError(f"{name}: its rows must be contiguous (last stride 1), got strides {t.stride()}")
