"""Colocated vs 1 prefill + 1 decode on the same cores, under the workload where disaggregation
pays: interactive requests while long prompts keep arriving. One run, side by side.

    python benchmark/compare_pd.py --model-path tiny-deepseek --out-dir benchmark/results/compare_pd

1. A colocated ``pdserve serve`` pinned to all the cores, at its default flags (its scheduler takes
   every core but one, leaving one to the frontend; ``--colocated-num-threads`` overrides).
2. ``pdserve up``: one prefill and one decode server, each pinned to its half of the cores, a
   router in front.
Against each, ``pdserve bench --dataset-name mixed`` with the same seed (same prompts, same
arrival times). Writes ``compare_pd.json`` (both bench results and the ratios) and
``compare_pd.png`` (TTFT and ITL distributions of both deployments, per stream).
Target: P99 ITL of 1P1D <= 0.5 x colocated, goodput no worse. Also printed: the interactive
stream's tokens per second of the run, 1P1D over colocated (a side that falls behind on the long
prompts lengthens the run), and the long prompts' TTFT.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plot  # noqa: E402  (benchmark/plot.py, beside this script)
import servers  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default="tiny-deepseek")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=120, help="interactive + background requests")
    p.add_argument("--interactive-rate", type=float, default=2.0, help="interactive requests per second")
    p.add_argument("--interactive-input-len", type=int, default=128)
    p.add_argument("--interactive-output-len", type=int, default=128)
    p.add_argument("--background-rate", type=float, default=2.0, help="long prompts per second")
    p.add_argument("--background-input-len", type=int, default=512)
    p.add_argument("--background-output-len", type=int, default=8)
    p.add_argument("--slo", default="ttft:2000,tpot:100", help="goodput SLO (ms), pdserve bench's format")
    p.add_argument("--colocated-num-threads", type=int, default=None,
                   help="torch threads of the colocated scheduler (default: the server's own default, "
                        "every core but one; 1P1D's servers get one thread per core of their share)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="benchmark/results/compare_pd")
    return p.parse_args(argv)


def bench(a: argparse.Namespace, url: str, label: str, out: Path) -> dict:
    cmd = [sys.executable, "-m", "pdserve.bench_serving", "--base-url", url, "--backend", "pdserve",
           "--dataset-name", "mixed", "--num-prompts", str(a.num_prompts), "--tokenize-prompt",
           "--mixed-interactive-rate", str(a.interactive_rate),
           "--mixed-interactive-input-len", str(a.interactive_input_len),
           "--mixed-interactive-output-len", str(a.interactive_output_len),
           "--mixed-background-rate", str(a.background_rate),
           "--mixed-background-input-len", str(a.background_input_len),
           "--mixed-background-output-len", str(a.background_output_len),
           "--slo", a.slo, "--seed", str(a.seed), "--warmup-requests", "2", "--disable-tqdm",
           "--label", label, "--output-file", str(out)]
    subprocess.run(cmd, check=True)
    return plot.load_results([str(out)])[-1]


def run_colocated(a: argparse.Namespace, cores: list[int], out: Path) -> dict:
    port = servers.free_port()
    proc = servers.start(["serve", "--model-path", a.model_path, "--port", str(port), "--page-size", str(a.page_size),
                          *(["--num-threads", str(a.colocated_num_threads)] if a.colocated_num_threads else []),
                          "--log-level", "error"], cores)
    try:
        servers.wait_healthy(f"http://127.0.0.1:{port}", proc)
        return bench(a, f"http://127.0.0.1:{port}", "colocated", out)
    finally:
        servers.stop(proc)


def run_pd(a: argparse.Namespace, out: Path) -> dict:
    port = servers.free_port()
    proc = servers.start(["up", "--model-path", a.model_path, "--port", str(port),
                          "--bootstrap-port", str(servers.free_port()), "--page-size", str(a.page_size),
                          "--log-level", "error"])
    try:
        servers.wait_healthy(f"http://127.0.0.1:{port}", proc)
        return bench(a, f"http://127.0.0.1:{port}", "1P1D", out)
    finally:
        servers.stop(proc)


def ratios(colo: dict, pd: dict) -> dict:
    def inter(r: dict, key: str):
        groups = r.get("groups") or {}
        return (groups.get("interactive") or r)[key]

    colo_tokens = inter(colo, "output_throughput")
    return {"p99_itl_1p1d_over_colocated": pd["p99_itl_ms"] / colo["p99_itl_ms"],
            # the interactive stream's output tokens per second of the run (the run lasts until the last
            # request ends, so a prefill side that falls behind shows here)
            "interactive_tokens_1p1d_over_colocated": (inter(pd, "output_throughput") / colo_tokens
                                                       if colo_tokens else None),
            "interactive_p99_itl_1p1d_over_colocated": inter(pd, "p99_itl_ms") / inter(colo, "p99_itl_ms"),
            "goodput_1p1d_over_colocated": (pd["request_goodput"] / colo["request_goodput"]
                                            if colo["request_goodput"] else None),
            "mean_ttft_1p1d_over_colocated": pd["mean_ttft_ms"] / colo["mean_ttft_ms"]}


def _ratio(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def inter_of(r: dict, key: str):
    return ((r.get("groups") or {}).get("interactive") or r)[key]


def _ttft(r: dict) -> str:
    """The background stream's (long prompts') mean and max TTFT, in seconds."""
    bg = (r.get("groups") or {}).get("background")
    if not bg:
        return "n/a"
    return f"{bg['mean_ttft_ms'] / 1e3:.2f} / {bg.get('max_ttft_ms', float('nan')) / 1e3:.2f} s"


def main(argv=None) -> int:
    a = parse_args(argv)
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    raw = out_dir / "bench.jsonl"
    raw.unlink(missing_ok=True)
    cores = sorted(os.sched_getaffinity(0))
    t0 = time.monotonic()
    colo = run_colocated(a, cores, raw)
    pd = run_pd(a, raw)
    summary = {"args": vars(a), "cores": cores, "ratios": ratios(colo, pd), "wall_s": time.monotonic() - t0,
               "colocated": colo, "1P1D": pd}
    (out_dir / "compare_pd.json").write_text(json.dumps(summary, indent=1))
    plot.plot_cdfs([colo, pd], str(out_dir / "compare_pd.png"))
    r = summary["ratios"]
    print(f"P99 ITL: colocated {colo['p99_itl_ms']:.1f} ms, 1P1D {pd['p99_itl_ms']:.1f} ms "
          f"(ratio {r['p99_itl_1p1d_over_colocated']:.2f}, target <= 0.5; interactive stream "
          f"{r['interactive_p99_itl_1p1d_over_colocated']:.2f})")
    print(f"interactive tokens: colocated {inter_of(colo, 'output_throughput'):.1f} tok/s, 1P1D "
          f"{inter_of(pd, 'output_throughput'):.1f} tok/s (ratio {r['interactive_tokens_1p1d_over_colocated']:.2f}); "
          f"long prompts' TTFT mean / max: colocated {_ttft(colo)}, 1P1D {_ttft(pd)}")
    goodput = r["goodput_1p1d_over_colocated"]
    print(f"goodput: colocated {colo['request_goodput']:.2f} req/s, 1P1D {pd['request_goodput']:.2f} req/s "
          f"(ratio {_ratio(goodput)}, target >= 1); mean TTFT ratio "
          f"{r['mean_ttft_1p1d_over_colocated']:.2f}")
    print(f"wrote {out_dir / 'compare_pd.json'} and {out_dir / 'compare_pd.png'} in {summary['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
