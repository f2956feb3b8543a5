"""``pdserve up``: a whole P/D deployment on one machine: prefill servers, decode servers and a
router in front, with the machine's cores split between prefill and decode.

Each server is an ordinary ``pdserve serve`` process (its own session, pinned to its cores, with
as many torch threads as cores); the router is ``pdserve router``. ``up`` waits until every
server answers /health, starts the router, prints its URL, and on Ctrl-C or SIGTERM (or when the
router dies) stops every process it started. A server that dies is logged and left to the router,
which serves without it (a dead prefill: decode prefills alone) and uses it again when it is back
(restarted by the operator on the same ports).

With ``--enable-hierarchical-cache`` every server gets the flag; the storage tier is wired per
deployment (docs/hicache.md, "Across P/D"): ``mooncake`` is the tier every server shares, so with
no ``master_server_address`` in the extra config ``up`` starts one ``mooncake_master`` before the
servers, hands its address to each of them and stops it after them; ``file`` takes one owner per
directory, so each server gets its own subdirectory (named after it) of ``--hicache-storage-dir``.

Secrets (the API key, the P/D token, the KV block hash key up makes) reach the children by
environment (``PDSERVE_API_KEY``, ``PDSERVE_DISAGGREGATION_AUTH_TOKEN``, ``PDSERVE_KV_HASH_KEY``),
never on a command line, which every local user can read in ``ps``; the command lines up logs hide
any secret flag all the same.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdserve.config import API_KEY_ENV, AUTH_TOKEN_ENV, KV_HASH_KEY_ENV
from pdserve.web.api_key import ADMIN_KEY_ENV

if TYPE_CHECKING:
    from pdserve.entrypoints.elastic import ElasticConfig
    from pdserve.mem.storage.mooncake_store import MooncakeMaster

logger = logging.getLogger(__name__)

HEALTH_POLL_S = 0.25
STOP_GRACE_S = 15.0
SECRET_FLAGS = ("--api-key", "--worker-api-key", "--disaggregation-auth-token")
WILDCARD_HOSTS = ("0.0.0.0", "::", "*", "")
# The one listener up cannot keep on --host: said once at start-up (info), documented in docs/security.md.
TRANSFER_ENGINE_WARNING = ("Mooncake's transfer engines listen on every interface whatever --host says (ports in "
                           "15000-17000, an RPC and a handshake port per engine; mooncake-transfer-engine 0.3.13 has "
                           "no bind setting): whoever reaches them can read the registered KV memory. Allow them "
                           "only from the P/D hosts (firewall recipe: docs/security.md)")


@dataclass(frozen=True)
class StorageTier:
    """The storage-tier flags ``up`` rewrites per server (``--hicache-storage-backend``,
    ``--hicache-storage-dir``, ``--hicache-storage-backend-extra-config``); None: not given."""

    backend: str | None = None
    directory: str | None = None
    extra_config: str | None = None  # a JSON object

    def __post_init__(self) -> None:
        if self.backend == "file" and not self.directory:
            raise ValueError("hicache_storage_dir (--hicache-storage-dir): needed with the file tier; up gives "
                             "each server its own subdirectory of it")
        extra = self.extra()
        if self.backend == "mooncake" and extra.get("start_master") and _named_master(extra):
            raise ValueError("hicache_storage_backend_extra_config: give master_server_address or start_master, "
                             "not both")

    def extra(self) -> dict[str, Any]:
        value = json.loads(self.extra_config) if self.extra_config else {}
        if not isinstance(value, dict):
            raise ValueError("hicache_storage_backend_extra_config (--hicache-storage-backend-extra-config): must "
                             "be a JSON object")
        return value

    @property
    def needs_master(self) -> bool:
        """Mooncake with no master named: up starts the one every server shares."""
        return self.backend == "mooncake" and not _named_master(self.extra())


def _named_master(extra: dict[str, Any]) -> bool:
    return bool(extra.get("master_server_address") or extra.get("master_server_addr"))


@dataclass(frozen=True)
class StoreMaster:
    """Where the servers find the ``mooncake_master`` up started."""

    address: str  # master_server_address
    metadata_server: str


def storage_flags(tier: StorageTier, server: str, master: StoreMaster | None) -> list[str]:
    """``server``'s storage-tier flags: its own file directory, or the shared master's address."""
    out: list[str] = []
    if tier.backend is not None:
        out += ["--hicache-storage-backend", tier.backend]
    if tier.directory:
        own = tier.backend == "file"  # one owner per directory: the file index is not shared
        out += ["--hicache-storage-dir", os.path.join(tier.directory, server) if own else tier.directory]
    extra = tier.extra()
    if master is not None:
        extra.pop("start_master", None)  # one master for the deployment, not one per server
        extra.update(master_server_address=master.address, metadata_server=master.metadata_server)
    if extra:
        out += ["--hicache-storage-backend-extra-config", json.dumps(extra)]
    return out


@dataclass(frozen=True)
class UpArgs:
    """A deployment: ``server_flags`` go to every server (model, memory, runtime flags)."""

    num_prefill: int = 1
    num_decode: int = 1
    host: str = "127.0.0.1"
    port: int = 30000  # the router; servers take the ports above it
    bootstrap_port: int = 8998  # prefill i's registry listens on bootstrap_port + i
    server_flags: tuple[str, ...] = ()
    router_policy: str = "cache_aware"
    api_key: str | None = field(default=None, repr=False)  # servers require it; the router too
    health_check_interval_secs: float = 5.0  # the router's
    startup_timeout_s: float = 600.0
    cores: tuple[int, ...] | None = None  # default: the cores this process may use
    elastic: ElasticConfig | None = None  # --elastic: a controller switches servers' roles (entrypoints/elastic.py)
    storage: StorageTier = field(default_factory=StorageTier)
    auth_token: str | None = field(default=None, repr=False)  # the P/D token, for the servers
    admin_api_key: str | None = field(default=None, repr=False)  # every child's, by the environment
    allow_no_api_key: bool = False  # --host beyond the loopback without --api-key (every child told so)
    # the KV block hash key, every child's by the environment (KV_HASH_KEY_ENV): events and the router's
    # matching agree, and hashes mean nothing to whoever lacks it. None: --kv-hash-key-file among the flags
    kv_hash_key: str | None = field(default=None, repr=False)

    def __post_init__(self):
        for name in ("num_prefill", "num_decode"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        last = self.port + self.num_prefill + self.num_decode
        if not 0 < self.port or last > 65535:
            raise ValueError(f"port: the router and its {self.num_prefill + self.num_decode} servers need "
                             f"ports {self.port}..{last}")
        boot_last = self.bootstrap_port + self.registries - 1
        if self.bootstrap_port <= last and self.port <= boot_last:
            # a registry and an HTTP server on one port: one of them never binds, or answers the other's requests
            raise ValueError(f"bootstrap_port: the bootstrap registries' ports {self.bootstrap_port}..{boot_last} "
                             f"overlap the router's and servers' {self.port}..{last}; pick another --bootstrap-port")

    @property
    def registries(self) -> int:
        """Bootstrap registries: one per prefill server (per server with --elastic: any may become prefill)."""
        return self.num_prefill + (self.num_decode if self.elastic is not None else 0)


@dataclass
class Child:
    name: str
    cmd: list[str]
    url: str  # polled for /health before the next stage starts
    cores: tuple[int, ...] | None
    proc: subprocess.Popen | None = None
    env: dict[str, str] = field(default_factory=dict, repr=False)  # secrets, added to up's own environment

    @property
    def process(self) -> subprocess.Popen:
        """Its process; every child is started before the deployment is watched or stopped."""
        if self.proc is None:
            raise RuntimeError(f"{self.name} was never started")
        return self.proc


def split_cores(cores: tuple[int, ...], num_prefill: int, num_decode: int) -> list[tuple[int, ...]]:
    """Cores per server, prefill servers first: the cores are shared out in proportion to the
    number of servers of each kind, at least one core each (servers share when there are too few)."""
    n = num_prefill + num_decode
    if len(cores) < n:
        return [(cores[i % len(cores)],) for i in range(n)]
    per, extra = divmod(len(cores), n)
    out, start = [], 0
    for i in range(n):
        k = per + (1 if i < extra else 0)
        out.append(tuple(cores[start:start + k]))
        start += k
    return out


def server_threads(cores: int, role: str, server_flags: tuple[str, ...]) -> int:
    """Torch threads of a server on ``cores`` cores of its own: less one for its HTTP frontend and,
    on a decode server, one for the overlapped scheduler thread (config.ThreadLayout); never zero."""
    overlap = role == "decode" and "--disable-overlap-schedule" not in server_flags
    return max(1, cores - 1 - overlap)


def plan(args: UpArgs, master: StoreMaster | None = None) -> list[Child]:
    """The servers then the router, with their command lines (pure: no process is started).
    ``master``: the shared store's master, which ``args.storage.needs_master`` says up starts."""
    if args.storage.needs_master and master is None:
        raise ValueError("hicache_storage_backend: mooncake needs a master; start it before planning the servers")
    cores = args.cores or tuple(sorted(os.sched_getaffinity(0)))
    shares = split_cores(cores, args.num_prefill, args.num_decode)
    py = [sys.executable, "-m", "pdserve"]
    children, prefill_urls, decode_urls = [], [], []
    for i in range(args.num_prefill + args.num_decode):
        role = "prefill" if i < args.num_prefill else "decode"
        port = args.port + 1 + i
        url = f"http://{args.host}:{port}"
        cmd = [*py, "serve", *args.server_flags, "--host", args.host, "--port", str(port),
               "--disaggregation-mode", role, *(["--allow-no-api-key"] if args.allow_no_api_key else [])]
        if "--num-threads" not in args.server_flags:
            cmd += ["--num-threads", str(server_threads(len(shares[i]), role, args.server_flags))]
        boot = args.bootstrap_port + i  # elastic: every server's, for when it becomes prefill
        if role == "prefill" or args.elastic is not None:
            cmd += ["--disaggregation-bootstrap-port", str(boot)]
            cmd += kv_events_flags(args)
        if role == "prefill":
            prefill_urls.append((url, boot))
        else:
            decode_urls.append(url)
        name = f"{role}-{i if role == 'prefill' else i - args.num_prefill}"
        cmd += storage_flags(args.storage, name, master)
        children.append(Child(name, cmd, url, shares[i], env=secrets_env(args)))
    router = [*py, "router", "--host", args.host, "--port", str(args.port), "--policy", args.router_policy,
              "--health-check-interval-secs", f"{args.health_check_interval_secs:g}",
              *(["--allow-no-api-key"] if args.allow_no_api_key else [])]
    for url, boot in prefill_urls:
        router += ["--prefill", url, str(boot)]
    for url in decode_urls:
        router += ["--decode", url]
    if "--kv-hash-key-file" in args.server_flags:  # the operator's key: the router hashes prompts with it too
        router += ["--kv-hash-key-file", args.server_flags[args.server_flags.index("--kv-hash-key-file") + 1]]
    children.append(Child("router", router, f"http://{args.host}:{args.port}", None,
                          env=secrets_env(args)))
    return children


def kv_events_flags(args: UpArgs) -> list[str]:
    """A prefill's ``--kv-events-config`` when the router routes cache-aware: the events on a free port
    of the server's ``--host`` (loopback when that is a wildcard: up's router is on this machine),
    never every interface (docs/security.md). None when given among the server flags (the operator's
    own), with ``--dp-size`` > 1 (a server publishes one group's events) or on an IPv6 ``--host`` (the
    publisher's socket is IPv4 only): the router then routes on its own guess of each cache."""
    flags = args.server_flags
    if args.router_policy != "cache_aware" or "--kv-events-config" in flags:
        return []
    if "--dp-size" in flags and flags[flags.index("--dp-size") + 1] != "1":
        return []
    host = "127.0.0.1" if args.host in WILDCARD_HOSTS else args.host
    if ":" in host:
        return []
    return ["--kv-events-config", json.dumps({"publisher": "zmq", "endpoint": f"tcp://{host}:*"})]


def secrets_env(args: UpArgs) -> dict[str, str]:
    """A child's secrets, as environment variables: the API and admin keys and the P/D token for all
    (the router signs the bootstrap fields it adds with the token)."""
    env = {API_KEY_ENV: args.api_key} if args.api_key else {}
    if args.admin_api_key:  # the children take it as --admin-api-key's default
        env[ADMIN_KEY_ENV] = args.admin_api_key
    if args.auth_token:
        env[AUTH_TOKEN_ENV] = args.auth_token
    if args.kv_hash_key:
        env[KV_HASH_KEY_ENV] = args.kv_hash_key
    return env


def ports_in_use(args: UpArgs) -> list[int]:
    ports = [args.port + i for i in range(1 + args.num_prefill + args.num_decode)]
    ports += [args.bootstrap_port + i for i in range(args.registries)]
    busy = []
    for port in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((args.host, port))
            except OSError:
                busy.append(port)
    return busy


class Deployment:
    """Starts, watches and stops the children of ``plan(args)``."""

    def __init__(self, args: UpArgs):
        self.args = args
        self.children: list[Child] = []  # planned by start, once the store's master (if any) is up
        self.master: MooncakeMaster | None = None  # the shared store's master, when up started one
        self.stopping = False

    def start(self) -> None:
        """The store's master (when up owns one), the servers (all at once), then the router once
        every server is healthy."""
        self.children = plan(self.args, self._start_master())
        servers, router = self.children[:-1], self.children[-1]
        for child in servers:
            self._spawn(child)
        self._wait_healthy(servers)
        self._spawn(router)
        self._wait_healthy([router])

    def _start_master(self) -> StoreMaster | None:
        if not self.args.storage.needs_master:
            return None
        from pdserve.mem.storage.mooncake_store import MooncakeMaster

        master = self.master = MooncakeMaster(self.args.host)  # kept before start: stop() cleans up either way
        master.start()
        logger.info("started mooncake_master at %s (log: %s)", master.address, master.log_path)
        return StoreMaster(master.address, master.metadata_server)

    def _spawn(self, child: Child) -> None:
        cores = child.cores

        def pin():  # runs in the child before exec: its cores (the frontend shares them)
            if cores:
                os.sched_setaffinity(0, cores)

        logger.info("starting %s%s: %s", child.name, f" on cores {list(cores)}" if cores else "",
                    _shown(child.cmd))
        child.proc = subprocess.Popen(child.cmd, start_new_session=True, preexec_fn=pin,
                                      env={**os.environ, **child.env})

    def _wait_healthy(self, children: list[Child]) -> None:
        deadline = time.monotonic() + self.args.startup_timeout_s
        waiting = list(children)
        while waiting:
            if self.stopping:
                raise InterruptedError("stopped during start-up")
            dead = self.dead_child()
            if dead is not None:
                raise RuntimeError(f"{dead.name} exited with code {dead.process.returncode} during start-up")
            waiting = [c for c in waiting if not _healthy(c.url)]
            if waiting and time.monotonic() > deadline:
                raise RuntimeError(f"{', '.join(c.name for c in waiting)} not healthy after "
                                   f"{self.args.startup_timeout_s:.0f} s")
            if waiting:
                time.sleep(HEALTH_POLL_S)

    def dead_child(self) -> Child | None:
        return next((c for c in self.children if c.proc is not None and c.proc.poll() is not None), None)

    def watch(self) -> int:
        """Until a signal (-> 0) or the router's death (-> 1); a server's death is logged once."""
        reported: set[str] = set()
        router = self.children[-1]
        while not self.stopping:
            if router.process.poll() is not None:
                logger.error("router exited with code %s; stopping the deployment", router.process.returncode)
                return 1
            if self.master is not None and not self.master.alive() and "master" not in reported:
                reported.add("master")
                logger.error("mooncake_master exited; the servers serve without the shared store (its hits are "
                             "misses) until the deployment is restarted")
            for c in self.children[:-1]:
                if c.process.poll() is not None and c.name not in reported:
                    reported.add(c.name)
                    logger.error("%s exited with code %s; the router serves without it (restart it with: %s)",
                                 c.name, c.process.returncode, _shown(c.cmd))
            time.sleep(HEALTH_POLL_S)
        return 0

    def stop(self) -> None:
        """SIGTERM to the router, and once it has exited (or after a grace period) to every server,
        then SIGKILL what is left after a grace period. The router goes first so that it does not see
        its workers go away (that would be an outage to report). The signal goes to each child alone,
        not its process group: a server stops its own scheduler processes in order (a scheduler
        killed under its frontend would look like a crash)."""
        self.stopping = True
        started = [(c.name, c.proc) for c in reversed(self.children) if c.proc is not None]
        deadline = time.monotonic() + STOP_GRACE_S
        for i, (name, proc) in enumerate(started):
            _signal(proc, signal.SIGTERM)
            if i == 0 and name == "router":
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass  # the servers stop all the same; the router is killed below
        for name, proc in started:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop in time; killing it", name)
        for _, proc in started:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
        if self.master is not None:  # last: the servers' store clients leave it while it still answers
            self.master.stop()
            self.master = None


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _shown(cmd: list[str]) -> str:
    """A command line for the log, the value of every secret flag hidden (``--flag value`` or ``--flag=value``)."""
    shown = []
    for i, a in enumerate(cmd):
        name = a.split("=", 1)[0]
        if i and cmd[i - 1] in SECRET_FLAGS:
            a = "***"
        elif name in SECRET_FLAGS and "=" in a:
            a = f"{name}=***"
        shown.append(a)
    return " ".join(shown)


def _signal(proc: subprocess.Popen, sig: int) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)


def _healthy(url: str) -> bool:
    """False until ``url`` answers /health with 200. Before the server listens, a probe from an
    ephemeral port equal to the server's may connect to itself and read its own request back
    (not HTTP): that too is "not yet", not a reason to stop the deployment."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            return resp.status == 200
    except (OSError, http.client.HTTPException):
        return False


def launch_up(args: UpArgs) -> int:
    """Run the deployment until Ctrl-C/SIGTERM (-> 0) or a failure (-> 1)."""
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s up] %(levelname)s %(message)s")
    busy = ports_in_use(args)
    if busy:
        logger.error("port: %s already in use (pick another --port / --bootstrap-port)",
                     ", ".join(map(str, busy)))
        return 1
    dep = Deployment(args)
    # every server runs Mooncake (SERVER_TRANSFER_BACKENDS). Said at info: it is true of every run, documented
    # (docs/security.md), and a warning on every clean start would teach operators to skip warnings.
    logger.info("%s", TRANSFER_ENGINE_WARNING)

    def on_signal(_sig, _frame):
        dep.stopping = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    code = 0
    controller = None
    try:
        dep.start()
        print(f"pdserve is up: {dep.children[-1].url} (router -> {args.num_prefill} prefill, "
              f"{args.num_decode} decode{', elastic' if args.elastic else ''})", flush=True)
        if args.elastic is not None:
            from pdserve.entrypoints.elastic import Controller

            if args.num_prefill + args.num_decode == 2:
                logger.warning("elastic: with 2 servers the split stays 1P1D (each role keeps one); give "
                               "--num-servers 3 or more")

            controller = Controller(dep.children[-1].url or "", args.elastic, args.api_key,
                                    args.admin_api_key).start()
        code = dep.watch()
    except InterruptedError:
        pass
    except RuntimeError as e:
        logger.error("%s", e)
        code = 1
    finally:
        if controller is not None:
            controller.stop()
        dep.stop()
    return code

