"""Where a streamed token waits on its way from the scheduler to the client, per stage, under load.

    python benchmark/handoff_profile.py --model-path tiny-llama --num-requests 32 --output-len 64
    python benchmark/handoff_profile.py --model-path tiny-llama --compare-overlap   # overlap on vs off
    python benchmark/handoff_profile.py --baseline-pythonpath /tmp/base/python   # this tree vs another
    python benchmark/handoff_profile.py --peer-shape --baseline-pythonpath /tmp/base/python  # bench_peer's online load

N concurrent streaming clients of ``/generate`` (token-id prompts, greedy, ``ignore_eos``). The
client side measures TTFT and the gap between a request's SSE events (ITL); the server side is the
frontend's handoff profile (``/get_server_info`` -> ``handoff``, obs/handoff.py): scheduler send ->
message in the frontend (``socket``), routing, the request coroutine's wake-up, detokenizing, and
the HTTP write. ``--compare-overlap`` starts a second server with ``--disable-overlap-schedule``
and alternates rounds between the two (the machine's other load hits both alike);
``--baseline-pythonpath`` does the same against a server running another checkout's package (a
change's before and after from one run). ``--peer-shape`` sends bench_peer's online load instead:
``--num-prompts`` requests of ``--input-len`` LO HI token ids through ``--clients`` concurrent
streaming ``/v1/completions`` clients, servers at their default flags, a fresh prompt set per round;
it adds the TTFT of the first and the second half of the requests to start (the first wave
prefills together, later requests join a running decode batch). The whole-step
view of the frontend's CPU is ``bench_server.py --profile-frontend`` + ``frontend_profile.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_peer  # noqa: E402  (its prompt sets)
import bench_server  # noqa: E402  (the sibling script's server and prompt helpers)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default="tiny-llama")
    p.add_argument("--num-requests", type=int, default=32, help="concurrent streaming clients")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-threads", type=int, default=None, help="the servers' --num-threads (default: theirs)")
    p.add_argument("--max-total-tokens", type=int, default=32768)
    p.add_argument("--repeats", type=int, default=2, help="timed rounds per server")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare-overlap", action="store_true",
                   help="also a server with --disable-overlap-schedule, rounds alternating")
    p.add_argument("--baseline-pythonpath", default=None,
                   help="also a server importing pdserve from this directory (e.g. an older checkout's python/), "
                        "rounds alternating")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                   help="also a server of this tree with these extra flags (e.g. 'chunk1024=--chunked-prefill-size "
                        "1024'), rounds alternating; repeatable")
    p.add_argument("--peer-shape", action="store_true",
                   help="bench_peer's online load: /v1/completions, --num-prompts over --clients, default flags")
    p.add_argument("--num-prompts", type=int, default=64, help="--peer-shape: requests per round")
    p.add_argument("--clients", type=int, default=32, help="--peer-shape: concurrent streaming clients")
    p.add_argument("--input-len", type=int, nargs=2, default=[64, 256], metavar=("LO", "HI"),
                   help="--peer-shape: prompt lengths, uniform")
    a = p.parse_args(argv)
    a.stream_interval, a.profile_frontend, a.endpoint = 1, None, "/generate"  # what bench_server's helpers read
    return a


async def _stream(session: aiohttp.ClientSession, url: str, body: dict, is_token) -> tuple[float, list[float]]:
    """(start, arrival times of the SSE events ``is_token`` counts) of one streamed request."""
    t0 = time.perf_counter()
    arrivals = []
    async with session.post(url, json=body) as r:
        r.raise_for_status()
        async for line in r.content:
            if line.startswith(b"data: [DONE]"):
                break
            if is_token(line):
                arrivals.append(time.perf_counter())
    return t0, arrivals


async def one_stream(session: aiohttp.ClientSession, url: str, prompt: list[int], output_len: int
                     ) -> tuple[float, list[float]]:
    """(TTFT, arrival times of its SSE events) of one streamed request."""
    t0, arrivals = await _stream(session, url + "/generate", bench_server.generate_body(prompt, output_len),
                                 lambda line: line.startswith(b"data: "))
    return arrivals[0] - t0, arrivals


async def one_round(url: str, prompts: list[list[int]], output_len: int) -> dict:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=600)) as s:
        t0 = time.perf_counter()
        res = await asyncio.gather(*(one_stream(s, url, p, output_len) for p in prompts))
    wall = max(a[-1] for _, a in res) - t0
    gaps = [b - a for _, arr in res for a, b in zip(arr, arr[1:])]
    return {"tok_s": len(prompts) * output_len / wall, "ttft": statistics.median(t for t, _ in res),
            "itl": statistics.median(gaps), "itl_p90": sorted(gaps)[int(0.9 * len(gaps))]}


async def peer_stream(session: aiohttp.ClientSession, url: str, prompt: list[int], output_len: int
                      ) -> tuple[float, float, list[float]]:
    """(start, TTFT, arrival times of its token events) of one streamed ``/v1/completions`` request."""
    t0, arrivals = await _stream(  # every data event but the usage one
        session, url + "/v1/completions", bench_server.completions_body(prompt, output_len),
        lambda line: line.startswith(b"data: {") and b'"choices":[]' not in line)
    return t0, arrivals[0] - t0, arrivals


async def peer_round(url: str, prompts: list[list[int]], output_len: int, clients: int) -> dict:
    gate = asyncio.Semaphore(clients)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=600)) as s:
        async def limited(p):
            async with gate:
                return await peer_stream(s, url, p, output_len)

        t0 = time.perf_counter()
        res = await asyncio.gather(*(limited(p) for p in prompts))
    wall = max(a[-1] for _, _, a in res) - t0
    gaps = [b - a for _, _, arr in res for a, b in zip(arr, arr[1:])]
    by_start = [t for _, t, _ in sorted(res, key=lambda r: r[0])]
    half = len(by_start) // 2
    return {"tok_s": len(prompts) * output_len / wall, "ttft": statistics.median(t for _, t, _ in res),
            "itl": statistics.median(gaps), "itl_p90": sorted(gaps)[int(0.9 * len(gaps))],
            "ttft_first": statistics.median(by_start[:half]), "ttft_rest": statistics.median(by_start[half:])}


async def server_info(url: str) -> dict:
    async with aiohttp.ClientSession() as s, s.get(url + "/get_server_info") as r:
        return json.loads(await r.read())


def start(a: argparse.Namespace, extra: list[str], pythonpath: str | None = None):
    port = bench_server.free_port()
    env = None if pythonpath is None else {**os.environ, "PYTHONPATH": pythonpath}
    flags = ["--model-path", a.model_path] if a.peer_shape else bench_server.server_flags(a)
    proc = bench_server.subprocess.Popen(
        [sys.executable, "-m", "pdserve", "serve", *flags, *extra, "--port", str(port),
         "--log-level", "warning"], start_new_session=True, env=env)
    return f"http://127.0.0.1:{port}", proc


async def ttft_stages(url: str) -> str:
    """The server's mean TTFT and its stages (queue, prefill, ...) over every finished request, from /metrics."""
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    sums: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        for kind in ("_sum", "_count"):
            if "ttft_stage_seconds" + kind in name:
                stage = name.split('stage="')[1].split('"')[0]
                sums[stage + kind] = float(value)
            elif "time_to_first_token_seconds" + kind in name:
                sums["ttft" + kind] = float(value)
    means = {k[:-4]: sums[k] / sums[k[:-4] + "_count"] * 1e3 for k in sums if k.endswith("_sum")
             and sums.get(k[:-4] + "_count")}
    return ", ".join(f"{k} {v:.0f}" for k, v in means.items())


def stage_table(handoff: dict) -> list[str]:
    rows = [f"  {'stage':<11} {'count':>7} {'mean ms':>8} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8}"]
    for stage, s in handoff.items():
        if "mean_ms" in s:
            rows.append(f"  {stage:<11} {int(s['count']):>7} {s['mean_ms']:8.3f} {s['p50_ms']:8.3f} {s['p90_ms']:8.3f} "
                        f"{s['p99_ms']:8.3f}")
    return rows


def main(argv=None) -> int:
    a = parse_args(argv)
    from pdserve.config import ModelConfig

    vocab = ModelConfig.from_path(a.model_path).vocab_size
    prompts = bench_server.make_prompts(a.num_requests, a.prompt_len, vocab, a.seed)

    def timed_round(url: str, r: int) -> dict:
        if not a.peer_shape:
            return asyncio.run(one_round(url, prompts, a.output_len))
        fresh = bench_peer.make_prompts(a.num_prompts, tuple(a.input_len), vocab, a.seed + r)  # no prefix hits
        return asyncio.run(peer_round(url, fresh, a.output_len, a.clients))

    sides: dict[str, tuple[list[str], str | None]] = {"overlap": ([], None)}
    if a.compare_overlap:
        sides["plain loop"] = (["--disable-overlap-schedule"], None)
    if a.baseline_pythonpath:
        sides["baseline"] = ([], a.baseline_pythonpath)
    for variant in a.variant:
        name, _, flags = variant.partition("=")
        sides[name] = (flags.split(), None)
    servers = {}
    try:
        for name, (extra, pythonpath) in sides.items():
            servers[name] = start(a, extra, pythonpath)
        for url, proc in servers.values():
            asyncio.run(bench_server.wait_healthy(url, proc))
            asyncio.run(one_round(url, prompts[:4], 4))  # warm-up
            if a.peer_shape:  # and one round of the real shape (as bench_peer's), not timed
                warm = bench_peer.make_prompts(a.clients, tuple(a.input_len), vocab, a.seed + 20_000)
                asyncio.run(peer_round(url, warm, a.output_len, a.clients))
        rounds: dict[str, list[dict]] = {name: [] for name in servers}
        load = [bench_server.load_average()]
        for r in range(a.repeats):
            order = list(servers.items())
            for name, (url, _) in order if r % 2 == 0 else order[::-1]:
                rounds[name].append(timed_round(url, r))
        load.append(bench_server.load_average())
        shape = (f"{a.num_prompts} requests of {a.input_len[0]}-{a.input_len[1]} tokens over {a.clients} clients "
                 f"(/v1/completions, default flags)" if a.peer_shape else
                 f"{a.num_requests} streams x (prompt {a.prompt_len}")
        print(f"model {a.model_path}: {shape}, output {a.output_len}, {a.repeats} rounds per server, "
              f"load average {load[0]} before, {load[1]} after")
        for name, (url, _) in servers.items():
            info = asyncio.run(server_info(url))
            rs = rounds[name]
            med = lambda k: statistics.median(r[k] for r in rs)  # noqa: E731,B023
            print(f"{name}: overlap_schedule={info.get('overlap_schedule')} threads={info.get('thread_layout')}")
            per_round = ", ".join(f"{r['tok_s']:.0f}" for r in rs)
            print(f"  client: {med('tok_s'):.0f} tok/s ({per_round}), median TTFT "
                  f"{med('ttft') * 1e3:.0f} ms, median ITL {med('itl') * 1e3:.1f} ms (p90 {med('itl_p90') * 1e3:.1f})")
            if a.peer_shape:
                per_round = ", ".join(f"{r['ttft'] * 1e3:.0f}" for r in rs)
                print(f"  TTFT per round {per_round} ms; first half to start {med('ttft_first') * 1e3:.0f} ms, "
                      f"second half {med('ttft_rest') * 1e3:.0f} ms")
                print(f"  server-side TTFT mean and its stages (ms, every request): {asyncio.run(ttft_stages(url))}")
            print("\n".join(stage_table(info.get("handoff", {}))))
        if a.compare_overlap:
            pairs = [o["tok_s"] / p["tok_s"] for o, p in zip(rounds["overlap"], rounds["plain loop"])]
            print(f"overlap / plain loop tok/s per round pair: {', '.join(f'{x:.2f}' for x in pairs)}")
        if a.baseline_pythonpath:
            for key in ("tok_s", "ttft", "itl"):
                pairs = [o[key] / p[key] for o, p in zip(rounds["overlap"], rounds["baseline"])]
                print(f"this tree / baseline {key} per round pair: {', '.join(f'{x:.2f}' for x in pairs)}")
    finally:
        for _, proc in servers.values():
            bench_server.stop_server(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
