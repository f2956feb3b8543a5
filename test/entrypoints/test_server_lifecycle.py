"""Shutdown and failure behaviour of a real server: signals, scheduler crash, startup errors.

Each test starts its own server (it ends it on purpose) and checks that no
process it started survives and the port is free again.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

import pdserve
from server_utils import Server, alive, descendants, port_is_free

SHUTDOWN_BUDGET_S = 10.0


@pytest.fixture
def server():
    s = Server("--max-total-tokens", "4096")
    try:
        yield s.start()
    finally:
        s.stop()


def _long_stream(server: Server, started: threading.Event) -> None:
    body = {"text": "a long story", "stream": True, "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    try:
        with httpx.stream("POST", server.url + "/generate", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    started.set()
    except httpx.HTTPError:
        pass
    finally:
        started.set()


def _assert_gone(server: Server, pids: list[int]) -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    assert not [p for p in pids if alive(p)], f"left behind: {pids}\n{server.output()}"
    assert port_is_free(server.port), f"port {server.port} still bound\n{server.output()}"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_stops_everything(server, sig):
    children = descendants(server.proc.pid)
    scheduler_pids = server.info()["scheduler_pids"]
    assert set(scheduler_pids) <= set(children)
    started = threading.Event()
    client = threading.Thread(target=_long_stream, args=(server, started), daemon=True)
    client.start()
    assert started.wait(60)
    server.signal(sig)
    try:
        rc = server.wait(SHUTDOWN_BUDGET_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running {SHUTDOWN_BUDGET_S} s after {sig!r}:\n{server.output()}")
    assert rc == 0, server.output()
    client.join(10)
    _assert_gone(server, [server.proc.pid, *children])


def test_scheduler_crash_fails_health_and_exits_nonzero(server):
    children = descendants(server.proc.pid)
    scheduler_pid = server.info()["scheduler_pids"][0]
    assert scheduler_pid in children
    subprocess.run(["kill", "-9", str(scheduler_pid)], check=True)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and server.proc.poll() is None:
        try:
            assert httpx.get(server.url + "/health", timeout=2).status_code == 503
        except httpx.TransportError:
            pass  # already closed its port
        except AssertionError:
            pass  # the crash is not noticed yet
        time.sleep(0.1)
    rc = server.wait(1)
    assert rc not in (0, None), server.output()
    assert "scheduler" in server.output()
    _assert_gone(server, [server.proc.pid, *children])


def test_scheduler_startup_failure_exits_nonzero(tmp_path):
    """Weights the scheduler cannot load: the frontend reports why and exits 1, nothing left behind."""
    preset = Path(pdserve.__file__).parent / "assets" / "presets" / "tiny-deepseek"
    model = tmp_path / "bad-weights"
    shutil.copytree(preset, model)
    # A weights file only loading can find wrong (a directory without any is refused at start-up).
    (model / "model.safetensors").write_bytes(b"not a safetensors file")
    s = Server("--load-format", "safetensors", model=str(model))
    try:
        s.proc = subprocess.Popen(s.cmd, stdout=s.log, stderr=subprocess.STDOUT, start_new_session=True)
        children = []
        deadline = time.monotonic() + 120
        while s.proc.poll() is None and time.monotonic() < deadline:
            children = sorted(set(children) | set(descendants(s.proc.pid)))
            time.sleep(0.1)
        assert s.wait(5) == 1
        assert "scheduler failed to start" in s.output()
        _assert_gone(s, children)
    finally:
        s.stop()


def test_busy_port_is_reported(server):
    proc = subprocess.run([sys.executable, "-m", "pdserve", "serve", "--model-path", "tiny-deepseek",
                           "--port", str(server.port)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "port" in proc.stderr and str(server.port) in proc.stderr
