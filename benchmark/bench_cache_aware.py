"""cache_aware vs round_robin behind ``pdserve router``: 2 prefill (publishing KV events) + 1 decode,
``pdserve bench --dataset-name multi-turn`` through the router once per policy on the same servers
(caches flushed between runs). Prints turn-1 and later-turn TTFT side by side and the ratio, and
the prefix hits: prefill's (predicted by the router, reported in ``cached_tokens``) and decode's own
(``decode_cached_tokens``: prompt tokens it did not ask prefill for).

    python benchmark/bench_cache_aware.py --model-path tiny-llama --clients 4 --rounds 4 \\
        --question-len 384 --output-len 16
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from servers import free_port, start, stop, wait_healthy

POLICIES = ("cache_aware", "round_robin")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", default="tiny-llama")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--question-len", type=int, default=384)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--output-file", default=None, help="JSON with both runs' summaries")
    args = ap.parse_args()
    procs, prefills, decode = start_servers(args.model_path)
    results = {}
    try:
        for policy in POLICIES:
            results[policy] = run_policy(policy, prefills, decode, args)
    finally:
        for p in procs:
            stop(p)
    report(results, args)
    return 0


def start_servers(model: str) -> tuple[list[subprocess.Popen], list[tuple[str, int]], str]:
    events = json.dumps({"publisher": "zmq", "endpoint": "tcp://127.0.0.1:*"})
    procs, prefills = [], []
    for _ in range(2):
        port, boot = free_port(), free_port()
        procs.append(start(["serve", "--model-path", model, "--port", str(port), "--disaggregation-mode", "prefill",
                            "--disaggregation-bootstrap-port", str(boot), "--kv-events-config", events,
                            "--log-level", "warning"]))
        prefills.append((f"http://127.0.0.1:{port}", boot))
    port = free_port()
    procs.append(start(["serve", "--model-path", model, "--port", str(port), "--disaggregation-mode", "decode",
                        "--log-level", "warning"]))
    decode = f"http://127.0.0.1:{port}"
    for (url, _), proc in zip([*prefills, (decode, 0)], procs):
        wait_healthy(url, proc)
    return procs, prefills, decode


def run_policy(policy: str, prefills: list[tuple[str, int]], decode: str, args) -> dict:
    port = free_port()
    cmd = ["router", "--port", str(port), "--policy", policy, "--decode", decode]
    for url, boot in prefills:
        cmd += ["--prefill", url, str(boot)]
    router = start(cmd)
    url = f"http://127.0.0.1:{port}"
    decode_before = decode_counters(decode)
    try:
        wait_healthy(url, router)
        if policy == "cache_aware":
            wait_following(url)
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            subprocess.run([sys.executable, "-m", "pdserve", "bench", "--backend", "pdserve", "--base-url", url,
                            "--dataset-name", "multi-turn", "--multi-turn-clients", str(args.clients),
                            "--multi-turn-rounds", str(args.rounds), "--multi-turn-question-len",
                            str(args.question_len), "--multi-turn-output-len", str(args.output_len),
                            "--max-concurrency", str(args.clients), "--warmup-requests", "1", "--flush-cache",
                            "--disable-tqdm", "--output-file", out.name, "--label", policy], check=True)
            result = json.loads(Path(out.name).read_text().splitlines()[-1])
        result["router_metrics"] = fetch(url + "/metrics").decode()
        after = decode_counters(decode)
        result["decode"] = {k: after[k] - decode_before[k] for k in after}
        return result
    finally:
        stop(router)


def wait_following(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = json.loads(fetch(url + "/get_server_info"))
        if all((w.get("kv_events") or {}).get("fresh") for w in info["prefill"]):
            return
        time.sleep(0.2)
    raise RuntimeError("the router did not start following the prefills' KV events")


def fetch(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read()


def decode_counters(decode: str) -> dict[str, int]:
    """Decode's own prefix hit and the pages it asked prefill for, so far."""
    info = json.loads(fetch(decode + "/get_server_info"))
    return {k: int(info.get(k, 0)) for k in ("decode_cached_tokens", "kv_pages_requested")}


def cached_tokens(metrics: str, kind: str) -> float:
    name = f"pdserve_router:{kind}_cached_tokens_total"
    return sum(float(line.rpartition(" ")[2]) for line in metrics.splitlines() if line.startswith(name + "{"))


def report(results: dict, args) -> None:
    print(f"\n2 prefill + 1 decode, {args.model_path}, multi-turn {args.clients} clients x {args.rounds} rounds, "
          f"question {args.question_len} tokens, output {args.output_len}")
    print(f"{'policy':<14}{'turn-1 TTFT ms':>16}{'later TTFT ms':>16}{'later P99 ms':>14}{'predicted':>11}"
          f"{'reported':>10}{'decode hit':>12}{'pages asked':>13}")
    for policy, r in results.items():
        g = r["groups"]
        print(f"{policy:<14}{g['turn1']['mean_ttft_ms']:>16.1f}{g['later_turns']['mean_ttft_ms']:>16.1f}"
              f"{g['later_turns'].get('p99_ttft_ms', float('nan')):>14.1f}"
              f"{cached_tokens(r['router_metrics'], 'predicted'):>11.0f}"
              f"{cached_tokens(r['router_metrics'], 'reported'):>10.0f}"
              f"{r['decode']['decode_cached_tokens']:>12}{r['decode']['kv_pages_requested']:>13}")
    ratio = (results["cache_aware"]["groups"]["later_turns"]["mean_ttft_ms"]
             / results["round_robin"]["groups"]["later_turns"]["mean_ttft_ms"])
    print(f"later-turn mean TTFT, cache_aware / round_robin: {ratio:.2f}x (target <= 0.7x)")
    if args.output_file:
        slim = {p: {k: v for k, v in r.items() if k not in ("details", "router_metrics")} for p, r in results.items()}
        Path(args.output_file).write_text(json.dumps({"ratio": ratio, "runs": slim}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
