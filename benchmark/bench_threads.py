"""pdserve at several thread settings, side by side: which layout wins on this machine.

    python benchmark/bench_threads.py --models tiny-llama --variants 1 2 auto --rounds 3
    python benchmark/bench_threads.py --models tiny-llama --variants 1 2 auto --rounds 3 --online

Offline (the default), each variant is an Engine in its own interpreter (``peer_worker.py``, as
bench_peer.py runs it); ``--online``, each is a ``pdserve serve`` that ``--clients`` streaming
clients send the prompts to at once (bench_server.py's rounds). Variants: ``auto`` (or
``default``: the same since the tuner is on by default) is pdserve's defaults, the forward's
threads chosen per step by the tuner (engine/thread_tuner.py; its final state is printed);
``layout`` is the start-up ``ThreadLayout``'s count without the tuner (``--disable-thread-tuning``);
a number N is ``--num-threads N`` (every forward on N threads). Suffixes: ``+compile`` also runs
``--enable-torch-compile`` (start-up, compile included, is reported); ``+passive`` starts the
process with ``OMP_WAIT_POLICY=passive`` (OpenMP threads sleep at once after a parallel region
instead of spinning, so an idle team member does not take a core from the frontend or the
scheduler thread). Every round sends one fresh prompt set (bench_peer.py's prompts: no shared
prefixes) to each variant in turn, the order rotating per round, so load from other processes
hits each alike. Reports per variant the median (min-max) of output tok/s and of CPU-seconds per
1,000 output tokens (the worker's or the server's process tree), online the median TTFT, and each
variant's per-round ratio to the first. Offline, greedy outputs must agree between variants on the
first round's prompts (thread counts change float summation order only; a rare near-tie can still
flip a token, which is reported, not hidden).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_peer import DEFAULT_MODELS, MODELS, Worker, make_prompts, model_dir  # noqa: E402

SUFFIXES = ("compile", "passive")


def run(a: argparse.Namespace, name: str) -> None:
    mdir = model_dir(name, Path(a.model_dir), a.seed)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(mdir).vocab_size
    sides = Online(a, mdir) if a.online else Offline(a, mdir)
    try:
        tok_s: dict[str, list[float]] = {v: [] for v in a.variants}
        cpu: dict[str, list[float]] = {v: [] for v in a.variants}
        ttft: dict[str, list[float]] = {v: [] for v in a.variants}
        outputs: dict[str, list] = {}
        order = list(a.variants)
        for r in range(a.rounds):
            prompts = make_prompts(a.num_prompts, tuple(a.input_len), vocab, a.seed + r)
            for v in order[r % len(order):] + order[:r % len(order)]:
                outs, tokens, wall, secs, first = sides.round(v, prompts)
                tok_s[v].append(tokens / wall)
                cpu[v].append(secs / tokens * 1000)
                ttft[v].append(first)
                if r == 0 and outs is not None:
                    outputs[v] = outs
        tuning = {v: sides.tuning(v) for v in a.variants}
        startup = {v: sides.startup_s(v) for v in a.variants}
    finally:
        sides.close()
    report(a, name, tok_s, cpu, ttft, outputs, tuning, startup)


def report(a, name, tok_s, cpu, ttft, outputs, tuning, startup) -> None:
    first = a.variants[0]
    how = (f"online, {a.num_prompts} streaming clients at once" if a.online else f"offline, batch {a.batch}")
    print(f"\n## {name}: {a.num_prompts} prompts of {a.input_len[0]}-{a.input_len[1]} tokens, {a.output_len} "
          f"output tokens, {how}, {a.rounds} rounds; load average {_load()}")
    last = "median TTFT ms" if a.online else f"greedy = {first}"
    print(f"| variant | tok/s | vs {first} per round | CPU-s / 1k tokens | {last} | start-up s |\n"
          "|---|---|---|---|---|---|")
    for v in a.variants:
        ratios = [x / y for x, y in zip(tok_s[v], tok_s[first])]
        if a.online:
            col = _cell([t * 1e3 for t in ttft[v]], ".0f")
        else:
            col = f"{sum(x == y for x, y in zip(outputs[v], outputs[first]))}/{len(outputs[first])}"
        print(f"| {v} | {_cell(tok_s[v], '.0f')} | **{statistics.median(ratios):.2f}** ({min(ratios):.2f}-"
              f"{max(ratios):.2f}) | {_cell(cpu[v], '.2f')} | {col} | {startup[v]:.1f} |")
    for v, t in tuning.items():
        if t and t.get("enabled"):
            chosen = {size: f"{b['threads']} ({b['switches']} switches, {b['probes']} probes, ms/token "
                            f"{b['ms_per_token']})" for size, b in t["buckets"].items()}
            print(f"{v}: tuner's count per step size (tokens >=): {json.dumps(chosen)}")


class Offline:
    """Each variant an Engine in a ``peer_worker.py`` process."""

    def __init__(self, a: argparse.Namespace, mdir: str):
        self.a = a
        self.workers: dict[str, Worker] = {}
        log = sys.stderr if a.verbose else subprocess.DEVNULL
        for v in a.variants:
            flags, env = _variant(v)
            self.workers[v] = Worker(sys.executable, "pdserve", mdir, a.batch, env, log, flags)

    def round(self, v: str, prompts: list[list[int]]):
        outs, wall, secs = self.workers[v].generate(prompts, self.a.output_len)
        return outs, sum(map(len, outs)), wall, secs, 0.0

    def tuning(self, v: str) -> dict | None:
        return self.workers[v].info.get("thread_tuning")

    def startup_s(self, v: str) -> float:
        return self.workers[v].startup_s

    def close(self) -> None:
        for w in self.workers.values():
            w.close()


class Online:
    """Each variant a ``pdserve serve``; a round streams every prompt to it at once (bench_server.py)."""

    def __init__(self, a: argparse.Namespace, mdir: str):
        import time

        from bench_server import ServerCpu, free_port, wait_healthy

        self.a = a
        self.servers: dict[str, tuple[subprocess.Popen, str, ServerCpu]] = {}
        self.started: dict[str, float] = {}
        log = sys.stderr if a.verbose else subprocess.DEVNULL
        for v in a.variants:
            flags, env = _variant(v)
            port = free_port()
            cmd = [sys.executable, "-m", "pdserve", "serve", "--model-path", mdir, "--port", str(port),
                   "--log-level", "warning", "--max-running-requests", str(a.num_prompts), "--max-total-tokens",
                   str(a.max_total_tokens), "--random-seed", str(a.seed), *flags]
            t0 = time.perf_counter()
            proc = subprocess.Popen(cmd, start_new_session=True, stdout=log, stderr=log, env={**os.environ, **env})
            url = f"http://127.0.0.1:{port}"
            self.servers[v] = (proc, url, ServerCpu(proc.pid))
            asyncio.run(wait_healthy(url, proc))
            self.started[v] = time.perf_counter() - t0
        warm = make_prompts(min(a.num_prompts, 8), (16, 32), 1000, a.seed + 1000)
        for v in a.variants:  # first touch of the pool and torch's kernels
            self.round(v, warm)

    def round(self, v: str, prompts: list[list[int]]):
        from bench_server import http_round

        _, url, cpu = self.servers[v]
        n0 = len(cpu.scheduler)
        rate, ttft = cpu.measure(lambda: asyncio.run(http_round(url, "/generate", prompts, self.a.output_len)))
        tokens = len(prompts) * self.a.output_len  # ignore_eos: every request makes them all
        secs = cpu.frontend[n0] + cpu.scheduler[n0]
        return None, tokens, tokens / rate, secs, ttft

    def tuning(self, v: str) -> dict | None:
        with urllib.request.urlopen(self.servers[v][1] + "/get_server_info", timeout=30) as r:
            return json.loads(r.read()).get("thread_tuning")

    def startup_s(self, v: str) -> float:
        return self.started[v]

    def close(self) -> None:
        from bench_server import stop_server

        for proc, _, _ in self.servers.values():
            stop_server(proc)


def _variant(variant: str) -> tuple[tuple[str, ...], dict[str, str]]:
    """(pdserve flags, environment) of a variant."""
    threads, *suffixes = variant.split("+")
    flags: tuple[str, ...] = {"default": (), "auto": (), "layout": ("--disable-thread-tuning",)}.get(
        threads, ("--num-threads", threads))
    flags += ("--enable-torch-compile",) if "compile" in suffixes else ()
    return flags, ({"OMP_WAIT_POLICY": "passive"} if "passive" in suffixes else {})


def _valid_variant(v: str) -> bool:
    threads, *suffixes = v.split("+")
    return ((threads in ("default", "auto", "layout") or (threads.isdigit() and int(threads) > 0))
            and all(x in SUFFIXES for x in suffixes) and len(set(suffixes)) == len(suffixes))


def _cell(xs: list[float], fmt: str) -> str:
    return f"{format(statistics.median(xs), fmt)} ({format(min(xs), fmt)}-{format(max(xs), fmt)})"


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--variants", nargs="+", default=["auto", "1", "2"],
                    help="'auto'/'default' (the tuner), 'layout' (the start-up count, no tuner) or a torch thread "
                         "count, optionally '+compile' and/or '+passive'; the first is the reference")
    ap.add_argument("--online", action="store_true", help="servers and streaming clients instead of Engines")
    ap.add_argument("--num-prompts", type=int, default=32, help="prompts per round (online: concurrent clients)")
    ap.add_argument("--input-len", type=int, nargs=2, default=[64, 256], metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32, help="offline: the Engine's max running requests")
    ap.add_argument("--max-total-tokens", type=int, default=65536, help="online: the servers' KV pool")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-dir", default=str(DEFAULT_MODELS))
    ap.add_argument("--verbose", action="store_true", help="the workers' logs on stderr")
    a = ap.parse_args(argv)
    bad = [v for v in a.variants if not _valid_variant(v)]
    if bad:
        ap.error(f"--variants: expected 'auto', 'default', 'layout' or a positive thread count, optionally "
                 f"+compile/+passive, got {bad}")
    for name in a.models:
        run(a, name)


if __name__ == "__main__":
    main()
