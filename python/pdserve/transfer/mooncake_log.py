"""Mooncake's C++ logging (glog, straight to file descriptor 2) kept to what means something.

Mooncake 0.3.13 reads ``MC_LOG_LEVEL`` (``INFO``/``WARNING``/``ERROR``) once per process, when
its library loads (measured: setting it later changes nothing), and sets glog's minimum level
from it; unset, it logs at INFO. A
normal TCP engine start then prints about ten lines, among them an ERROR ("Local segment
descriptor not found", from the handshake path looking up a descriptor that ``initialize`` has
not published yet) and WARNINGs that only describe a CPU host. So:

* ``MC_LOG_LEVEL`` defaults to WARNING (INFO when this module's logger is at DEBUG, as under
  ``--log-level debug``, when Mooncake is first imported); an operator's own setting wins.
* While an engine starts, fd 2 runs through a pipe that drops the start-up lines listed in
  ``STARTUP_NOISE`` and forwards everything else at once (any thread's output, Python's too).
  Outside that window nothing is filtered: a later "Local segment descriptor not found" or
  "No RDMA devices found" would mean something, and shows.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Iterator

logger = logging.getLogger(__name__)

LEVEL_ENV = "MC_LOG_LEVEL"
# Start-up lines that report nothing wrong (0.3.13), by protocol ("*": all).
STARTUP_NOISE = {
    "*": ("Logging before InitGoogleLogging() is written to STDERR",  # glog's notice: Mooncake never inits it
          "Local segment descriptor not found",  # initialize's own handshake path, before the descriptor exists
          "Using default malloc/free for protocol",  # the Python wrapper's allocator choice
          "Memory allocator already initialized with"),  # a second engine in the process
    "tcp": ("No RDMA devices found",),  # topology discovery on a host TCP serves
}
_START_LOCK = threading.Lock()  # one filtered start at a time: fd 2 is the process's


def set_level() -> None:
    """Mooncake's level for this process, from this module's logger (call before importing it)."""
    os.environ.setdefault(LEVEL_ENV, "INFO" if logger.isEnabledFor(logging.DEBUG) else "WARNING")


def noise_for(protocol: str) -> tuple[str, ...]:
    return STARTUP_NOISE["*"] + STARTUP_NOISE.get(protocol, ())


@contextlib.contextmanager
def quiet_start(protocol: str) -> Iterator[None]:
    """Run an engine's start with its harmless lines dropped from fd 2 (nothing dropped at DEBUG)."""
    if logger.isEnabledFor(logging.DEBUG):
        yield
        return
    with _START_LOCK, _filtered_fd2(noise_for(protocol)):
        yield


@contextlib.contextmanager
def _filtered_fd2(noise: tuple[str, ...]) -> Iterator[None]:
    sys.stderr.flush()
    real = os.dup(2)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)
    forwarder = threading.Thread(target=_forward, args=(read_end, real, noise), name="mooncake-log", daemon=True)
    forwarder.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(real, 2)  # the pipe's last write end closes: the forwarder sees EOF
        forwarder.join(5.0)
        if forwarder.is_alive():  # a process forked meanwhile holds the pipe: keep forwarding to ``real``
            logger.warning("Mooncake's start-up log filter still has a reader; leaving it running")
        else:
            os.close(real)


def _forward(read_end: int, real: int, noise: tuple[str, ...]) -> None:
    with os.fdopen(read_end, "rb") as pipe:
        for line in pipe:
            if not any(n.encode() in line for n in noise):
                os.write(real, line)
