"""``pdserve up``: the deployment plan (pure) and one real run: up, serving through its router
with real transfers, then SIGTERM stops every process it started and frees every port."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

import pdserve
from pdserve.entrypoints.up import UpArgs, plan, split_cores
from server_utils import alive, descendants, free_port, port_is_free


def test_cores_are_split_between_the_servers():
    assert split_cores((0, 1), 1, 1) == [(0,), (1,)]
    assert split_cores((0, 1, 2, 3, 4), 1, 2) == [(0, 1), (2, 3), (4,)]
    assert split_cores((0,), 1, 1) == [(0,), (0,)]  # too few cores: the servers share


def test_plan_wires_prefills_decodes_and_the_router():
    kids = plan(UpArgs(2, 1, port=40000, bootstrap_port=9000, server_flags=("--model-path", "m"), cores=(0, 1, 2)))
    assert [k.name for k in kids] == ["prefill-0", "prefill-1", "decode-0", "router"]
    assert [k.cores for k in kids] == [(0,), (1,), (2,), None]
    p1 = kids[1].cmd
    assert p1[p1.index("--port") + 1] == "40002" and p1[p1.index("--disaggregation-bootstrap-port") + 1] == "9001"
    assert p1[p1.index("--disaggregation-mode") + 1] == "prefill" and p1[p1.index("--num-threads") + 1] == "1"
    r = kids[-1].cmd
    assert r[r.index("--port") + 1] == "40000"
    assert " ".join(r).count("--prefill") == 2 and "http://127.0.0.1:40003" in r


def test_invalid_deployment_is_refused():
    with pytest.raises(ValueError, match="num_decode"):
        UpArgs(1, 0)
    proc = subprocess.run([sys.executable, "-m", "pdserve", "up", "--model-path", "tiny-llama", "--page-size", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "page_size" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "pdserve", "up", "--model-path", "tiny-llama",
                           "--disaggregation-transfer-backend", "memory"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "disaggregation_transfer_backend: 'memory'" in proc.stderr


def test_up_serves_through_its_router_and_stops_everything():
    port, boot = free_port(), free_port()
    log = tempfile.NamedTemporaryFile(prefix="pdserve-up-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "pdserve", "up", "--model-path", "tiny-llama", "--port", str(port),
           "--bootstrap-port", str(boot), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    children: set[int] = set()
    try:
        deadline = time.monotonic() + 240
        while "pdserve is up" not in Path(log.name).read_text(errors="replace"):
            assert proc.poll() is None and time.monotonic() < deadline, Path(log.name).read_text()[-3000:]
            children |= set(descendants(proc.pid))
            time.sleep(0.2)
        children |= set(descendants(proc.pid))
        url = f"http://127.0.0.1:{port}"
        body = {"text": "The quick brown fox", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        got = httpx.post(url + "/generate", json=body, timeout=120).json()
        want = pdserve.Engine(model_path="tiny-llama", num_threads=1).generate(
            prompt=body["text"], sampling_params=body["sampling_params"])
        assert got["output_ids"] == want["output_ids"]
        decode = httpx.get(f"http://127.0.0.1:{port + 2}/get_server_info", timeout=30).json()
        assert decode["disaggregation_mode"] == "decode" and decode["kv_received"] == 1  # through prefill
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        wait_until = time.monotonic() + 30
        while any(alive(c) for c in children) and time.monotonic() < wait_until:
            time.sleep(0.2)
        assert not [c for c in children if alive(c)]
        assert all(port_is_free(p) for p in (port, port + 1, port + 2, boot))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        Path(log.name).unlink()
