"""A fixed P:D split vs ``pdserve up --elastic`` on the same cores, under a workload whose mix
changes halfway: long prompts with short answers (phase A), then chat: short prompts, long
answers (phase B). One run, side by side.

    python benchmark/bench_elastic.py --model-path tiny-llama --out-dir benchmark/results/elastic

1. ``pdserve up`` with a fixed split (``--fixed-prefill`` of ``--num-servers``; default 1P2D,
   wrong for phase A, right for phase B).
2. ``pdserve up --elastic`` with the same servers starting at the same split; its controller may
   switch roles (``POST /pd_role_switch``) as the mix changes.
Against each, ``pdserve bench`` runs phase A then phase B (same seeds, so the same prompts and
arrival times). Writes ``bench_elastic.json`` (per-phase goodput, P99 TTFT and ITL of both, the
switches with their times) and ``bench_elastic.png`` (TTFT of every request over time, both
deployments, a vertical line at each role switch, the elastic split as a step line).
Target: elastic goodput >= 1.2x fixed in the phase the fixed split is wrong for.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plot  # noqa: E402  (benchmark/plot.py, beside this script)
import servers  # noqa: E402

PHASES = ("A: long prompts", "B: chat")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default="tiny-llama")
    p.add_argument("--num-servers", type=int, default=3)
    p.add_argument("--fixed-prefill", type=int, default=1, help="prefill servers of the fixed split (and of the "
                   "elastic one at the start)")
    p.add_argument("--long-prompts", type=int, default=24, help="requests of phase A")
    p.add_argument("--long-input-len", type=int, default=768)
    p.add_argument("--long-output-len", type=int, default=4)
    p.add_argument("--long-rate", type=float, default=0.6)
    p.add_argument("--chat-prompts", type=int, default=60, help="requests of phase B")
    p.add_argument("--chat-input-len", type=int, default=32)
    p.add_argument("--chat-output-len", type=int, default=96)
    p.add_argument("--chat-rate", type=float, default=2.5)
    p.add_argument("--slo", default="ttft:3000,tpot:150", help="goodput and controller SLO (ms)")
    p.add_argument("--elastic-interval", type=float, default=2.0)
    p.add_argument("--elastic-patience", type=int, default=2)
    p.add_argument("--server-flags", default="--max-total-tokens 16384 --chunked-prefill-size 512",
                   help="extra flags every server gets")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="benchmark/results/elastic")
    return p.parse_args(argv)


def bench_phase(a: argparse.Namespace, url: str, phase: int, label: str, out: Path) -> dict:
    n, isl, osl, rate = ((a.long_prompts, a.long_input_len, a.long_output_len, a.long_rate) if phase == 0
                         else (a.chat_prompts, a.chat_input_len, a.chat_output_len, a.chat_rate))
    cmd = [sys.executable, "-m", "pdserve.bench_serving", "--base-url", url, "--backend", "pdserve",
           "--dataset-name", "random", "--num-prompts", str(n), "--random-input-len", str(isl),
           "--random-output-len", str(osl), "--random-range-ratio", "0.8", "--request-rate", str(rate),
           "--slo", a.slo, "--seed", str(a.seed + phase), "--warmup-requests", "0", "--disable-tqdm",
           "--label", f"{label} {PHASES[phase]}", "--output-file", str(out)]
    servers.subprocess.run(cmd, check=True)
    ended = time.time()
    result = plot.load_results([str(out)])[-1]
    result["wall_start"] = ended - result["duration"]  # the first send (the client's start-up excluded)
    return result


def free_range(n: int) -> int:
    """The first of ``n`` consecutive free ports (``up`` takes its servers' ports above its own)."""
    while True:
        base = servers.free_port()
        if base + n < 65536 and all(_free(base + i) for i in range(n)):
            return base


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def run(a: argparse.Namespace, elastic: bool, out: Path) -> tuple[list[dict], list[dict]]:
    """Both phases against one deployment; returns the two results and the role switches made."""
    port = free_range(a.num_servers + 1)
    boot = free_range(a.num_servers)
    while boot <= port + a.num_servers and port <= boot + a.num_servers:
        boot = free_range(a.num_servers)
    flags = ["up", "--model-path", a.model_path, "--port", str(port), "--bootstrap-port", str(boot),
             "--health-check-interval-secs", "1", "--log-level", "warning", *a.server_flags.split()]
    if elastic:
        flags += ["--elastic", "--num-servers", str(a.num_servers), "--num-prefill", str(a.fixed_prefill),
                  "--slo", a.slo, "--elastic-interval", str(a.elastic_interval),
                  "--elastic-patience", str(a.elastic_patience)]
    else:
        flags += ["--num-prefill", str(a.fixed_prefill), "--num-decode", str(a.num_servers - a.fixed_prefill)]
    log = open(out.parent / f"up_{'elastic' if elastic else 'fixed'}.log", "w")  # noqa: SIM115 - kept open for the child
    proc = servers.start(flags, log=log)
    url = f"http://127.0.0.1:{port}"
    label = "elastic" if elastic else f"fixed {a.fixed_prefill}P{a.num_servers - a.fixed_prefill}D"
    try:
        servers.wait_healthy(url, proc)
        results = [bench_phase(a, url, phase, label, out) for phase in (0, 1)]
        return results, switches(url)
    finally:
        servers.stop(proc)
        log.close()


def switches(router_url: str) -> list[dict]:
    with urllib.request.urlopen(router_url + "/get_server_info", timeout=30) as resp:
        info = json.loads(resp.read())
    out = []
    for w in info["prefill"] + info["decode"]:
        for s in (w.get("server_info") or {}).get("role_switches", []):
            out.append({"url": w["url"], **s})
    return sorted(out, key=lambda s: s["at"])


def summarize(results: list[dict]) -> list[dict]:
    return [{"phase": PHASES[i], "wall_start": r["wall_start"], "request_goodput": r["request_goodput"],
             "p99_ttft_ms": r["p99_ttft_ms"],
             "p99_itl_ms": r["p99_itl_ms"], "completed": r["completed"], "request_throughput":
             r["request_throughput"]} for i, r in enumerate(results)]


def plot_timeline(runs: dict[str, list[dict]], moves: list[dict], start_split: int, total: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    for (label, results), marker in zip(runs.items(), ("o", "x")):
        t0 = results[0]["wall_start"]
        for r in results:
            d = r["details"]
            xs = [r["wall_start"] - t0 + s for s, ok in zip(d["start_times"], d["success"]) if ok]
            ys = [t * 1000 for t, ok in zip(d["ttfts"], d["success"]) if ok]
            ax.scatter(xs, ys, s=10, marker=marker, label=f"{label} {r.get('label', '').split(' ', 1)[-1]}")
    elastic = runs.get("elastic")
    if elastic:
        t0 = elastic[0]["wall_start"]
        split, times, prefill = [0.0], [start_split], start_split
        for m in moves:
            ax.axvline(m["at"] - t0, color="red", linestyle="--", linewidth=1)
            prefill += 1 if m["role"] == "prefill" else -1
            split.append(m["at"] - t0)
            times.append(prefill)
        ax2 = ax.twinx()
        ax2.step(split + [ax.get_xlim()[1]], times + [prefill], where="post", color="red", label="elastic prefill "
                 "servers")
        ax2.set_ylim(0, total)
        ax2.set_ylabel("elastic: prefill servers")
    ax.set_xlabel("seconds since the first phase started")
    ax.set_ylabel("TTFT (ms)")
    ax.set_yscale("log")
    ax.legend(fontsize=7, loc="upper left")
    ax.set_title("fixed split vs --elastic (red dashed: role switches)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    a = parse_args(argv)
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    raw = out_dir / "bench.jsonl"
    raw.unlink(missing_ok=True)
    t0 = time.monotonic()
    fixed, _ = run(a, False, raw)
    elastic, moves = run(a, True, raw)
    fixed_s, elastic_s = summarize(fixed), summarize(elastic)
    ratios = [e["request_goodput"] / f["request_goodput"] if f["request_goodput"] else None
              for f, e in zip(fixed_s, elastic_s)]
    summary = {"args": vars(a), "fixed": fixed_s, "elastic": elastic_s, "goodput_elastic_over_fixed": ratios,
               "switches": moves, "wall_s": time.monotonic() - t0}
    (out_dir / "bench_elastic.json").write_text(json.dumps(summary, indent=1))
    plot_timeline({"fixed": fixed, "elastic": elastic}, moves, a.fixed_prefill, a.num_servers,
                  str(out_dir / "bench_elastic.png"))
    for i, phase in enumerate(PHASES):
        f, e = fixed_s[i], elastic_s[i]
        ratio = f"{ratios[i]:.2f}" if ratios[i] is not None else "n/a"
        print(f"phase {phase}: goodput fixed {f['request_goodput']:.2f} / elastic {e['request_goodput']:.2f} req/s "
              f"(x{ratio}); P99 TTFT {f['p99_ttft_ms']:.0f} / {e['p99_ttft_ms']:.0f} ms; "
              f"P99 ITL {f['p99_itl_ms']:.0f} / {e['p99_itl_ms']:.0f} ms")
    print(f"switches: {[(round(m['at'] - elastic[0]['wall_start'], 1), m['role']) for m in moves]}")
    print(f"wrote {out_dir / 'bench_elastic.json'} and {out_dir / 'bench_elastic.png'} in {summary['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
