"""Serving metrics, defined as sglang.bench_serving and vllm bench serve define them.

Per request (successful ones only):
- TTFT, E2E latency and ITL as measured in ``backends`` (see its docstring).
- TPOT = (E2E - TTFT) / (output_len - 1): the first token is excluded; requests
  with one output token have no TPOT (and count as meeting a TPOT SLO, as vLLM).
Per run (``duration`` = first send to last completion):
- request / input / output / total token throughput = counts / duration, counting
  successful requests only; input tokens are the server's ``prompt_tokens`` when it
  reports them (chat templates included), else the dataset's length.
- goodput = requests meeting *every* given SLO / duration (vLLM's ``--goodput``):
  a value equal to its SLO meets it.
- concurrency = sum of E2E latencies / duration (sglang); max_concurrent_requests
  = most requests in flight at once (vLLM).
- distributions: mean, median, std (population, numpy's default), percentiles
  (numpy's linear interpolation) in milliseconds; an empty set reports 0, as both do.

The server-side TTFT breakdown reads ``meta_info["timeline"]`` (stage -> seconds)
when a native server sends it; any subset of stages is accepted.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pdserve.bench.backends import RequestOutput

TIMELINE_STAGES = ("queue", "prefill", "transfer", "decode_scheduling")
TRANSFER_WARN_SHARE = 0.2
DISTRIBUTIONS = ("ttft", "tpot", "itl", "e2e_latency")


def request_tpot(out: RequestOutput) -> float | None:
    """Seconds per output token after the first, or None with fewer than two tokens."""
    if out.output_len < 2:
        return None
    return (out.latency - out.ttft) / (out.output_len - 1)


def distribution(values_s: list[float], name: str, percentiles: tuple[float, ...]) -> dict:
    """mean/median/std/percentiles of ``values_s`` (seconds) as ``{stat}_{name}_ms`` keys."""
    ms = np.asarray(values_s if len(values_s) else [0.0], dtype=np.float64) * 1000.0
    out = {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
           f"std_{name}_ms": float(ms.std())}
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = float(np.percentile(ms, p))
    out[f"max_{name}_ms"] = float(ms.max())
    return out


def slo_values(out: RequestOutput) -> dict:
    """The request's value (ms) of each SLO metric."""
    tpot = request_tpot(out)
    return {"ttft": out.ttft * 1000.0, "tpot": 0.0 if tpot is None else tpot * 1000.0,
            "e2e": out.latency * 1000.0}


def meets_slo(out: RequestOutput, slo: dict) -> bool:
    """True if a successful request is within every SLO given (``{"ttft": ms, ...}``)."""
    if not out.success:
        return False
    values = slo_values(out)
    return all(values[k] <= limit for k, limit in slo.items())


def max_in_flight(outputs: list[RequestOutput]) -> int:
    """Peak number of requests in flight (half-open [start, start + latency) intervals)."""
    events = sorted([(o.start, 1) for o in outputs] + [(o.start + o.latency, -1) for o in outputs])
    peak = cur = 0
    for _, delta in events:
        cur += delta
        peak = max(peak, cur)
    return peak


def summarize(outputs: list[RequestOutput], duration: float, percentiles: tuple[float, ...] = (90, 95, 99),
              slo: dict | None = None) -> dict:
    """Every run metric of ``outputs`` over ``duration`` seconds (see the module docstring)."""
    ok = [o for o in outputs if o.success]
    total_in = sum(o.prompt_len for o in ok)
    total_out = sum(o.output_len for o in ok)
    tpots = [t for t in map(request_tpot, ok) if t is not None]
    m: dict[str, Any] = {"completed": len(ok), "failed": len(outputs) - len(ok), "duration": duration,
         "total_input_tokens": total_in, "total_output_tokens": total_out,
         "request_throughput": len(ok) / duration, "input_throughput": total_in / duration,
         "output_throughput": total_out / duration, "total_throughput": (total_in + total_out) / duration,
         "concurrency": sum(o.latency for o in ok) / duration, "max_concurrent_requests": max_in_flight(ok)}
    if slo:
        good = sum(meets_slo(o, slo) for o in ok)
        m.update(request_goodput=good / duration, slo_attainment=good / len(outputs) if outputs else 0.0)
    else:
        m.update(request_goodput=None, slo_attainment=None)
    series = {"ttft": [o.ttft for o in ok], "tpot": tpots, "itl": [x for o in ok for x in o.itl],
              "e2e_latency": [o.latency for o in ok]}
    for name in DISTRIBUTIONS:
        m.update(distribution(series[name], name, percentiles))
    return m


# ------------------------------------------------------------ TTFT breakdown
def timeline_summary(outputs: list[RequestOutput]) -> dict | None:
    """Per-stage mean/median/P99 (ms) of the servers' timelines, or None if no request carried one.

    ``transfer_share_of_ttft`` = mean transfer / mean client TTFT over the requests that
    report a transfer; above TRANSFER_WARN_SHARE the network, not compute, is the bottleneck.
    """
    ok = [(o.timeline, o.ttft) for o in outputs if o.success and o.timeline]  # (timeline, client TTFT)
    if not ok:
        return None
    stages: dict[str, dict[str, float]] = {}
    for name in _stage_names([t for t, _ in ok]):
        values = [float(t[name]) for t, _ in ok if _is_number(t.get(name))]
        if values:
            ms = np.asarray(values) * 1000.0
            stages[name] = {"count": len(values), "mean_ms": float(ms.mean()), "median_ms": float(np.median(ms)),
                            "p99_ms": float(np.percentile(ms, 99))}
    summary: dict[str, Any] = {"stages": stages, "transfer_share_of_ttft": None, "warning": None}
    with_transfer = [(t, ttft) for t, ttft in ok if _is_number(t.get("transfer")) and ttft > 0]
    if with_transfer:
        share = (np.mean([t["transfer"] for t, _ in with_transfer])
                 / np.mean([ttft for _, ttft in with_transfer]))
        summary["transfer_share_of_ttft"] = float(share)
        if share > TRANSFER_WARN_SHARE:
            summary["warning"] = (f"KV transfer is {share:.0%} of TTFT (> {TRANSFER_WARN_SHARE:.0%}): the network, "
                                  "not prefill compute, bounds TTFT")
    return summary


def _stage_names(timelines: list[dict]) -> list[str]:
    seen = {k for t in timelines for k in t}
    return [s for s in TIMELINE_STAGES if s in seen] + sorted(seen - set(TIMELINE_STAGES))


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
