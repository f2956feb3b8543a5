"""``pdserve bench`` against a 1 prefill + 1 decode deployment behind ``pdserve router``: the JSON
has every metric plus the server's TTFT breakdown with a transfer stage, and its mean TTFT and
per-request figures agree with an independent observer of the same requests (test_bench_server's
recording proxy, between bench and the router)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # test/: the disagg and router helpers

from test_bench_server import METRIC_KEYS, MODEL, assert_bench_agrees, bench  # noqa: E402

from disagg.pd_servers import decode_server, prefill_server, start_all  # noqa: E402
from router.router_utils import Router, wait_for  # noqa: E402


@pytest.fixture(scope="module")
def deployment():
    flags = ("--num-threads", "1", "--max-total-tokens", "32768")
    prefill, boot = prefill_server(MODEL, *flags)
    decode = decode_server(MODEL, *flags)
    router = None
    try:
        start_all([prefill, decode])
        router = Router([(prefill.url, boot)], [decode.url]).start()
        wait_for(lambda: router.get("/health").status_code == 200, 60, "router sees healthy workers")
        yield router, decode
    finally:
        if router is not None:
            router.stop()
        prefill.stop()
        decode.stop()


def test_json_has_every_metric_and_the_transfer_stage(deployment, tmp_path):
    router, decode = deployment
    r = bench(router.url, tmp_path / "m.jsonl", "--num-prompts", "6", "--random-input-len", "64",
              "--random-output-len", "8", "--random-range-ratio", "1", "--slo", "ttft:60000,tpot:60000")
    for key in METRIC_KEYS:
        assert r[key] is not None, key
    assert r["completed"] == 6 and r["total_output_tokens"] == 48
    stages = r["server_timeline"]["stages"]
    assert set(stages) == {"queue", "prefill", "transfer", "decode_scheduling"}
    assert stages["prefill"]["count"] == 6 and stages["transfer"]["mean_ms"] > 0
    assert 0 < r["server_timeline"]["transfer_share_of_ttft"] < 1
    # the verdict on the link reads the decode's KV bytes and the loopback's measured bandwidth
    t = r["server_timeline"]
    assert t["kv_bytes"] > 0 and t["link_source"] == "loopback, measured" and 0 < t["link_utilization"] < 1
    assert decode.info()["kv_received"] >= 6  # the requests really went through prefill


def test_bench_agrees_with_an_independent_observer(deployment, tmp_path):
    router, _ = deployment
    assert_bench_agrees(router.url, tmp_path / "agree.jsonl")
