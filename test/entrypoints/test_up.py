"""``pdserve up``: the deployment plan (pure) and one real run: up, serving through its router
with real transfers, then SIGTERM stops every process it started and frees every port."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

import pdserve
from pdserve.config import API_KEY_ENV, AUTH_TOKEN_ENV, KV_HASH_KEY_ENV
from pdserve.entrypoints.cli import build_parser, router_args_from_namespace, server_args_from_namespace
from pdserve.entrypoints.up import (
    TRANSFER_ENGINE_WARNING,
    Deployment,
    StorageTier,
    StoreMaster,
    UpArgs,
    _shown,
    plan,
    split_cores,
)
from pdserve.web.api_key import ADMIN_KEY_ENV
from server_utils import TLS, alive, descendants, free_port_block, port_is_free


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
    # 4 cores each: a core for each frontend, and one for decode's overlapped scheduler thread
    big = plan(UpArgs(1, 1, port=40000, bootstrap_port=9000, server_flags=("--model-path", "m"), cores=tuple(range(8))))
    assert [k.cmd[k.cmd.index("--num-threads") + 1] for k in big[:2]] == ["3", "2"]
    assert " ".join(r).count("--prefill") == 2 and "http://127.0.0.1:40003" in r
    assert "--api-key" not in r and r[r.index("--health-check-interval-secs") + 1] == "5"


def _events(child) -> dict | None:
    cmd = child.cmd
    return json.loads(cmd[cmd.index("--kv-events-config") + 1]) if "--kv-events-config" in cmd else None


def test_prefills_publish_kv_events_on_the_server_s_host_never_a_wildcard():
    kids = plan(UpArgs(2, 1, server_flags=("--model-path", "m"), cores=(0, 1, 2)))
    assert [_events(k) for k in kids] == [{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:*"}] * 2 + [None, None]
    on_host = plan(UpArgs(1, 1, host="10.1.2.3", server_flags=("--model-path", "m"), cores=(0, 1)))
    assert _events(on_host[0]) == {"publisher": "zmq", "endpoint": "tcp://10.1.2.3:*"}
    everywhere = plan(UpArgs(1, 1, host="0.0.0.0", server_flags=("--model-path", "m"), cores=(0, 1)))
    assert _events(everywhere[0]) == {"publisher": "zmq", "endpoint": "tcp://127.0.0.1:*"}  # up's router is here
    for args in (UpArgs(1, 1, router_policy="round_robin", server_flags=("--model-path", "m"), cores=(0, 1)),
                 UpArgs(1, 1, host="::1", server_flags=("--model-path", "m"), cores=(0, 1)),
                 UpArgs(1, 1, server_flags=("--model-path", "m", "--dp-size", "2"), cores=(0, 1))):
        assert _events(plan(args)[0]) is None, args  # the router guesses each cache then
    own = '{"publisher": "zmq", "endpoint": "ipc:///tmp/ev"}'
    mine = plan(UpArgs(1, 1, server_flags=("--model-path", "m", "--kv-events-config", own), cores=(0, 1)))[0]
    assert mine.cmd.count("--kv-events-config") == 1 and _events(mine)["endpoint"] == "ipc:///tmp/ev"


def test_bootstrap_ports_that_overlap_the_http_ports_are_refused_naming_the_flag():
    # router 31555, servers 31556-31557: a registry on 31556 would share the prefill's HTTP port
    overlap = r"bootstrap_port: .*31556\.\.31556 overlap .*31555\.\.31557.*--bootstrap-port"
    with pytest.raises(ValueError, match=overlap):
        UpArgs(1, 1, port=31555, bootstrap_port=31556)
    with pytest.raises(ValueError, match="bootstrap_port"):
        UpArgs(2, 1, port=40000, bootstrap_port=39999)  # registries 39999, 40000
    UpArgs(2, 1, port=40000, bootstrap_port=39998)  # 39998-39999: just below
    UpArgs(1, 1, port=31555, bootstrap_port=31558)  # just above


def test_the_admin_key_reaches_the_children_by_the_environment_only(monkeypatch):
    """pdserve up --admin-api-key: on no child's command line; servers, router and up itself take
    $PDSERVE_ADMIN_API_KEY as --admin-api-key's default."""
    kids = plan(UpArgs(1, 1, server_flags=("--model-path", "m"), admin_api_key="adm-secret", cores=(0, 1)))
    assert not [k.name for k in kids if "adm-secret" in " ".join(k.cmd)]
    assert [k.env[ADMIN_KEY_ENV] for k in kids] == ["adm-secret"] * len(kids)
    assert "adm-secret" not in repr(UpArgs(admin_api_key="adm-secret"))
    monkeypatch.setenv(ADMIN_KEY_ENV, "adm-secret")
    parser = build_parser()
    assert parser.parse_args(["up", "--model-path", "m"]).up_admin_api_key == "adm-secret"
    assert server_args_from_namespace(parser.parse_args(["serve", "--model-path", "tiny-deepseek"])
                                      ).admin_api_key == "adm-secret"
    ns = parser.parse_args(["router", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"])
    assert router_args_from_namespace(ns).admin_api_key == "adm-secret"
    assert "adm-secret" not in parser.parse_args(["serve", "--model-path", "m"]).subparser.format_help()


def test_plan_gives_the_secrets_to_every_child_by_environment_not_command_line():
    # A command line is world-readable (ps, /proc/<pid>/cmdline); a process's environment is its user's.
    kids = plan(UpArgs(1, 1, server_flags=("--model-path", "m"), api_key="key-123", auth_token="token-456",
                       health_check_interval_secs=0.5, cores=(0, 1)))
    for k in kids:
        assert "key-123" not in " ".join(k.cmd) and "token-456" not in " ".join(k.cmd) and "--api-key" not in k.cmd
        assert k.env[API_KEY_ENV] == "key-123"
    assert [k.env.get(AUTH_TOKEN_ENV) for k in kids] == ["token-456"] * 3  # the router signs bootstrap fields
    assert kids[-1].cmd[kids[-1].cmd.index("--health-check-interval-secs") + 1] == "0.5"
    assert "secret-key" not in repr(UpArgs(api_key="secret-key", auth_token="secret-key")) + repr(kids)


def test_up_takes_secrets_off_the_servers_flags():
    import argparse

    from pdserve.entrypoints.cli import add_up_args, up_args_from_namespace

    parser = argparse.ArgumentParser()
    add_up_args(parser)
    ns = parser.parse_args(["--model-path", "tiny-llama", "--api-key", "key-123",
                            "--disaggregation-auth-token", "token-456"])
    args = up_args_from_namespace(ns, parser)
    assert (args.api_key, args.auth_token) == ("key-123", "token-456")
    assert not any("token-456" in f or "key-123" in f for f in args.server_flags)


def _options(command: str) -> set[str]:
    sub = build_parser()._subparsers._group_actions[0].choices[command]  # noqa: SLF001 - argparse's own
    return {o for a in sub._actions for o in a.option_strings if o.startswith("--")}  # noqa: SLF001


def test_every_serve_flag_passes_through_up_but_the_documented_exclusions():
    """A server flag added to ``serve`` alone (the parser, TP and events flags once were) fails
    here until ``up`` takes it too, or ``UP_EXCLUDED_FLAGS`` says why it cannot."""
    from pdserve.entrypoints.cli import UP_EXCLUDED_FLAGS

    serve, up = _options("serve"), _options("up")
    assert serve - up == set(UP_EXCLUDED_FLAGS)
    assert not set(UP_EXCLUDED_FLAGS) & up
    passed = ["--tool-call-parser", "qwen25", "--reasoning-parser", "qwen3", "--tp-size", "2",
              "--max-request-bytes", "5000", "--kv-events-config", '{"publisher": "zmq"}']
    ns = build_parser().parse_args(["up", "--model-path", "tiny-llama", *passed])
    from pdserve.entrypoints.cli import up_args_from_namespace

    args = up_args_from_namespace(ns, ns.subparser)
    for server in plan(args)[:-1]:
        for flag, value in zip(passed[::2], passed[1::2]):
            assert _flag(server.cmd, flag) == value, (flag, server.cmd)


def test_up_keys_the_kv_block_hashes_of_every_child(monkeypatch, tmp_path):
    """Every server and the router get one key up makes (by environment): events and the router's
    matching agree, and the hashes mean nothing without it. An operator's key file goes to the router too."""
    import argparse

    from pdserve.entrypoints.cli import add_up_args, up_args_from_namespace

    monkeypatch.delenv(KV_HASH_KEY_ENV, raising=False)
    parser = argparse.ArgumentParser()
    add_up_args(parser)
    args = up_args_from_namespace(parser.parse_args(["--model-path", "tiny-llama"]), parser)
    again = up_args_from_namespace(parser.parse_args(["--model-path", "tiny-llama"]), parser)
    assert args.kv_hash_key and len(args.kv_hash_key) >= 32 and args.kv_hash_key != again.kv_hash_key
    kids = plan(args.__class__(**{**args.__dict__, "cores": (0, 1)}))
    assert {k.env[KV_HASH_KEY_ENV] for k in kids} == {args.kv_hash_key} and len(kids) == 3
    assert not [k.name for k in kids if args.kv_hash_key in " ".join(k.cmd)]
    assert args.kv_hash_key not in repr(args)
    key_file = tmp_path / "kv.key"
    key_file.write_text("operator-secret\n")
    own = up_args_from_namespace(parser.parse_args(["--model-path", "tiny-llama", "--kv-hash-key-file",
                                                    str(key_file)]), parser)
    assert own.kv_hash_key is None
    router = plan(own.__class__(**{**own.__dict__, "cores": (0, 1)}))[-1]
    assert router.cmd[router.cmd.index("--kv-hash-key-file") + 1] == str(key_file)


def test_a_probe_answered_by_something_else_than_http_is_not_healthy():
    import socket
    import threading

    from pdserve.entrypoints.up import _healthy

    with socket.socket() as srv:  # echoes the request, as a probe connected to itself reads it
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)

        def echo():
            conn, _ = srv.accept()
            with conn:
                conn.sendall(conn.recv(4096))

        t = threading.Thread(target=echo)
        t.start()
        assert _healthy(f"http://127.0.0.1:{srv.getsockname()[1]}") is False
        t.join(10)


def test_logged_command_lines_hide_every_secret():
    shown = _shown(["pdserve", "serve", "--api-key", "a1", "--disaggregation-auth-token", "t1", "--api-key=a2",
                    "--worker-api-key", "w1", "--disaggregation-auth-token=t2", "--port", "1"])
    assert not {"a1", "a2", "t1", "t2", "w1"} & set(re.split(r"[ =]", shown)) and shown.endswith("--port 1")


@pytest.mark.parametrize("command", ["serve", "router"])
def test_servers_and_the_router_read_the_api_key_from_the_environment(command, monkeypatch):
    from pdserve.entrypoints.cli import build_parser, router_args_from_namespace, server_args_from_namespace

    monkeypatch.setenv(API_KEY_ENV, "key-from-env")
    if command == "serve":
        args = server_args_from_namespace(build_parser().parse_args(["serve", "--model-path", "tiny-llama"]))
    else:
        argv = ["router", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]
        args = router_args_from_namespace(build_parser().parse_args(argv))
    assert args.api_key == "key-from-env"


def test_elastic_plan_gives_every_server_a_registry_port():
    from pdserve.bench.planner import SLO
    from pdserve.entrypoints.elastic import ElasticConfig

    kids = plan(UpArgs(1, 2, bootstrap_port=9000, server_flags=("--model-path", "m"), cores=(0, 1, 2),
                       elastic=ElasticConfig(SLO(ttft=1.0))))
    ports = [k.cmd[k.cmd.index("--disaggregation-bootstrap-port") + 1] for k in kids[:-1]]
    assert ports == ["9000", "9001", "9002"]  # a decode server that becomes prefill opens its own
    r = kids[-1].cmd
    assert " ".join(r).count("--prefill") == 1 and " ".join(r).count("--decode") == 2


@pytest.mark.parametrize("argv,field", [(["--num-servers", "3"], "--num-servers: only with --elastic"),
                                        (["--elastic", "--num-servers", "1"], "--num-servers"),
                                        (["--elastic", "--num-prefill", "2"], "--num-servers"),
                                        (["--elastic", "--prefill-profile", "x"], "--prefill-profile")])
def test_invalid_elastic_flags_are_refused_naming_the_flag(argv, field):
    from pdserve.entrypoints.cli import build_parser, elastic_from_namespace, up_split

    ns = build_parser().parse_args(["up", "--model-path", "tiny-llama", *argv])
    with pytest.raises(ValueError, match=field):
        up_split(ns)
        elastic_from_namespace(ns)


def _flag(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


def test_plan_shares_one_mooncake_master_and_gives_each_server_its_own_file_directory():
    tier = StorageTier("mooncake", extra_config=json.dumps({"start_master": True, "local_buffer_size": "16mb"}))
    with pytest.raises(ValueError, match="mooncake needs a master"):
        plan(UpArgs(2, 1, cores=(0,), storage=tier))
    kids = plan(UpArgs(2, 1, cores=(0,), storage=tier), StoreMaster("127.0.0.1:5", "http://127.0.0.1:6/metadata"))
    for k in kids[:-1]:
        assert _flag(k.cmd, "--hicache-storage-backend") == "mooncake"
        extra = json.loads(_flag(k.cmd, "--hicache-storage-backend-extra-config") or "{}")
        assert extra == {"local_buffer_size": "16mb", "master_server_address": "127.0.0.1:5",
                         "metadata_server": "http://127.0.0.1:6/metadata"}
    assert "--hicache-storage-backend" not in kids[-1].cmd  # the router
    named = StorageTier("mooncake", extra_config=json.dumps({"master_server_address": "10.0.0.1:50051"}))
    assert not named.needs_master
    given = _flag(plan(UpArgs(storage=named, cores=(0,)))[0].cmd, "--hicache-storage-backend-extra-config")
    assert json.loads(given or "{}") == {"master_server_address": "10.0.0.1:50051"}
    kids = plan(UpArgs(1, 2, cores=(0,), storage=StorageTier("file", "/kv")))
    assert [_flag(k.cmd, "--hicache-storage-dir") for k in kids] == ["/kv/prefill-0", "/kv/decode-0", "/kv/decode-1",
                                                                     None]
    with pytest.raises(ValueError, match="hicache_storage_dir"):
        StorageTier("file")


def test_deployment_starts_the_mooncake_master_and_stops_it_after_the_servers():
    pytest.importorskip("mooncake.store")
    dep = Deployment(UpArgs(storage=StorageTier("mooncake")))
    started = dep._start_master()
    master = dep.master
    assert started is not None and master is not None and master.alive()
    assert started.address == master.address and not port_is_free(master.rpc_port)
    dep.stop()
    assert dep.master is None and not master.alive() and port_is_free(master.rpc_port)


def test_invalid_deployment_is_refused():
    with pytest.raises(ValueError, match="num_decode"):
        UpArgs(1, 0)
    proc = subprocess.run([sys.executable, "-m", "pdserve", "up", "--model-path", "tiny-llama", "--page-size", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "page_size" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "pdserve", "up", "--model-path", "tiny-llama",
                           "--disaggregation-transfer-backend", "memory"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "disaggregation_transfer_backend: 'memory'" in proc.stderr


# The deployment runs the hierarchical cache with a Mooncake Store tier up provides the master of.
HICACHE_FLAGS = ["--enable-hierarchical-cache", "--hicache-storage-backend", "mooncake", "--hicache-storage-size-gb",
                 "0.05", "--hicache-storage-chunk-tokens", "8", "--hicache-storage-prefetch-policy", "wait_complete",
                 "--hicache-storage-backend-extra-config",
                 json.dumps({"local_buffer_size": "16mb"})]


# Given on up's own command line, as an operator would: none of its children may show them.
API_KEY, TOKEN = "up-test-api-key-5f1c", "up-test-pd-token-9a7e"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# Mooncake 0.3.13's transfer engines listen on every interface in this range whatever --host says
# (docs/security.md): the one documented exception to "nothing of ours beyond --host".
TRANSFER_ENGINE_PORTS = range(15000, 17001)


def listeners(pids: set[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every TCP socket ``pids`` listen on, from ``ss -ltnp``."""
    assert shutil.which("ss"), "this check needs ss (iproute2)"
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        host, port = line.split()[3].rsplit(":", 1)
        found += [(int(pid), host, int(port)) for pid in re.findall(r"pid=(\d+),", line) if int(pid) in pids]
    return found


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def assert_listening_on_loopback_only(up_pid: int, router_pid: int) -> None:
    """Every socket of up's tree is on 127.0.0.1, but the transfer engines' documented ports: held by
    the servers (not up, the router or mooncake_master), in the range, one wildcard pair per engine."""
    tree = {up_pid, *descendants(up_pid)}
    found = listeners(tree)
    assert found and {h for _, h, _ in found} <= {"127.0.0.1", "0.0.0.0", "*"}, found
    beyond = [(pid, h, p) for pid, h, p in found if h != "127.0.0.1"]
    assert beyond, "no transfer engine seen: the exception this checks is not exercised"
    for pid, host, port in beyond:
        assert port in TRANSFER_ENGINE_PORTS, (pid, host, port)
        assert pid not in {up_pid, router_pid, *descendants(router_pid)} and _comm(pid) != "mooncake_master", pid
    for pid in {pid for pid, _, _ in beyond}:  # per engine: the RPC port (0.0.0.0) and the handshake port (*)
        hosts = [h for p, h, _ in beyond if p == pid]
        assert hosts.count("0.0.0.0") == hosts.count("*") >= 1, (pid, hosts)


def assert_no_secret_on_a_command_line(pids: set[int]) -> None:
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue  # gone meanwhile
        assert API_KEY not in cmdline and TOKEN not in cmdline, cmdline.replace("\0", " ")


def _router_pid(pids: set[int]) -> int:
    for pid in pids:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"router" in argv[:4]:
            return pid
    raise AssertionError("no router among up's children")


def test_up_serves_through_its_router_and_stops_everything():
    pytest.importorskip("mooncake.store")
    port = free_port_block(4)  # router, prefill, decode, then the prefill's bootstrap registry
    boot = port + 3
    log = tempfile.NamedTemporaryFile(prefix="pdserve-up-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "pdserve", "up", "--model-path", "tiny-llama", "--port", str(port),
           "--bootstrap-port", str(boot), "--log-level", "warning", "--api-key", API_KEY,
           "--disaggregation-auth-token", TOKEN, *HICACHE_FLAGS]
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
        sampling = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
        reference = pdserve.Engine(model_path="tiny-llama", num_threads=1)
        turn1 = list(range(20, 32))
        got = httpx.post(url + "/generate", json={"input_ids": turn1, "sampling_params": sampling}, headers=AUTH,
                         timeout=120).json()
        assert got["output_ids"] == reference.generate(input_ids=turn1, sampling_params=sampling)["output_ids"]
        decode = httpx.get(f"http://127.0.0.1:{port + 2}/get_server_info", headers=AUTH, timeout=30).json()
        assert decode["disaggregation_mode"] == "decode" and decode["kv_received"] == 1  # through prefill
        # `ss` over the whole tree, once the transfer engines are up: nothing of ours beyond loopback but them.
        assert_listening_on_loopback_only(proc.pid, _router_pid(children))
        assert_no_secret_on_a_command_line(set(descendants(proc.pid)))
        # Decode wrote turn 1 back to the shared store: turn 2's prefill loads it from there.
        _wait(lambda: httpx.get(f"http://127.0.0.1:{port + 2}/get_server_info", headers=AUTH, timeout=30, verify=TLS)
              .json()["storage_puts"] >= 2, 30, "decode's write-back")
        turn2 = turn1 + got["output_ids"] + [40, 41, 42]
        got = httpx.post(url + "/generate", json={"input_ids": turn2, "sampling_params": sampling}, headers=AUTH,
                         timeout=120).json()
        assert got["output_ids"] == reference.generate(input_ids=turn2, sampling_params=sampling)["output_ids"]
        # Decode stored two chunks (16 of the 19 positions it computed); prefill's device held 11 of them.
        assert got["meta_info"]["cached_tokens_by_tier"] == {"device": 11, "host": 0, "storage": 5}
        # The router follows the prefill's keyed KV events (one key up made for all, its snapshot worker-only).
        _wait(lambda: httpx.get(url + "/get_server_info", headers=AUTH, timeout=30, verify=TLS).json()["prefill"][0]
              ["cache_view"]["source"] == "events", 60, "the router following the prefill's KV events")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        output = Path(log.name).read_text(errors="replace")
        assert "unexpectedly" not in output
        assert API_KEY not in output and TOKEN not in output  # up's log and every child's
        assert output.count(TRANSFER_ENGINE_WARNING) == 1  # said once, the documented exception
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


# ------------------------------------------------------- a dead prefill
PROMPTS = [f"Request {i}: tell me about the number {i * 7}" for i in range(16)]
FRESH = "A prompt no server has seen yet, so decode has none of it cached"  # cached: decode would not ask for KV
SAMPLING = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
# The streams in flight at the kill: long enough that all 8 are still decoding when the test
# has seen them there (24 tokens of tiny-llama can finish before the 8th reaches decode).
LONG = {**SAMPLING, "max_new_tokens": 200}


def _wait(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"{what}: not true after {timeout} s")


def _metric(url: str, name: str, **labels) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in httpx.get(url + "/metrics", timeout=30, verify=TLS).text.splitlines():  # polled: TLS built once
        key, _, value = line.rpartition(" ")
        if key == (f"{name}{{{want}}}" if want else name):
            return float(value)
    return 0.0


def _ask(url: str, prompt: str, stream: bool, sampling: dict = SAMPLING) -> list[int]:
    """One greedy request's output ids; fails on any client-visible error."""
    body = {"text": prompt, "sampling_params": sampling, "stream": stream}
    if not stream:
        r = httpx.post(url + "/generate", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["output_ids"]
    last = None
    with httpx.stream("POST", url + "/generate", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                last = json.loads(line[6:])
                assert "error" not in last, last
    return last["output_ids"]


def _server_pid(up_pid: int, role: str) -> int:
    """The session leader (frontend) of ``up``'s server of ``role``."""
    for pid in descendants(up_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" in argv and role.encode() in argv and os.getpgid(pid) == pid:
            return pid
    raise AssertionError(f"no {role} server under pid {up_pid}")


def test_killed_prefill_under_up_degrades_then_comes_back():
    """kill -9 of the only prefill with 8 streams in flight and 8 requests after: all 16 complete with
    the colocated engine's greedy tokens; restarted on its ports, it is used again once the router's
    next health check passes it."""
    port = free_port_block(4)  # router, prefill, decode, then the prefill's bootstrap registry
    boot = port + 3
    router, decode = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 2}"
    log = tempfile.NamedTemporaryFile(prefix="pdserve-up-kill-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "pdserve", "up", "--model-path", "tiny-llama", "--port", str(port),
           "--bootstrap-port", str(boot), "--log-level", "warning", "--health-check-interval-secs", "1"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    restarted = None
    try:
        _wait(lambda: "pdserve is up" in Path(log.name).read_text(errors="replace") or proc.poll() is not None,
              240, "up")
        assert proc.poll() is None, Path(log.name).read_text()[-3000:]
        reference = pdserve.Engine(model_path="tiny-llama", num_threads=1)
        want = [o["output_ids"] for o in reference.generate(prompt=[*PROMPTS, FRESH], sampling_params=SAMPLING)]
        want_long = [o["output_ids"] for o in reference.generate(prompt=PROMPTS[:8], sampling_params=LONG)]
        victim = _server_pid(proc.pid, "prefill")
        prefill_cmd = [a.decode() for a in Path(f"/proc/{victim}/cmdline").read_bytes().split(b"\0")[:-1]]
        # and its environment: up hands its children their secrets there (the P/D token, the hash key)
        prefill_env = dict(e.decode().split("=", 1) for e in Path(f"/proc/{victim}/environ").read_bytes().split(b"\0")
                           if b"=" in e)
        with ThreadPoolExecutor(16) as pool:
            first = [pool.submit(_ask, router, p, True, LONG) for p in PROMPTS[:8]]
            _wait(lambda: _info(router)["decode"][0]["in_flight"] == 8,
                  60, "8 streams in flight")
            os.killpg(victim, signal.SIGKILL)
            _wait(lambda: not alive(victim), 30, "prefill gone")
            after = [pool.submit(_ask, router, p, i % 2 == 0) for i, p in enumerate(PROMPTS[8:])]
            got = [f.result() for f in first + after]
        assert got == want_long + want[8:16]
        assert _metric(router, "pdserve_router:degraded_requests_total") >= 1
        assert httpx.get(router + "/health", timeout=30).json()["status"] == "degraded"
        assert proc.poll() is None  # up keeps serving without its prefill
        restarted = subprocess.Popen(prefill_cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=prefill_env)
        _wait(lambda: _metric(router, "pdserve_router:worker_healthy", role="prefill",
                              worker=f"http://127.0.0.1:{port + 1}") == 1, 240, "router sees the prefill again")
        # the kill opened its breaker (connection failures): the router picks it once that breaker lets
        # requests through again (half-open after its cool-down), which a health check alone does not
        _wait(lambda: _info(router)["prefill"][0]["circuit_breaker"] != "open", 120,
              "the prefill's breaker lets requests through")
        prefill = f"http://127.0.0.1:{port + 1}"
        sent = _metric(router, "pdserve_router:requests_total", role="prefill", worker=prefill)
        degraded = _metric(router, "pdserve_router:degraded_requests_total")
        kv_before = httpx.get(decode + "/get_server_info", timeout=30).json()["kv_received"]
        assert _ask(router, FRESH, False) == want[16]
        assert _metric(router, "pdserve_router:requests_total", role="prefill", worker=prefill) == sent + 1
        assert _metric(router, "pdserve_router:degraded_requests_total") == degraded
        assert httpx.get(router + "/health", timeout=30).json()["status"] == "ok"
        assert httpx.get(decode + "/get_server_info", timeout=30).json()["kv_received"] == kv_before + 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        output = Path(log.name).read_text(errors="replace")
        assert "unexpectedly" not in output
        assert API_KEY not in output and TOKEN not in output  # up's log and every child's
        assert output.count(TRANSFER_ENGINE_WARNING) == 1  # said once, the documented exception
    finally:
        for p in (proc, restarted):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        Path(log.name).unlink()


# ------------------------------------------------------- a quiet run
# The shapes a line of up's output may take: a pdserve record ("[time process] LEVEL ..."), a
# uvicorn record ("LEVEL:  ..."), up's banner. Any other line (a bare third-party message, a
# traceback, a Python warning) counts as noise.
PDSERVE_RECORD = re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,]+ [\w-]+\] (DEBUG|INFO|WARNING|ERROR|CRITICAL) ")
UVICORN_RECORD = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL):\s")
QUIET = ("DEBUG", "INFO")


def noisy_lines(output: str) -> list[str]:
    """Lines at WARNING or above, and lines that are not a log record at all."""
    noisy = []
    for line in output.splitlines():
        record = PDSERVE_RECORD.match(line) or UVICORN_RECORD.match(line)
        if record is None and line.strip() and not line.startswith("pdserve is up: "):
            noisy.append(line)
        elif record is not None and record.group(1) not in QUIET:
            noisy.append(line)
    return noisy


def test_noisy_lines_are_told_apart():
    assert noisy_lines("[2026-01-02 03:04:05,678 router] INFO x: y\nINFO:     Started server process [1]\n"
                       "pdserve is up: http://127.0.0.1:1 (router -> 1 prefill, 1 decode)\n") == []
    bad = ["[2026-01-02 03:04:05,678 up] WARNING z", "ERROR:    boom", "Token indices sequence length is longer",
           "Traceback (most recent call last):"]
    assert noisy_lines("\n".join(bad)) == bad


def test_a_clean_up_run_logs_nothing_at_warning_or_above():
    """pdserve up (1P1D and its router, every process at its default log level, the output parsers
    passed through up): requests served, a prompt past the context (and past the tokenizer's
    model_max_length) and a bad sampling parameter refused with a 400 naming the field, n > 1 on
    every route, the parsers at work, a truncated forced call, then Ctrl-C: nothing logged at
    WARNING or above by up, the router or either server, and nothing that is not a log record."""
    openai = pytest.importorskip("openai")
    port = free_port_block(4)  # router, prefill, decode, then the prefill's bootstrap registry
    log = tempfile.NamedTemporaryFile(prefix="pdserve-up-quiet-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "pdserve", "up", "--model-path", "tiny-llama", "--port", str(port),
           "--bootstrap-port", str(port + 3), "--context-length", "1024", *PARSER_FLAGS]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait(lambda: "pdserve is up" in Path(log.name).read_text(errors="replace") or proc.poll() is not None,
              240, "up")
        assert proc.poll() is None, Path(log.name).read_text()[-3000:]
        url = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        messages = [{"role": "user", "content": "Tell me about the sea birds of the north."}]
        first = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=8, temperature=0,
                                               extra_body={"separate_reasoning": False})
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And in winter?"}]
        assert client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=8).choices
        assert len(_ask(url, "A streamed request", True, {"max_new_tokens": 4, "temperature": 0})) == 4
        # > 1024 (the context; a chat with tools needs ~450) and > 4096 (tiny-llama's model_max_length)
        too_long = "word " * 5000
        r = httpx.post(url + "/generate", json={"text": too_long, "sampling_params": {"max_new_tokens": 4}},
                       timeout=120)
        assert r.status_code == 400 and r.json()["error"]["param"] == "text", r.text
        with pytest.raises(openai.BadRequestError, match="context length"):
            client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": too_long}],
                                           max_tokens=4)
        r = httpx.post(url + "/generate", json={"text": "x", "sampling_params": {"temperature": -3}}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.temperature", r.text
        check_n_samples(url, client, port + 1, port + 2)
        check_parsers(client)
        check_framework_errors(url)
        check_a_truncated_forced_call(client)
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        assert proc.wait(60) == 0
        output = Path(log.name).read_text(errors="replace")
        assert "pdserve router on" in output and "pdserve is up" in output  # the router's and up's logs are here
        assert noisy_lines(output) == [], output[-6000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        Path(log.name).unlink()


# --------------------------------------------- through up: n > 1, the parsers, error shapes
# Passed through up to every server (up once refused them as unrecognized arguments); deepseek-r1's
# output starts inside the thinking part, so a random-weight model's reply is all reasoning.
PARSER_FLAGS = ["--tool-call-parser", "qwen25", "--reasoning-parser", "deepseek-r1"]
SEEDED = {"max_new_tokens": 8, "temperature": 1.0, "seed": 77, "ignore_eos": True}
RAW = {"separate_reasoning": False}  # the reply as written, without the reasoning parser
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _info(url: str) -> dict:
    return httpx.get(url + "/get_server_info", timeout=30, verify=TLS).json()  # polled: TLS built once


def check_n_samples(url: str, client, prefill_port: int, decode_port: int) -> None:
    """n > 1 disaggregated on every route: the prompt moves from prefill once, each sample is the
    colocated engine's with the same seeds, greedy samples are equal."""
    reference = pdserve.Engine(model_path="tiny-llama", num_threads=1)
    prompt = list(range(300, 340))
    prefill, decode = f"http://127.0.0.1:{prefill_port}", f"http://127.0.0.1:{decode_port}"
    before = (_info(prefill)["rooms_completed"], _info(decode)["kv_received"])
    r = httpx.post(url + "/generate", json={"input_ids": prompt, "sampling_params": {**SEEDED, "n": 3}}, timeout=120)
    assert r.status_code == 200, r.text
    want = reference.generate(input_ids=prompt, sampling_params={**SEEDED, "n": 3})
    assert [g["output_ids"] for g in r.json()] == [w["output_ids"] for w in want]
    assert (_info(prefill)["rooms_completed"], _info(decode)["kv_received"]) == (before[0] + 1, before[1] + 1)
    text = "The lighthouse keeper wrote in his log that night"
    r = httpx.post(url + "/v1/completions", json={"model": "tiny-llama", "prompt": text, "max_tokens": 8, "n": 2,
                                                 "temperature": 1.0, "seed": 77, "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    got = [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
    assert got == [w["text"] for w in reference.generate(prompt=text, sampling_params={**SEEDED, "n": 2})]
    one = client.chat.completions.create(model="tiny-llama", messages=ASK, max_tokens=8, temperature=0,
                                         extra_body=RAW)
    two = client.chat.completions.create(model="tiny-llama", messages=ASK, max_tokens=8, temperature=0, n=2,
                                         extra_body=RAW)
    assert [c.message.content for c in two.choices] == [one.choices[0].message.content] * 2
    streamed: dict[int, str] = {}
    for chunk in client.chat.completions.create(model="tiny-llama", messages=ASK, max_tokens=8, temperature=0, n=2,
                                                stream=True, extra_body=RAW):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
    assert streamed == {0: one.choices[0].message.content, 1: one.choices[0].message.content}


# Under --reasoning-parser deepseek-r1 a constrained reply thinks first and the grammar waits for
# "</think>", which a random model never writes: these checks ask for the whole reply constrained.
WHOLE = {"separate_reasoning": False}


def check_parsers(client) -> None:
    """--reasoning-parser: the reply goes to reasoning_content (deepseek-r1 starts thinking);
    --tool-call-parser: a reply in Qwen's format (forced here by a regex) becomes tool_calls."""
    raw = client.chat.completions.create(model="tiny-llama", messages=ASK, max_tokens=8, temperature=0,
                                         extra_body=RAW).choices[0].message
    split = client.chat.completions.create(model="tiny-llama", messages=ASK, max_tokens=8,
                                           temperature=0).choices[0].message
    assert raw.content and not split.content and split.model_extra["reasoning_content"] == raw.content
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    reply = client.chat.completions.create(model="tiny-llama", messages=ASK, tools=[WEATHER], max_tokens=100,
                                           temperature=0, extra_body={"regex": _literal(call), **WHOLE}).choices[0]
    assert reply.finish_reason == "tool_calls", reply
    (got,) = reply.message.tool_calls
    assert got.function.name == "get_weather"
    assert json.loads(got.function.arguments) == {"city": "Paris", "unit": "celsius"}


def _literal(text: str) -> str:
    """A regex matching ``text`` alone, escaping only what the grammar backend takes as syntax."""
    return re.sub(r"([\\{}\[\]().*+?^$|])", r"\\\1", text)


def check_a_truncated_forced_call(client) -> None:
    """A named tool_choice cut by max_tokens, at every length from the name on: finish_reason
    length, and the arguments written so far (a prefix of the whole call's, "" when they had not
    begun), never an invented empty object."""
    kw = {"model": "tiny-llama", "messages": ASK, "tools": [WEATHER], "temperature": 0, "extra_body": WHOLE,
          "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    whole = client.chat.completions.create(max_tokens=200, **kw)
    assert whole.choices[0].finish_reason in ("stop", "tool_calls"), whole
    full = "".join(whole.choices[0].message.tool_calls[0].function.arguments.split())
    cuts = []
    for max_tokens in range(1, whole.usage.completion_tokens - 1):
        cut = client.chat.completions.create(max_tokens=max_tokens, **kw).choices[0]
        assert cut.finish_reason == "length", cut
        for call in cut.message.tool_calls or []:
            assert call.function.name == "get_weather" and call.function.arguments != "{}", (max_tokens, call)
            assert full.startswith("".join(call.function.arguments.split())), (max_tokens, call, full)
            cuts.append(call.function.arguments)
    assert cuts and "{" not in cuts[0] and "city" in cuts[-1], cuts  # cut before the arguments and inside them


def check_framework_errors(url: str) -> None:
    """No such route, or a method the route does not take: OpenAI's error shape, from the router
    and from a server behind it."""
    for base in (url, url.rsplit(":", 1)[0] + f":{int(url.rsplit(':', 1)[1]) + 2}"):
        r = httpx.get(base + "/v1/no-such-route", timeout=30)
        assert r.status_code == 404 and r.json()["error"]["param"] == "path", r.text
        r = httpx.get(base + "/v1/chat/completions", timeout=30)
        assert r.status_code == 405 and r.json()["error"]["param"] == "method" and "POST" in r.headers["allow"], r.text
