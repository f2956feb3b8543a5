"""Start a real ``pdserve serve`` subprocess on a free loopback port, inspect its process tree, stop it.

Each server runs in its own session (process group), so cleanup can always kill
everything it started even if the server misbehaves.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

PRESET = "tiny-deepseek"
STARTUP_TIMEOUT_S = 240.0


# Test servers take their ports from 20000..32000: below the kernel's ephemeral range (32768 and up on
# Linux), where every client socket takes its source port (a port picked there may be taken by a
# connection before the server binds it: CI lost a run to that), and above Mooncake's 15000-17000. Each
# xdist worker draws from its own slice, and a process never hands out a port twice, so two servers
# that have not bound yet cannot be given the same port.
PORT_RANGE = (20000, 32000)
_handed_out: set[int] = set()


def _worker_slice() -> tuple[int, int]:
    lo, hi = PORT_RANGE
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    index = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0
    width = (hi - lo) // max(count, 1)
    return lo + index % max(count, 1) * width, lo + (index % max(count, 1) + 1) * width


def free_port() -> int:
    """A loopback port free now, from this worker's slice of PORT_RANGE, not handed out before."""
    return free_port_block(1)


def free_port_block(n: int) -> int:
    """The first of ``n`` consecutive ports that are free now and were never handed out by this
    process, from this worker's slice of PORT_RANGE (above)."""
    lo, hi = _worker_slice()
    rng = random.Random()
    for _ in range(500):
        base = rng.randrange(lo, hi - n)
        block = range(base, base + n)
        if not _handed_out.intersection(block) and all(port_is_free(p) for p in block):
            _handed_out.update(block)
            return base
    raise RuntimeError(f"no {n} consecutive free ports in {lo}..{hi}")


def port_is_free(port: int) -> bool:
    """True if a new server could bind the port now (SO_REUSEADDR, as servers bind)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid``, read from /proc (children of children too)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            ppid = _ppid(entry)
            if ppid is not None:
                children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _ppid(proc_dir: Path) -> int | None:
    try:
        stat = (proc_dir / "stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # the command name may contain spaces
    return int(fields[1]) if fields[0] != "Z" else None  # a zombie is already dead


def reapable(pid: int) -> bool:
    """True once ``pid`` has fully exited: gone, or a zombie whose last thread is gone too.
    (A killed multi-threaded process shows state Z while its other threads still exit, and
    until they have, its parent's ``waitpid`` still reports it running.)"""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return fields["State"].strip().startswith("Z") and int(fields["Threads"]) <= 1


# Servers here speak plain http, but httpx builds a certificate store for every call not given an SSL
# context (about 20 ms of CPU, https or not): a poll every 0.1 s then burns a fifth of a core beside the
# server it waits for. One context, built once, for every request the helpers send.
TLS = ssl.create_default_context()
HEALTH_POLL_S = 0.05  # a /health poll costs well under a millisecond of CPU with TLS

def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return state[state.rindex(")") + 2] != "Z"


def assert_gone(server: Server, pids: list[int]) -> None:
    """Every pid in ``pids`` has exited (within 5 s) and the server's port is free again."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    assert not [p for p in pids if alive(p)], f"left behind: {pids}\n{server.output()}"
    assert port_is_free(server.port), f"port {server.port} still bound\n{server.output()}"


# P/D resources a server holds only while a request or a late write needs them.
IDLE_ZERO = ("num_waiting_for_kv", "num_pending_kv", "quarantined_pages", "quarantine_entries", "aux_rows_in_use",
             "transfer_batches_in_flight", "rooms_waiting", "rooms_transferring", "rooms_open")


class Server:
    """A ``python -m pdserve serve`` subprocess; ``url`` once ``start()`` returns."""

    def __init__(self, *flags: str, model: str = PRESET, api_key: str | None = None,
                 env: dict[str, str | None] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        # None: inherit ours; a variable given as None is unset
        self.env = None if env is None else {k: v for k, v in {**os.environ, **env}.items() if v is not None}
        self.log = tempfile.NamedTemporaryFile(prefix="pdserve-test-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "pdserve", "serve", "--model-path", model, "--port", str(self.port),
               "--log-level", "warning", *flags]
        if api_key:
            cmd += ["--api-key", api_key]
        self.cmd = cmd
        self.proc: subprocess.Popen | None = None

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def start(self, timeout: float = STARTUP_TIMEOUT_S) -> Server:
        self.launch()
        return self.wait_healthy(timeout)

    def launch(self) -> Server:
        """Start the process without waiting for it (``wait_healthy`` does)."""
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=self.env)
        return self

    def wait_healthy(self, timeout: float = STARTUP_TIMEOUT_S) -> Server:
        assert self.proc is not None, "launch() first"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during startup:\n{self.output()}")
            if self._healthy():
                return self
            time.sleep(HEALTH_POLL_S)
        self.kill()
        raise RuntimeError(f"server not healthy after {timeout} s:\n{self.output()}")

    def _healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=2, verify=TLS).status_code == 200
        except httpx.HTTPError:
            return False

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(self.url + path, headers=self.headers, timeout=kw.pop("timeout", 30),
                         verify=kw.pop("verify", TLS), **kw)

    def post(self, path: str, **kw) -> httpx.Response:
        return httpx.post(self.url + path, headers={**self.headers, **kw.pop("headers", {})},
                          timeout=kw.pop("timeout", 60), verify=kw.pop("verify", TLS), **kw)

    def info(self) -> dict:
        r = self.get("/get_server_info")
        r.raise_for_status()
        return r.json()

    def wait_idle(self, timeout: float = 30.0) -> dict:
        """Poll until nothing runs or waits, free + cached pages == total, and (P/D modes) no
        room, quarantine entry, aux row or transfer batch is held; returns the last info."""
        deadline = time.monotonic() + timeout
        info = self.info()
        while time.monotonic() < deadline:
            if (info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0
                    and info["free_pages"] + info["cached_pages"] == info["total_pages"]
                    and not any(info.get(k) for k in IDLE_ZERO)):
                return info
            time.sleep(0.1)
            info = self.info()
        raise AssertionError(f"server not idle after {timeout} s: {info}")

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-6000:]

    def kill(self) -> None:
        """Last-resort cleanup: SIGKILL the server's whole session."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if needed; removes the log file."""
        if self.proc is not None and self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                pass
        self.kill()
        self.log.close()
        os.unlink(self.log.name)
