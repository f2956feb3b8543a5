"""A receiving transfer engine driven over a pipe (for the transfer tests): in its own process
for Mooncake and NIXL, on a thread of the test process for the in-memory backend (its fabric does not
cross processes).

The child owns a real backend with one registered CPU buffer (pinned when an accelerator makes
that possible) and answers commands: check a region, read bytes, drain notifies, or wait for the
next notify and check the region it names at once.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading

import torch

from pdserve.transfer import TransferBackend, create_transfer_backend
from pdserve.transfer.memory import PROCESS_FABRIC


def alloc(nbytes: int) -> torch.Tensor:
    """Zeroed byte buffer, page-locked when the host has an accelerator to pin for."""
    return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())


def _mismatches(buf: torch.Tensor, off: int, size: int, val: int) -> int:
    """Bytes of ``buf[off:off+size]`` that differ from ``val``; then clears the region so a
    later round can never mistake these bytes for its own."""
    region = buf[off:off + size]
    bad = int((region != val).sum())
    region.zero_()
    return bad


def _check_on_notify(be: TransferBackend, buf: torch.Tensor):
    """Spin until a notify arrives, then check the region its msg names: ``"off,size,val"``."""
    while not (got := be.notifies()):
        pass
    (name, msg), rest = got[0], got[1:]
    assert not rest, f"one notify per round expected, got {got}"
    off, size, val = map(int, msg.split(","))
    return name, _mismatches(buf, off, size, val)


def _serve(conn, nbytes: int, backend: str = "mooncake") -> None:
    be = create_transfer_backend(backend)
    buf = alloc(nbytes)
    be.register([(buf.data_ptr(), nbytes)])
    conn.send((be.session_id, buf.data_ptr(), be.peer_info))
    commands = {
        "mismatches": lambda off, size, val: _mismatches(buf, off, size, val),
        "bytes": lambda off, size: bytes(buf[off:off + size].numpy()),
        "fill": lambda off, size, val: buf[off:off + size].fill_(val) is None,
        "notifies": lambda: be.notifies(),
        "check_on_notify": lambda: _check_on_notify(be, buf),
        "connect": lambda session, info: be.connect(session, info),
    }
    while True:
        cmd, *args = conn.recv()
        if cmd == "stop":
            break
        conn.send(commands[cmd](*args))
    be.close()
    conn.send("stopped")


class Peer:
    """Parent-side handle: ``session``, ``base`` (address of the child's buffer), ``info`` (its
    ``peer_info``), ``call``, ``link`` (both ends learn each other, as records do in P/D);
    ``kill``, ``freeze`` and ``thaw`` act on the child as signals act on a process."""

    def __init__(self, nbytes: int, backend: str = "mooncake"):
        self.backend = backend
        self.proc: mp.Process | None = None
        if backend == "memory":
            self.conn, child = mp.Pipe()
            self.thread = threading.Thread(target=_serve, args=(child, nbytes, backend), daemon=True)
            self.thread.start()
        else:
            ctx = mp.get_context("spawn")
            self.conn, child = ctx.Pipe()
            self.proc = ctx.Process(target=_serve, args=(child, nbytes, backend), daemon=True)
            self.proc.start()
        if not self.conn.poll(120):
            self.kill()
            raise RuntimeError("transfer peer did not start within 120 s")
        self.session, self.base, self.info = self.conn.recv()

    def link(self, be: TransferBackend) -> None:
        """``be`` and the child learn each other (NIXL needs it both ways; a no-op elsewhere)."""
        be.connect(self.session, self.info)
        self.call("connect", be.session_id, be.peer_info)

    def call(self, cmd: str, *args):
        self.conn.send((cmd, *args))
        return self.conn.recv()

    def kill(self) -> None:
        """The end of the child's engine: kill -9 of its process; closing an in-process one."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.join()
        else:
            self.stop()

    def freeze(self) -> None:
        """SIGSTOP, waiting until every thread is really stopped (delivery is not instant);
        an in-process engine freezes."""
        if self.proc is None:
            PROCESS_FABRIC.lookup(self.session).freeze()
            return
        os.kill(self.proc.pid, signal.SIGSTOP)
        tasks = f"/proc/{self.proc.pid}/task"
        while not all(_stopped(f"{tasks}/{t}/stat") for t in os.listdir(tasks)):
            threading.Event().wait(0.01)

    def thaw(self) -> None:
        if self.proc is None:
            if (be := PROCESS_FABRIC.lookup(self.session)) is not None:
                be.thaw()
        elif self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is None:
            if self.thread.is_alive():
                self.thaw()
                self.call("stop")
                self.thread.join(30)
            return
        if self.proc.is_alive():
            try:
                self.call("stop")
            except (EOFError, BrokenPipeError, ConnectionResetError):
                pass
            self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


def _stopped(stat: str) -> bool:
    with open(stat) as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"
