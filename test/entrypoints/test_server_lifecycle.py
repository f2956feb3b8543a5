"""Shutdown and failure behaviour of a real server: signals, scheduler crash, startup errors.

Each test starts its own server (it ends it on purpose) and checks that no
process it started survives and the port is free again.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

import pdserve
from server_utils import Server, assert_gone, descendants, reapable

SHUTDOWN_BUDGET_S = 10.0


def _server(max_total_tokens: int):
    s = Server("--max-total-tokens", str(max_total_tokens))
    try:
        yield s.start()
    finally:
        s.stop()


@pytest.fixture
def server():
    yield from _server(4096)


@pytest.fixture
def roomy_server():
    """Room for two long decodes and a long prefill at once."""
    yield from _server(16384)


LONG_PREFILL_WORDS = 1800  # ~3600 prompt tokens: a prefill that keeps the scheduler busy for a while


def _stream(server: Server, body: dict, result: dict, started: threading.Event) -> None:
    """POST a streaming /generate; ``result``: status, content type, every data line (or error)."""
    try:
        with httpx.stream("POST", server.url + "/generate", json=body, timeout=60) as r:
            result.update(status=r.status_code, content_type=r.headers.get("content-type", ""), events=[])
            for line in r.iter_lines():
                if line.startswith("data: "):
                    result["events"].append(line[6:])
                    started.set()
            result["body"] = r.read().decode() if r.status_code != 200 else ""
    except httpx.HTTPError as e:
        result["error"] = repr(e)
    finally:
        started.set()


def _post(server: Server, body: dict, result: dict) -> None:
    try:
        r = httpx.post(server.url + "/generate", json=body, timeout=60)
        result.update(status=r.status_code, content_type=r.headers.get("content-type", ""), body=r.text)
    except httpx.HTTPError as e:
        result["error"] = repr(e)


def _client(target, *args) -> threading.Thread:
    t = threading.Thread(target=target, args=args, daemon=True)
    t.start()
    return t


def _wait_inflight(server: Server, n: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while server.info()["num_inflight_requests"] < n:
        assert time.monotonic() < deadline, f"{n} requests not in flight after {timeout} s"
        time.sleep(0.05)


def _assert_503_json(result: dict) -> None:
    assert "error" not in result, result
    assert result["status"] == 503 and result["content_type"].startswith("application/json"), result
    err = json.loads(result["body"])["error"]
    assert err["type"] == "service_unavailable" and err["message"], err


def _assert_stream_aborted(result: dict) -> None:
    """A stream that had started: its last event says abort, then [DONE]; nothing is cut."""
    assert "error" not in result and result["status"] == 200, result
    assert result["events"][-1] == "[DONE]", result
    last = json.loads(result["events"][-2])
    assert last["meta_info"]["finish_reason"]["type"] == "abort", last


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_stops_everything(roomy_server, sig):
    """A signal while requests are in flight, one of them a long prefill: the server exits 0
    within its budget, leaving nothing behind, and every client gets a proper ending: a started
    stream a final abort event and [DONE]; a request not yet answered a 503 in the JSON error
    shape (a stream not yet started may instead end with an abort event). Never a 500 or a cut."""
    server = roomy_server
    children = descendants(server.proc.pid)
    scheduler_pids = server.info()["scheduler_pids"]
    assert set(scheduler_pids) <= set(children)
    long_out = {"max_new_tokens": 3000, "ignore_eos": True}
    decoding, plain, prefilling = {}, {}, {}
    started = threading.Event()
    clients = [_client(_stream, server, {"text": "a long story", "stream": True, "sampling_params": long_out},
                       decoding, started)]
    assert started.wait(60)
    clients.append(_client(_post, server, {"text": "another story", "sampling_params": long_out}, plain))
    prompt = " ".join(["word"] * LONG_PREFILL_WORDS)
    # ignore_eos: once its prefill is done it must not end on its own (an EOS) before the signal's abort
    clients.append(_client(_stream, server, {"text": prompt, "stream": True, "sampling_params": {
        "max_new_tokens": 200, "ignore_eos": True}}, prefilling, threading.Event()))
    _wait_inflight(server, 3)
    server.signal(sig)
    try:
        rc = server.wait(SHUTDOWN_BUDGET_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running {SHUTDOWN_BUDGET_S} s after {sig!r}:\n{server.output()}")
    assert rc == 0, server.output()
    for t in clients:
        t.join(10)
    assert_gone(server, [server.proc.pid, *children])
    _assert_stream_aborted(decoding)
    _assert_503_json(plain)
    if prefilling.get("status") == 200:
        _assert_stream_aborted(prefilling)
    else:
        _assert_503_json(prefilling)


def _http_get(sock: socket.socket, path: str) -> tuple[int, bytes]:
    """One HTTP/1.1 GET on a kept-alive socket: (status, body)."""
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    return _http_read(sock)


def _http_read(sock: socket.socket) -> tuple[int, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed after {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    length = int(next(v for k, _, v in (h.partition(": ") for h in lines[1:]) if k.lower() == "content-length"))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed mid-body"
        body += chunk
    return int(lines[0].split()[1]), body


def _bytes_waiting(server_port: int, client_port: int) -> int:
    """Bytes the server side of a loopback TCP connection has received but not read (/proc/net/tcp)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, queues = fields[1], fields[2], fields[4]
        if int(local.split(":")[1], 16) == server_port and int(remote.split(":")[1], 16) == client_port:
            return int(queues.split(":")[1], 16)
    return 0


def test_scheduler_crash_fails_health_and_exits_nonzero(server):
    """A /health asked after the scheduler died answers 503 (JSON, naming the scheduler), then the
    server exits non-zero. The frontend is frozen (SIGSTOP) while the scheduler is killed and the
    request is queued on an open keep-alive connection, so the check cannot race the shutdown."""
    children = descendants(server.proc.pid)
    scheduler_pid = server.info()["scheduler_pids"][0]
    assert scheduler_pid in children
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        assert _http_get(sock, "/health")[0] == 200
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            os.kill(scheduler_pid, signal.SIGKILL)
            while not reapable(scheduler_pid):  # so the frontend's waitpid will see it dead
                time.sleep(0.01)
            request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
            sock.sendall(request)
            while _bytes_waiting(server.port, sock.getsockname()[1]) < len(request):
                time.sleep(0.01)
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        status, body = _http_read(sock)
    assert status == 503, body
    assert "scheduler" in json.loads(body)["error"]["message"]
    rc = server.wait(15)
    assert rc not in (0, None), server.output()
    assert "scheduler" in server.output()
    assert_gone(server, [server.proc.pid, *children])


def test_scheduler_startup_failure_exits_nonzero(tmp_path):
    """Weights the scheduler cannot load (a checkpoint missing every tensor the model needs): the
    frontend reports why and exits 1, nothing left behind. (A directory with no weight file at
    all is refused before any process starts: see test_cli.)"""
    from safetensors.torch import save_file

    preset = Path(pdserve.__file__).parent / "assets" / "presets" / "tiny-deepseek"
    model = tmp_path / "bad-weights"
    shutil.copytree(preset, model)
    save_file({"unrelated.weight": torch.zeros(2)}, str(model / "model.safetensors"))
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
        assert_gone(s, children)
    finally:
        s.stop()


def test_busy_port_is_reported(server):
    proc = subprocess.run([sys.executable, "-m", "pdserve", "serve", "--model-path", "tiny-deepseek",
                           "--port", str(server.port)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "port" in proc.stderr and str(server.port) in proc.stderr


def test_sigterm_to_the_whole_process_group_is_a_shutdown_not_a_crash(server):
    """``kill -TERM -PGID`` (a service manager, ``pdserve up`` before) reaches the scheduler and the
    frontend at once; the scheduler dies of it first. That is a shutdown: exit 0, and no
    "exited ... unexpectedly" in the log."""
    children = descendants(server.proc.pid)
    os.killpg(server.proc.pid, signal.SIGTERM)
    assert server.wait(SHUTDOWN_BUDGET_S) == 0, server.output()
    assert "unexpectedly" not in server.output() and "scheduler failed" not in server.output()
    assert_gone(server, [server.proc.pid, *children])
