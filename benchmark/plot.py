"""Plot `pdserve bench` results (JSON lines) to PNG with matplotlib.

    python benchmark/plot.py results.jsonl -o latency.png              # TTFT / ITL / E2E CDFs
    python benchmark/plot.py sweep.jsonl -o sweep.png --kind sweep     # vs request rate

``cdf``: one panel per latency (TTFT, ITL on a log axis, E2E), one line per run
(its label, or backend and dataset, with the rate), and per stream for ``mixed``
runs. ``sweep``: runs of a ``--request-rate`` sweep (one JSON line per rate, e.g.
a shell loop appending to one file) give output throughput, goodput (when an
SLO was set) and P99 TTFT / ITL / E2E against the rate, one line per label.
``auto`` (the default) picks ``sweep`` when the runs have two or more finite
request rates. matplotlib is needed only to draw: the data functions below are
plain Python.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from pdserve.bench.planner import offered_rate

LATENCIES = (("TTFT", "ttfts"), ("ITL", "itls"), ("E2E latency", "e2e_latencies"))
SWEEP_PANELS = (("Output throughput (tok/s)", "output_throughput"), ("Goodput (req/s)", "request_goodput"),
                ("P99 TTFT (ms)", "p99_ttft_ms"), ("P99 ITL (ms)", "p99_itl_ms"),
                ("P99 E2E latency (ms)", "p99_e2e_latency_ms"))


def load_results(paths: list[str]) -> list[dict]:
    """Every `pdserve bench` result in the files, in order."""
    out = []
    for path in paths:
        for n, line in enumerate(Path(path).read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON: {e}") from None
            if obj.get("schema") == "pdserve.bench/v1":
                out.append(obj)
    if not out:
        raise ValueError(f"no `pdserve bench` results in {', '.join(paths)}")
    return out


def label(r: dict) -> str:
    """The run's label (or backend and dataset) and the rate it offered: both streams of ``mixed``."""
    rate = offered_rate({**r, **(r.get("args") or {})})
    name = r.get("label") or f"{r['backend']} {r['dataset_name']}"
    return f"{name} @ {'inf' if rate is None else f'{rate:g}'} req/s"


def cdf(values: list[float]) -> tuple[list[float], list[float]]:
    """Sorted values and their empirical cumulative fractions (i / n for the i-th smallest)."""
    xs = sorted(values)
    n = len(xs)
    return xs, [(i + 1) / n for i in range(n)]


def latency_ms(r: dict, tag: str | None = None) -> dict[str, list[float]]:
    """Per-request TTFT and E2E, and every ITL, of the successful requests (of stream ``tag``), in ms."""
    d = r["details"]
    ok = [i for i, s in enumerate(d["success"]) if s and (tag is None or d["tags"][i] == tag)]
    out = {}
    for name, key in LATENCIES:
        if key == "itls":
            out[name] = [x * 1000 for i in ok for x in d[key][i]]
        else:
            out[name] = [d[key][i] * 1000 for i in ok]
    return out


def rate_of(r: dict) -> float | None:
    rate = r.get("request_rate")
    return None if rate in (None, "inf") else float(rate)


def sweep_series(results: list[dict]) -> dict[str, dict[str, list]]:
    """{label: {"rate": [...], metric: [...]}} sorted by rate; runs with an infinite rate are left out."""
    by_label: dict[str, list[dict]] = defaultdict(list)
    for r in results:
        if rate_of(r) is not None:
            by_label[r.get("label") or f"{r['backend']} {r['dataset_name']}"].append(r)
    series = {}
    for name, runs in by_label.items():
        runs = sorted(runs, key=rate_of)
        series[name] = {"rate": [rate_of(r) for r in runs], **{key: [r.get(key) for r in runs]
                                                               for _, key in SWEEP_PANELS}}
    return series


def choose_kind(results: list[dict]) -> str:
    return "sweep" if len({rate_of(r) for r in results} - {None}) >= 2 else "cdf"


# ------------------------------------------------------------------ drawing
def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("benchmark/plot.py draws with matplotlib, which is not installed: "
                         "pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_cdfs(results: list[dict], out: str) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(LATENCIES), figsize=(5 * len(LATENCIES), 4))
    for r in results:
        for tag in sorted(r.get("groups") or {}) or [None]:  # mixed runs: one line per stream
            lat = latency_ms(r, tag)
            for ax, (name, _) in zip(axes, LATENCIES):
                if lat[name]:
                    ax.plot(*cdf(lat[name]), label=label(r) + (f" [{tag}]" if tag else ""))
    for ax, (name, _) in zip(axes, LATENCIES):
        ax.set(xlabel=f"{name} (ms)", ylabel="fraction of requests" if name != "ITL" else "fraction of tokens",
               title=f"{name} CDF", ylim=(0, 1.01))
        if name == "ITL":
            ax.set_xscale("log")  # steady steps of a few ms and prefill stalls of hundreds on one axis
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def plot_sweep(results: list[dict], out: str) -> None:
    plt = _pyplot()
    series = sweep_series(results)
    panels = [(t, k) for t, k in SWEEP_PANELS if any(any(v is not None for v in s[k]) for s in series.values())]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4), squeeze=False)
    for name, s in series.items():
        for ax, (_, key) in zip(axes[0], panels):
            pts = [(x, y) for x, y in zip(s["rate"], s[key]) if y is not None]
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=name)
    for ax, (title, _) in zip(axes[0], panels):
        ax.set(xlabel="request rate (req/s)", title=title)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", help="`pdserve bench --output-file` JSON-lines files")
    p.add_argument("-o", "--output", required=True, help="PNG file to write")
    p.add_argument("--kind", choices=("auto", "cdf", "sweep"), default="auto")
    a = p.parse_args(argv)
    try:
        results = load_results(a.results)
    except (OSError, ValueError) as e:
        p.exit(2, f"plot.py: error: {e}\n")
    kind = choose_kind(results) if a.kind == "auto" else a.kind
    (plot_sweep if kind == "sweep" else plot_cdfs)(results, a.output)
    print(f"wrote {a.output} ({kind}, {len(results)} runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
