"""Starting and stopping pdserve processes for the benchmark scripts beside this file."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str], cores: list[int] | None = None, env: dict | None = None, log=None) -> subprocess.Popen:
    """``pdserve *args`` in its own session (so ``stop`` reaches its children), output discarded
    (or written to the open file ``log``), pinned to ``cores`` when given; ``env`` is added to ours."""
    out = subprocess.DEVNULL if log is None else log
    return subprocess.Popen([sys.executable, "-m", "pdserve", *args], stdout=out,
                            stderr=subprocess.DEVNULL if log is None else subprocess.STDOUT, start_new_session=True,
                            env=None if env is None else {**os.environ, **env},
                            preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None)


def stop(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGTERM to the process group, SIGKILL if it has not exited within ``timeout``."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        proc.wait()


def wait_healthy(url: str, proc: subprocess.Popen | None = None, timeout: float = 600.0) -> None:
    """Poll ``url``/health until it answers 200; fail early if ``proc`` exited."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:4]} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} not healthy after {timeout} s")
