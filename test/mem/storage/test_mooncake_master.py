"""The ``mooncake_master`` pdserve starts: every listener on the host it is given, its log where
no other local user can plant a link (a real master subprocess, stopped by each test)."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import tempfile

import pytest

mooncake_store = pytest.importorskip("pdserve.mem.storage.mooncake_store")
MooncakeMaster = mooncake_store.MooncakeMaster

needs_ss = pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")


def listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket ``pid`` listens on, as ``ss -ltnp`` shows them."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        if re.search(rf"pid={pid},", line):
            host, port = line.split()[3].rsplit(":", 1)
            found.append((host, int(port)))
    return found


@needs_ss
def test_every_listener_of_the_master_is_on_its_host():
    with MooncakeMaster("127.0.0.1") as master:
        pid = master._proc.pid
        found = listening(pid)
        assert (master.host, master.rpc_port) in found
        assert {host for host, _ in found} == {"127.0.0.1"}, found  # no 0.0.0.0: not even its metadata server
        assert master.metadata_server == "P2PHANDSHAKE"  # clients find segments from each other, not over HTTP


def test_the_log_is_private_and_a_planted_link_is_not_followed():
    victim_dir = tempfile.mkdtemp(prefix="pdserve-victim-")
    victim = os.path.join(victim_dir, "precious")
    with open(victim, "w") as f:
        f.write("keep me")
    # The name the master's log once had, predictable from the pid: a local user links it to a victim.
    planted = os.path.join(tempfile.gettempdir(), f"pdserve-mooncake-master-{os.getpid()}.log")
    if os.path.lexists(planted):
        os.unlink(planted)
    os.symlink(victim, planted)
    master = MooncakeMaster("127.0.0.1")
    try:
        master.start()
        folder = os.path.dirname(master.log_path)
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(master.log_path).st_mode) == 0o600
        assert os.path.realpath(master.log_path) == master.log_path and master.log_path != planted
        master.stop()
        assert not os.path.exists(folder)  # stopped by its owner: nothing left in /tmp
    finally:
        master.stop()
        with open(victim) as f:
            assert f.read() == "keep me"
        os.unlink(planted)
        shutil.rmtree(victim_dir)
