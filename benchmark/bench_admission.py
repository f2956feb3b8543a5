"""The HTTP frontend's CPU per admitted request, for bench_peer's online request shape (issue 36).

    python benchmark/bench_admission.py --baseline-pythonpath /work/main/python   # this tree vs another
    python benchmark/bench_admission.py --profile fe.prof   # this tree's frontend under cProfile
    python benchmark/bench_admission.py --in-process --baseline-pythonpath /tmp/base/python  # admission alone

Waves of ``--clients`` streaming ``/v1/completions`` requests sent at once, each a token-id prompt of
``--input-len`` LO HI ids, ``max_tokens`` 1 (``temperature`` 0, ``ignore_eos``, ``include_usage``): the
frontend's work per request is then mostly admission (HTTP bytes, body validation, the send to the
scheduler) plus one token's events. Reported per server: the frontend process's CPU per request (its
own /proc counters, all its threads, not the scheduler's) and the median over waves of the client's
median TTFT. With ``--baseline-pythonpath`` a second server imports pdserve from that directory and
rounds alternate between the two, so the machine's other load hits both alike. ``--profile FILE``
runs this tree's frontend under cProfile on its thread's CPU clock (read FILE with ``pstats``).

``--in-process`` times admission alone: no HTTP server and no scheduler. The server's ASGI app
(``create_app``, every middleware and route) gets each wave's requests as ASGI calls, their bodies
already read, and its manager sends to a ZMQ socket nobody serves; the time is the event loop
thread's CPU from the wave's arrival to its last request's send, per request (what the last
request of a wave waits before its prefill can start, less uvicorn's parsing). Each side runs in
its own process (``--baseline-pythonpath`` for the other), rounds alternating.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_peer  # noqa: E402  (its prompt sets)
import bench_server  # noqa: E402  (its server helpers)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default="tiny-llama")
    p.add_argument("--clients", type=int, default=32, help="requests per wave, sent at once")
    p.add_argument("--waves", type=int, default=8, help="waves per round")
    p.add_argument("--rounds", type=int, default=4, help="timed rounds per server (alternating)")
    p.add_argument("--input-len", type=int, nargs=2, default=[64, 256], metavar=("LO", "HI"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--baseline-pythonpath", default=None,
                   help="also a server importing pdserve from this directory, rounds alternating")
    p.add_argument("--in-process", action="store_true",
                   help="time admission alone: the ASGI app in this process, no HTTP server or scheduler")
    p.add_argument("--in-process-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--profile", metavar="FILE", default=None,
                   help="run this tree's frontend under cProfile and write its stats to FILE")
    return p.parse_args(argv)


# cProfile on the thread's CPU clock: the 2-core machine's waits for a core are not the frontend's cost
_PROFILED = """import cProfile, runpy, sys, time
out = sys.argv[1]
sys.argv = sys.argv[2:]
prof = cProfile.Profile(time.thread_time)
prof.enable()
try:
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
finally:
    prof.disable()
    prof.dump_stats(out)
"""


def start(a: argparse.Namespace, pythonpath: str | None, profile: str | None) -> tuple[str, subprocess.Popen]:
    port = bench_server.free_port()
    env = None if pythonpath is None else {**os.environ, "PYTHONPATH": pythonpath}
    prof = ["-m"] if profile is None else ["-c", _PROFILED, profile]
    proc = subprocess.Popen([sys.executable, *prof, "pdserve", "serve", "--model-path", a.model_path,
                             "--port", str(port), "--log-level", "warning"], start_new_session=True, env=env)
    return f"http://127.0.0.1:{port}", proc


async def one(session: aiohttp.ClientSession, url: str, prompt: list[int]) -> float:
    """TTFT of one streamed one-token request (its first data event)."""
    t0 = time.perf_counter()
    ttft = None
    async with session.post(url + "/v1/completions", json=bench_server.completions_body(prompt, 1)) as r:
        r.raise_for_status()
        async for line in r.content:
            if ttft is None and line.startswith(b"data: "):
                ttft = time.perf_counter() - t0
    if ttft is None:
        raise RuntimeError("a stream carried no event")
    return ttft


async def waves(url: str, prompt_sets: list[list[list[int]]]) -> list[float]:
    """Each wave's median TTFT; a wave starts when the previous one has ended."""
    out = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=600)) as s:
        for prompts in prompt_sets:
            out.append(statistics.median(await asyncio.gather(*(one(s, url, p) for p in prompts))))
    return out


# ------------------------------------------------------------ in process
def asgi_call(body: bytes, i: int) -> tuple[dict, object]:
    """The scope and receive of one POST /v1/completions, as uvicorn hands them to the app."""
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 40000 + i),
             "server": ("127.0.0.1", 30000), "state": {},
             "headers": [(b"host", b"127.0.0.1:30000"), (b"user-agent", b"Python/3.11 aiohttp/3.9"),
                         (b"accept", b"*/*"), (b"accept-encoding", b"gzip, deflate"),
                         (b"content-length", str(len(body)).encode()), (b"content-type", b"application/json")]}
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict:
        if messages:
            return messages.pop()
        await asyncio.Event().wait()  # the client never leaves
        return {}

    return scope, receive


async def admission_waves(a: argparse.Namespace, rounds: int, seed: int) -> list[float]:
    """Per round, the loop thread's CPU seconds per request from a wave's arrival to its last send."""
    import json

    import zmq

    from pdserve.config import ServerArgs
    from pdserve.engine.request import RequestLimits
    from pdserve.engine.tokenizer import load_tokenizer
    from pdserve.entrypoints.http_server import ServerContext, create_app
    from pdserve.entrypoints.tokenizer_manager import TokenizerManager
    from pdserve.obs.metrics import ServerMetrics

    args = ServerArgs(model_path=a.model_path)
    files = args.model_files()
    tok = load_tokenizer(files.path)
    tm = TokenizerManager(args, tok, ServerMetrics(a.model_path))
    tm.limits = RequestLimits(args.context_length or 4096, tok.vocab_size, 32768)
    tm.healthy = True
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    push.bind("inproc://admission")
    pull.connect("inproc://admission")
    tm._send = push  # what a scheduler would read
    app = create_app(ServerContext(args, files, tm, ServerMetrics(a.model_path)))
    out = []

    async def drop(_message) -> None:
        return None

    for r in range(rounds + 1):  # the first is a warm-up
        waves = []
        for w in range(a.waves):
            prompts = bench_peer.make_prompts(a.clients, tuple(a.input_len), tok.vocab_size, seed + 1000 * r + w)
            bodies = [json.dumps(bench_server.completions_body(p, 1)).encode() for p in prompts]
            calls = [asgi_call(b, i) for i, b in enumerate(bodies)]
            t0 = time.thread_time()
            tasks = [asyncio.create_task(app(scope, receive, drop)) for scope, receive in calls]
            while tm.num_inflight < len(tasks):  # each request sends before its first wait
                await asyncio.sleep(0)
            waves.append((time.thread_time() - t0) / len(tasks))
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            while pull.poll(0):
                pull.recv()
        if r:
            out.append(statistics.median(waves))
    push.close(0)
    pull.close(0)
    ctx.term()
    return out


def in_process(a: argparse.Namespace) -> int:
    """Alternate rounds of ``admission_waves`` between this tree and the baseline, one process each."""
    me = [sys.executable, __file__, "--in-process-worker", "--model-path", a.model_path, "--clients", str(a.clients),
          "--waves", str(a.waves), "--input-len", *map(str, a.input_len)]
    sides = {"tree": None} | ({"baseline": a.baseline_pythonpath} if a.baseline_pythonpath else {})
    per: dict[str, list[float]] = {n: [] for n in sides}
    load = [bench_server.load_average()]
    for r in range(a.rounds):
        order = list(sides.items())
        for name, pythonpath in order if r % 2 == 0 else order[::-1]:
            env = None if pythonpath is None else {**os.environ, "PYTHONPATH": pythonpath}
            done = subprocess.run([*me, "--seed", str(a.seed + r)], env=env, capture_output=True, text=True,
                                  timeout=600)
            if done.returncode != 0:
                raise RuntimeError(f"{name}: {done.stderr[-2000:]}")
            per[name] += [float(x) for x in done.stdout.split()]
    load.append(bench_server.load_average())
    print(f"model {a.model_path}: admission in process, {a.rounds} rounds x 3 x {a.waves} waves of {a.clients} "
          f"/v1/completions (prompts {a.input_len[0]}-{a.input_len[1]} ids, stream, max_tokens 1); load average "
          f"{load[0]} before, {load[1]} after")
    for name, xs in per.items():
        print(f"{name}: CPU per admitted request, median {statistics.median(xs) * 1e6:.0f} us "
              f"(per round: {', '.join(f'{x * 1e6:.0f}' for x in xs)})")
    return 0


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.in_process_worker:
        print(" ".join(f"{x:.9f}" for x in asyncio.run(admission_waves(a, 3, a.seed))))
        return 0
    if a.in_process:
        return in_process(a)
    from pdserve.config import ModelConfig

    vocab = ModelConfig.from_path(a.model_path).vocab_size
    sides = {"tree": None} | ({"baseline": a.baseline_pythonpath} if a.baseline_pythonpath else {})
    servers: dict[str, tuple[str, subprocess.Popen]] = {}
    try:
        for name, pythonpath in sides.items():
            servers[name] = start(a, pythonpath, a.profile if name == "tree" else None)
        for url, proc in servers.values():
            asyncio.run(bench_server.wait_healthy(url, proc))
            warm = [bench_peer.make_prompts(a.clients, tuple(a.input_len), vocab, a.seed + 50_000 + w)
                    for w in range(2)]
            asyncio.run(waves(url, warm))
        cpu: dict[str, list[float]] = {n: [] for n in servers}
        ttft: dict[str, list[float]] = {n: [] for n in servers}
        load = [bench_server.load_average()]
        for r in range(a.rounds):
            sets = [bench_peer.make_prompts(a.clients, tuple(a.input_len), vocab, a.seed + 1000 * r + w)
                    for w in range(a.waves)]
            order = list(servers.items())
            for name, (url, proc) in order if r % 2 == 0 else order[::-1]:
                cpu0 = bench_server.cpu_seconds(proc.pid)
                ttft[name] += asyncio.run(waves(url, sets))
                cpu[name].append((bench_server.cpu_seconds(proc.pid) - cpu0) / (a.waves * a.clients))
        load.append(bench_server.load_average())
        print(f"model {a.model_path}: {a.rounds} rounds x {a.waves} waves of {a.clients} streaming /v1/completions, "
              f"prompts {a.input_len[0]}-{a.input_len[1]} ids, max_tokens 1; load average {load[0]} before, "
              f"{load[1]} after")
        for name in servers:
            rounds = ", ".join(f"{c * 1e3:.2f}" for c in cpu[name])
            print(f"{name}: frontend CPU per request {statistics.median(cpu[name]) * 1e3:.2f} ms (rounds: {rounds}); "
                  f"median wave TTFT {statistics.median(ttft[name]) * 1e3:.0f} ms")
    finally:
        for _, proc in servers.values():
            bench_server.stop_server(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
