"""``pdserve bench``: run a workload against a server, then print and save its metrics.

A run: resolve the model and tokenizer (flags, else the server's ``/v1/models``),
build the seeded workload, send ``--warmup-requests`` copies of the first request
(at most 32 output tokens, as sglang), optionally flush the server's cache, then
start the clock and send every conversation at its arrival time (a client-side
semaphore caps ``--max-concurrency``; a request's clock starts when it is
actually sent). The duration ends when the last request completes.

Each run appends one JSON object to ``--output-file`` (JSON lines); its keys are
in ``docs/benchmarking.md``.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import math
import time
from pathlib import Path

import aiohttp
import numpy as np

from pdserve.bench import link
from pdserve.bench.backends import RequestOutput, new_session, send
from pdserve.bench.config import BenchConfig, EndpointConfig
from pdserve.bench.datasets import BenchRequest, Conversation, Workload, build_workload
from pdserve.bench.metrics import KVLink, speculative_summary, summarize, timeline_summary
from pdserve.bench.progress import progress_bar

RESULT_SCHEMA = "pdserve.bench/v1"
WARMUP_MAX_OUTPUT = 32


# ------------------------------------------------------------ model, tokenizer
async def server_model(session: aiohttp.ClientSession, ep: EndpointConfig) -> tuple[str, str | None]:
    """(model id to send, model path the server loaded) from ``/v1/models``."""
    try:
        async with session.get(ep.url + "/v1/models", headers=ep.headers()) as r:
            r.raise_for_status()
            first = (await r.json())["data"][0]
    except (aiohttp.ClientError, KeyError, IndexError, ValueError) as e:
        raise RuntimeError(f"--model: not given and {ep.url}/v1/models did not name one ({e}); "
                           "pass --model") from None
    return first["id"], first.get("root")


def load_tokenizer(name: str):
    """A local tokenizer: a pdserve preset name or a directory (or a name already in the HF cache).
    Nothing is downloaded."""
    from transformers import AutoTokenizer

    from pdserve.assets import PRESET_NAMES, preset_dir

    path = str(preset_dir(name)) if name in PRESET_NAMES else name
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"--tokenizer: cannot load {name!r} locally ({e}); pass a preset name or a "
                         "directory with tokenizer files (nothing is downloaded)") from None


# ----------------------------------------------------------------- the run
async def run_workload(session: aiohttp.ClientSession, cfg: BenchConfig, workload: Workload,
                       model: str) -> tuple[list[RequestOutput], float]:
    """Send every conversation of ``workload`` on schedule; (outputs in send order, duration s)."""
    rng = np.random.default_rng([cfg.load.seed, 1])
    arrivals = workload.schedule(cfg.load, rng)
    sem = asyncio.Semaphore(cfg.load.max_concurrency) if cfg.load.max_concurrency else None
    bar = progress_bar(workload.num_requests, cfg.load.disable_tqdm)

    async def one(req: BenchRequest) -> RequestOutput:
        if sem is None:
            return await send(session, cfg.endpoint, req, model)
        async with sem:
            return await send(session, cfg.endpoint, req, model)

    async def conversation(conv: Conversation, at: float, t0: float) -> list[RequestOutput]:
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        outs: list[RequestOutput] = []
        req: BenchRequest | None = conv.first()
        while req is not None:
            out = await one(req)
            outs.append(out)
            bar.update(1)
            req = conv.next(req, out.text, out.output_ids) if out.success else None
        return outs

    t0 = time.perf_counter()
    per_conv = await asyncio.gather(*(conversation(c, a, t0) for c, a in zip(workload.conversations, arrivals)))
    duration = time.perf_counter() - t0
    bar.close()
    outputs = sorted((o for outs in per_conv for o in outs), key=lambda o: o.start)
    return outputs, duration


async def warmup(session: aiohttp.ClientSession, cfg: BenchConfig, req: BenchRequest, model: str) -> None:
    """``--warmup-requests`` concurrent copies of ``req`` (short output); fails loudly if none succeeds."""
    n = cfg.load.warmup_requests
    if n == 0:
        return
    short = BenchRequest(req.prompt, req.prompt_ids, req.prompt_len, min(req.output_len, WARMUP_MAX_OUTPUT),
                         req.messages, req.tag)
    outs = await asyncio.gather(*(send(session, cfg.endpoint, short, model) for _ in range(n)))
    if not any(o.success for o in outs):
        raise RuntimeError(f"warmup failed: check the benchmark's flags against the server ({outs[0].error})")


async def flush_cache(session: aiohttp.ClientSession, ep: EndpointConfig) -> None:
    async with session.post(ep.url + "/flush_cache", headers=ep.admin_headers()) as r:
        if r.status != 200:
            raise RuntimeError(f"--flush-cache: {ep.url}/flush_cache answered {r.status}: {await r.text()}")


def count_output_tokens(outputs: list[RequestOutput], tokenizer) -> None:
    """Streams without usage counts: retokenize the text (vLLM does the same)."""
    for o in outputs:
        if o.success and o.output_len == 0:
            o.output_len = len(tokenizer.encode(o.text, add_special_tokens=False))


async def benchmark(cfg: BenchConfig) -> dict:
    """One full run; returns the result object (also written to --output-file)."""
    async with new_session(cfg.endpoint) as session:
        model, tok_name, tokenizer = await resolve_model(session, cfg.endpoint)
    workload = build_workload(cfg.dataset, cfg.load, tokenizer, use_ids=cfg.endpoint.tokenize_prompt)
    async with new_session(cfg.endpoint) as session:
        await warmup(session, cfg, workload.conversations[0].first(), model)
        if cfg.load.flush_cache:
            await flush_cache(session, cfg.endpoint)
        kv_before = link.kv_bytes_received(await link.server_info(session, cfg.endpoint))
        outputs, duration = await run_workload(session, cfg, workload, model)
        info_after = await link.server_info(session, cfg.endpoint) if kv_before is not None else None
    count_output_tokens(outputs, tokenizer)
    kv = link.kv_link(cfg.endpoint.url, info_after, kv_before, cfg.report.kv_link_gbps)
    result = build_result(cfg, workload.name, model, tok_name, outputs, duration, kv)
    if cfg.report.output_file:
        append_jsonl(cfg.report.output_file, result)
    return result


async def resolve_model(session: aiohttp.ClientSession, ep: EndpointConfig):
    """(model id for request bodies, tokenizer name, tokenizer); the server is asked what is not given."""
    model, root = ep.model, None
    if model is None:
        model, root = await server_model(session, ep)
    elif ep.tokenizer is None:
        try:
            root = (await server_model(session, ep))[1]
        except RuntimeError:
            root = None  # a server without /v1/models: the model name must name the tokenizer
    tok_name = ep.tokenizer or root or model
    return model, tok_name, load_tokenizer(tok_name)


# ------------------------------------------------------------------ results
def build_result(cfg: BenchConfig, dataset: str, model: str, tokenizer: str, outputs: list[RequestOutput],
                 duration: float, kv: KVLink | None = None) -> dict:
    ep, load, rep = cfg.endpoint, cfg.load, cfg.report
    result = {"schema": RESULT_SCHEMA, "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "label": rep.label, "backend": ep.backend, "base_url": ep.url, "model": model, "tokenizer": tokenizer,
              "dataset_name": dataset, "num_requests": len(outputs), "request_rate": _num(load.request_rate),
              "burstiness": _num(load.burstiness), "max_concurrency": load.max_concurrency, "slo": rep.slo or None}
    result.update(summarize(outputs, duration, rep.metric_percentiles, rep.slo))
    result["server_timeline"] = timeline_summary(outputs, kv)
    result["speculative"] = speculative_summary(outputs)
    result["groups"] = _groups(outputs, duration, rep) if dataset in ("mixed", "multi-turn") else None
    result["rounds"] = rounds_summary(outputs) if dataset == "multi-turn" else None
    result["args"] = cfg.to_dict()
    result["details"] = details(outputs, rep.output_details)
    return result


def _groups(outputs: list[RequestOutput], duration: float, rep) -> dict:
    tags = sorted({o.tag for o in outputs})
    return {t: summarize([o for o in outputs if o.tag == t], duration, rep.metric_percentiles, rep.slo)
            for t in tags}


def rounds_summary(outputs: list[RequestOutput]) -> dict[str, dict]:
    """Per multi-turn round: TTFT and the share of prompt tokens each cache tier served (None
    where the server reports no split by tier)."""
    out: dict[str, dict] = {}
    for r in sorted({o.round for o in outputs if o.round}):
        ok = [o for o in outputs if o.round == r and o.success]
        ttft = [o.ttft * 1e3 for o in ok]
        prompt = sum(o.prompt_len for o in ok) or 1
        split = [o.cached_by_tier for o in ok if o.cached_by_tier is not None]
        tiers = sorted({t for s in split for t in s})
        out[str(r)] = {"completed": len(ok), "mean_ttft_ms": float(np.mean(ttft)) if ttft else float("nan"),
                       "median_ttft_ms": float(np.median(ttft)) if ttft else float("nan"),
                       "cached_rate": sum(o.cached_tokens or 0 for o in ok) / prompt,
                       "tier_hit_rate": {t: sum(s.get(t, 0) for s in split) / prompt for t in tiers} if split else None}
    return out


def details(outputs: list[RequestOutput], keep_text: bool = False) -> dict:
    """Per-request arrays (send order) for plots: seconds, lengths, errors."""
    t0 = min((o.start for o in outputs), default=0.0)
    d = {"start_times": [o.start - t0 for o in outputs], "success": [o.success for o in outputs],
         "input_lens": [o.prompt_len for o in outputs], "output_lens": [o.output_len if o.success else 0
                                                                         for o in outputs],
         "ttfts": [o.ttft for o in outputs], "e2e_latencies": [o.latency for o in outputs],
         "itls": [o.itl for o in outputs], "tags": [o.tag for o in outputs], "errors": [o.error for o in outputs],
         # tokens each output event carried (None: the stream did not say): a first event carrying k
         # tokens gives k - 1 fewer ITLs, as in SGLang's bench_serving
         "event_tokens": [o.event_tokens for o in outputs]}
    if any(o.timeline for o in outputs):
        d["timelines"] = [o.timeline for o in outputs]
    if keep_text:
        d["generated_texts"] = [o.text for o in outputs]
    return d


def _num(x: float):
    return "inf" if isinstance(x, float) and math.isinf(x) else x


def append_jsonl(path: str, obj: dict) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("a") as f:
        f.write(json.dumps(obj) + "\n")


def read_jsonl(path: str) -> list[dict]:
    """Every JSON object of a results file (one per line; blank lines skipped)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ValueError(f"{path}: cannot read: {e.strerror}") from None
    try:
        return [json.loads(line) for line in lines if line.strip()]
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON lines: {e}") from None


# ------------------------------------------------------------------ console
def format_table(r: dict) -> str:
    """The result as sglang's console table (ms, tok/s)."""
    rows = [("Backend:", r["backend"]), ("Dataset:", r["dataset_name"]), ("Traffic request rate:", r["request_rate"]),
            ("Max request concurrency:", r["max_concurrency"] or "not set"),
            ("Successful requests:", r["completed"]), ("Failed requests:", r["failed"]),
            ("Benchmark duration (s):", r["duration"]), ("Total input tokens:", r["total_input_tokens"]),
            ("Total generated tokens:", r["total_output_tokens"]),
            ("Request throughput (req/s):", r["request_throughput"])]
    if r["request_goodput"] is not None:
        rows += [("Request goodput (req/s):", r["request_goodput"]), ("SLO attainment:", r["slo_attainment"])]
    rows += [("Input token throughput (tok/s):", r["input_throughput"]),
             ("Output token throughput (tok/s):", r["output_throughput"]),
             ("Total token throughput (tok/s):", r["total_throughput"]), ("Concurrency:", r["concurrency"])]
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="), *_rows(rows)]
    for name, title in (("e2e_latency", "End-to-End Latency"), ("ttft", "Time to First Token"),
                        ("tpot", "Time per Output Token (excl. 1st token)"), ("itl", "Inter-Token Latency")):
        lines += _section(r, name, title)
    lines += _timeline_lines(r.get("server_timeline"))
    spec = r.get("speculative")
    if spec:
        lines += [f"{' Speculative decoding ':-^50}",
                  *_rows([("Accept length (tok/verify):", spec["accept_length"]),
                          ("Accept rate (drafts):", spec["accept_rate"]),
                          ("Verify forwards:", spec["verify_ct"])])]
    for tag, g in (r.get("groups") or {}).items():
        lines += [f"{'[' + tag + '] ' + str(g['completed']) + ' requests':-^50}",
                  *_rows([("Mean / P99 TTFT (ms):", f"{g['mean_ttft_ms']:.2f} / {_p99(g, 'ttft'):.2f}"),
                          ("Mean / P99 ITL (ms):", f"{g['mean_itl_ms']:.2f} / {_p99(g, 'itl'):.2f}")])]
    lines += _round_lines(r.get("rounds"))
    lines.append("=" * 50)
    return "\n".join(lines)


def _round_lines(rounds: dict | None) -> list[str]:
    if not rounds:
        return []
    lines = [f"{' Per round ':-^50}", f"{'round':<6}{'n':>4}{'TTFT mean/med ms':>20}  hit rate by tier"]
    for r, g in rounds.items():
        tiers = g["tier_hit_rate"]
        split = " ".join(f"{t}={v:.2f}" for t, v in tiers.items()) if tiers else f"all={g['cached_rate']:.2f}"
        lines.append(f"{r:<6}{g['completed']:>4}{g['mean_ttft_ms']:>10.1f}/{g['median_ttft_ms']:<9.1f}  {split}")
    return lines


def _p99(m: dict, name: str) -> float:
    return m.get(f"p99_{name}_ms", m[f"max_{name}_ms"])


def _section(r: dict, name: str, title: str) -> list[str]:
    label = {"e2e_latency": "E2E Latency"}.get(name, name.upper())
    rows = [(f"Mean {label} (ms):", r[f"mean_{name}_ms"]), (f"Median {label} (ms):", r[f"median_{name}_ms"]),
            (f"Std {label} (ms):", r[f"std_{name}_ms"])]
    rows += [(f"P{k[1:].split('_')[0]} {label} (ms):", v) for k, v in r.items()
             if k.startswith("p") and k.endswith(f"_{name}_ms") and k[1].isdigit()]
    rows.append((f"Max {label} (ms):", r[f"max_{name}_ms"]))
    return ["{s:{c}^{n}}".format(s=title, n=50, c="-"), *_rows(rows)]


def _timeline_lines(t: dict | None) -> list[str]:
    if not t or not t["stages"]:
        return []
    lines = ["{s:{c}^{n}}".format(s="Server TTFT breakdown", n=50, c="-")]
    lines += _rows([(f"{name} mean / P99 (ms):", f"{s['mean_ms']:.2f} / {s['p99_ms']:.2f}")
                    for name, s in t["stages"].items()])
    if t["transfer_share_of_ttft"] is not None:
        lines += _rows([("Transfer share of TTFT:", f"{t['transfer_share_of_ttft']:.1%}")])
    if t.get("kv_transfer_gbps") is not None:
        lines += _rows([("KV transfer rate (Gbit/s):", t["kv_transfer_gbps"])])
    if t.get("link_utilization") is not None:
        lines += _rows([("Link utilization:", f"{t['link_utilization']:.1%} of {t['link_gbps']:.1f} Gbit/s")])
    if t["warning"]:
        lines.append("WARNING: " + t["warning"])
    if t.get("note"):
        lines.append("NOTE: " + t["note"])
    return lines


def _rows(rows) -> list[str]:
    return [f"{k:<40} {v:<10.2f}" if isinstance(v, float) else f"{k:<40} {v!s:<10}" for k, v in rows]


def main(cfg: BenchConfig) -> int:
    """Run (or profile), print the table; returns the exit code."""
    if cfg.profile.profile:
        from pdserve.bench.profiles import run_profile

        profile = asyncio.run(run_profile(cfg))
        print(json.dumps(profile, indent=2))
        return 0
    result = asyncio.run(benchmark(cfg))
    print(format_table(result))
    if result["completed"] == 0:
        print("All requests failed; first error:", result["details"]["errors"][0])
        return 1
    return 0
