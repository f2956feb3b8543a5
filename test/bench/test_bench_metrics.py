"""Metric definitions against hand-computed values (sglang.bench_serving / vllm bench serve semantics)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pdserve.bench.arrivals import arrival_offsets
from pdserve.bench.backends import NativeParser, OpenAIParser, RequestOutput
from pdserve.bench.config import parse_slo
from pdserve.bench.metrics import (
    KVLink,
    distribution,
    max_in_flight,
    meets_slo,
    request_tpot,
    summarize,
    timeline_summary,
    transfer_busy_seconds,
)


def timed(start: float, events: list[tuple[float, int | None]], output_len: int | None = None,
          prompt_len: int = 10, timeline: dict | None = None) -> RequestOutput:
    """A successful request whose output-carrying events arrived at absolute times ``events``."""
    out = RequestOutput(start=start, prompt_len=prompt_len, timeline=timeline)
    for now, k in events:
        out.on_output(now, k)
    out.output_len = output_len if output_len is not None else sum(k or 1 for _, k in events)
    out.success = True
    return out


def failed() -> RequestOutput:
    return RequestOutput(start=0.0, prompt_len=99).fail("HTTP 500")


# ------------------------------------------------------------ per request
def test_ttft_latency_and_itl_per_gap():
    out = timed(100.0, [(100.5, 1), (100.7, 1), (101.0, 1)])
    assert out.ttft == pytest.approx(0.5)
    assert out.latency == pytest.approx(1.0)
    assert out.itl == pytest.approx([0.2, 0.3])


def test_chunk_of_k_tokens_spreads_its_gap_when_k_is_known():
    # sglang's native client: a chunk of 3 tokens after a 0.6 s gap is three 0.2 s ITLs
    out = timed(0.0, [(0.5, 1), (1.1, 3)])
    assert out.itl == pytest.approx([0.2, 0.2, 0.2])
    assert out.output_len == 4


def test_chunk_of_unknown_size_is_one_gap():
    # OpenAI deltas do not say how many tokens they hold: one ITL per chunk (sglang's and vLLM's OpenAI clients)
    out = timed(0.0, [(0.5, None), (1.1, None)], output_len=4)
    assert out.itl == pytest.approx([0.6])


def test_tpot_excludes_the_first_token():
    out = timed(0.0, [(1.0, 1), (1.1, 1), (1.2, 1), (1.3, 1)])
    assert request_tpot(out) == pytest.approx(0.3 / 3)  # not 1.3 / 4
    assert request_tpot(timed(0.0, [(1.0, 1)])) is None


# -------------------------------------------------------------- per run
def test_distribution_statistics():
    d = distribution([0.010, 0.020, 0.030, 0.040], "ttft", (90, 99))
    assert d["mean_ttft_ms"] == pytest.approx(25.0)
    assert d["median_ttft_ms"] == pytest.approx(25.0)
    assert d["std_ttft_ms"] == pytest.approx(math.sqrt(125.0))  # population std, numpy's default
    assert d["p90_ttft_ms"] == pytest.approx(37.0)  # linear interpolation: 30 + 0.7 * 10
    assert d["p99_ttft_ms"] == pytest.approx(39.7)
    assert d["max_ttft_ms"] == pytest.approx(40.0)
    assert distribution([], "itl", (99,))["mean_itl_ms"] == 0.0  # empty reports 0, as both clients


def test_summarize_throughputs_and_latencies():
    a = timed(0.0, [(0.1, 1), (0.2, 1), (0.3, 1)], prompt_len=100)  # tpot 0.1
    b = timed(0.5, [(0.9, 1), (1.5, 2)], prompt_len=50)  # 3 tokens, tpot (1.0 - 0.4) / 2 = 0.3
    m = summarize([a, b, failed()], duration=2.0, percentiles=(50,))
    assert (m["completed"], m["failed"]) == (2, 1)
    assert m["total_input_tokens"] == 150 and m["total_output_tokens"] == 6  # the failure counts nothing
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["input_throughput"] == pytest.approx(75.0)
    assert m["output_throughput"] == pytest.approx(3.0)
    assert m["total_throughput"] == pytest.approx(78.0)
    assert m["mean_ttft_ms"] == pytest.approx((100 + 400) / 2)
    assert m["mean_tpot_ms"] == pytest.approx((100 + 300) / 2)
    assert m["mean_itl_ms"] == pytest.approx(np.mean([100, 100, 300, 300]))
    assert m["mean_e2e_latency_ms"] == pytest.approx((300 + 1000) / 2)
    assert m["concurrency"] == pytest.approx((0.3 + 1.0) / 2.0)
    assert m["max_concurrent_requests"] == 1  # a ends at 0.3, b starts at 0.5
    assert m["request_goodput"] is None


def test_goodput_counts_only_requests_meeting_every_slo():
    slo = {"ttft": 125.0, "tpot": 62.5}
    good = timed(0.0, [(0.1, 1), (0.14, 1), (0.18, 1)])  # ttft 100, tpot 40
    slow_decode = timed(0.0, [(0.1, 1), (0.17, 1), (0.24, 1)])  # tpot 70
    slow_first = timed(0.0, [(0.2, 1), (0.21, 1)])  # ttft 200
    one_token = timed(0.0, [(0.1, 1)])  # no TPOT: meets a TPOT SLO (vLLM)
    at_limit = timed(0.0, [(0.125, 1), (0.1875, 1)])  # exactly at both limits (binary-exact): meets them
    outs = [good, slow_decode, slow_first, one_token, at_limit, failed()]
    assert [meets_slo(o, slo) for o in outs] == [True, False, False, True, True, False]
    m = summarize(outs, duration=4.0, slo=slo)
    assert m["request_goodput"] == pytest.approx(3 / 4.0)
    assert m["slo_attainment"] == pytest.approx(3 / 6)
    assert summarize(outs, 4.0, slo={"e2e": 185.0})["request_goodput"] == pytest.approx(2 / 4.0)  # good, one


def test_max_in_flight_is_a_sweep_over_intervals():
    outs = [timed(0.0, [(1.0, 1)]), timed(0.5, [(1.5, 1)]), timed(0.9, [(1.2, 1)]), timed(1.0, [(2.0, 1)])]
    assert max_in_flight(outs) == 3  # at 0.9..1.0; the first ends as the last starts


def test_parse_slo():
    assert parse_slo("ttft:200,tpot:50") == {"ttft": 200.0, "tpot": 50.0}
    assert parse_slo("ttft:200 e2el:1000") == {"ttft": 200.0, "e2e": 1000.0}
    for bad, word in (("ttft", "METRIC:MS"), ("itl:5", "itl"), ("ttft:fast", "fast")):
        with pytest.raises(ValueError, match=word):
            parse_slo(bad)


# ------------------------------------------------------------ breakdown
def test_timeline_breakdown_accepts_any_subset_of_stages():
    a = timed(0.0, [(0.100, 1)], timeline={"queue": 0.010, "prefill": 0.060, "transfer": 0.030})
    b = timed(0.0, [(0.100, 1)], timeline={"queue": 0.030, "prefill": 0.060, "transfer": 0.010,
                                           "decode_scheduling": 0.002})
    c = timed(0.0, [(0.100, 1)], timeline={"prefill": 0.090})
    t = timeline_summary([a, b, c, timed(0.0, [(0.1, 1)])])
    assert list(t["stages"]) == ["queue", "prefill", "transfer", "decode_scheduling"]
    assert t["stages"]["queue"] == {"count": 2, "mean_ms": pytest.approx(20.0), "median_ms": pytest.approx(20.0),
                                    "p99_ms": pytest.approx(29.8)}
    assert t["stages"]["prefill"]["mean_ms"] == pytest.approx(70.0)
    assert t["stages"]["decode_scheduling"]["count"] == 1
    assert t["transfer_share_of_ttft"] == pytest.approx(0.2)  # 20 ms of 100 ms: at the line, no warning
    assert t["warning"] is None


GBIT = 1e9 / 8  # bytes/s


def test_transfer_near_the_link_bandwidth_warns_that_the_network_bounds_ttft():
    """30 ms of transfer moving 3 MB: 0.8 Gbit/s on a 1 Gbit/s link."""
    slow = timed(0.0, [(0.100, 1)], timeline={"queue": 0.01, "prefill": 0.05, "transfer": 0.030})
    t = timeline_summary([slow], KVLink(kv_bytes=3_000_000, bandwidth=1 * GBIT, source="--kv-link-gbps"))
    assert t["kv_transfer_gbps"] == pytest.approx(0.8) and t["link_utilization"] == pytest.approx(0.8)
    assert "network bounds TTFT" in t["warning"] and "30%" in t["warning"] and t["note"] is None


def test_a_large_share_at_a_low_rate_is_latency_not_the_network():
    """The loopback case of issue 36: 34 ms of transfer, a quarter of TTFT, moving 0.3 MB on a link
    of 40 Gbit/s: per-transfer latency, no warning."""
    idle = timed(0.0, [(0.136, 1)], timeline={"queue": 0.002, "prefill": 0.1, "transfer": 0.034})
    t = timeline_summary([idle], KVLink(kv_bytes=300_000, bandwidth=40 * GBIT, source="loopback, measured"))
    assert t["transfer_share_of_ttft"] == pytest.approx(0.25)
    assert t["warning"] is None and "per-transfer latency" in t["note"] and "loopback, measured" in t["note"]


def test_without_bytes_or_a_link_there_is_no_verdict():
    slow = timed(0.0, [(0.100, 1)], timeline={"transfer": 0.030})
    no_bytes = timeline_summary([slow])
    assert no_bytes["warning"] is None and "did not report the KV bytes" in no_bytes["note"]
    no_link = timeline_summary([slow], KVLink(kv_bytes=10**6))
    assert no_link["warning"] is None and "--kv-link-gbps" in no_link["note"]
    assert no_link["kv_transfer_gbps"] == pytest.approx(10**6 / 0.030 * 8e-9)


def test_transfer_busy_time_is_the_union_of_the_transfer_stages():
    a = timed(0.0, [(1, 1)], timeline={"queue": 0.1, "prefill": 0.2, "transfer": 0.3})  # 0.3 .. 0.6
    b = timed(0.4, [(1, 1)], timeline={"prefill": 0.0, "transfer": 0.4})  # 0.4 .. 0.8
    c = timed(1.0, [(2, 1)], timeline={"transfer": 0.1})  # 1.0 .. 1.1
    assert transfer_busy_seconds([a, b, c, timed(0.0, [(1, 1)])]) == pytest.approx(0.6)


def test_no_timeline_means_no_breakdown():
    assert timeline_summary([timed(0.0, [(0.1, 1)]), failed()]) is None


# -------------------------------------------------------------- parsers
def test_native_parser_counts_tokens_from_meta_info():
    out = RequestOutput(start=0.0, prompt_len=5)
    p = NativeParser(out)
    p.feed({"text": "a", "output_ids": [7], "meta_info": {"prompt_tokens": 6, "completion_tokens": 1}}, 0.5)
    p.feed({"text": "a", "output_ids": [7], "meta_info": {"completion_tokens": 1}}, 0.6)  # nothing new
    p.feed({"text": "abcd", "output_ids": [7, 8, 9, 10], "meta_info": {
        "completion_tokens": 4, "timeline": {"prefill": 0.1}}}, 1.1)
    p.finish()
    assert (out.ttft, out.latency, out.output_len, out.prompt_len) == (0.5, 1.1, 4, 6)
    assert out.itl == pytest.approx([0.2, 0.2, 0.2])
    assert out.text == "abcd" and out.output_ids == [7, 8, 9, 10] and out.timeline == {"prefill": 0.1}


def test_openai_chat_parser_ignores_role_finish_and_usage_chunks():
    out = RequestOutput(start=0.0)
    p = OpenAIParser(out, chat=True)
    p.feed({"choices": [{"delta": {"role": "assistant", "content": ""}}]}, 0.4)
    p.feed({"choices": [{"delta": {"content": "Hi"}}]}, 0.5)
    p.feed({"choices": [{"delta": {"content": " there"}}]}, 0.7)
    p.feed({"choices": [{"delta": {}, "finish_reason": "length"}]}, 0.71)
    p.feed({"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 3}}, 0.72)
    assert (out.ttft, out.latency, out.output_len, out.prompt_len, out.text) == (0.5, 0.7, 3, 12, "Hi there")
    assert out.itl == pytest.approx([0.2])


# ------------------------------------------------------------- arrivals
def test_infinite_rate_sends_everything_at_once():
    assert arrival_offsets(4, math.inf, 1.0, np.random.default_rng(0)) == [0.0] * 4


def test_arrivals_are_seeded_with_the_requested_mean_rate():
    a = arrival_offsets(20000, 5.0, 1.0, np.random.default_rng(3))
    assert a == arrival_offsets(20000, 5.0, 1.0, np.random.default_rng(3))
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))
    gaps = np.diff(a)
    assert gaps.mean() == pytest.approx(0.2, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1


def test_burstiness_shapes_the_gaps():
    gaps = np.diff(arrival_offsets(20000, 5.0, 0.25, np.random.default_rng(3)))
    assert gaps.mean() == pytest.approx(0.2, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(2.0, rel=0.05)  # gamma(k): CV 1/sqrt(k)
    assert np.diff(arrival_offsets(5, 4.0, math.inf, np.random.default_rng(0))) == pytest.approx([0.25] * 4)


# ---------------------------------------------------------------- report
def test_console_table_shows_the_breakdown_only_when_present():
    from pdserve.bench.config import BenchConfig
    from pdserve.bench.serving import build_result, format_table

    plain = [timed(0.0, [(0.1, 1), (0.2, 1)])]
    with_tl = [timed(0.0, [(0.1, 1), (0.2, 1)], timeline={"queue": 0.01, "prefill": 0.05, "transfer": 0.04})]
    table = format_table(build_result(BenchConfig(), "random", "m", "t", plain, 1.0))
    assert "Mean TTFT (ms):" in table and "P99 ITL (ms):" in table and "breakdown" not in table
    r = build_result(BenchConfig(), "random", "m", "t", with_tl, 1.0)
    table = format_table(r)
    assert "Server TTFT breakdown" in table and "transfer mean / P99 (ms):" in table
    assert "NOTE: KV transfer is 40% of TTFT" in table and "WARNING" not in table  # no bytes: no verdict
    busy = format_table(build_result(BenchConfig(), "random", "m", "t", with_tl, 1.0,
                                     KVLink(kv_bytes=4_000_000, bandwidth=1 * GBIT, source="--kv-link-gbps")))
    assert "Link utilization:" in busy and "80.0% of 1.0 Gbit/s" in busy
    assert "WARNING: KV moved at 0.80 Gbit/s" in busy and "the network bounds TTFT" in busy
    assert r["server_timeline"]["stages"]["transfer"]["mean_ms"] == pytest.approx(40.0)
    assert r["details"]["timelines"] == [{"queue": 0.01, "prefill": 0.05, "transfer": 0.04}]


def test_speculative_summary_from_the_servers_figures():
    from pdserve.bench.backends import RequestOutput
    from pdserve.bench.metrics import speculative_summary

    a = RequestOutput(success=True, output_len=9, spec_verify_ct=4, spec_draft_tokens=8, spec_accepted_tokens=4)
    b = RequestOutput(success=True, output_len=5, spec_verify_ct=4, spec_draft_tokens=8, spec_accepted_tokens=0)
    failed = RequestOutput(success=False, output_len=0, spec_verify_ct=1, spec_draft_tokens=2, spec_accepted_tokens=2)
    s = speculative_summary([a, b, failed])
    assert s == {"requests": 2, "verify_ct": 8, "accept_length": (8 + 4) / 8, "accept_rate": 4 / 16}
    assert speculative_summary([RequestOutput(success=True, output_len=3)]) is None


def test_native_parser_keeps_the_speculative_figures():
    out = RequestOutput(start=0.0)
    p = NativeParser(out)
    p.feed({"text": "ab", "output_ids": [7, 8], "meta_info": {
        "completion_tokens": 2, "spec_verify_ct": 1, "spec_draft_token_num": 3, "spec_accept_token_num": 0}}, 0.5)
    p.feed({"text": "abcd", "output_ids": [7, 8, 9, 10], "meta_info": {
        "completion_tokens": 4, "spec_verify_ct": 2, "spec_draft_token_num": 6, "spec_accept_token_num": 1}}, 0.9)
    p.finish()
    assert (out.spec_verify_ct, out.spec_draft_tokens, out.spec_accepted_tokens) == (2, 6, 1)
