"""A receiving transfer engine in its own process, driven over a pipe (for the transfer tests).

The child owns a real MooncakeTransferBackend with one registered CPU buffer (pinned when an
accelerator makes that possible) and answers commands: check a region, read bytes, drain
notifies, or wait for the next notify and check the region it names at once.
"""

from __future__ import annotations

import multiprocessing as mp

import torch

from pdserve.disagg.transfer import MooncakeTransferBackend


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


def _check_on_notify(be: MooncakeTransferBackend, buf: torch.Tensor):
    """Spin until a notify arrives, then check the region its msg names: ``"off,size,val"``."""
    while not (got := be.notifies()):
        pass
    (name, msg), rest = got[0], got[1:]
    assert not rest, f"one notify per round expected, got {got}"
    off, size, val = map(int, msg.split(","))
    return name, _mismatches(buf, off, size, val)


def _serve(conn, nbytes: int) -> None:
    be = MooncakeTransferBackend()
    buf = alloc(nbytes)
    be.register([(buf.data_ptr(), nbytes)])
    conn.send((be.session_id, buf.data_ptr()))
    commands = {
        "mismatches": lambda off, size, val: _mismatches(buf, off, size, val),
        "bytes": lambda off, size: bytes(buf[off:off + size].numpy()),
        "fill": lambda off, size, val: buf[off:off + size].fill_(val) is None,
        "notifies": lambda: be.notifies(),
        "check_on_notify": lambda: _check_on_notify(be, buf),
    }
    while True:
        cmd, *args = conn.recv()
        if cmd == "stop":
            break
        conn.send(commands[cmd](*args))
    be.close()
    conn.send("stopped")


class Peer:
    """Parent-side handle: ``session``, ``base`` (address of the child's buffer), ``call``."""

    def __init__(self, nbytes: int):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, nbytes), daemon=True)
        self.proc.start()
        if not self.conn.poll(120):
            self.proc.kill()
            raise RuntimeError("transfer peer did not start within 120 s")
        self.session, self.base = self.conn.recv()

    def call(self, cmd: str, *args):
        self.conn.send((cmd, *args))
        return self.conn.recv()

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("stop")
            except (EOFError, BrokenPipeError, ConnectionResetError):
                pass
            self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
