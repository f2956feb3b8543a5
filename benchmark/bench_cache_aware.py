"""What cache_aware knows of the prefills' caches, side by side: ``none`` (routed by load: the router
started with ``--no-approximate-index``), ``approximate`` (the router's guess from its own routing)
and ``events`` (the prefills publish KV events). 2 prefill + 1 decode behind ``pdserve router``;
for none and approximate the prefills are started by hand's way, without ``--kv-events-config``,
for events with it (the decode server stays; caches flushed between runs).

Each of ``--clients`` runs one multi-turn conversation of ``--rounds`` turns on ``/generate``
(streamed, greedy): turn t's prompt is turn t-1's prompt, its answer and a new question. Per
turn >= 2 it records the share of the previous turn's prompt the prefill reused
(``cached_tokens`` / the previous turn's prompt tokens: about 1.0 when the turn went back to the
prefill holding its history, which caches the prompts it computed, not decode's answers), and
reports the mean, the share of turns reusing >= 0.9, TTFT of turn 1 and of later turns, and the
router's decisions (``policy_decisions_total`` by reason).

    python benchmark/bench_cache_aware.py --model-path tiny-llama --clients 8 --rounds 4 \\
        --question-len 128 --output-len 16
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from servers import free_port, start, stop, wait_healthy

MODES = ("none", "approximate", "events")
EVENTS = json.dumps({"publisher": "zmq", "endpoint": "tcp://127.0.0.1:*"})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", default="tiny-llama")
    ap.add_argument("--clients", type=int, default=8, help="conversations, run at once")
    ap.add_argument("--rounds", type=int, default=4, help="turns per conversation")
    ap.add_argument("--question-len", type=int, default=128, help="tokens each turn adds besides the answer")
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-file", default=None, help="JSON with every run's summary")
    args = ap.parse_args()
    results = {}
    decode_proc, decode = start_server(args.model_path, "decode")
    try:
        wait_healthy(decode, decode_proc)
        for with_events, modes in ((False, ("none", "approximate")), (True, ("events",))):
            procs, prefills = start_prefills(args.model_path, with_events)
            try:
                for mode in modes:
                    results[mode] = run_mode(mode, prefills, decode, args)
            finally:
                for p in procs:
                    stop(p)
    finally:
        stop(decode_proc)
    report(results, args)
    return 0


def start_server(model: str, mode: str, *flags: str) -> tuple:
    port = free_port()
    proc = start(["serve", "--model-path", model, "--port", str(port), "--disaggregation-mode", mode,
                  "--log-level", "warning", *flags])
    return proc, f"http://127.0.0.1:{port}"


def start_prefills(model: str, with_events: bool) -> tuple[list, list[tuple[str, int]]]:
    procs, prefills = [], []
    for _ in range(2):
        boot = free_port()
        flags = ["--disaggregation-bootstrap-port", str(boot)] + (["--kv-events-config", EVENTS] if with_events else [])
        proc, url = start_server(model, "prefill", *flags)
        procs.append(proc)
        prefills.append((url, boot))
    for (url, _), proc in zip(prefills, procs):
        wait_healthy(url, proc)
    return procs, prefills


def run_mode(mode: str, prefills: list[tuple[str, int]], decode: str, args) -> dict:
    port = free_port()
    cmd = ["router", "--port", str(port), "--policy", "cache_aware", "--decode", decode, "--log-level", "warning"]
    cmd += ["--no-approximate-index"] if mode == "none" else []
    for url, boot in prefills:
        cmd += ["--prefill", url, str(boot)]
    router = start(cmd)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, router)
        wait_ready(url, mode)
        generate(url, list(range(100, 140)), args.output_len)  # warm-up
        post(url + "/flush_cache")
        rng = random.Random(args.seed)  # the same conversations in every mode
        questions = [[[rng.randrange(100, 2000) for _ in range(args.question_len)] for _ in range(args.rounds)]
                     for _ in range(args.clients)]
        with ThreadPoolExecutor(args.clients) as pool:
            turns = [t for conv in pool.map(lambda q: converse(url, q, args.output_len), questions) for t in conv]
        return summarize(turns, fetch(url + "/metrics").decode())
    finally:
        stop(router)


def wait_ready(url: str, mode: str, timeout: float = 60.0) -> None:
    """Until the router hashes prompts (it has read a prefill's page size) and, for events, follows both."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = json.loads(fetch(url + "/get_server_info"))
        hashing = info["cache_view"]["page_size"] is not None
        if hashing and (mode != "events" or all((w["kv_events"] or {}).get("fresh") for w in info["prefill"])):
            return
        time.sleep(0.2)
    raise RuntimeError(f"{mode}: the router is not ready to route by cache after {timeout} s")


def converse(url: str, questions: list[list[int]], output_len: int) -> list[dict]:
    """One conversation: per turn its prompt tokens, cached tokens, TTFT and the previous turn's prompt
    tokens (what the prefill that served it computed and cached)."""
    prompt: list[int] = []
    out: list[dict] = []
    for t, question in enumerate(questions):
        prompt = prompt + question
        ttft, meta, output_ids = generate(url, prompt, output_len)
        out.append({"turn": t + 1, "prompt": meta["prompt_tokens"], "cached": meta["cached_tokens"],
                    "prev": out[-1]["prompt"] if out else 0, "ttft": ttft})
        prompt = prompt + output_ids
    return out


def generate(url: str, ids: list[int], output_len: int) -> tuple[float, dict, list[int]]:
    """(TTFT in s, the final meta_info, output ids) of one streamed greedy /generate."""
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True}}
    req = urllib.request.Request(url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    start_t, ttft, last = time.perf_counter(), None, None
    with urllib.request.urlopen(req, timeout=600) as resp:
        for line in resp:
            if not line.startswith(b"data: {"):
                continue
            last = json.loads(line[6:])
            if "error" in last:
                raise RuntimeError(f"/generate: {last['error']}")
            if ttft is None:
                ttft = time.perf_counter() - start_t
    if last is None or ttft is None:
        raise RuntimeError("/generate: empty stream")
    return ttft, last["meta_info"], last["output_ids"]


def summarize(turns: list[dict], metrics: str) -> dict:
    later = [t for t in turns if t["turn"] >= 2]
    reuse = [t["cached"] / t["prev"] for t in later]
    first = [t["ttft"] for t in turns if t["turn"] == 1]
    return {"later_turns": len(later), "mean_reuse": sum(reuse) / len(reuse),
            "share_reuse_ge_0_9": sum(r >= 0.9 for r in reuse) / len(reuse),
            "turn1_ttft_ms": 1e3 * sum(first) / len(first),
            "later_ttft_ms": 1e3 * sum(t["ttft"] for t in later) / len(later),
            "decisions": decisions(metrics), "turns": turns}


def decisions(metrics: str) -> dict[str, float]:
    """The router's prefill decisions by reason (``cache_hit``, ``balance``, ``load``)."""
    out: dict[str, float] = {}
    for line in metrics.splitlines():
        if line.startswith("pdserve_router:policy_decisions_total{") and 'role="prefill"' in line:
            reason = line.split('reason="')[1].split('"')[0]
            out[reason] = out.get(reason, 0.0) + float(line.rpartition(" ")[2])
    return out


def fetch(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read()


def post(url: str) -> None:
    with urllib.request.urlopen(urllib.request.Request(url, b"", method="POST"), timeout=60) as r:
        r.read()


def report(results: dict, args) -> None:
    print(f"\n2 prefill + 1 decode, {args.model_path}, {args.clients} conversations x {args.rounds} turns at once, "
          f"{args.question_len} new tokens a turn, output {args.output_len}")
    print(f"{'mode':<13}{'reuse of prev turn':>19}{'turns >= 0.9':>14}{'turn-1 TTFT ms':>16}{'later TTFT ms':>15}"
          f"  prefill decisions")
    for mode in MODES:
        r = results[mode]
        why = ", ".join(f"{k} {v:.0f}" for k, v in sorted(r["decisions"].items()))
        print(f"{mode:<13}{r['mean_reuse']:>19.2f}{r['share_reuse_ge_0_9']:>14.2f}{r['turn1_ttft_ms']:>16.1f}"
              f"{r['later_ttft_ms']:>15.1f}  {why}")
    if args.output_file:
        Path(args.output_file).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    sys.exit(main())
