"""Rank 0 of a ``--nnodes 2`` server as an attacker on the cluster network finds it, before node 1
has joined: a pickle pushed at each of its scheduler ports (dist-init port +1 and +2) runs
nothing, the server goes on to serve once node 1 joins, the ports are bound on the node's
address (not every interface), and under the cluster token a stranger who connects to pull
requests gets none of them (without one the server says who can read prompts)."""

from __future__ import annotations

import ipaddress
import os
import pickle
import shlex
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import zmq

from entrypoints.server_utils import Server, free_port, port_is_free
from fixtures.parallel_runs import ENGINE_ARGS
from pdserve.config import AUTH_TOKEN_ENV

MODEL = "tiny-llama"
PORTS_TIMEOUT_S = 120.0
REQUEST_TIMEOUT_S = 60.0
ENGINE_FLAGS = [x for k, v in ENGINE_ARGS.items() for x in (f"--{k.replace('_', '-')}", str(v))]


class Evil:
    """A pickle that creates ``path`` when loaded (as a shell command would run anything)."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(str(self.path))}",))


def listening_addresses(port: int) -> set[str]:
    """The local addresses TCP sockets listen on at ``port`` (what ``ss -ltn`` shows), from /proc."""
    out = set()
    for name, width in (("tcp", 4), ("tcp6", 16)):
        for line in Path(f"/proc/net/{name}").read_text().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].split(":")
            if fields[3] != "0A" or int(hex_port, 16) != port:  # 0A: LISTEN
                continue
            raw = bytes.fromhex(address)  # 32-bit words in host (little-endian) order
            packed = b"".join(raw[i:i + 4][::-1] for i in range(0, width, 4))
            out.add(str(ipaddress.ip_address(packed)))
    return out


def _wait_listening(server: Server, ports: tuple[int, ...]) -> dict[int, set[str]]:
    deadline = time.monotonic() + PORTS_TIMEOUT_S
    while time.monotonic() < deadline:
        assert server.proc.poll() is None, server.output()
        found = {p: listening_addresses(p) for p in ports}
        if all(found.values()):
            return found
        time.sleep(0.1)
    raise AssertionError(f"ports {ports} not listening after {PORTS_TIMEOUT_S} s\n{server.output()}")


def _push(ctx: zmq.Context, endpoint: str, frames: list[bytes]) -> zmq.Socket:
    """A stranger's PUSH at ``endpoint`` (frames that find no peer in 2 s are dropped)."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDTIMEO, 2000)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    for frame in frames:
        try:
            sock.send(frame)
        except zmq.Again:
            break  # nobody takes them: a PUSH port, or a handshake refused
    return sock


def _free_port_run(n: int) -> int:
    """A port p with p .. p+n-1 all free now (rendezvous, then the two scheduler ports)."""
    for _ in range(50):
        p = free_port()
        if p + n < 65536 and all(port_is_free(p + i) for i in range(n)):
            return p
    raise RuntimeError("no run of free ports")


def _node1(port: int, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pdserve", "serve", "--model-path", MODEL, "--node-rank", "1",
                             "--log-level", "warning", *_common(port)], env={**os.environ, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def _common(port: int) -> list[str]:
    return ["--dp-size", "2", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{port}", *ENGINE_FLAGS]


def _generate(url: str, n: int) -> list[list[int]]:
    def one(i: int) -> list[int]:
        r = httpx.post(url + "/generate", json={"input_ids": [5 + i, 17, 99], "sampling_params": {
            "max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True}}, timeout=REQUEST_TIMEOUT_S)
        r.raise_for_status()
        return r.json()["output_ids"]

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def _stop(server: Server, node1: subprocess.Popen | None) -> None:
    server.stop()
    if node1 is not None and node1.poll() is None:
        os.killpg(node1.pid, signal.SIGKILL)
        node1.wait(10)


@pytest.mark.parametrize("token", [None, "cluster-secret"], ids=["no-token", "token"])
def test_rank0_ports_before_node1_joins(tmp_path, token):
    port = _free_port_run(3)
    env = {AUTH_TOKEN_ENV: token} if token else {}
    server = Server("--node-rank", "0", *_common(port), model=MODEL, env=env)
    marker = tmp_path / "pwned"
    ctx = zmq.Context()
    node1 = None
    try:
        server.launch()
        bound = _wait_listening(server, (port + 1, port + 2))
        strangers = [_push(ctx, f"tcp://127.0.0.1:{p}", [pickle.dumps(Evil(marker))]) for p in (port + 1, port + 2)]
        thief = ctx.socket(zmq.PULL)  # a stranger who would take a share of the requests
        thief.setsockopt(zmq.LINGER, 0)
        if token:
            thief.connect(f"tcp://127.0.0.1:{port + 1}")
        node1 = _node1(port, env)
        server.wait_healthy()  # once node 1's rank joined
        assert _generate(server.url, 4) == _generate(server.url, 4)  # every request answered, twice
        assert not thief.poll(0), "a stranger pulled a request"
        assert not marker.exists(), "a pickle pushed at rank 0's port ran"
        assert bound == {port + 1: {"127.0.0.1"}, port + 2: {"127.0.0.1"}}, "bound beyond the node's address"
        assert server.get("/health").status_code == 200
        warned = "can read prompts" in server.output()
        assert warned == (token is None), server.output()
        for sock in (*strangers, thief):
            sock.close(linger=0)
    finally:
        ctx.destroy(linger=0)
        _stop(server, node1)
