"""The elastic controller's pure parts: hysteresis, the one-of-each bound, the planner's split for
a prefill-heavy and a decode-heavy mix, and intervals read from real /metrics text."""

from __future__ import annotations

import http.server
import json
import threading

import pytest

from pdserve.bench import planner
from pdserve.bench.profiles import Curve, DecodeProfile, PrefillProfile
from pdserve.entrypoints.elastic import (
    Controller,
    ElasticConfig,
    Hysteresis,
    Interval,
    decide,
    interval_from,
    parse_metrics,
    plan_split,
)
from pdserve.obs.metrics import ServerMetrics
from pdserve.obs.timeline import ReqTimeline

HW = planner.Hardware(PrefillProfile(Curve((128.0, 4096.0), (0.02, 0.6))),
                      DecodeProfile(Curve((1.0, 64.0), (0.01, 0.03))))
SLO = planner.SLO(ttft=2.0, tpot=0.1)


def test_a_switch_needs_patience_and_then_starts_over():
    state, moves = Hysteresis(), []
    for _ in range(5):
        state, move = decide(state, prefill=1, total=4, wanted=3, patience=2)
        moves.append(move)
    assert moves == [0, 1, 0, 1, 0]  # at most one switch per interval, patience again after each


def test_a_change_of_mind_resets_the_streak():
    state, move = decide(Hysteresis(), 2, 4, 3, patience=2)
    state, move2 = decide(state, 2, 4, 1, patience=2)  # now the other way
    state, move3 = decide(state, 2, 4, 2, patience=2)  # content
    assert (move, move2, move3) == (0, 0, 0) and state.streak == 0
    assert decide(Hysteresis(-1), 2, 4, 1, patience=2) == (Hysteresis(0), -1)


@pytest.mark.parametrize("prefill,wanted", [(1, 0), (3, 9), (1, -5)])
def test_never_fewer_than_one_of_each_role(prefill, wanted):
    state = Hysteresis()
    for _ in range(4):
        state, move = decide(state, prefill, 4, wanted, patience=1)
        assert 1 <= prefill + move <= 3
        prefill += move


def test_the_planner_leans_towards_the_busy_side():
    long_prompts = planner.WorkloadModel((3000,), (8,), 2.0)
    chat = planner.WorkloadModel((64,), (200,), 2.0)
    assert plan_split(long_prompts, HW, SLO, 4)[0] >= 2
    assert plan_split(chat, HW, SLO, 4)[0] == 1


def _metrics(prompt: int, output: int, itls: list[float], e2e: float) -> dict[str, float]:
    m = ServerMetrics("m")
    t = ReqTimeline(0.0)
    t.on_tokens(1, 0.5)
    t.set_stages({"queue": 0.1, "prefill": 0.3, "transfer": 0.05})
    for gap in itls:
        t.on_tokens(1, t.last_token + gap)
    t.on_finish(e2e)
    m.observe_finished(t, prompt, output, "length")
    m.set_scheduler_stats({"num_running_reqs": 3})
    return parse_metrics(m.render().decode())


def test_interval_from_two_scrapes():
    before = {"d": {}, "p": {}}
    after = {"d": _metrics(100, 20, [0.01, 0.03], 1.0), "p": _metrics(100, 0, [], 0.4)}
    iv = interval_from(before, after, {"d": "decode", "p": "prefill"}, seconds=2.0)
    assert (iv.requests, iv.prompt_tokens, iv.output_tokens) == (1, 100, 20)
    assert iv.prefill_tokens == 100 and iv.prefill_seconds == pytest.approx(0.3)  # the decode side's breakdown
    assert iv.itl_count == 2 and iv.itl_seconds == pytest.approx(0.04) and iv.decode_batch == 3
    assert iv.workload().rate == pytest.approx(0.5)
    hw = iv.hardware()
    assert hw is not None and hw.decode.step(3) == pytest.approx(0.02)
    assert Interval(1.0, 5, 10, 10).hardware() is None  # nothing measured on one side: no estimate


def test_the_role_switch_goes_with_the_admin_key():
    """The servers take POST /pd_role_switch only with --admin-api-key when they have one: the
    controller sends it there (and the inference key for its reads)."""
    seen: list[tuple[str, str | None]] = []

    class Worker(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers["Content-Length"]))
            seen.append((self.path, self.headers.get("Authorization")))
            self.send_response(200)
            self.end_headers()
            self.wfile.write(json.dumps({"seconds": 0.1}).encode())

        def log_message(self, *_args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Worker)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        controller = Controller("http://127.0.0.1:1", ElasticConfig(SLO), api_key="inf", admin_api_key="adm")
        controller._switch([{"url": url, "in_flight": 0}], "decode")  # noqa: SLF001 - the one HTTP call
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    assert seen == [("/pd_role_switch", "Bearer adm")]
    assert controller.switches[0]["role"] == "decode"
