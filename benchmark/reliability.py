"""Failure drills against real servers on loopback; regenerates docs/reliability.md.

    PYTHONPATH=python python3 benchmark/reliability.py                  # every scenario, 10-minute soak
    PYTHONPATH=python python3 benchmark/reliability.py --scenarios malformed,duplicate_rooms \\
        --requests 3 --soak-s 5 --out /tmp/reliability.md --json /tmp/reliability.json

One prefill, two decodes and a ``pdserve router`` in front (tiny-llama, page size 4, greedy,
real Mooncake over TCP, an HMAC token shared by the servers). Each scenario sends requests
through the router (or straight to a server where the scenario needs it), breaks something while
they are in flight, and then classifies every request:

- completed: a normal finish; its tokens are compared with a colocated ``pdserve.Engine`` run of
  the same prompt (a difference is a wrong token);
- failed with a clear error: HTTP 4xx/5xx with a message, an abort finish reason with a message,
  or a stream's error event;
- unclear: anything else the client saw (a dropped connection, a stream that just stops);
- hung: no answer within ``--hung-s``.

After each scenario every live server must come back to idle: free + cached pages == total and
every P/D resource count zero (rooms, quarantine, aux rows, transfer batches); what is still held
after ``--idle-s`` counts as leaked. The failover rate is completed / (completed + failed) among
the requests that were in flight while the fault lasted. Rows that must be zero and are not are
flagged in the report.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
import servers  # noqa: E402  (benchmark/servers.py, beside this script)

MODEL = "tiny-llama"
NEW = 12  # tokens per request
STREAM_NEW = 64  # per streamed request (long enough to be mid-stream when a decode dies)
VICTIM_NEW = 256  # api_abuse's victim stream: still running when another client tries to abort it
BIG_PROMPTS = 24  # api_abuse's call of many prompts (within --max-seqs-per-request)
CLIENT_TOKEN = "X-Client-Token"  # a client's own secret: only its owner may abort a request (docs/security.md)
FLAGS = ("--page-size", "4", "--max-total-tokens", "8192", "--num-threads", "1", "--log-level", "warning")
PD_TIMEOUT_S = 10  # --disaggregation-timeout-s of both sides (decode's quarantine lease is twice this)
HEARTBEAT_S = 0.5
PAUSE_S = 3.0  # SIGSTOP length: several heartbeats, so decode reaches its death verdict
SLOW = "delay_posts=1.5"  # prefill's writes reach the network late: transfers stay in flight
LOSSY = "fail_rate=0.05,delay_rate=0.05,delay_s=2,seed=7"
# Mirrors test/entrypoints/server_utils.IDLE_ZERO (test/bench/test_reliability.py checks they agree).
IDLE_ZERO = ("num_waiting_for_kv", "num_pending_kv", "quarantined_pages", "quarantine_entries", "aux_rows_in_use",
             "transfer_batches_in_flight", "rooms_waiting", "rooms_transferring", "rooms_open")
SCENARIOS = ("prefill_kill9", "prefill_sigstop", "decode_sigstop", "decode_kill9", "malformed", "duplicate_rooms",
             "lossy_writes", "soak", "replayed_bootstrap", "replayed_control_frame", "api_abuse", "hostile_client",
             "cache_privacy")
STANDALONE = ("cache_privacy",)  # scenarios that start their own servers (no cluster, no reference run)
HOSTILE_DEPTH = 3000  # a json_schema nested past Python's stack (issue 33)
HOSTILE_STOPS = 16, 256  # the most and longest stop strings a request may have (engine/request.py)
HOSTILE_SCHEMAS = 10  # clients that each send a large schema and hang up at once
VICTIM_SAMPLES = 5  # victim requests per phase (their median latency is reported)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated, from: " + ", ".join(SCENARIOS))
    p.add_argument("--requests", type=int, default=8, help="requests per fault scenario (lossy_writes: 8x)")
    p.add_argument("--soak-s", type=float, default=600.0, help="length of the soak")
    p.add_argument("--soak-concurrency", type=int, default=4)
    p.add_argument("--sample-s", type=float, default=5.0, help="soak: seconds between RSS and page samples")
    p.add_argument("--hung-s", type=float, default=90.0, help="a request with no answer after this is hung")
    p.add_argument("--idle-s", type=float, default=4.0 * PD_TIMEOUT_S,
                   help="how long a server may take to release everything after a scenario")
    p.add_argument("--decodes", type=int, default=2, help="decode servers behind the router")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="docs/reliability.md")
    p.add_argument("--json", default=None, help="also write the rows as JSON here")
    a = p.parse_args(argv)
    unknown = set(a.scenarios.split(",")) - set(SCENARIOS)
    if unknown:
        p.error(f"--scenarios: unknown {sorted(unknown)} (known: {', '.join(SCENARIOS)})")
    return a


# --- processes -------------------------------------------------------------------------------------


class Node:
    """One ``pdserve`` process (server or router) on a fixed port, so it can be killed and
    restarted where its peers expect it. Output goes to a temporary log, shown on failure."""

    def __init__(self, name: str, args: list[str], port: int, env: dict | None = None):
        self.name, self.args, self.port, self.env = name, args, port, env
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile(prefix=f"reliability-{name}-", suffix=".log", delete=False)
        self.proc: subprocess.Popen | None = None

    def start(self, env: dict | None = None) -> Node:
        self.env = self.env if env is None else env
        self.proc = servers.start(self.args, env=self.env, log=self.log)
        try:
            servers.wait_healthy(self.url, self.proc, timeout=300)
        except RuntimeError as e:
            raise RuntimeError(f"{self.name}: {e}\n{self.tail()}") from None
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def info(self) -> dict:
        r = httpx.get(self.url + "/get_server_info", timeout=10)
        r.raise_for_status()
        return r.json()

    def kill9(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def pause(self, seconds: float) -> None:
        """SIGSTOP the whole process group (frontend and scheduler), SIGCONT ``seconds`` later."""
        os.killpg(self.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(seconds)  # the pause is the drill itself
        finally:
            os.killpg(self.proc.pid, signal.SIGCONT)

    def pids(self) -> list[int]:
        """The process group's live processes (frontend, scheduler, their helpers)."""
        out = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                except OSError:
                    continue
                fields = stat[stat.rindex(")") + 2:].split()
                if fields[0] != "Z" and self.proc is not None and int(fields[2]) == self.proc.pid:
                    out.append(int(entry.name))
        return out

    def rss_mib(self) -> float:
        total = 0
        for pid in self.pids():
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
            except OSError:
                pass
        return total / 1024

    def stop(self) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGCONT)  # a paused server cannot act on SIGTERM
            except ProcessLookupError:
                pass
            servers.stop(self.proc)

    def tail(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-4000:]

    def close(self) -> None:
        self.stop()
        self.log.close()
        os.unlink(self.log.name)


class Cluster:
    """A prefill, ``decodes`` decode servers and a router; every process is stopped by ``close``."""

    def __init__(self, token: str, decodes: int = 2):
        self.token = token
        auth = ("--disaggregation-auth-token", token)
        pd = ("--disaggregation-timeout-s", str(PD_TIMEOUT_S), "--disaggregation-heartbeat-s", str(HEARTBEAT_S))
        self.boot = servers.free_port()
        port = servers.free_port()
        self.prefill = Node("prefill", ["serve", "--model-path", MODEL, "--port", str(port), *FLAGS, *auth, *pd,
                                        "--disaggregation-mode", "prefill",
                                        "--disaggregation-bootstrap-port", str(self.boot)], port)
        self.decodes = []
        for i in range(decodes):
            port = servers.free_port()
            # the drills that send a routed pair straight to the servers (no router to sign it) name this
            # prefill, which decode is told to trust unsigned
            allow = ("--disaggregation-bootstrap-allow", f"127.0.0.1:{self.boot}")
            self.decodes.append(Node(f"decode{i}", ["serve", "--model-path", MODEL, "--port", str(port), *FLAGS,
                                                    *auth, *pd, *allow, "--disaggregation-mode", "decode"], port))
        port = servers.free_port()
        self.router = Node("router", ["router", "--port", str(port), "--prefill", self.prefill.url, str(self.boot),
                                      *[a for d in self.decodes for a in ("--decode", d.url)], *auth,
                                      "--health-check-interval-secs", "1", "--health-check-timeout-secs", "2",
                                      "--log-level", "warning"], port)

    @property
    def servers(self) -> list[Node]:
        return [self.prefill, *self.decodes]

    def start(self, prefill_faults: str) -> None:
        with ThreadPoolExecutor(len(self.servers)) as pool:
            futures = [pool.submit(self.prefill.start, _faults_env(prefill_faults)),
                       *[pool.submit(d.start) for d in self.decodes]]
            for f in futures:
                f.result()
        self.router.start()

    def restart_prefill(self, faults: str) -> None:
        self.prefill.stop()
        self.prefill.start(_faults_env(faults))
        self.wait_router_sees_all()

    def wait_router_sees_all(self, timeout: float = 60.0) -> None:
        """Until the router's health checks found every worker healthy again."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                r = httpx.get(self.router.url + "/metrics", timeout=5)
                gauges = [ln for ln in r.text.splitlines() if "worker_healthy{" in ln]
                if r.status_code == 200 and gauges and all(float(ln.split()[-1]) == 1 for ln in gauges):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)

    def close(self) -> None:
        for n in (self.router, *self.servers):
            n.close()


COUNTERS = {"decode": ("kv_received", "fallbacks", "transfer_failures", "local_prefills", "duplicate_rooms",
                       "stale_messages", "control_refused"),
            "prefill": ("rooms_completed", "rooms_failed", "rooms_aborted", "rooms_expired", "rooms_dropped",
                        "kv_requests_refused", "stale_messages", "control_refused")}


def counters(cluster: Cluster) -> dict[str, tuple[int, dict]]:
    """Each live server's (pid, counters), to show what the servers did during a scenario."""
    out = {}
    for node in cluster.servers:
        try:
            info = node.info()
        except httpx.HTTPError:  # dead or stopped: reported by the scenario's exit check
            continue
        out[node.name] = (node.proc.pid, {k: info.get(k, 0) for k in COUNTERS[info["disaggregation_mode"]]})
    return out


def exits(cluster: Cluster) -> list[str]:
    """Processes that exited without the drill asking (every drill restarts what it kills)."""
    return [f"{n.name} exited with code {n.proc.returncode}" for n in (cluster.router, *cluster.servers)
            if n.proc is not None and not n.alive()]


def counter_notes(before: dict, after: dict) -> list[str]:
    notes = []
    for name, (pid, now) in after.items():
        then = before.get(name)
        restarted = then is None or then[0] != pid
        base = {} if restarted else then[1]
        moved = [f"{k} +{v - base.get(k, 0)}" for k, v in now.items() if v - base.get(k, 0)]
        notes.append(f"{name} counters{' (restarted: since its restart)' if restarted else ''}: "
                     + (", ".join(moved) or "no change"))
    return notes


def _large_schema(fields: int, variant: str) -> str:
    """An object of ``fields`` properties (strings with a pattern, bounded integers) that each compile anew."""
    props = {f"{variant}_{i}": {"type": "string", "pattern": "^[a-z]{1,12}$"} if i % 2 else
             {"type": "integer", "minimum": 0, "maximum": 10_000} for i in range(fields)}
    return json.dumps({"type": "object", "properties": props, "required": list(props)})


def _faults_env(spec: str) -> dict:
    return {"PDSERVE_TRANSFER_FAULTS": spec} if spec else {}


# --- requests and their outcomes ---------------------------------------------------------------------


@dataclass
class Outcome:
    kind: str  # "completed", "failed", "unclear", "hung"
    detail: str = ""
    wrong: bool = False
    start: float = 0.0
    end: float = 0.0


def _greedy(n: int) -> dict:
    return {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}


class Client:
    """Sends /generate and classifies the answer against the colocated reference."""

    def __init__(self, refs: dict[tuple, list[int]], hung_s: float):
        self.refs, self.hung_s = refs, hung_s

    def generate(self, url: str, prompt: list[int], n: int = NEW, extra: dict | None = None,
                 tokens: bool = True) -> Outcome:
        """``tokens`` False: a prefill server's half of a request (it answers with no tokens)."""
        body = {"input_ids": prompt, "sampling_params": _greedy(n), **(extra or {})}
        start = time.monotonic()
        try:
            r = httpx.post(url + "/generate", json=body, timeout=self.hung_s)
        except httpx.TimeoutException:
            return Outcome("hung", f"no answer in {self.hung_s} s", start=start, end=time.monotonic())
        except httpx.HTTPError as e:
            return Outcome("unclear", f"{type(e).__name__}: {e}", start=start, end=time.monotonic())
        out = self._classify_response(r, prompt, n if tokens else None)
        out.start, out.end = start, time.monotonic()
        if out.wrong:
            out.detail = f"POST {url}/generate {json.dumps(extra or {})}: {out.detail}"
        return out

    def stream(self, url: str, prompt: list[int], n: int = STREAM_NEW) -> Outcome:
        body = {"input_ids": prompt, "sampling_params": _greedy(n), "stream": True}
        start, last, error = time.monotonic(), None, None
        try:
            with httpx.stream("POST", url + "/generate", json=body, timeout=self.hung_s) as r:
                if r.status_code != 200:
                    r.read()
                    out = self._classify_response(r, prompt, n)
                    out.start, out.end = start, time.monotonic()
                    return out
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        event = json.loads(line[len("data: "):])
                        if "error" in event:
                            error = event["error"]
                        else:
                            last = event
        except httpx.TimeoutException:
            return Outcome("hung", f"stream silent for {self.hung_s} s", start=start, end=time.monotonic())
        except httpx.HTTPError as e:
            return Outcome("unclear", f"stream broke: {type(e).__name__}: {e}", start=start, end=time.monotonic())
        if error is not None:
            msg = error.get("message", "") if isinstance(error, dict) else str(error)
            kind = "failed" if msg else "unclear"
            return Outcome(kind, f"stream error event: {msg[:200]}", start=start, end=time.monotonic())
        out = self._classify_final(last, prompt, n)
        out.start, out.end = start, time.monotonic()
        return out

    def _classify_response(self, r: httpx.Response, prompt, n) -> Outcome:
        if r.status_code >= 400:
            msg = _error_message(r)
            return Outcome("failed" if msg else "unclear", f"HTTP {r.status_code}: {msg[:200]}")
        try:
            body = r.json()
        except ValueError:
            return Outcome("unclear", f"HTTP {r.status_code} with a body that is not JSON")
        return self._classify_final(body, prompt, n)

    def _classify_final(self, body, prompt, n) -> Outcome:
        if not isinstance(body, dict) or not isinstance(body.get("meta_info"), dict):
            return Outcome("unclear", f"no final event / meta_info: {str(body)[:200]}")
        reason = body["meta_info"].get("finish_reason") or {}
        if reason.get("type") == "abort":
            msg = reason.get("message") or ""
            return Outcome("failed" if msg else "unclear", f"abort: {msg[:200]}")
        if reason.get("type") not in ("length", "stop"):
            return Outcome("unclear", f"finish_reason {reason}")
        if n is None:
            return Outcome("completed")
        got = body.get("output_ids")
        want = self.refs[(tuple(prompt), n)]
        return Outcome("completed", wrong=got != want,
                       detail="" if got == want else f"got {got[:8]}.. want {want[:8]}..")


def _error_message(r: httpx.Response) -> str:
    try:
        body = r.json()
    except ValueError:
        return r.text.strip()
    err = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(err, dict):
        return str(err.get("message") or "")
    return str(err or "")


# --- per-scenario accounting ---------------------------------------------------------------------------


@dataclass
class Row:
    name: str
    title: str
    outcomes: list[Outcome] = field(default_factory=list)
    hit: list[Outcome] = field(default_factory=list)  # in flight while the fault lasted
    leaked: dict = field(default_factory=dict)  # server -> what was still held
    notes: list[str] = field(default_factory=list)
    extra: dict = field(default_factory=dict)
    crashed: str = ""  # the drill itself failed (an expected state never came): flagged
    unrefused: list[str] = field(default_factory=list)  # requests the servers had to refuse and did not: flagged

    def count(self, kind: str, among: list[Outcome] | None = None) -> int:
        return sum(o.kind == kind for o in (self.outcomes if among is None else among))

    @property
    def wrong(self) -> int:
        return sum(o.wrong for o in self.outcomes)

    @property
    def leaked_pages(self) -> int:
        return sum(v.get("pages", 0) + sum(v.get("counts", {}).values()) for v in self.leaked.values())

    @property
    def failover(self) -> float | None:
        done, failed = self.count("completed", self.hit), self.count("failed", self.hit) + self.count(
            "unclear", self.hit) + self.count("hung", self.hit)
        return done / (done + failed) if done + failed else None

    def summary(self) -> dict:
        return {"scenario": self.name, "sent": len(self.outcomes), "completed": self.count("completed"),
                "failed_clear": self.count("failed"), "unclear": self.count("unclear"), "hung": self.count("hung"),
                "wrong_tokens": self.wrong, "leaked": self.leaked_pages, "hit_by_fault": len(self.hit),
                "failover_rate": self.failover}

    def flags(self) -> list[str]:
        s = self.summary()
        bad = [f"{k}={s[k]}" for k in ("hung", "wrong_tokens", "leaked", "unclear") if s[k]]
        if self.crashed:
            bad.append(f"drill crashed: {self.crashed[:300]}")
        if self.unrefused:
            bad.append(f"not refused: {'; '.join(self.unrefused)[:300]}")
        if s["failover_rate"] is not None and s["failover_rate"] < 0.99:
            bad.append(f"failover_rate={s['failover_rate']:.0%} < 99%")
        return bad


def in_window(outcomes: list[Outcome], t0: float, t1: float) -> list[Outcome]:
    """The requests in flight at some moment of [t0, t1]."""
    return [o for o in outcomes if o.start <= t1 and o.end >= t0]


def check_idle(node: Node, timeout: float) -> dict | None:
    """None once ``node`` is idle with everything returned; else what it still holds at ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        info = node.info()
        pages = info["total_pages"] - info["free_pages"] - info["cached_pages"]
        counts = {k: info[k] for k in IDLE_ZERO if info.get(k)}
        busy = info["num_running_reqs"] + info["num_waiting_reqs"]
        if not pages and not counts and not busy:
            return None
        if time.monotonic() > deadline:
            return {"pages": pages, "counts": counts, "busy": busy}
        time.sleep(0.2)


def settle(row: Row, cluster: Cluster, idle_s: float) -> None:
    for node in cluster.servers:
        if node.alive():
            held = check_idle(node, idle_s)
            if held:
                row.leaked[node.name] = held


def wait_until(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _in_transfer(cluster: Cluster, n: int) -> bool:
    return sum(d.info()["num_waiting_for_kv"] for d in cluster.decodes) >= n


# --- scenarios ----------------------------------------------------------------------------------------


class Drills:
    def __init__(self, a: argparse.Namespace, cluster: Cluster, client: Client, prompts: list[list[int]],
                 streams: list[list[int]]):
        self.a, self.cluster, self.client = a, cluster, client
        self.prompts, self.streams = prompts, streams
        self.rng = random.Random(a.seed)
        self.faults = SLOW

    def _prefill_faults(self, spec: str) -> None:
        if self.faults != spec:
            self.cluster.restart_prefill(spec)
            self.faults = spec

    def _burst(self, pool: ThreadPoolExecutor, n: int, stream: bool = False) -> list:
        url = self.cluster.router.url
        if stream:
            return [pool.submit(self.client.stream, url, self.streams[i % len(self.streams)]) for i in range(n)]
        return [pool.submit(self.client.generate, url, self.rng.choice(self.prompts)) for _ in range(n)]

    def prefill_kill9(self) -> Row:
        row = Row("prefill_kill9", "kill -9 of the prefill mid-transfer, then a restart")
        self._prefill_faults(SLOW)
        n = self.a.requests
        with ThreadPoolExecutor(n) as pool:
            futures = self._burst(pool, n)
            wait_until(lambda: _in_transfer(self.cluster, 1), 60, "KV in flight")
            waiting = sum(d.info()["num_waiting_for_kv"] for d in self.cluster.decodes)
            t0 = time.monotonic()
            self.cluster.prefill.kill9()
            t1 = time.monotonic()
            during = [f.result() for f in futures]
        row.outcomes += during
        row.hit = in_window(during, t0, t1)
        row.notes.append(f"{waiting} requests were waiting for KV on the decodes at the kill")
        # With the prefill gone, new requests (router: degraded, decode prefills locally).
        with ThreadPoolExecutor(n) as pool:
            row.outcomes += [f.result() for f in self._burst(pool, max(2, n // 2))]
        self.cluster.prefill.start()
        self.cluster.wait_router_sees_all()
        before = sum(d.info()["kv_received"] for d in self.cluster.decodes)
        with ThreadPoolExecutor(n) as pool:
            row.outcomes += [f.result() for f in self._burst(pool, max(2, n // 2))]
        received = sum(d.info()["kv_received"] for d in self.cluster.decodes) - before
        row.notes.append(f"after the restart, {received} of {max(2, n // 2)} requests received their KV from "
                         "the restarted prefill (the rest prefilled on decode)")
        settle(row, self.cluster, self.a.idle_s)
        return row

    def prefill_sigstop(self) -> Row:
        row = Row("prefill_sigstop", f"SIGSTOP of the prefill for {PAUSE_S:g} s mid-transfer, then SIGCONT")
        self._prefill_faults(SLOW)
        n = self.a.requests
        with ThreadPoolExecutor(n) as pool:
            futures = self._burst(pool, n)
            wait_until(lambda: _in_transfer(self.cluster, 1), 60, "KV in flight")
            t0 = time.monotonic()
            self.cluster.prefill.pause(PAUSE_S)
            t1 = time.monotonic()
            row.outcomes += [f.result() for f in futures]
        row.hit = in_window(row.outcomes, t0, t1)
        self._after(row)
        return row

    def decode_sigstop(self) -> Row:
        row = Row("decode_sigstop", f"SIGSTOP of a decode for {PAUSE_S:g} s mid-transfer, then SIGCONT")
        self._prefill_faults(SLOW)
        n = self.a.requests
        with ThreadPoolExecutor(n) as pool:
            futures = self._burst(pool, n)
            wait_until(lambda: _in_transfer(self.cluster, 1), 60, "KV in flight")
            victim = max(self.cluster.decodes, key=lambda d: d.info()["num_waiting_for_kv"])
            t0 = time.monotonic()
            victim.pause(PAUSE_S)
            t1 = time.monotonic()
            row.outcomes += [f.result() for f in futures]
        row.hit = in_window(row.outcomes, t0, t1)
        row.notes.append(f"paused {victim.name}")
        self._after(row)
        return row

    def decode_kill9(self) -> Row:
        row = Row("decode_kill9", "kill -9 of a decode mid-stream (through the router), then a restart")
        n = self.a.requests
        with ThreadPoolExecutor(n) as pool:
            futures = self._burst(pool, n, stream=True)
            wait_until(lambda: any(d.info()["num_running_reqs"] for d in self.cluster.decodes), 120, "streams")
            victim = max(self.cluster.decodes, key=lambda d: d.info()["num_running_reqs"])
            on_victim = victim.info()["num_running_reqs"]
            t0 = time.monotonic()
            victim.kill9()
            t1 = time.monotonic()
            row.outcomes += [f.result() for f in futures]
        row.hit = in_window(row.outcomes, t0, t1)
        seen = sorted({o.detail[:120] for o in row.hit if o.kind != "completed"})
        row.notes.append(f"killed {victim.name} with {on_victim} streams running on it; what the clients of the "
                         f"{len(row.hit)} streams in flight saw: {'; '.join(seen) or 'nothing wrong'}")
        row.notes.append("`pdserve router` on this branch has no decode failover yet: a stream on the killed decode "
                         "ends with an error event (counted as failed with a clear error, never as completed)")
        victim.start()
        self.cluster.wait_router_sees_all()
        with ThreadPoolExecutor(n) as pool:
            row.outcomes += [f.result() for f in self._burst(pool, max(2, n // 2))]
        self._after(row)
        return row

    def lossy_writes(self) -> Row:
        row = Row("lossy_writes", "5% of KV write batches dropped (reported failed), 5% delayed by 2 s")
        self._prefill_faults(LOSSY)
        n = 8 * self.a.requests
        with ThreadPoolExecutor(4) as pool:
            row.outcomes += [f.result() for f in self._burst(pool, n)]
        row.hit = list(row.outcomes)  # every request's writes ran under the fault rates
        self._after(row)
        return row

    def malformed(self) -> Row:
        row = Row("malformed", "malformed and forged control frames on every control port; a forged bootstrap PUT")
        endpoints = self._control_endpoints()
        refused_before = self._refused()
        sent = must_refuse = 0
        peer = Forger(self.cluster.token)
        n = self.a.requests
        try:
            with ThreadPoolExecutor(n) as pool:
                futures = self._burst(pool, n)
                for _ in range(3):
                    for ep in endpoints:
                        n_sent, n_refuse = peer.hostile(ep)
                        sent, must_refuse = sent + n_sent, must_refuse + n_refuse
                row.outcomes += [f.result() for f in futures]
        finally:
            peer.close()
        row.extra["bootstrap"] = forged_bootstrap(self.cluster)
        row.extra["frames"] = sent
        try:
            wait_until(lambda: self._refused() - refused_before >= must_refuse, 30, "hostile frames counted")
        except RuntimeError:
            pass  # reported below: the count says how many were
        row.notes.append(f"{sent} hostile frames to {len(endpoints)} control endpoints (unsigned, under a wrong key, "
                         f"signed but malformed: {must_refuse} must be refused; signed, well-formed, for rooms nobody "
                         f"holds: ignored as stale); control_refused grew by {self._refused() - refused_before}")
        for what, status in row.extra["bootstrap"].items():
            row.notes.append(f"bootstrap: {what} -> {status}")
        row.notes.append("every server alive afterwards: " + str(all(s.alive() for s in self.cluster.servers)))
        with ThreadPoolExecutor(n) as pool:
            row.outcomes += [f.result() for f in self._burst(pool, n)]
        self._after(row)
        return row

    def replayed_bootstrap(self) -> Row:
        row = Row("replayed_bootstrap", "an API client names its own registry in requests to decode; it replays "
                                        "decode's signed GETs to the real registry and answers with its own records")
        evil = EvilRegistry(self.cluster.boot)
        # Records are no secret: the attacker may know them from elsewhere and answer with them.
        from pdserve.disagg.auth import PeerAuth

        target = f"127.0.0.1:{self.cluster.boot}"
        evil.known = httpx.get(f"http://{target}/bootstrap", timeout=10,
                               headers=PeerAuth(self.cluster.token).sign("GET", "/bootstrap", b"", target)).json()
        n = self.a.requests
        try:
            with ThreadPoolExecutor(n + 1) as pool:
                futures = self._burst(pool, n)
                room = random.getrandbits(63)
                pd = {"bootstrap_host": "127.0.0.1", "bootstrap_port": evil.port, "bootstrap_room": room}
                attacks = [pool.submit(self.client.generate, d.url, self.rng.choice(self.prompts), NEW,
                                       {**pd, "bootstrap_room": room + i}) for i, d in enumerate(self.cluster.decodes)]
                row.outcomes += [f.result() for f in futures + attacks]
            row.hit = list(row.outcomes)
            again = [_get_status(self.cluster.boot, h) for h in evil.captured]  # the same GETs replayed once more
            frames = evil.frames()
        finally:
            evil.close()
        row.notes.append(f"decode's signed GETs replayed to the real registry: {len(evil.replays)}, answered "
                         f"{sorted(set(evil.replays))}; replayed again: {sorted(set(again))}")
        row.notes.append(f"control frames decode sent to the attacker's endpoint: {frames}")
        row.extra["bootstrap"] = {"replays": evil.replays, "again": again}
        with ThreadPoolExecutor(n) as pool:
            row.outcomes += [f.result() for f in self._burst(pool, n)]
        self._after(row)
        return row

    def replayed_control_frame(self) -> Row:
        row = Row("replayed_control_frame", "signed control frames replayed to their endpoint, pushed at another "
                                            "endpoint, and sent late, while requests run")
        endpoints = self._control_endpoints()
        before = self._refused_by_reason()
        peer = Forger(self.cluster.token)
        n = self.a.requests
        try:
            with ThreadPoolExecutor(n) as pool:
                futures = self._burst(pool, n)
                for i, ep in enumerate(endpoints):
                    peer.replays(ep, endpoints[(i + 1) % len(endpoints)])
                row.outcomes += [f.result() for f in futures]
        finally:
            peer.close()
        want = {"replay": 3 * len(endpoints), "wrong_destination": len(endpoints), "stale": len(endpoints)}
        try:
            wait_until(lambda: all(self._refused_by_reason().get(k, 0) - before.get(k, 0) >= v
                                   for k, v in want.items()), 30, "replayed frames counted")
        except RuntimeError:
            pass  # reported below
        after = self._refused_by_reason()
        got = {k: after.get(k, 0) - before.get(k, 0) for k in sorted(set(after) | set(before))}
        row.notes.append(f"{len(endpoints)} control endpoints, each sent one signed frame for a room nobody holds "
                         f"(read once, ignored as stale) and then its replays, a copy meant for another endpoint and "
                         f"a 10-minute-old one; must be refused: {want}; refused by reason: {got}")
        row.extra["refused"] = got
        row.hit = list(row.outcomes)
        self._after(row)
        return row

    def api_abuse(self) -> Row:
        row = Row("api_abuse", "API clients past the request caps, one aborting another's stream, and one call of "
                               f"{BIG_PROMPTS} prompts, while other clients' requests run")
        router, n = self.cluster.router.url, self.a.requests
        victim = self.streams[0]
        rid = f"victim-{random.getrandbits(48):x}"
        with ThreadPoolExecutor(n + 4) as pool:
            futures = self._burst(pool, n)
            started = threading.Event()
            stream = pool.submit(self._owned_stream, router, victim, rid, started)
            big = pool.submit(self._big_call, router)
            wait_until(started.is_set, 60, "the victim's stream running")
            abort = httpx.post(router + "/abort_request", json={"rid": rid}, headers={CLIENT_TOKEN: "mallory"},
                               timeout=30)
            if abort.status_code != 403:
                row.unrefused.append(f"abort of another client's rid: HTTP {abort.status_code}")
            for what, body in self._over_caps().items():
                r = httpx.post(router + "/generate", json=body, timeout=30)
                if r.status_code != 400 or not _error_message(r):
                    row.unrefused.append(f"{what}: HTTP {r.status_code}")
                row.notes.append(f"{what}: HTTP {r.status_code} {_error_message(r)[:120]}")
            row.outcomes += [f.result() for f in futures]
            row.outcomes += [stream.result(), big.result()]
        row.notes.append(f"another client's abort of the running stream: HTTP {abort.status_code} "
                         f"{_error_message(abort)[:120]}; the stream then ran to its end")
        row.hit = list(row.outcomes)
        self._after(row)
        return row

    def hostile_client(self) -> Row:
        """Issue 33: one client tries to take the deployment down for everyone: requests that crashed a
        parser (to open the router's breakers), the most and longest stop strings on streams (to stall
        the frontend's loop), large schemas sent by clients that hang up at once (to starve the grammar
        compiles). A second client's latency is measured idle and under each; it should stay within 2x."""
        row = Row("hostile_client", "one client sends requests that crash parsers, the most stop strings and "
                                    f"{HOSTILE_SCHEMAS} large schemas it abandons, while another client's latency "
                                    "is measured")
        self._prefill_faults("")  # the victim's latency is the router's and servers', not a fault's
        router = self.cluster.router.url
        latency = {"idle": self._victim(row)}
        deep = {"input_ids": self.prompts[0], "sampling_params": {
            **_greedy(2), "json_schema": '{"a": ' * HOSTILE_DEPTH + "1" + "}" * HOSTILE_DEPTH}}
        codes = [httpx.post(router + "/generate", json=deep, timeout=60).status_code for _ in range(12)]
        if set(codes) != {400}:
            row.unrefused.append(f"a json_schema nested {HOSTILE_DEPTH} deep: HTTP {sorted(set(codes))}")
        info = httpx.get(router + "/get_server_info", timeout=10).json()
        breakers = sorted({w.get("circuit_breaker") for w in info["prefill"] + info["decode"]})
        row.notes.append(f"12 requests with a json_schema nested {HOSTILE_DEPTH} deep: HTTP {sorted(set(codes))}; "
                         f"breakers after them: {breakers}")
        latency["after parser crashes"] = self._victim(row)
        latency["plain streams (control)"] = self._under(row, self._plain_streams)
        latency["stop-string streams"] = self._under(row, self._stop_streams)
        latency["abandoned schema compiles"] = self._under(row, self._abandoned_schemas)
        idle = latency["idle"]
        row.extra["victim_latency_s"] = latency
        row.notes.append("victim's median latency (s): " + ", ".join(
            f"{k} {v:.3f}" + ("" if k == "idle" or not idle else f" ({v / idle:.2f}x idle)")
            for k, v in latency.items()))
        row.hit = list(row.outcomes)
        self._after(row)
        return row

    def _victim(self, row: Row) -> float:
        """The median latency of VICTIM_SAMPLES requests of the second client, one after another."""
        outs = [self.client.generate(self.cluster.router.url, self.prompts[1 + i % (len(self.prompts) - 1)])
                for i in range(VICTIM_SAMPLES)]
        row.outcomes += outs
        return sorted(o.end - o.start for o in outs)[len(outs) // 2]

    def _under(self, row: Row, attack) -> float:
        stop = threading.Event()
        with ThreadPoolExecutor(1) as pool:
            hostile = pool.submit(attack, row, stop)
            time.sleep(0.5)
            try:
                return self._victim(row)
            finally:
                stop.set()
                hostile.result()

    def _plain_streams(self, row: Row, stop: threading.Event) -> None:
        """The same streams without stop strings: what a second client's streams cost the victim anyway
        (on a machine this small, mostly CPU), so the stop-string phase's own cost is the difference."""
        self._stream_loop(row, stop, {"input_ids": self.streams[0], "stream": True,
                                      "sampling_params": _greedy(STREAM_NEW)}, "streams without stop strings")

    def _stream_loop(self, row: Row, stop: threading.Event, body: dict, what: str) -> None:
        sent, url = 0, self.cluster.router.url + "/generate"
        while not stop.is_set():
            with httpx.stream("POST", url, json=body, timeout=self.client.hung_s) as s:
                for _ in s.iter_bytes():
                    pass
            sent += 1
        row.notes.append(f"{what} sent meanwhile: {sent}")

    def _stop_streams(self, row: Row, stop: threading.Event) -> None:
        router = self.cluster.router.url
        count, length = HOSTILE_STOPS
        over = {"input_ids": self.prompts[0], "sampling_params": {**_greedy(2), "stop": ["x" * 1000] * 3000}}
        r = httpx.post(router + "/generate", json=over, timeout=60)
        if r.status_code != 400:
            row.unrefused.append(f"3000 stop strings of 1000 characters: HTTP {r.status_code}")
        row.notes.append(f"3000 stop strings of 1000 characters: HTTP {r.status_code} {_error_message(r)[:120]}")
        body = {"input_ids": self.streams[0], "stream": True, "sampling_params": {
            **_greedy(STREAM_NEW), "stop": [("ab" * length)[:length - 1] + str(i % 10) for i in range(count)]}}
        self._stream_loop(row, stop, body, f"streams with {count} stop strings of {length} characters")

    def _abandoned_schemas(self, row: Row, stop: threading.Event) -> None:
        router = self.cluster.router.url
        # a server that has checked a constraint before (its compile children started: seconds of imports
        # on the first one, docs/structured-outputs.md), as one serving structured outputs would be
        warm = {"input_ids": self.prompts[1], "sampling_params": {**_greedy(2), "regex": "[a-z]{1,4}"}}
        t0 = time.monotonic()
        r = httpx.post(router + "/generate", json=warm, timeout=self.client.hung_s)
        row.notes.append(f"the first constraint (compile children starting): HTTP {r.status_code} in "
                         f"{time.monotonic() - t0:.2f} s")
        gone = 0
        for i in range(HOSTILE_SCHEMAS):
            body = {"input_ids": self.prompts[0], "sampling_params": {**_greedy(2), "json_schema": _large_schema(
                400, f"h{i}-{random.getrandbits(32):x}")}}
            try:
                httpx.post(router + "/generate", json=body, headers={CLIENT_TOKEN: f"hostile-{i}"}, timeout=0.3)
            except httpx.TimeoutException:
                gone += 1
        row.notes.append(f"clients that sent a large schema and hung up: {gone} of {HOSTILE_SCHEMAS}")
        # the symptom: a trivial schema sent after them timed out behind their compiles
        trivial = {"input_ids": self.prompts[1], "sampling_params": {**_greedy(2), "json_schema": json.dumps(
            {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]})}}
        t0 = time.monotonic()
        r = httpx.post(router + "/generate", json=trivial, timeout=self.client.hung_s)
        row.notes.append(f"a trivial schema right after them: HTTP {r.status_code} in {time.monotonic() - t0:.2f} s")
        if r.status_code != 200:
            row.unrefused.append(f"a trivial schema after abandoned compiles: HTTP {r.status_code}")
        stop.wait(60)

    def _over_caps(self) -> dict[str, dict]:
        prompt = self.rng.choice(self.prompts)
        return {"top_logprobs_num 100 (past --max-logprobs) from position 0": {
                    "input_ids": prompt, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 100,
                    "sampling_params": _greedy(2)},
                "500 prompts x n=128 (past --max-seqs-per-request)": {
                    "input_ids": [prompt] * 500, "sampling_params": {**_greedy(2), "n": 128}}}

    def _owned_stream(self, url: str, prompt: list[int], rid: str, started: threading.Event) -> Outcome:
        """A stream started by client "alice" (X-Client-Token), classified like any other; ``started``
        is set at its first token."""
        body = {"input_ids": prompt, "sampling_params": _greedy(VICTIM_NEW), "stream": True, "rid": rid}
        start, last = time.monotonic(), None
        try:
            with httpx.stream("POST", url + "/generate", json=body, headers={CLIENT_TOKEN: "alice"},
                              timeout=self.client.hung_s) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        last = json.loads(line[len("data: "):])
                        started.set()
        except httpx.HTTPError as e:
            return Outcome("unclear", f"stream broke: {type(e).__name__}: {e}", start=start, end=time.monotonic())
        out = self.client._classify_final(last, prompt, VICTIM_NEW)
        out.start, out.end = start, time.monotonic()
        return out

    def _big_call(self, url: str) -> Outcome:
        """One call of many prompts (within the caps): every prompt's greedy tokens must be right."""
        prompts = self.rng.sample(self.prompts, BIG_PROMPTS)
        body = {"input_ids": prompts, "sampling_params": _greedy(NEW)}
        start = time.monotonic()
        try:
            r = httpx.post(url + "/generate", json=body, timeout=self.client.hung_s)
        except httpx.HTTPError as e:
            return Outcome("unclear", f"{type(e).__name__}: {e}", start=start, end=time.monotonic())
        if r.status_code != 200:
            return Outcome("failed" if _error_message(r) else "unclear", f"HTTP {r.status_code}: "
                           f"{_error_message(r)[:200]}", start=start, end=time.monotonic())
        got = sorted(o.get("output_ids") or [] for o in r.json())
        want = sorted(self.client.refs[(tuple(p), NEW)] for p in prompts)
        return Outcome("completed", wrong=got != want, detail="" if got == want else "a sequence's tokens differ",
                       start=start, end=time.monotonic())

    def _refused_by_reason(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for s in self.cluster.servers:
            for k, v in s.info().get("control_refused_by_reason", {}).items():
                total[k] = total.get(k, 0) + v
        return total

    def _control_endpoints(self) -> list[str]:
        signed = Forger(self.cluster.token).auth.sign("GET", "/bootstrap", b"", f"127.0.0.1:{self.cluster.boot}")
        snap = httpx.get(f"http://127.0.0.1:{self.cluster.boot}/bootstrap", headers=signed, timeout=10).json()
        return [r["control"] for r in snap["ranks"]] + [d.info()["control_endpoint"] for d in self.cluster.decodes]

    def _refused(self) -> int:
        return sum(s.info()["control_refused"] for s in self.cluster.servers)

    def duplicate_rooms(self) -> Row:
        row = Row("duplicate_rooms", "one bootstrap_room used twice (decode, prefill), a scalar room on a batch")
        self._prefill_faults(SLOW)  # the first pair's room stays live while the second arrives
        row.notes.append("each routed pair is sent straight to prefill and decode (two requests; prefill's half "
                         "answers without tokens, so only decode's tokens are compared); the second pair reuses the "
                         "first's room while it is in flight; then a batch with one scalar room and one with a room "
                         "named twice")
        prefill, decode = self.cluster.prefill, self.cluster.decodes[0]
        for _ in range(self.a.requests):
            room = random.getrandbits(63)
            prompt, other = self.rng.sample(self.prompts, 2)
            pd = {"bootstrap_host": "127.0.0.1", "bootstrap_port": self.cluster.boot, "bootstrap_room": room}
            row.outcomes += self._same_room_twice(prefill, decode, prompt, other, pd)
            # A batch with one scalar room, and one that names a room twice.
            row.outcomes.append(self._batch(decode, [prompt, other], {**pd, "bootstrap_room": room + 1}))
            row.outcomes.append(self._batch(decode, [prompt, other], {**pd, "bootstrap_room": [room + 2] * 2}))
        self._after(row)
        return row

    def _same_room_twice(self, prefill: Node, decode: Node, prompt, other, pd: dict) -> list[Outcome]:
        """A routed pair, and while decode holds it, a second pair with the same room."""
        with ThreadPoolExecutor(4) as pool:
            first = [pool.submit(self.client.generate, s.url, prompt, NEW, pd, s is decode) for s in (prefill, decode)]
            wait_until(lambda: decode.info()["num_waiting_for_kv"] + decode.info()["num_running_reqs"] >= 1
                       or first[1].done(), 60, "the first request in")
            again = [pool.submit(self.client.generate, s.url, other, NEW, pd, s is decode) for s in (prefill, decode)]
            return [f.result() for f in first + again]

    def _batch(self, node: Node, prompts: list[list[int]], pd: dict) -> Outcome:
        body = {"input_ids": prompts, "sampling_params": _greedy(NEW), **pd}
        r = httpx.post(node.url + "/generate", json=body, timeout=self.a.hung_s)
        if r.status_code >= 400:
            msg = _error_message(r)
            return Outcome("failed" if "bootstrap_room" in msg else "unclear", f"HTTP {r.status_code}: {msg[:200]}")
        return Outcome("unclear", f"a batch with a shared room was accepted: HTTP {r.status_code}")

    def soak(self) -> Row:
        row = Row("soak", f"soak: {self.a.soak_s:g} s at concurrency {self.a.soak_concurrency}, prefill faults "
                          f"{self.faults or 'none'}")
        stop = threading.Event()
        samples: list[dict] = []
        t_start = time.monotonic()

        def worker():
            while not stop.is_set():
                row.outcomes.append(self.client.generate(self.cluster.router.url, self.rng.choice(self.prompts)))

        nodes = [*self.cluster.servers, self.cluster.router]
        with ThreadPoolExecutor(self.a.soak_concurrency) as pool:
            futures = [pool.submit(worker) for _ in range(self.a.soak_concurrency)]
            try:
                while time.monotonic() - t_start < self.a.soak_s:
                    samples.append(self._sample(nodes, t_start))
                    stop.wait(min(self.a.sample_s, max(0.0, self.a.soak_s - (time.monotonic() - t_start))))
            finally:
                stop.set()
                for f in futures:
                    f.result()
        samples.append(self._sample(nodes, t_start))
        row.extra["samples"] = samples
        row.hit = []
        self._after(row)
        samples.append(self._sample(nodes, t_start))
        return row

    def _sample(self, nodes: list[Node], t0: float) -> dict:
        s = {"t": round(time.monotonic() - t0, 1)}
        for node in nodes:
            s[f"{node.name}_rss_mib"] = round(node.rss_mib(), 1)
        for node in self.cluster.servers:
            try:
                info = node.info()
            except httpx.HTTPError:
                s.update({f"{node.name}_{k}": "down" for k in ("used_pages", "cached_pages", "pd")})
                continue
            s[f"{node.name}_used_pages"] = info["total_pages"] - info["free_pages"] - info["cached_pages"]
            s[f"{node.name}_cached_pages"] = info["cached_pages"]
            s[f"{node.name}_pd"] = sum(info.get(k, 0) for k in IDLE_ZERO)
        return s

    def _after(self, row: Row) -> None:
        settle(row, self.cluster, self.a.idle_s)


class Forger:
    """Whoever reaches a control port: unsigned frames, frames under a wrong key, and frames sealed
    with the real token whose content is hostile (a compromised or buggy peer)."""

    def __init__(self, token: str):
        from pdserve.disagg.auth import PeerAuth

        self.auth = PeerAuth(token)
        self.wrong = PeerAuth("not-the-token")
        self.ctx = zmq.Context()
        self.socks: dict[str, zmq.Socket] = {}
        self.seq = 0

    def binding(self, endpoint: str):
        """A frame's binding as a peer holding the token gives it (a sequence of its own, now)."""
        from pdserve.disagg.auth import FrameBinding

        self.seq += 1
        return FrameBinding(f"forger#{id(self)}", endpoint, self.seq, int(time.time() * 1000))

    def replays(self, endpoint: str, other: str) -> None:
        """A signed frame read once at ``endpoint``, then three replays of it, a copy meant for
        ``other`` pushed at ``endpoint``, and one sent ten minutes ago."""
        frame = _forged()[2]  # a DropRoom of a room nobody holds: read and ignored
        first = self.auth.seal(frame, self.binding(endpoint))
        for f in (first, first, first, first, self.auth.seal(frame, self.binding(other))):
            self._send(endpoint, f)
        old = self.binding(endpoint)
        self._send(endpoint, self.auth.seal(frame, type(old)(old.sender, endpoint, old.seq, old.t_ms - 600_000)))

    def hostile(self, endpoint: str) -> tuple[int, int]:
        """Sends the frames; (how many, how many the server must refuse)."""
        refused = [*_malformed(), *[self.wrong.seal(f, self.binding(endpoint)) for f in _forged()],
                   *[self.auth.seal(f, self.binding(endpoint)) for f in _malformed()]]
        # well-formed, signed, for rooms nobody holds: ignored
        stale = [self.auth.seal(f, self.binding(endpoint)) for f in _forged()]
        for f in refused + stale:
            self._send(endpoint, f)
        return len(refused) + len(stale), len(refused)

    def _send(self, endpoint: str, data: bytes) -> None:
        if endpoint not in self.socks:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDTIMEO, 2000)
            sock.connect(endpoint)
            self.socks[endpoint] = sock
        self.socks[endpoint].send(data)

    def close(self) -> None:
        for s in self.socks.values():
            s.close(linger=0)
        self.ctx.term()


class EvilRegistry:
    """An API client's own bootstrap registry (no token): replays each signed GET it receives to the
    real registry (``captured`` keeps the headers), answers with the real records, or the records
    it learned before, every control endpoint replaced by its own PULL socket."""

    def __init__(self, real_port: int):
        import http.server

        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.control = f"tcp://127.0.0.1:{self.pull.bind_to_random_port('tcp://127.0.0.1')}"
        self.captured: list[dict] = []
        self.replays: list[int] = []
        self.known: dict | None = None
        evil = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                headers = {k: v for k, v in self.headers.items() if k.lower().startswith("x-pdserve")}
                evil.captured.append(headers)
                r = httpx.get(f"http://127.0.0.1:{real_port}/bootstrap", headers=headers, timeout=10)
                evil.replays.append(r.status_code)
                snap = r.json() if r.status_code == 200 else evil.known
                if snap is None:
                    self.send_response(503)
                    self.end_headers()
                    return
                evil.known = snap
                data = json.dumps({**snap, "ranks": [{**rk, "control": evil.control} for rk in snap["ranks"]]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.http.server_address[1]
        threading.Thread(target=self.http.serve_forever, args=(0.05,), daemon=True).start()

    def frames(self) -> int:
        n = 0
        while self.pull.poll(0):
            self.pull.recv()
            n += 1
        return n

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()
        self.pull.close(linger=0)
        self.ctx.term()


def _get_status(boot: int, headers: dict) -> int:
    return httpx.get(f"http://127.0.0.1:{boot}/bootstrap", headers=headers, timeout=10).status_code


def _malformed() -> list[bytes]:
    completion = {"v": 1, "type": "KVCompletion", "body": {"room": 1, "nonce": 5, "src_rank": 0, "dst_rank": 0,
                                                           "writes": 3, "status": "ok", "queue_s": "@@"}}
    return [json.dumps(completion).replace('"@@"', "9" * 400).encode(),  # float overflow
            json.dumps(completion).replace('"@@"', "9" * 5000).encode(),  # int digit limit
            b"[" * 100_000,  # recursion
            b'{"v": 1, "type": "Heartbeat", "body": {"server_id": "not an endpoint", "time": 1.0}}',
            b"\xff" * 1000, b"", b"{}", os.urandom(4096)]


def _forged() -> list[bytes]:
    from pdserve.disagg import protocol
    from pdserve.disagg.protocol import DropRoom, KVAbort, KVCompletion

    room = random.getrandbits(63)
    return [protocol.encode(KVCompletion(room=room, nonce=7, src_rank=0, dst_rank=0, writes=3, status="ok")),
            protocol.encode(KVAbort(room=room, reason="forged", side="decode", sender="127.0.0.1:1", nonce=7)),
            protocol.encode(DropRoom(room))]


def forged_bootstrap(cluster: Cluster) -> dict[str, int]:
    """PUTs of a rank record that points rank 0's control at a forger: unsigned, under a wrong
    key, and oversized; then checks the registry still holds the real record."""
    from pdserve.disagg.auth import PeerAuth

    base = f"http://127.0.0.1:{cluster.boot}"
    real = PeerAuth(cluster.token)
    target = f"127.0.0.1:{cluster.boot}"
    snap = httpx.get(base + "/bootstrap", headers=real.sign("GET", "/bootstrap", b"", target), timeout=10).json()
    rec = dict(snap["ranks"][0], control="tcp://127.0.0.1:1")
    body = json.dumps(rec).encode()
    out = {"unsigned PUT /bootstrap/rank": httpx.put(base + "/bootstrap/rank", content=body, timeout=10).status_code,
           "PUT /bootstrap/rank under a wrong key": httpx.put(
               base + "/bootstrap/rank", content=body, timeout=10,
               headers=PeerAuth("not-the-token").sign("PUT", "/bootstrap/rank", body, target)).status_code,
           "unsigned GET /bootstrap": httpx.get(base + "/bootstrap", timeout=10).status_code}
    huge = b"{" + b" " * (2 << 20) + b"}"
    try:
        out["2 MiB PUT /bootstrap/rank"] = httpx.put(base + "/bootstrap/rank", content=huge, timeout=10).status_code
    except httpx.HTTPError as e:  # the server may close before reading the body
        out["2 MiB PUT /bootstrap/rank"] = f"connection closed ({type(e).__name__})"
    after = httpx.get(base + "/bootstrap", headers=real.sign("GET", "/bootstrap", b"", target), timeout=10).json()
    out["rank 0 control unchanged"] = after["ranks"][0]["control"] == snap["ranks"][0]["control"]
    return out


# --- references, the run, the report --------------------------------------------------------------------


def make_prompts(seed: int) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(seed)
    shared = [rng.randint(3, 1500) for _ in range(16)]  # a common prefix: the radix cache is exercised too
    prompts = [(shared if i % 3 == 0 else []) + [rng.randint(3, 1500) for _ in range(rng.randint(12, 90))]
               for i in range(32)]
    streams = [[rng.randint(3, 1500) for _ in range(rng.randint(20, 60))] for _ in range(8)]
    return prompts, streams


def references(prompts, streams) -> dict[tuple, list[int]]:
    import pdserve

    eng = pdserve.Engine(model_path=MODEL, page_size=4, num_threads=1)
    try:
        refs = {}
        for batch, n in ((prompts, NEW), (streams, STREAM_NEW), (streams[:1], VICTIM_NEW)):
            outs = eng.generate(input_ids=batch, sampling_params=_greedy(n))
            refs.update({(tuple(p), n): o["output_ids"] for p, o in zip(batch, outs)})
        return refs
    finally:
        eng.shutdown()


def run(a: argparse.Namespace) -> list[Row]:
    names = a.scenarios.split(",")
    rows = run_cluster(a, [n for n in names if n not in STANDALONE])
    for name in (n for n in names if n in STANDALONE):
        print(f"[reliability] {name} ...", file=sys.stderr, flush=True)
        t = time.monotonic()
        try:
            row = STANDALONE_DRILLS[name](a)
        except Exception as e:  # recorded and flagged
            row = Row(name, f"{name} (crashed)", crashed=f"{type(e).__name__}: {e}")
        row.extra["seconds"] = round(time.monotonic() - t, 1)
        rows.append(row)
        print(f"[reliability] {name}: {row.summary()} {row.flags() or ''}", file=sys.stderr, flush=True)
    return rows


def run_cluster(a: argparse.Namespace, names: list[str]) -> list[Row]:
    if not names:
        return []
    prompts, streams = make_prompts(a.seed)
    refs = references(prompts, streams)
    cluster = Cluster(secrets.token_hex(16), a.decodes)
    rows = []
    try:
        cluster.start(SLOW)
        drills = Drills(a, cluster, Client(refs, a.hung_s), prompts, streams)
        for name in names:
            print(f"[reliability] {name} ...", file=sys.stderr, flush=True)
            t, before = time.monotonic(), counters(cluster)
            try:
                row = getattr(drills, name)()
            except Exception as e:  # recorded and flagged; the remaining scenarios still run
                row = Row(name, f"{name} (crashed)", crashed=f"{type(e).__name__}: {e}")
            row.notes += counter_notes(before, counters(cluster))
            if exits(cluster):
                row.crashed = (row.crashed + "; " if row.crashed else "") + "; ".join(exits(cluster))
            row.extra["seconds"] = round(time.monotonic() - t, 1)
            rows.append(row)
            print(f"[reliability] {name}: {row.summary()} {row.flags() or ''}", file=sys.stderr, flush=True)
    except Exception:  # a failed start: the logs say why (a signal or Ctrl-C needs no logs)
        for n in (cluster.router, *cluster.servers):
            if n.proc is not None:
                print(f"--- {n.name} log tail ---\n{n.tail()}", file=sys.stderr)
        raise
    finally:
        cluster.close()
    return rows


# --- cache privacy (issue 33) -------------------------------------------------------------------------
PRIVACY_PROMPT = [17, 305, 96, 44, 17, 17, 1021, 7, 415]  # "My bank PIN is 4417 ..." as token ids
PRIVACY_FLAGS = ("--page-size", "1", "--max-total-tokens", "512", "--num-threads", "1", "--log-level", "warning")
EVENTS_WAIT_S = 20.0


def cache_privacy(a: argparse.Namespace) -> Row:
    """The vocabulary attack of test/obs/test_cache_privacy.py against real servers (page size 1: a block
    is one token): a keyed server (``$PDSERVE_KV_HASH_KEY``, as ``pdserve up`` hands it; API and admin
    keys; KV events bound beyond loopback) and an unkeyed one (events on loopback) as the control. The
    attacker reads the snapshot (with the admin key: more than an API client may) and subscribes to the
    events port, then tries the vocabulary against every hash. Nothing may come back from the keyed
    server; the whole prompt must come back from the control, or the drill proves nothing."""
    from pdserve.config import KV_HASH_KEY_ENV, resolve_kv_hash_key
    from pdserve.obs.kv_event_publisher import EventCurveKeys
    from pdserve.web.api_key import ADMIN_KEY_ENV

    row = Row("cache_privacy", "the vocabulary attack on KV block hashes from the snapshot and the events port of "
                               "a keyed server, and of an unkeyed one (the control)")
    secret, admin = secrets.token_hex(16), secrets.token_hex(16)
    hash_key = resolve_kv_hash_key(None, {KV_HASH_KEY_ENV: secret})
    keyed = _privacy_node("keyed", "tcp://0.0.0.0:*", ["--api-key", "inference-key"],
                          {KV_HASH_KEY_ENV: secret, ADMIN_KEY_ENV: admin})
    plain = _privacy_node("unkeyed", "tcp://127.0.0.1:*", [], {KV_HASH_KEY_ENV: ""})
    try:
        for node in (keyed, plain):
            node.start()
        # keyed: a stranger subscribes (no CURVE key) and so does a holder of the hash key (the router)
        got = _privacy_round(row, keyed, {"Authorization": "Bearer inference-key"},
                             {None: None, "router": EventCurveKeys.from_hash_key(hash_key)})
        snap = httpx.get(keyed.url + "/kv_events/snapshot", headers={"Authorization": "Bearer inference-key"},
                         timeout=30)
        row.notes.append(f"keyed: the snapshot with the API key: HTTP {snap.status_code} (worker-only)")
        if snap.status_code != 403:
            row.unrefused.append(f"keyed snapshot read with the API key: HTTP {snap.status_code}")
        blocks = _snapshot_blocks(keyed.url, {"Authorization": f"Bearer {admin}"})
        _attack(row, "keyed snapshot (read with the admin key)", blocks, b"", expect=0)
        _attack(row, "keyed snapshot, the attacker holding the hash key (sanity)", blocks, hash_key, expect=None)
        stranger, router = got[None], got["router"]
        row.notes.append(f"keyed events: a subscriber without the key received {stranger[0]} messages, the "
                         f"router's (CURVE under the hash key) {router[0]}")
        if stranger[0]:
            row.unrefused.append(f"keyed events port: a subscriber without the key received {stranger[0]} messages")
        _attack(row, "keyed events (as the router receives them; no token ids)", router[1], b"", expect=0)
        _attack(row, "keyed events, the attacker holding the hash key (sanity)", router[1], hash_key, expect=None)
        got = _privacy_round(row, plain, {}, {None: None})
        _attack(row, "unkeyed snapshot (control)", _snapshot_blocks(plain.url, {}), b"",
                expect=len(PRIVACY_PROMPT))
        _attack(row, "unkeyed events (control)", got[None][1], b"", expect=len(PRIVACY_PROMPT))
    finally:
        for node in (keyed, plain):
            node.close()
    return row


def _privacy_node(name: str, events: str, flags: list[str], env: dict) -> Node:
    port = servers.free_port()
    config = json.dumps({"publisher": "zmq", "endpoint": events})
    return Node(f"privacy-{name}", ["serve", "--model-path", MODEL, "--port", str(port), *PRIVACY_FLAGS,
                                    "--kv-events-config", config, *flags], port, env=env)


def _privacy_round(row: Row, node: Node, headers: dict, subscribers: dict) -> dict:
    """Subscribe (``subscribers``: name -> CURVE keys or None), send the secret prompt, and collect what
    each subscriber received: name -> (messages, [(hash, parent)] of every stored block)."""
    info = httpx.get(node.url + "/get_server_info", headers=headers, timeout=10).json()
    endpoint = "tcp://127.0.0.1:" + info["kv_events_endpoint"].rsplit(":", 1)[1]
    row.notes.append(f"{node.name}: events at {info['kv_events_endpoint']} (as advertised), CURVE "
                     f"{info.get('kv_events_curve')}, token ids {info.get('kv_events_token_ids')}")
    ctx = zmq.Context()
    socks = {}
    for name, keys in subscribers.items():
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            keys.secure_subscriber(sock)
        sock.connect(endpoint)
        socks[name] = sock
    got: dict = {name: [0, []] for name in socks}
    try:
        listener = next(n for n in socks if subscribers[n] is not None or len(socks) == 1)
        wait_until(lambda: _drain(socks, got) or got[listener][0] > 0, EVENTS_WAIT_S, "a heartbeat on the events port")
        body = {"input_ids": PRIVACY_PROMPT, "sampling_params": _greedy(1)}
        t0 = time.monotonic()
        r = httpx.post(node.url + "/generate", json=body, headers=headers, timeout=60)
        row.outcomes.append(Outcome("completed" if r.status_code == 200 else "failed", f"HTTP {r.status_code}",
                                    start=t0, end=time.monotonic()))
        wait_until(lambda: _drain(socks, got) or len(got[listener][1]) >= len(PRIVACY_PROMPT), EVENTS_WAIT_S,
                   "the prompt's blocks on the events port")
        _drain(socks, got)
    finally:
        for sock in socks.values():
            sock.close()
        ctx.term()
    return {name: (n, blocks) for name, (n, blocks) in got.items()}


def _drain(socks: dict, got: dict) -> bool:
    """Read what each subscriber has waiting into ``got``; always False (a poll step for wait_until)."""
    for name, sock in socks.items():
        while sock.poll(0):
            payload = json.loads(sock.recv_multipart()[2])
            got[name][0] += 1
            for e in payload["events"]:
                if e["type"] == "BlockStored":
                    parent = e["parent_block_hash"]
                    for h in e["block_hashes"]:
                        got[name][1].append((h, parent))
                        parent = h
    return False


def _snapshot_blocks(url: str, headers: dict) -> list[tuple[int, int | None]]:
    r = httpx.get(url + "/kv_events/snapshot", headers=headers, timeout=30)
    r.raise_for_status()
    return [(b["block_hash"], b["parent_block_hash"]) for b in r.json()["blocks"]]


def _attack(row: Row, what: str, blocks: list[tuple[int, int | None]], key: bytes, expect: int | None) -> None:
    """The vocabulary attack over ``blocks``; ``expect`` the tokens it must recover (None: all of them)."""
    t0 = time.monotonic()
    tokens = rebuild_prompt(blocks, key)
    found = tokens[:len(PRIVACY_PROMPT)] == PRIVACY_PROMPT
    row.notes.append(f"{what}: {len(blocks)} block hashes, {len(tokens)} tokens recovered"
                     f"{' (the prompt)' if found else ''} in {time.monotonic() - t0:.2f} s")
    row.extra.setdefault("recovered_tokens", {})[what] = len(tokens)
    if expect == 0:
        if tokens:
            row.unrefused.append(f"{what}: {len(tokens)} tokens recovered without the key")
    elif not found:  # the control or the sanity check failed: the drill proves nothing
        row.crashed = (row.crashed + "; " if row.crashed else "") + f"{what}: the prompt was not recovered"


def rebuild_prompt(blocks: list[tuple[int, int | None]], key: bytes, vocab: int = 2048) -> list[int]:
    """The attacker of test/obs/test_cache_privacy.py: the longest chain from the root whose every block's
    token it finds by trying the vocabulary against the block's hash and its parent's."""
    from pdserve.mem.radix_cache import ROOT_HASH, hash_block

    children: dict[int, list[int]] = {}
    for h, p in blocks:
        children.setdefault(ROOT_HASH if p is None else p, []).append(h)
    best: list[int] = []
    stack: list[tuple[int, list[int]]] = [(ROOT_HASH, [])]
    while stack:
        h, tokens = stack.pop()
        best = max(best, tokens, key=len)
        for child in children.get(h, []):
            t = next((t for t in range(vocab) if hash_block(h, [t], key) == child), None)
            if t is not None:
                stack.append((child, [*tokens, t]))
    return best


STANDALONE_DRILLS = {"cache_privacy": cache_privacy}


def _fmt_rate(r: float | None) -> str:
    return "n/a" if r is None else f"{r:.0%}"


def render(a: argparse.Namespace, argv: list[str], rows: list[Row], started: str) -> str:
    cmd = "PYTHONPATH=python python3 benchmark/reliability.py" + ("" if not argv else " " + " ".join(argv))
    flagged = [(r.name, r.flags()) for r in rows if r.flags()]
    lines = ["# Reliability report", "",
             "Regenerate with:", "", f"    {cmd}", "",
             f"- date: {started} (UTC)",
             f"- machine: {os.cpu_count()} CPU cores ({platform.machine()}, {platform.system()}), no GPU, "
             "shared with other work",
             f"- deployment: 1 prefill + {a.decodes} decodes + `pdserve router`, {MODEL}, page size 4, greedy, "
             f"{NEW} new tokens ({STREAM_NEW} streamed), Mooncake over TCP loopback, HMAC token on the P/D ports, "
             f"`--disaggregation-timeout-s {PD_TIMEOUT_S} --disaggregation-heartbeat-s {HEARTBEAT_S}`",
             f"- a request is hung after {a.hung_s:g} s without an answer; a server must release every page and "
             f"P/D resource within {a.idle_s:g} s of a scenario's end", ""]
    if flagged:
        lines += ["**ATTENTION: rows that must be zero are not:**", ""]
        lines += [f"- **{name}: {', '.join(f)}**" for name, f in flagged]
        lines.append("")
    else:
        lines += ["All zero rows are zero: no request hung, no wrong token, nothing leaked, "
                  "no unclear failure, every failover rate >= 99%.", ""]
    lines += ["## Summary", "",
              "| scenario | sent | completed | failed (clear error) | unclear | hung | wrong tokens | leaked | "
              "hit by the fault | failover rate |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s = r.summary()
        mark = " **(!)**" if r.flags() else ""
        lines.append(f"| [{r.name}](#{r.name.replace('_', '-')}){mark} | {s['sent']} | {s['completed']} | "
                     f"{s['failed_clear']} | {s['unclear']} | {s['hung']} | {s['wrong_tokens']} | {s['leaked']} | "
                     f"{s['hit_by_fault']} | {_fmt_rate(s['failover_rate'])} |")
    lines += ["", "*leaked*: pages not free or cached, plus P/D resource counts (rooms, quarantine entries, aux "
              "rows, transfer batches) still non-zero after the idle bound, summed over the live servers. "
              "*failover rate*: completed / (completed + any failure) among the requests in flight while the "
              "fault lasted (lossy_writes: all of its requests).", ""]
    for r in rows:
        lines += section(r)
    return "\n".join(lines) + "\n"


def section(r: Row) -> list[str]:
    s = r.summary()
    out = [f"## {r.name}", "", r.title + ".", "",
           f"{s['sent']} sent, {s['completed']} completed, {s['failed_clear']} failed with a clear error, "
           f"{s['unclear']} unclear, {s['hung']} hung, {s['wrong_tokens']} wrong among completed, "
           f"{s['leaked']} leaked; failover {_fmt_rate(s['failover_rate'])} over {s['hit_by_fault']} requests hit; "
           f"{r.extra.get('seconds', 0):g} s.", ""]
    if r.flags():
        out += [f"**FLAGGED: {', '.join(r.flags())}**", ""]
    out += [f"- {n}" for n in r.notes]
    errors = sorted({o.detail[:160] for o in r.outcomes if o.kind in ("failed", "unclear", "hung")})
    if errors:
        out += ["- errors the clients saw:"] + [f"  - `{e}`" for e in errors[:12]]
    wrong = [o.detail for o in r.outcomes if o.wrong]
    if wrong:
        out += ["- wrong tokens:"] + [f"  - `{w}`" for w in wrong[:8]]
    for name, held in r.leaked.items():
        out.append(f"- **still held on {name}**: {held}")
    if "samples" in r.extra:
        out += ["", *soak_table(r.extra["samples"])]
    return out + [""]


def soak_table(samples: list[dict]) -> list[str]:
    keys = [k for k in samples[0] if k != "t"]
    step = max(1, len(samples) // 20)
    shown = samples[::step] + ([samples[-1]] if (len(samples) - 1) % step else [])
    out = ["RSS (MiB, every process of each server's group) and pages sampled during the soak (the last row: "
           "after the idle check); *_pd* sums the P/D resource counts:", "",
           "| t (s) | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    out += ["| " + " | ".join(str(s[k]) for k in ["t", *keys]) + " |" for s in shown]
    first, last = samples[0], samples[-1]
    growth = ", ".join(f"{k.removesuffix('_rss_mib')} {last[k] - first[k]:+.1f} MiB"
                       for k in keys if k.endswith("_rss_mib"))
    return out + ["", f"RSS change from the first to the last sample: {growth}."]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally blocks stop every process
    rows = run(a)
    Path(a.out).write_text(render(a, argv, rows, started))
    if a.json:
        Path(a.json).write_text(json.dumps([{**r.summary(), "flags": r.flags()} for r in rows], indent=1))
    flagged = [r.name for r in rows if r.flags()]
    print(f"[reliability] wrote {a.out}" + (f"; FLAGGED: {flagged}" if flagged else ""), file=sys.stderr)
    return 1 if flagged else 0


if __name__ == "__main__":
    sys.exit(main())
