"""What a Mooncake transfer engine does to its process: what it logs, which ports it opens where.

Each test starts engines in a fresh Python process (Mooncake reads its log level and port range
once per process), makes one write between two of them, and reads the child's stderr or ``ss``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from pdserve.transfer import mooncake_available

pytestmark = pytest.mark.skipif(not mooncake_available(), reason="needs mooncake")

GLOG_LINE = re.compile(r"^[IWEF]\d{4} ", re.M)
HARMLESS = "Local segment descriptor not found"  # logged at ERROR by every engine start

# Two engines, one write between them, then ``ss``'s view of this process's listening sockets.
CHILD = """
import json, logging, os, subprocess, sys, torch
if sys.argv[1] == "debug":
    logging.basicConfig(level=logging.DEBUG)
from pdserve.transfer import MooncakeTransferBackend, WriteState
a, b = MooncakeTransferBackend(), MooncakeTransferBackend()
x, y = torch.ones(4096, dtype=torch.uint8), torch.zeros(4096, dtype=torch.uint8)
a.register([(x.data_ptr(), 4096)])
b.register([(y.data_ptr(), 4096)])
assert a.wait(a.post_writes(b.session_id, [x.data_ptr()], [y.data_ptr()], [4096]), 60) is WriteState.DONE
ss = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
mine = [line.split()[3] for line in ss.splitlines() if f"pid={os.getpid()}," in line]
print(json.dumps({"sessions": [a.session_id, b.session_id], "listening": mine}))
a.close()
b.close()
"""


def _run_child(mode: str, **env) -> tuple[dict, str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("MC_")} | env
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=120, env=full)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


LOW, HIGH = 23400, 23460  # the port range the quiet child is confined to


@pytest.fixture(scope="module")
def quiet_child() -> tuple[dict, str]:
    return _run_child("quiet", MC_MIN_RPC_PORT=str(LOW), MC_MAX_RPC_PORT=str(HIGH))


def test_a_normal_start_logs_nothing_and_debug_keeps_mooncakes_lines(quiet_child):
    _, quiet = quiet_child
    assert HARMLESS not in quiet and not GLOG_LINE.search(quiet), quiet
    _, debug = _run_child("debug")
    assert HARMLESS in debug and "Transfer Engine RPC using P2P handshake" in debug, debug


@pytest.mark.skipif(not os.path.exists("/usr/bin/ss") and not os.path.exists("/bin/ss"), reason="needs ss")
def test_an_engine_listens_on_every_interface_within_the_port_range(quiet_child):
    """Mooncake binds its handshake and TCP data ports to the wildcard address whatever host it
    is given (docs/disaggregation.md, "Ports to firewall"); MC_MIN_RPC_PORT/MC_MAX_RPC_PORT
    confine both to a range an operator can firewall."""
    got, _ = quiet_child
    hosts_ports = [addr.rsplit(":", 1) for addr in got["listening"]]
    ports = {int(p) for _, p in hosts_ports}
    assert len(ports) == 4, got  # per engine: the handshake port (its session) and the data port
    assert all(LOW <= p <= HIGH for p in ports), got
    assert {int(s.rsplit(":", 1)[1]) for s in got["sessions"]} <= ports
    assert {h for h, _ in hosts_ports} <= {"0.0.0.0", "*", "[::]"}, got  # not 127.0.0.1: all interfaces
