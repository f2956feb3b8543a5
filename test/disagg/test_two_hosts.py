"""docs/disaggregation.md's by-hand recipes, followed as written on two hosts: two network
namespaces joined by a veth pair, each with its own address in a private test range.

The commands are read from the doc (its sections "By hand, as on a cluster", "One server over two
hosts" and "With the hierarchical cache"), not copied here. Each runs under ``ip netns exec`` on
the host its ``# host A`` / ``# host B`` comment names, after the doc's settings block, with these
substitutions only: ``HOST_A`` and ``HOST_B`` get the namespaces' addresses, ``/etc/pdserve/``
(the secrets' files) a private folder, ``--model-path M`` a tiny preset; and flags appended that
size the servers for a 2-core box (``SIZING``, ``HICACHE_SIZING``). Each namespace has ports of
its own, so the doc's ports are used as written. Checked:

- P/D, prefill on A, decode and router on B, under the token: greedy output through the router
  equals the offline engine's, every request's KV came over from prefill; every listener of ours
  is on its host's address but Mooncake's transfer engine (the documented exception); a peer
  without the token, or with another one, is refused, and without any token an off-host peer is.
- One server over two hosts (TP 2, a rank on each): output equal to the single-rank engine's;
  listeners on the hosts' addresses but torch's TCP store (documented).
- The hierarchical cache: the Mooncake master on A, prefill on A, decode on B: decode writes
  turn 1 back to the store, turn 2 is a storage hit on prefill, outputs unchanged.

Skipped, with the reason, where namespaces cannot be made (not root, no ``ip``, ``ip netns add``
refused). Everything started is stopped and the namespaces deleted, also when a test fails.
"""

from __future__ import annotations

import ctypes
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from entrypoints.server_utils import HEALTH_POLL_S, TLS, alive, descendants
from pdserve.disagg.auth import PeerAuth

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "disaggregation.md"
SECTIONS = {"pd": "By hand, as on a cluster", "tp": "One server over two hosts",
            "hicache": "With the hierarchical cache"}
MODEL = "tiny-llama"
SUBNET = "10.213.77"  # private, and only inside the namespaces this test makes
ADDRESS = {"A": f"{SUBNET}.1", "B": f"{SUBNET}.2"}
TOKEN, API_KEY = "two-hosts-pd-token-4c1e", "two-hosts-api-key-77b0"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
SIZING = ("--max-total-tokens", "4096")  # 16 MiB of KV per server instead of 256
HICACHE_SIZING = ("--hicache-storage-size-gb", "0.05", "--hicache-storage-chunk-tokens", "8",
                  "--hicache-storage-prefetch-policy", "wait_complete")
TRANSFER_ENGINE_PORTS = range(15000, 17001)  # Mooncake's wildcard listeners (docs/security.md)
START_TIMEOUT_S = 240.0
SAMPLING = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
PROMPTS = [list(range(20, 32)), [7, 300, 12, 1500, 44, 9, 811], list(range(100, 140, 3))]


# ------------------------------------------------------------------ the doc
@dataclass(frozen=True)
class Step:
    """One line of a recipe: ``host`` "A"/"B" (None: a setting, run before every command)."""

    host: str | None
    line: str

    @property
    def words(self) -> list[str]:
        return shlex.split(self.line, comments=True)


def section(markdown: str, title: str) -> str:
    """The text under the ``### title`` heading, up to the next heading of level 1-3 (outside
    code blocks, where ``#`` starts a comment)."""
    out: list[str] | None = None
    fenced = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,3} ", line):
            if out is not None:
                break
            if line == f"### {title}":
                out = []
                continue
        if out is not None:
            out.append(line)
    assert out is not None, f"{DOC.name}: no section '### {title}'"
    return "\n".join(out) + "\n"


def recipe(title: str) -> list[Step]:
    """The section's shell lines (continuations joined) in order, each with its host."""
    steps = []
    for block in re.findall(r"```bash\n(.*?)```", section(DOC.read_text(), title), re.S):
        host, pending = None, ""
        for raw in block.splitlines():
            line = raw.strip()
            if line.endswith("\\"):
                pending += line[:-1].strip() + " "
                continue
            line, pending = (pending + line).strip(), ""
            named = re.fullmatch(r"#\s*host ([AB])\b.*", line)
            if named:
                host = named.group(1)
            elif line and not line.startswith("#"):
                steps.append(Step(host, line))
    return steps


def settings(steps: list[Step]) -> list[str]:
    return [s.line for s in steps if s.host is None and re.match(r"(export\s+)?\w+=", s.line)]


def commands(steps: list[Step], program: str, sub: str | None = None) -> list[Step]:
    return [s for s in steps if s.host and s.words[0] == program and (sub is None or s.words[1] == sub)]


def flag(words: list[str], name: str) -> str | None:
    return words[words.index(name) + 1] if name in words else None


def _option(words: list[str], name: str) -> str:
    """A gflags option's value (``-name=value``, mooncake_master's style)."""
    (value,) = [w.split("=", 1)[1] for w in words if w.startswith(name + "=")]
    return value


# Checked on any machine: what a reader must get right for the recipe to work on two hosts.
def test_the_recipe_sets_both_hosts_and_exports_the_token():
    lines = settings(recipe(SECTIONS["pd"]))
    assert any(re.match(r"HOST_A=\S+", line) for line in lines) and any(re.match(r"HOST_B=\S+", line)
                                                                           for line in lines), lines
    assert any(line.startswith("export PDSERVE_DISAGGREGATION_AUTH_TOKEN=") for line in lines), lines


@pytest.mark.parametrize("name", SECTIONS)
def test_every_server_and_router_binds_its_own_hosts_address(name):
    steps = recipe(SECTIONS[name])
    run = commands(steps, "pdserve")
    assert run, f"no pdserve command under '{SECTIONS[name]}'"
    for step in run:
        assert flag(step.words, "--host") == f"$HOST_{step.host}", f"host {step.host}: {step.line}"
        assert "--disaggregation-allow-unauthenticated" not in step.words, step.line
    for step in commands(steps, "pdserve", "router"):
        urls = [step.words[i + 1] for i, w in enumerate(step.words) if w in ("--prefill", "--decode")]
        assert urls and all(re.fullmatch(r"http://\$HOST_[AB]:\d+", u) for u in urls), step.line


# ------------------------------------------------------------------ two hosts
def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


_CLONE_NEWNET = 0x40000000


def _enter_netns(name: str) -> None:
    """Move the calling thread into network namespace ``name`` (its sockets are made there)."""
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {name}")
    finally:
        os.close(fd)


def _why_no_namespaces() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    if shutil.which("ss") is None:
        return "no `ss` command (iproute2)"
    return None


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path


@dataclass
class Cluster:
    """Two namespaces ("hosts" A and B) joined by a veth pair, and what runs in them."""

    names: dict[str, str]
    tag: str
    workdir: Path
    procs: list[Proc] = field(default_factory=list)
    clients: dict[str, ThreadPoolExecutor] = field(default_factory=dict)
    current: str | None = None  # the recipe running now

    # -- running the doc's commands --------------------------------------------------------
    def env(self) -> dict[str, str]:
        path = os.pathsep.join([str(self.workdir / "bin"), os.environ.get("PATH", "")])
        pythonpath = os.pathsep.join([str(ROOT / "python"), str(ROOT / "kernels"), os.environ.get("PYTHONPATH", "")])
        return {**os.environ, "PATH": path, "PYTHONPATH": pythonpath}

    def script(self, prelude: list[str], step: Step, extra: tuple[str, ...]) -> str:
        lines = [*(_substitute(line, self.workdir) for line in prelude),
                 "exec " + _substitute(step.line, self.workdir) + "".join(" " + shlex.quote(a) for a in extra)]
        return "set -eu\n" + "\n".join(lines) + "\n"

    def launch(self, prelude: list[str], step: Step, extra: tuple[str, ...] = ()) -> Proc:
        assert step.host is not None
        program = "-".join(step.words[:2]) if step.words[0] == "pdserve" else step.words[0]
        name = f"{len(self.procs)}-{step.host}-{program}"
        log = self.workdir / (re.sub(r"[^\w.-]", "_", name) + ".log")
        with open(log, "wb") as out:
            popen = subprocess.Popen(["ip", "netns", "exec", self.names[step.host], "bash", "-c",
                                      self.script(prelude, step, extra)], stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=self.env(), start_new_session=True)
        self.procs.append(Proc(name, popen, log))
        return self.procs[-1]

    def stop_all(self) -> None:
        """SIGTERM every process group, SIGKILL what is left after 30 s; wait for all of them."""
        tree = {p.popen.pid: [p.popen.pid, *descendants(p.popen.pid)] for p in self.procs}
        for p in self.procs:
            _signal_group(p.popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        for p in self.procs:
            try:
                p.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in self.procs:
            _signal_group(p.popen.pid, signal.SIGKILL)
            p.popen.wait(10)
            for pid in tree[p.popen.pid]:  # a child that left the group (none should)
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)
        self.procs.clear()
        self.current = None

    def logs(self, tail: int = 3000) -> str:
        return "\n".join(f"--- {p.name} (rc {p.popen.poll()}):\n{p.log.read_text(errors='replace')[-tail:]}"
                         for p in self.procs)

    # -- talking to them ---------------------------------------------------------------------
    def on(self, host: str, fn: Callable, *args, **kwargs):
        """``fn(*args, **kwargs)`` run by a thread inside host's namespace (a client on that host)."""
        if host not in self.clients:
            self.clients[host] = ThreadPoolExecutor(2, initializer=_enter_netns, initargs=(self.names[host],))
        return self.clients[host].submit(fn, *args, **kwargs).result()

    def get(self, host: str, url: str, **kw) -> httpx.Response:
        return self.on(host, httpx.get, url, headers=kw.pop("headers", AUTH), timeout=kw.pop("timeout", 30),
                       verify=kw.pop("verify", TLS), **kw)

    def post(self, host: str, url: str, body: dict) -> httpx.Response:
        return self.on(host, httpx.post, url, json=body, headers=AUTH, timeout=120, verify=TLS)

    def wait_healthy(self, host: str, url: str, timeout: float = START_TIMEOUT_S, router: bool = False) -> None:
        """Until ``url``'s /health answers 200 to a client on ``host`` (a router: and it sees a
        prefill too, "ok": before that it sends requests to decode alone)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [p.name for p in self.procs if p.popen.poll() is not None]
            assert not dead, f"exited: {dead}\n{self.logs()}"
            try:
                reply = self.get(host, url + "/health", timeout=2)
                if reply.status_code == 200 and (not router or reply.json()["status"] == "ok"):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(HEALTH_POLL_S)
        raise AssertionError(f"{url} not healthy after {timeout} s\n{self.logs()}")

    def wait_listening(self, host: str, address: str, port: int, timeout: float = 30.0) -> None:
        def connects() -> bool:
            try:
                socket.create_connection((address, port), timeout=1).close()
                return True
            except OSError:
                return False

        deadline = time.monotonic() + timeout
        while not self.on(host, connects):
            assert time.monotonic() < deadline, f"nothing listens on {address}:{port}\n{self.logs()}"
            time.sleep(0.1)

    def listeners(self, host: str) -> list[tuple[int, str, int]]:
        """(pid, address, port) of every TCP listener of our processes in host's namespace."""
        ours = {pid for p in self.procs for pid in (p.popen.pid, *descendants(p.popen.pid))}
        out = _ip("netns", "exec", self.names[host], "ss", "-ltnpH").stdout
        found = []
        for line in out.splitlines():
            address, port = line.split()[3].rsplit(":", 1)
            found += [(int(pid), address.strip("[]"), int(port)) for pid in re.findall(r"pid=(\d+),", line)
                      if int(pid) in ours]
        return found

    def close(self) -> None:
        try:
            self.stop_all()
        finally:
            for pool in self.clients.values():
                pool.shutdown(wait=False)
            _remove_hosts(self.tag)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def _substitute(line: str, workdir: Path) -> str:
    """The doc's placeholders: the hosts' addresses, the secrets' folder, the model."""
    line = re.sub(r"^HOST_([AB])=\S+", lambda m: f"HOST_{m.group(1)}={ADDRESS[m.group(1)]}", line)
    line = line.replace("/etc/pdserve/", f"{workdir}/secrets/")
    return re.sub(r"--model-path M(?=\s|$)", f"--model-path {MODEL}", line)


def test_the_placeholders_are_where_the_substitutions_look():
    """Each substitution finds its placeholder, so the recipe never runs with the doc's own values."""
    prelude = settings(recipe(SECTIONS["pd"]))
    done = [_substitute(line, Path("/w")) for line in prelude]
    assert {f"HOST_{h}={a}" for h, a in ADDRESS.items()} <= {line.split()[0] for line in done}, done
    secrets = [line for line in done if "$(cat " in line]
    assert secrets and all("/w/secrets/" in line for line in secrets), done
    for name in SECTIONS:
        for step in commands(recipe(SECTIONS[name]), "pdserve", "serve"):
            assert flag(shlex.split(_substitute(step.line, Path("/w"))), "--model-path") == MODEL, step.line


def _host_names(tag: str) -> tuple[dict[str, str], dict[str, str]]:
    """Namespace and veth names of this run (a veth name has at most 15 characters)."""
    return {h: f"pd2h-{tag}-{h.lower()}" for h in ADDRESS}, {h: f"pd2h{tag}{h.lower()}"[:15] for h in ADDRESS}


def _make_hosts(tag: str) -> dict[str, str]:
    names, veth = _host_names(tag)
    try:
        _ip("netns", "add", names["A"])
        _ip("netns", "add", names["B"])
        _ip("link", "add", veth["A"], "type", "veth", "peer", "name", veth["B"])
        for h in ADDRESS:
            _ip("link", "set", veth[h], "netns", names[h])
            _ip("-n", names[h], "addr", "add", f"{ADDRESS[h]}/24", "dev", veth[h])
            _ip("-n", names[h], "link", "set", veth[h], "up")
            _ip("-n", names[h], "link", "set", "lo", "up")
    except BaseException:
        _remove_hosts(tag)
        raise
    return names


def _remove_hosts(tag: str) -> None:
    names, veth = _host_names(tag)
    for h in ADDRESS:
        _ip("netns", "del", names[h], check=False)  # takes its end of the veth pair with it
    _ip("link", "del", veth["A"], check=False)  # still here if it never moved into its namespace


def _remove_stale_hosts() -> None:
    """Namespaces an earlier run of this module left (its process killed before teardown)."""
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        m = re.match(r"(pd2h-(\d+)-[ab])\b", line)
        if m and not Path(f"/proc/{m.group(2)}").exists():
            _ip("netns", "del", m.group(1), check=False)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    why = _why_no_namespaces()
    if why:
        pytest.skip(f"two-host test skipped: {why}")
    pytest.importorskip("mooncake.store", reason="the recipes' transfer engine and store are Mooncake's")
    from pdserve.mem.storage.mooncake_store import master_binary

    _remove_stale_hosts()
    tag = str(os.getpid())
    try:
        names = _make_hosts(tag)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"two-host test skipped: `{' '.join(e.cmd)}` failed: {e.stderr.strip()}")
    workdir = Path(tempfile.mkdtemp(prefix="pdserve-two-hosts-"))
    c = Cluster(names, tag, workdir)
    try:
        (workdir / "secrets").mkdir(mode=0o700)
        (workdir / "secrets" / "pd-token").write_text(TOKEN + "\n")
        (workdir / "secrets" / "api-key").write_text(API_KEY + "\n")
        (workdir / "bin").mkdir()
        shim = workdir / "bin" / "pdserve"  # this checkout's pdserve, whatever is installed
        shim.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m pdserve "$@"\n')
        shim.chmod(0o755)
        (workdir / "bin" / "mooncake_master").symlink_to(master_binary())  # the wheel's, as the doc says
        yield c
    finally:
        c.close()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="module")
def reference():
    """The offline single-rank engine: what every recipe's greedy output must equal."""
    import pdserve

    engine = pdserve.Engine(model_path=MODEL, num_threads=1)
    answers: dict[tuple[int, ...], list[int]] = {}

    def answer(ids: list[int]) -> list[int]:
        if tuple(ids) not in answers:
            answers[tuple(ids)] = engine.generate(input_ids=ids, sampling_params=SAMPLING)["output_ids"]
        return answers[tuple(ids)]

    yield answer
    engine.shutdown()


def _start(c: Cluster, name: str, extra: Callable[[Step], tuple[str, ...]] = lambda s: ()) -> list[Step]:
    """Run section ``name`` of the doc (after the settings block), stopping whatever ran before."""
    if c.current == name:
        return recipe(SECTIONS[name])
    c.stop_all()
    steps = recipe(SECTIONS[name])
    prelude = settings(recipe(SECTIONS["pd"])) + (settings(steps) if name != "pd" else [])
    for step in commands(steps, "mooncake_master"):  # first, as on a cluster: the servers join it at start-up
        c.launch(prelude, step)
        c.wait_listening(step.host, ADDRESS[step.host], int(_option(step.words, "-rpc_port")))
    for step in commands(steps, "pdserve"):
        sizing = SIZING if step.words[:2] == ["pdserve", "serve"] else ()
        c.launch(prelude, step, (*sizing, *extra(step)))
    c.current = name
    return steps


def _url(step: Step) -> str:
    return f"http://{ADDRESS[step.host]}:{flag(step.words, '--port')}"


def _server(steps: list[Step], mode: str) -> Step:
    (step,) = [s for s in commands(steps, "pdserve", "serve") if flag(s.words, "--disaggregation-mode") == mode]
    return step


@pytest.fixture
def pd(cluster: Cluster) -> dict[str, Step]:
    """The P/D recipe running: prefill on A, decode and router on B."""
    steps = _start(cluster, "pd")
    (router,) = commands(steps, "pdserve", "router")
    parts = {"prefill": _server(steps, "prefill"), "decode": _server(steps, "decode"), "router": router}
    assert (parts["prefill"].host, parts["decode"].host, router.host) == ("A", "B", "B")
    for part in ("prefill", "decode", "router"):  # a client on host A: every request crosses the link
        cluster.wait_healthy("A", _url(parts[part]), router=part == "router")
    return parts


def test_pd_across_hosts_answers_as_colocated(cluster, pd, reference):
    router = _url(pd["router"])
    for ids in PROMPTS:
        got = cluster.post("A", router + "/generate", {"input_ids": ids, "sampling_params": SAMPLING})
        assert got.status_code == 200, got.text
        assert got.json()["output_ids"] == reference(ids), ids
    info = cluster.get("A", _url(pd["decode"]) + "/get_server_info").json()
    assert info["disaggregation_mode"] == "decode"
    counters = {k: info[k] for k in ("requests_disaggregated", "kv_received", "local_prefills", "fallbacks",
                                     "transfer_failures")}
    # every prompt's KV came from host A, none fell back
    assert counters["kv_received"] == len(PROMPTS) and counters["fallbacks"] == 0, f"{counters}\n{cluster.logs()}"


def _assert_bound_to(cluster: Cluster, host: str, allowed_wildcard: Callable[[int, int], bool]) -> list:
    found = cluster.listeners(host)
    assert found, f"no listener of ours on host {host}"
    for pid, address, port in found:
        if address != ADDRESS[host]:
            assert address in ("0.0.0.0", "*", "::") and allowed_wildcard(pid, port), (host, pid, address, port)
    return found


def _pids(cluster: Cluster, suffix: str) -> set[int]:
    """The process trees of what runs a command whose name ends with ``suffix``."""
    roots = {p.popen.pid for p in cluster.procs if p.name.endswith(suffix)}
    assert roots, suffix
    return roots | {d for pid in roots for d in descendants(pid)}


def _assert_only_engines_on_wildcards(cluster: Cluster, not_engines: set[int]) -> None:
    """Every socket of ours is on its host's address but Mooncake's transfer engines: wildcard
    ports in 15000-17000 held by P/D servers and store clients, never by ``not_engines``."""
    for host in ("A", "B"):
        found = _assert_bound_to(cluster, host, lambda pid, port: port in TRANSFER_ENGINE_PORTS
                                 and pid not in not_engines)
        assert [a for _, a, _ in found if a != ADDRESS[host]], \
            f"host {host}: no transfer engine seen, so the exception is not exercised"


def test_pd_listeners_bind_the_given_address_and_no_secret_shows(cluster, pd):
    _assert_only_engines_on_wildcards(cluster, _pids(cluster, "pdserve-router"))
    ports = {(a, p) for _, a, p in cluster.listeners("A")}
    assert {(ADDRESS["A"], 30001), (ADDRESS["A"], 8998)} <= ports  # HTTP and the bootstrap registry
    for p in cluster.procs:  # the recipe passes both secrets by environment: not in `ps`
        for pid in (p.popen.pid, *descendants(p.popen.pid)):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            assert TOKEN not in argv and API_KEY not in argv, argv.replace("\0", " ")


def test_a_peer_without_the_token_is_refused(cluster, pd):
    """From host B (where decode runs), prefill's registry on host A: unsigned, or signed with
    another token, is a 401; signed with the deployment's token, the records."""
    registry = f"{ADDRESS['A']}:{flag(pd['prefill'].words, '--disaggregation-bootstrap-port')}"

    def fetch(token: str | None) -> httpx.Response:
        headers = PeerAuth(token).sign("GET", "/bootstrap", b"", registry)
        return httpx.get(f"http://{registry}/bootstrap", headers=headers, timeout=10)

    for token in (None, "not-the-token"):
        refused = cluster.on("B", fetch, token)
        assert refused.status_code == 401 and refused.json()["kind"] == "unauthorized", refused.text
    assert cluster.on("B", fetch, TOKEN).json()["complete"] is True


def test_without_a_token_an_off_host_peer_is_refused(cluster):
    """What the token is for: without one, a registry bound to a host's address answers a peer on
    the other host 403, as it does any peer that does not come over loopback."""
    from pdserve.disagg.bootstrap import BootstrapServer

    server = cluster.on("A", lambda: BootstrapServer(ADDRESS["A"], 0, auth=PeerAuth(None)).start())
    try:
        url = f"http://{ADDRESS['A']}:{server.port}/bootstrap"
        for host in ("B", "A"):
            refused = cluster.on(host, httpx.get, url, timeout=10)
            assert refused.status_code == 403 and "disaggregation-auth-token" in refused.json()["error"], refused.text
        assert server.refused["auth"] == 2
    finally:
        server.stop()


# ------------------------------------------------------------------ one server over two hosts
def test_tp_over_two_hosts_answers_as_one_rank(cluster, reference):
    """Rank 0 on A (HTTP), rank 1 on B: the single-rank engine's answers; every listener on its
    host's address but torch's TCP store (node 0, the --dist-init-addr port: docs/security.md)."""
    steps = _start(cluster, "tp")
    nodes = {flag(s.words, "--node-rank"): s for s in commands(steps, "pdserve", "serve")}
    assert (nodes["0"].host, nodes["1"].host) == ("A", "B") and flag(nodes["0"].words, "--nnodes") == "2"
    url = _url(nodes["0"])
    cluster.wait_healthy("B", url)
    for ids in PROMPTS:
        got = cluster.post("B", url + "/generate", {"input_ids": ids, "sampling_params": SAMPLING})
        assert got.status_code == 200, got.text
        assert got.json()["output_ids"] == reference(ids), ids
    info = cluster.get("B", url + "/get_server_info").json()
    assert len(info["scheduler_pids"]) == 1  # rank 1 runs on host B
    store_port = int(flag(nodes["0"].words, "--dist-init-addr").rsplit(":", 1)[1])
    found = _assert_bound_to(cluster, "A", lambda pid, port: port == store_port)
    assert {(ADDRESS["A"], store_port + 1), (ADDRESS["A"], store_port + 2)} <= {(a, p) for _, a, p in found}
    _assert_bound_to(cluster, "B", lambda pid, port: False)  # node 1: gloo's sockets on B's address
    assert cluster.listeners("B"), "node 1 holds no socket: its rank did not join"


# ------------------------------------------------------------------ the hierarchical cache
def test_hicache_store_on_one_host_serves_the_other(cluster, reference):
    """Master and prefill on A, decode on B: decode writes turn 1 back into the store; turn 2's
    prefill on A loads that from the store (pages that crossed hosts, as written into a segment on
    one and read on the other); every output the offline engine's."""
    steps = _start(cluster, "hicache", lambda s: HICACHE_SIZING if s.words[:2] == ["pdserve", "serve"] else ())
    (master,) = commands(steps, "mooncake_master")
    assert master.host == "A"
    prefill, decode = _server(steps, "prefill"), _server(steps, "decode")
    assert (prefill.host, decode.host) == ("A", "B")
    (router,) = commands(recipe(SECTIONS["pd"]), "pdserve", "router")  # "and the router as above"
    cluster.launch(settings(recipe(SECTIONS["pd"])), router)
    for step in (prefill, decode, router):
        cluster.wait_healthy("A", _url(step), router=step is router)

    turn1 = PROMPTS[0]
    got = cluster.post("A", _url(router) + "/generate", {"input_ids": turn1, "sampling_params": SAMPLING}).json()
    assert got["output_ids"] == reference(turn1)
    deadline = time.monotonic() + 60
    while cluster.get("A", _url(decode) + "/get_server_info").json()["storage_puts"] < 2:
        assert time.monotonic() < deadline, f"decode wrote nothing back to the store\n{cluster.logs()}"
        time.sleep(0.25)
    turn2 = turn1 + got["output_ids"] + [40, 41, 42]
    got = cluster.post("A", _url(router) + "/generate", {"input_ids": turn2, "sampling_params": SAMPLING}).json()
    assert got["output_ids"] == reference(turn2)
    tiers = got["meta_info"]["cached_tokens_by_tier"]
    info = cluster.get("A", _url(prefill) + "/get_server_info").json()
    counters = {k: v for k, v in info.items() if k.startswith("storage_")}
    assert tiers["storage"] > 0, f"{tiers}; prefill's store: {counters}\n{cluster.logs()}"
    assert info["storage_bad_mac"] == 0 and info["storage_get_bytes"] > 0, counters  # pages signed under the token
    master_pids = _pids(cluster, "mooncake_master")
    _assert_only_engines_on_wildcards(cluster, master_pids | _pids(cluster, "pdserve-router"))
    assert {a for pid, a, _ in cluster.listeners("A") if pid in master_pids} == {ADDRESS["A"]}
