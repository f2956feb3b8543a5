"""A real ``pdserve serve`` with several scheduler ranks: HTTP answers equal the single-rank
engine's, SIGTERM stops every rank and frees the port, a killed rank fails /health and
ends the server with a non-zero code, and a second "node" on this host joins over TCP.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from entrypoints.server_utils import Server, assert_gone, descendants, free_port, port_is_free, reapable
from fixtures.parallel_runs import ENGINE_ARGS, mixed_requests, single_rank_answers

SHUTDOWN_BUDGET_S = 10.0
DP_ATTENTION_EP = ("--tp-size", "2", "--dp-size", "2", "--enable-dp-attention", "--ep-size", "2")


def _flags(args: dict) -> list[str]:
    return [x for k, v in args.items() for x in (f"--{k.replace('_', '-')}", str(v))]


def _generate_all(url: str, prompts: list[list[int]], params: list[dict]) -> list[list[int]]:
    """Every request at once, each on its own connection: the ranks see them arrive mixed."""
    def one(i: int) -> list[int]:
        r = httpx.post(url + "/generate", json={"input_ids": prompts[i], "sampling_params": params[i]}, timeout=120)
        r.raise_for_status()
        return r.json()["output_ids"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, range(len(prompts))))


@pytest.fixture(scope="module")
def dp_server():
    s = Server(*DP_ATTENTION_EP, *_flags(ENGINE_ARGS))
    try:
        yield s.start()
    finally:
        s.stop()


def test_http_answers_equal_single_rank(dp_server):
    """DeepSeek decode's shape (DP attention + EP) behind the HTTP server: 16 concurrent requests."""
    want = [o["output_ids"] for o in single_rank_answers("tiny-deepseek")]
    prompts, params = mixed_requests(2048)
    assert _generate_all(dp_server.url, prompts, params) == want
    info = dp_server.wait_idle()
    assert len(info["scheduler_pids"]) == 2 and set(info["scheduler_pids"]) <= set(descendants(dp_server.proc.pid))
    assert [d["total_pages"] for d in info["dp_ranks"]] == [256, 256]
    assert all(d["cached_pages"] > 0 for d in info["dp_ranks"])  # both attention groups served requests
    assert dp_server.get("/health").status_code == 200


def test_killed_frontend_takes_every_rank_with_it(dp_server):
    """SIGKILL of the server process (no cleanup code runs): the kernel ends every rank. On the
    module's two-rank server, which no test uses after this one (a server of its own would cost a
    start of three processes)."""
    ranks = dp_server.info()["scheduler_pids"]
    assert len(ranks) == 2
    os.kill(dp_server.proc.pid, signal.SIGKILL)
    dp_server.wait(10)
    assert_gone(dp_server, ranks)


def _stream_long(url: str, result: dict, started: threading.Event) -> None:
    body = {"input_ids": [5, 6, 7], "stream": True, "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    try:
        with httpx.stream("POST", url + "/generate", json=body, timeout=60) as r:
            result["status"] = r.status_code
            result["events"] = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    result["events"].append(line[6:])
                    started.set()
    except httpx.HTTPError as e:
        result["error"] = repr(e)
    finally:
        started.set()


def test_sigterm_stops_every_rank():
    server = Server("--tp-size", "2", "--max-total-tokens", "4096", model="tiny-llama").start()
    try:
        children = descendants(server.proc.pid)
        assert len(server.info()["scheduler_pids"]) == 2
        result, started = {}, threading.Event()
        client = threading.Thread(target=_stream_long, args=(server.url, result, started), daemon=True)
        client.start()
        assert started.wait(60)
        server.signal(signal.SIGTERM)
        try:
            rc = server.wait(SHUTDOWN_BUDGET_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {SHUTDOWN_BUDGET_S} s after SIGTERM:\n{server.output()}")
        assert rc == 0, server.output()
        client.join(10)
        assert result["events"][-1] == "[DONE]", result
        assert json.loads(result["events"][-2])["meta_info"]["finish_reason"]["type"] == "abort"
        assert_gone(server, [server.proc.pid, *children])
    finally:
        server.stop()


def _health_after_kill(server: Server, victim: int) -> tuple[int, bytes]:
    """GET /health asked after ``victim`` died: the frontend is frozen while the rank is killed
    and the request is queued, so the answer cannot race the server's exit."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            os.kill(victim, signal.SIGKILL)
            while not reapable(victim):
                time.sleep(0.01)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        data = b""
        while b"\r\n\r\n" not in data or not data.endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def test_killed_rank_fails_health_and_exits_nonzero():
    """A follower rank dies: /health answers 503 naming the scheduler, the server exits non-zero,
    and neither the other rank nor the port is left behind."""
    server = Server("--tp-size", "2", "--max-total-tokens", "4096", model="tiny-llama").start()
    try:
        children = descendants(server.proc.pid)
        leader, follower = server.info()["scheduler_pids"]
        status, body = _health_after_kill(server, follower)
        assert status == 503, body
        assert "scheduler" in json.loads(body)["error"]["message"]
        rc = server.wait(15)
        assert rc not in (0, None), server.output()
        assert "rank" in server.output()
        assert_gone(server, [server.proc.pid, leader, *children])
    finally:
        server.stop()


def test_rank_startup_failure_exits_nonzero(tmp_path):
    """Weights no rank can load: the server reports a rank's reason and exits 1, nothing left."""
    import shutil

    import torch
    from safetensors.torch import save_file

    import pdserve

    model = tmp_path / "bad-weights"
    shutil.copytree(os.path.join(os.path.dirname(pdserve.__file__), "assets", "presets", "tiny-llama"), model)
    save_file({"unrelated.weight": torch.zeros(2)}, str(model / "model.safetensors"))
    s = Server("--tp-size", "2", "--load-format", "safetensors", model=str(model))
    try:
        s.proc = subprocess.Popen(s.cmd, stdout=s.log, stderr=subprocess.STDOUT, start_new_session=True)
        seen: set[int] = set()
        deadline = time.monotonic() + 120
        while s.proc.poll() is None and time.monotonic() < deadline:
            seen |= set(descendants(s.proc.pid))
            time.sleep(0.1)
        assert s.wait(5) == 1, s.output()
        assert "scheduler failed to start: rank" in s.output() and "checkpoint is missing" in s.output()
        assert_gone(s, sorted(seen))
    finally:
        s.stop()


def _free_port_run(n: int) -> int:
    """A port p with p .. p+n-1 all free now (rendezvous, then the two TCP endpoints)."""
    for _ in range(50):
        p = free_port()
        if p + n < 65536 and all(port_is_free(p + i) for i in range(n)):
            return p
    raise RuntimeError("no run of free ports")


def test_second_node_on_this_host_joins_over_tcp():
    """--nnodes 2: node 1 runs DP replica 1 alone and sends its outputs to node 0's frontend over
    TCP; when node 0 stops, node 1's rank is told to stop too and its launcher exits 0."""
    addr = f"127.0.0.1:{_free_port_run(3)}"
    common = ["--dp-size", "2", "--nnodes", "2", "--dist-init-addr", addr, *_flags(ENGINE_ARGS)]
    node1 = subprocess.Popen([sys.executable, "-m", "pdserve", "serve", "--model-path", "tiny-llama",
                              "--node-rank", "1", "--log-level", "warning", *common],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    server = Server("--node-rank", "0", *common, model="tiny-llama")
    try:
        server.start()
        assert len(server.info()["scheduler_pids"]) == 1  # rank 1 runs on node 1
        want = [o["output_ids"] for o in single_rank_answers("tiny-llama")]
        prompts, params = mixed_requests(2048)
        assert _generate_all(server.url, prompts, params) == want
        info = server.wait_idle()
        assert all(d["cached_pages"] > 0 for d in info["dp_ranks"])  # node 1's replica answered too
        server.signal(signal.SIGTERM)
        assert server.wait(SHUTDOWN_BUDGET_S) == 0, server.output()
        assert node1.wait(SHUTDOWN_BUDGET_S) == 0, node1.stdout.read().decode()
    finally:
        server.stop()
        if node1.poll() is None:
            os.killpg(node1.pid, signal.SIGKILL)
            node1.wait(10)
