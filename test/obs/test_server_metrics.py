"""ServerMetrics and ReqTimeline: what the frontend records and what /metrics exposes."""

from __future__ import annotations

import pytest

from pdserve.obs.metrics import ServerMetrics
from pdserve.obs.timeline import ReqTimeline


def test_timeline_ttft_itl_e2e():
    t = ReqTimeline(arrival=10.0)
    t.on_tokens(1, now=10.5)
    t.on_tokens(1, now=10.7)
    t.on_tokens(2, now=11.1)  # two tokens in one message share the gap
    t.on_finish(now=11.2)
    assert t.ttft == pytest.approx(0.5)
    assert t.itls == pytest.approx([0.2, 0.2, 0.2])
    assert t.e2e == pytest.approx(1.2)


def test_metrics_render_and_servers_do_not_share_state():
    a, b = ServerMetrics("m"), ServerMetrics("m")
    t = ReqTimeline(arrival=0.0)
    t.on_tokens(1, now=0.1)
    t.on_tokens(1, now=0.15)
    t.on_finish(now=0.2)
    a.observe_finished(t, prompt_tokens=7, completion_tokens=2, finish_type="length")
    a.set_scheduler_stats({"num_running_reqs": 3, "num_waiting_reqs": 1, "token_usage": 0.25,
                           "free_pages": 10, "cached_pages": 2, "total_pages": 16})
    text = a.render().decode()
    assert 'pdserve:prompt_tokens_total{model_name="m"} 7.0' in text
    assert 'pdserve:generation_tokens_total{model_name="m"} 2.0' in text
    assert 'pdserve:num_running_reqs{model_name="m"} 3.0' in text
    assert 'pdserve:num_queue_reqs{model_name="m"} 1.0' in text
    assert 'pdserve:time_to_first_token_seconds_count{model_name="m"} 1.0' in text
    assert 'pdserve:inter_token_latency_seconds_count{model_name="m"} 1.0' in text
    assert 'finish_reason="length"' in text
    assert 'prompt_tokens_total{model_name="m"} 0.0' in b.render().decode()


def test_refused_and_stale_p_d_messages_are_counted_in_metrics():
    m = ServerMetrics("m")
    m.set_scheduler_stats({"control_refused": 7, "stale_messages": 2, "duplicate_rooms": 1,
                           "kv_requests_refused": 3})
    text = m.render().decode()
    for line in ('pdserve:control_frames_refused_total{model_name="m"} 7.0',
                 'pdserve:control_stale_messages_total{model_name="m"} 2.0',
                 'pdserve:decode_duplicate_rooms_total{model_name="m"} 1.0',
                 'pdserve:prefill_kv_requests_refused_total{model_name="m"} 3.0'):
        assert line in text, line


def test_batch_histogram_renders_as_prometheus_histogram_of_the_same_samples():
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from pdserve.obs.metrics import LATENCY_BUCKETS, BatchHistogram

    samples = [0.0, 0.001, 0.0011, 0.01, 0.013, 0.5, 0.75, 59.9, 60.0, 61.0, 1e-6, 0.02]  # bounds, between, beyond
    batch, slow = CollectorRegistry(), CollectorRegistry()
    fast = BatchHistogram("h", "doc", {"model_name": "m"}, LATENCY_BUCKETS)
    batch.register(fast)
    fast.observe_many(samples[:5])
    fast.observe_many([])
    fast.observe_many(samples[5:])
    reference = Histogram("h", "doc", ["model_name"], buckets=LATENCY_BUCKETS, registry=slow).labels(model_name="m")
    for x in samples:
        reference.observe(x)

    def series(registry):
        return sorted(line for line in generate_latest(registry).decode().splitlines()
                      if line.startswith(("h_bucket", "h_count", "h_sum")))

    assert series(batch) == series(slow)
    assert 'h_count{model_name="m"} 12.0' in series(batch)
