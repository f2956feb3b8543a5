"""benchmark/plot.py: the data it plots from real result objects, and the PNG when matplotlib is installed."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from pdserve.bench.backends import RequestOutput
from pdserve.bench.config import BenchConfig
from pdserve.bench.serving import build_result

PLOT = Path(__file__).resolve().parents[2] / "benchmark" / "plot.py"


@pytest.fixture(scope="module")
def plot():
    spec = importlib.util.spec_from_file_location("bench_plot", PLOT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def result(rate: float, ttft_s: float, label: str | None = None, slo: dict | None = None) -> dict:
    ok = RequestOutput(start=0.0, prompt_len=10)
    for t in (ttft_s, ttft_s + 0.01, ttft_s + 0.03):
        ok.on_output(t, 1)
    ok.output_len, ok.success = 3, True
    cfg = BenchConfig.from_flat({"request_rate": rate, "label": label, "slo": slo or {}})
    return build_result(cfg, "random", "m", "t", [ok, RequestOutput(start=0.5).fail("HTTP 500")], duration=1.0)


def test_cdf_and_latencies(plot):
    assert plot.cdf([3.0, 1.0, 2.0]) == ([1.0, 2.0, 3.0], [1 / 3, 2 / 3, 1.0])
    lat = plot.latency_ms(result(1.0, 0.1))
    assert lat["TTFT"] == pytest.approx([100.0]) and lat["E2E latency"] == pytest.approx([130.0])
    assert lat["ITL"] == pytest.approx([10.0, 20.0])  # the failed request contributes nothing


def test_label_names_the_offered_rate(plot):
    assert plot.label(result(2.0, 0.1, "a")) == "a @ 2 req/s"
    assert plot.label(result(float("inf"), 0.1)) == "pdserve random @ inf req/s"
    mixed = {**result(float("inf"), 0.1, "pd"), "dataset_name": "mixed"}
    mixed["args"] = {**mixed["args"], "dataset_name": "mixed", "mixed_interactive_rate": 2.0,
                     "mixed_background_rate": 0.5}
    assert plot.label(mixed) == "pd @ 2.5 req/s"  # both streams, not the unused --request-rate


def test_sweep_series_sorted_by_rate_per_label(plot):
    runs = [result(4.0, 0.4, "a"), result(1.0, 0.1, "a"), result(2.0, 0.2, "a"), result(float("inf"), 9, "a"),
            result(1.0, 0.3, "b", slo={"ttft": 200})]
    s = plot.sweep_series(runs)
    assert s["a"]["rate"] == [1.0, 2.0, 4.0]
    assert s["a"]["p99_ttft_ms"] == pytest.approx([100.0, 200.0, 400.0])
    assert s["a"]["request_goodput"] == [None] * 3 and s["b"]["request_goodput"] == [0.0]  # ttft 300 > 200
    assert plot.choose_kind(runs) == "sweep" and plot.choose_kind(runs[:1]) == "cdf"


def test_load_results_skips_other_objects_and_names_bad_lines(plot, tmp_path):
    f = tmp_path / "r.jsonl"
    f.write_text(json.dumps(result(1.0, 0.1)) + "\n" + json.dumps({"schema": "pdserve.profile/v1"}) + "\n")
    assert len(plot.load_results([str(f)])) == 1
    f.write_text("{oops\n")
    with pytest.raises(ValueError, match="r.jsonl:1: not JSON"):
        plot.load_results([str(f)])


@pytest.mark.parametrize("kind,runs", [("cdf", 1), ("sweep", 3)])
def test_writes_a_png(plot, tmp_path, kind, runs):
    pytest.importorskip("matplotlib")
    f = tmp_path / "r.jsonl"
    f.write_text("".join(json.dumps(result(float(i + 1), 0.1 * (i + 1))) + "\n" for i in range(runs)))
    out = tmp_path / "out.png"
    assert plot.main([str(f), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
