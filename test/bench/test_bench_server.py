"""``pdserve bench`` against a real tiny colocated server (one per module).

The agreement test checks bench's figures against an independent observer of the very same
requests: a recording proxy between bench and the server, on the same clock. Two runs' timings
are never compared (on a shared 2-core machine other processes move a single run by far more
than any tolerance, and the old paired comparison of bench against a second client failed
under load whichever statistic it used: docs/testing.md). What is asserted holds whatever the
load: causality (bench's TTFT and latency of each request are at least what the proxy saw
between receiving it and forwarding its tokens), containment (one request at a time, each
inside the run's duration, the duration inside the wall time around the run), the summary
recomputed from bench's own per-request details, and the token counts the stream carried.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import statistics
import time
from dataclasses import dataclass

import httpx
import pytest
from aiohttp import ClientSession, web

from pdserve.bench.backends import new_session, send
from pdserve.bench.config import EndpointConfig
from pdserve.bench.datasets import BenchRequest
from pdserve.bench.profiles import flush_prefix_cache
from pdserve.entrypoints.cli import main as cli_main
from server_utils import Server

MODEL = "tiny-llama"
N, IN, OUT, CONC = 4, 256, 32, 1
METRIC_KEYS = ["completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
               "request_throughput", "input_throughput", "output_throughput", "total_throughput", "concurrency",
               "max_concurrent_requests", "request_goodput", "slo_attainment"]
DETAIL_KEYS = ["start_times", "success", "input_lens", "output_lens", "ttfts", "e2e_latencies", "itls", "tags",
               "errors", "event_tokens"]


@pytest.fixture(scope="module")
def server():
    s = Server("--num-threads", "1", "--max-total-tokens", "32768", model=MODEL)
    try:
        yield s.start()
    finally:
        s.stop()


def bench(url: str, out_file, *flags: str) -> dict:
    """Run ``pdserve bench`` in this process; returns the JSON line it appended."""
    before = out_file.read_text().splitlines() if out_file.exists() else []
    with contextlib.redirect_stdout(io.StringIO()) as table:
        rc = cli_main(["bench", "--base-url", url, "--disable-tqdm", "--output-file", str(out_file), *flags])
    assert rc == 0, table.getvalue()
    lines = out_file.read_text().splitlines()
    assert len(lines) == len(before) + 1
    return json.loads(lines[-1])


def assert_bench_agrees(url: str, out) -> None:
    """One ``pdserve bench`` run through a recording proxy (module docstring): bench never
    reports less time than the proxy saw, never more than the run took, and its summary and
    token counts are what its requests were."""
    flags = ["--num-prompts", str(N), "--random-input-len", str(IN), "--random-output-len", str(OUT),
             "--random-range-ratio", "1", "--max-concurrency", str(CONC), "--seed", "1", "--flush-cache"]
    bench(url, out, *flags, "--warmup-requests", "2")  # a first run warms the server up
    with serve_proxy(url) as (proxy_url, rec):
        t0 = time.perf_counter()
        r = bench(proxy_url, out, *flags, "--warmup-requests", "0")
        wall = time.perf_counter() - t0
    seen = [t for t in rec.timings if t.path == "/generate"]  # arrival order = send order (concurrency 1)
    d = r["details"]
    assert r["completed"] == N and len(seen) == N and r["total_output_tokens"] == N * OUT
    for i, t in enumerate(seen):
        assert d["output_lens"][i] == t.tokens == OUT, (i, t)
        assert d["ttfts"][i] >= t.first_token, (i, d["ttfts"][i], t)  # sent before t.arrived, read after
        assert d["e2e_latencies"][i] >= t.last_token >= t.first_token, (i, d["e2e_latencies"][i], t)
    for i in range(N - 1):  # one at a time: a request ends before the next one starts
        assert d["start_times"][i] + d["e2e_latencies"][i] <= d["start_times"][i + 1] + 1e-9, d
    assert d["start_times"][-1] + d["e2e_latencies"][-1] <= r["duration"] <= wall
    assert r["mean_ttft_ms"] == pytest.approx(1000 * statistics.mean(d["ttfts"]))
    assert r["mean_e2e_latency_ms"] == pytest.approx(1000 * statistics.mean(d["e2e_latencies"]))
    assert r["output_throughput"] == pytest.approx(r["total_output_tokens"] / r["duration"])


def test_bench_agrees_with_an_independent_observer(server, tmp_path):
    assert_bench_agrees(server.url, tmp_path / "agree.jsonl")


def test_json_has_every_metric(server, tmp_path):
    r = bench(server.url, tmp_path / "m.jsonl", "--num-prompts", "6", "--random-input-len", "64",
              "--random-output-len", "8", "--random-range-ratio", "1", "--slo", "ttft:60000,tpot:60000",
              "--metric-percentiles", "50,90,99", "--label", "every-metric")
    for key in METRIC_KEYS:
        assert r[key] is not None, key
    for name in ("ttft", "tpot", "itl", "e2e_latency"):
        for stat in ("mean", "median", "std", "p50", "p90", "p99", "max"):
            assert isinstance(r[f"{stat}_{name}_ms"], float), (stat, name)
    assert r["completed"] == 6 and r["total_input_tokens"] == 6 * 64 and r["total_output_tokens"] == 6 * 8
    assert r["request_goodput"] == pytest.approx(r["request_throughput"]) and r["slo_attainment"] == 1.0
    assert r["schema"] == "pdserve.bench/v1" and r["label"] == "every-metric" and r["model"] == MODEL
    assert r["args"]["random_input_len"] == 64 and r["args"]["slo"] == {"ttft": 60000.0, "tpot": 60000.0}
    d = r["details"]
    assert all(len(d[k]) == 6 for k in DETAIL_KEYS)
    assert d["output_lens"] == [8] * 6 and all(sum(k) == 8 for k in d["event_tokens"]), d["event_tokens"]
    # native: one ITL per token after the first event (which may carry several when the stream lagged)
    assert [len(itl) for itl in d["itls"]] == [8 - k[0] for k in d["event_tokens"]], (d["itls"], d["event_tokens"])
    # A colocated server's breakdown: no transfer stage time.
    t = r["server_timeline"]
    assert set(t["stages"]) == {"queue", "prefill", "transfer", "decode_scheduling"}, t
    assert t["stages"]["transfer"]["mean_ms"] == 0.0 and t["transfer_share_of_ttft"] == 0.0 and t["warning"] is None


# --------------------------------------------------------- request shapes
@dataclass
class Timing:
    """One request as the proxy saw it, seconds from its arrival: the first and the last event
    that carried new tokens (stamped before the proxy forwarded them), and the tokens counted."""

    path: str
    first_token: float = 0.0
    last_token: float = 0.0
    tokens: int = 0


class RecordingProxy:
    """A loopback HTTP proxy that records each request (method, path, JSON body) and streams the
    reply, timing the token events of native /generate streams."""

    def __init__(self, upstream: str):
        self.upstream = upstream
        self.seen: list[tuple[str, str, dict | None]] = []
        self.timings: list[Timing] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        arrived = time.perf_counter()
        raw = await request.read()
        self.seen.append((request.method, request.path, json.loads(raw) if raw else None))
        timing = Timing(request.path)
        self.timings.append(timing)
        async with ClientSession() as s, s.request(request.method, self.upstream + request.path_qs, data=raw,
                                                   headers={"Content-Type": "application/json"}) as up:
            resp = web.StreamResponse(status=up.status, headers={"Content-Type": up.headers["Content-Type"]})
            await resp.prepare(request)
            buf = b""
            async for chunk in up.content.iter_any():
                buf += chunk
                *events, buf = buf.split(b"\n\n")
                for ev in events:
                    self._observe(timing, ev.strip(), time.perf_counter() - arrived)
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    @staticmethod
    def _observe(timing: Timing, event: bytes, now: float) -> None:
        if not event.startswith(b"data: {"):
            return
        tokens = (json.loads(event[6:]).get("meta_info") or {}).get("completion_tokens") or 0
        if tokens > timing.tokens:
            timing.first_token = timing.first_token or now
            timing.last_token, timing.tokens = now, tokens


@contextlib.contextmanager
def serve_proxy(upstream: str):
    """(proxy URL, RecordingProxy) served from a thread's event loop, stopped on exit."""
    import threading

    rec = RecordingProxy(upstream)
    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", rec.handle)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}", rec
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


@pytest.fixture(scope="module")
def proxy(server):
    with serve_proxy(server.url) as served:
        yield served


SHAPES = {
    "sglang": ("/generate", {"text", "sampling_params", "stream"}),
    "pdserve": ("/generate", {"text", "sampling_params", "stream"}),
    "openai": ("/v1/completions", {"model", "prompt", "max_tokens", "temperature", "stream", "stream_options",
                                   "ignore_eos"}),
    "openai-chat": ("/v1/chat/completions", {"model", "messages", "max_tokens", "temperature", "stream",
                                             "stream_options", "ignore_eos"}),
}


@pytest.mark.parametrize("backend", list(SHAPES))
def test_backends_send_their_servers_request_shapes(server, proxy, backend, tmp_path):
    url, rec = proxy
    rec.seen.clear()
    r = bench(url, tmp_path / "shape.jsonl", "--backend", backend, "--num-prompts", "3", "--random-input-len", "40",
              "--random-output-len", "6", "--random-range-ratio", "1", "--warmup-requests", "1")
    assert r["completed"] == 3 and r["failed"] == 0
    assert r["total_output_tokens"] == 18  # usage (OpenAI) or meta_info (native) counts, ignore_eos
    if backend != "openai-chat":
        assert r["total_input_tokens"] == 3 * 40
    else:  # the server's count includes the chat template around the 40 tokens
        assert r["total_input_tokens"] > 3 * 40
    path, keys = SHAPES[backend]
    posts = [(p, b) for m, p, b in rec.seen if m == "POST"]
    assert len(posts) == 4 and {p for p, _ in posts} == {path}  # warm-up + 3
    for _, body in posts:
        assert keys <= set(body), set(body)
        assert body["stream"] is True
        if backend in ("sglang", "pdserve"):
            assert body["sampling_params"] == {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
        else:
            assert body["stream_options"] == {"include_usage": True} and body["model"] == MODEL
    if backend == "openai-chat":
        assert all(b["messages"][0]["role"] == "user" for _, b in posts)
    if backend == "openai":
        assert all(isinstance(b["prompt"], str) and b["max_tokens"] == 6 for _, b in posts)


def test_tokenize_prompt_sends_input_ids(server, proxy, tmp_path):
    url, rec = proxy
    rec.seen.clear()
    r = bench(url, tmp_path / "ids.jsonl", "--backend", "sglang", "--tokenize-prompt", "--num-prompts", "2",
              "--random-input-len", "33", "--random-output-len", "4", "--random-range-ratio", "1")
    assert r["completed"] == 2 and r["total_input_tokens"] == 66
    bodies = [b for m, _, b in rec.seen if m == "POST"]
    assert all("text" not in b and len(b["input_ids"]) == 33 for b in bodies)


# ------------------------------------------------------------- workloads
def test_multi_turn_rounds_extend_on_the_server(server, tmp_path, proxy):
    url, rec = proxy
    rec.seen.clear()
    r = bench(url, tmp_path / "mt.jsonl", "--dataset-name", "multi-turn", "--tokenize-prompt",
              "--multi-turn-clients", "2", "--multi-turn-rounds", "3", "--multi-turn-question-len", "24",
              "--multi-turn-output-len", "5", "--warmup-requests", "0", "--request-rate", "20")
    assert r["completed"] == 6
    assert sorted(r["details"]["input_lens"]) == [24, 24, 53, 53, 82, 82]  # + 5 answer + 24 question per round
    assert {t: g["completed"] for t, g in r["groups"].items()} == {"turn1": 2, "later_turns": 4}
    rounds = r["rounds"]  # per round: TTFT and the share of prompt tokens each cache tier served
    assert {k: g["completed"] for k, g in rounds.items()} == {"1": 2, "2": 2, "3": 2}
    assert set(rounds["2"]["tier_hit_rate"]) == {"device", "host", "storage"}
    assert rounds["2"]["tier_hit_rate"]["device"] == rounds["2"]["cached_rate"]  # no hierarchical cache here
    ids = [b["input_ids"] for m, _, b in rec.seen if m == "POST"]
    for longer in (x for x in ids if len(x) > 24):
        shorter = [x for x in ids if len(x) == len(longer) - 29 and longer[:len(x)] == x]
        assert len(shorter) == 1  # extends exactly one previous prompt of its conversation


def test_mixed_reports_each_stream(server, tmp_path):
    r = bench(server.url, tmp_path / "mixed.jsonl", "--dataset-name", "mixed", "--num-prompts", "8",
              "--request-rate", "8", "--mixed-background-rate", "4", "--mixed-interactive-input-len", "16",
              "--mixed-interactive-output-len", "8", "--mixed-background-input-len", "300",
              "--mixed-background-output-len", "2")
    groups = r["groups"]
    assert set(groups) == {"interactive", "background"}
    assert groups["interactive"]["completed"] + groups["background"]["completed"] == 8 == r["completed"]
    assert groups["background"]["total_input_tokens"] == 300 * groups["background"]["completed"]


def test_failures_are_counted_not_fatal(server, tmp_path):
    # a prompt longer than the context: every request fails with the server's 400, the run reports it
    ctx = httpx.get(server.url + "/get_model_info").json()["context_length"]
    out = tmp_path / "fail.jsonl"
    with contextlib.redirect_stdout(io.StringIO()) as table:
        rc = cli_main(["bench", "--base-url", server.url, "--disable-tqdm", "--output-file", str(out),
                       "--num-prompts", "2", "--random-input-len", str(ctx + 10), "--random-range-ratio", "1",
                       "--random-output-len", "4", "--warmup-requests", "0"])
    assert rc == 1 and "All requests failed" in table.getvalue()
    r = json.loads(out.read_text())
    assert r["completed"] == 0 and r["failed"] == 2
    assert all(e.startswith("HTTP 400") for e in r["details"]["errors"])


# ----------------------------------------------------------- planner inputs
def assert_cold_profiles(server, tmp_path, first: dict) -> None:
    """A re-run of the same profile times cold prompts too (fresh prompts, flushed cache, cached_tokens
    checked); the check would see a hit (the server reports one for a repeated prompt); lengths past
    the server's context are refused before anything is sent."""
    again = tmp_path / "again.jsonl"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
        assert cli_main(["bench", "--base-url", server.url, "--output-file", str(again), "--profile", "prefill",
                         "--profile-input-lens", "32,128", "--profile-repeats", "2"]) == 0
    rerun = json.loads(again.read_text())
    for prof in (first, rerun):
        assert prof["cache"] == {"flushed_before_each": True, "max_cached_tokens": 0,
                                 "requests_with_cache_hits": 0, "requests": 4}
    assert "warning" not in rerun and "WARNING" not in err.getvalue()
    outs = asyncio.run(_twice(server.url, "a repeated prompt " * 8))
    assert outs[0].cached_tokens == 0 and outs[1].cached_tokens > 0
    with pytest.raises(SystemExit) as e, contextlib.redirect_stderr(io.StringIO()) as err:
        cli_main(["bench", "--base-url", server.url, "--profile", "prefill", "--profile-input-lens", "32,99999"])
    assert e.value.code == 1
    assert "--profile-input-lens: 99999 leaves no room for the output token in the server's context length" \
        in err.getvalue()


async def _twice(url: str, text: str) -> list:
    ep = EndpointConfig(base_url=url)
    req = BenchRequest(text, None, 24, 2)
    async with new_session(ep) as session:
        assert await flush_prefix_cache(session, ep)
        return [await send(session, ep, req, MODEL) for _ in range(2)]


def test_profiles_and_plan_from_a_real_server(server, tmp_path):
    profiles = tmp_path / "profiles.jsonl"
    for flags in (["--profile", "prefill", "--profile-input-lens", "32,128", "--profile-repeats", "2"],
                  ["--profile", "decode", "--profile-batch-sizes", "1,4", "--profile-context-len", "32",
                   "--profile-output-len", "8", "--profile-repeats", "1"]):
        with contextlib.redirect_stdout(io.StringIO()):
            assert cli_main(["bench", "--base-url", server.url, "--output-file", str(profiles), *flags]) == 0
    prefill, decode = (json.loads(line) for line in profiles.read_text().splitlines())
    assert prefill["schema"] == decode["schema"] == "pdserve.profile/v1"
    assert [p["input_len"] for p in prefill["points"]] == [32, 128] and all(p["seconds"] > 0
                                                                           for p in prefill["points"])
    assert [p["batch_size"] for p in decode["points"]] == [1, 4] and all(p["step_seconds"] > 0
                                                                         for p in decode["points"])
    assert decode["context_len"] == 32 and prefill["model"] == MODEL
    assert_cold_profiles(server, tmp_path, prefill)
    run = bench(server.url, tmp_path / "w.jsonl", "--num-prompts", "4", "--random-input-len", "64",
                "--random-output-len", "8", "--request-rate", "4")
    plan_file = tmp_path / "plan.jsonl"
    with contextlib.redirect_stdout(io.StringIO()) as table:
        rc = cli_main(["plan", "--prefill-profile", str(profiles), "--decode-profile", str(profiles),
                       "--workload", str(tmp_path / "w.jsonl"), "--slo", "ttft:60000,tpot:60000",
                       "--max-instances", "3", "--num-requests", "100", "--output-file", str(plan_file)])
    assert rc == 0, table.getvalue()
    plan = json.loads(plan_file.read_text())
    assert plan["schema"] == "pdserve.plan/v1" and plan["recommendation"]["feasible"] is True
    assert plan["recommendation"]["deployment"] == "1 colocated"  # SLOs this loose: one instance suffices
    assert "Recommendation: colocate" in table.getvalue() and run["completed"] == 4
