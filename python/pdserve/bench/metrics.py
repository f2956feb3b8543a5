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
when a native server sends it; any subset of stages is accepted. Whether the network bounds
TTFT is judged by bandwidth, not by the transfer's share of TTFT: the KV bytes the decode servers
received during the run over the time any transfer was running, against the link's bandwidth
(``KVLink``). A short transfer can be a large share of a short TTFT on an idle loopback link.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pdserve.bench.backends import RequestOutput

TIMELINE_STAGES = ("queue", "prefill", "transfer", "decode_scheduling")
TRANSFER_WARN_SHARE = 0.2  # a transfer share above this is explained (bandwidth or per-transfer latency)
# KV moving at this fraction of the link's bandwidth or more while transfers run: the link is the limit
LINK_BOUND_UTILIZATION = 0.5
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


def speculative_summary(outputs: list[RequestOutput]) -> dict | None:
    """Speculative decoding over the successful requests that report it (None: none does):
    ``accept_length`` = decoded tokens (output less the prefill's first) per verify forward,
    ``accept_rate`` = accepted / proposed draft tokens."""
    ok = [o for o in outputs if o.success and o.spec_verify_ct is not None]
    if not ok:
        return None
    verifies = sum(o.spec_verify_ct or 0 for o in ok)
    drafted = sum(o.spec_draft_tokens or 0 for o in ok)
    decoded = sum(max(0, o.output_len - 1) for o in ok)
    return {"requests": len(ok), "verify_ct": verifies,
            "accept_length": decoded / verifies if verifies else 0.0,
            "accept_rate": sum(o.spec_accepted_tokens or 0 for o in ok) / drafted if drafted else 0.0}


# ------------------------------------------------------------ TTFT breakdown
@dataclass(frozen=True)
class KVLink:
    """What the benchmark knows of the prefill->decode link: the KV bytes the decode servers
    received during the run (None: not reported), and the link's bandwidth in bytes/s (None:
    unknown) with where that figure came from."""

    kv_bytes: int | None = None
    bandwidth: float | None = None
    source: str = ""


def transfer_busy_seconds(outputs: list[RequestOutput]) -> float:
    """Seconds during which at least one request's KV transfer ran: the union of the transfer
    stages, each placed after its queue and prefill stages from the request's send (client clock)."""
    spans = sorted((o.start + (t.get("queue") or 0.0) + (t.get("prefill") or 0.0), float(t["transfer"]))
                   for o in outputs if o.success and o.timeline and _is_number((t := o.timeline).get("transfer")))
    busy, end = 0.0, float("-inf")
    for start, length in spans:
        stop = start + length
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy


def timeline_summary(outputs: list[RequestOutput], link: KVLink | None = None) -> dict | None:
    """Per-stage mean/median/P99 (ms) of the servers' timelines, or None if no request carried one.

    ``transfer_share_of_ttft`` = mean transfer / mean client TTFT over the requests that report a
    transfer. ``kv_transfer_gbps`` = the run's KV bytes (``link``) over ``transfer_busy_seconds``;
    ``link_utilization`` = that over the link's bandwidth. Only a utilization of
    LINK_BOUND_UTILIZATION or more warns that the network bounds TTFT; a large share at a low
    utilization is per-transfer latency, and the note says so.
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
    summary: dict[str, Any] = {"stages": stages, "transfer_share_of_ttft": None, "kv_bytes": None,
                               "kv_transfer_gbps": None, "link_gbps": None, "link_source": None,
                               "link_utilization": None, "warning": None, "note": None}
    with_transfer = [(t, ttft) for t, ttft in ok if _is_number(t.get("transfer")) and ttft > 0]
    if with_transfer:
        share = (np.mean([t["transfer"] for t, _ in with_transfer])
                 / np.mean([ttft for _, ttft in with_transfer]))
        summary["transfer_share_of_ttft"] = float(share)
        summary.update(_link_verdict(float(share), transfer_busy_seconds(outputs), link or KVLink()))
    return summary


def _link_verdict(share: float, busy_s: float, link: KVLink) -> dict[str, Any]:
    """The bandwidth figures and the warning or note on what bounds the transfer."""
    out: dict[str, Any] = {"kv_bytes": link.kv_bytes, "link_source": link.source or None,
                           "link_gbps": link.bandwidth * 8e-9 if link.bandwidth else None}
    rate = link.kv_bytes / busy_s if link.kv_bytes and busy_s > 0 else None
    out["kv_transfer_gbps"] = rate * 8e-9 if rate else None
    if rate is None or not link.bandwidth:
        if share > TRANSFER_WARN_SHARE:
            out["note"] = (f"KV transfer is {share:.0%} of TTFT; whether the network bounds it is unknown: "
                           + ("give --kv-link-gbps" if rate else "the servers did not report the KV bytes received"))
        return out
    util = rate / link.bandwidth
    out["link_utilization"] = util
    moved = f"KV moved at {rate * 8e-9:.2f} Gbit/s while transferring, {util:.1%} of the link's " \
            f"{link.bandwidth * 8e-9:.1f} Gbit/s ({link.source})"
    if util >= LINK_BOUND_UTILIZATION:
        out["warning"] = (f"{moved}, and transfer is {share:.0%} of TTFT: the network bounds TTFT (check the NIC, "
                          "layer-wise streaming, page size)")
    elif share > TRANSFER_WARN_SHARE:
        out["note"] = (f"KV transfer is {share:.0%} of TTFT, but {moved}: its time is per-transfer latency "
                       "(handshake, polling, the decode's scheduling), not bandwidth")
    return out


def _stage_names(timelines: list[dict]) -> list[str]:
    seen = {k for t in timelines for k in t}
    return [s for s in TIMELINE_STAGES if s in seen] + sorted(seen - set(TIMELINE_STAGES))


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
