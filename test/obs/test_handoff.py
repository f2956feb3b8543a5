"""The frontend's handoff profile: per-stage percentiles in ms, and a socket stage across two
clocks (another node) left out rather than counted as a wait."""

from pdserve.obs.handoff import STAGES, HandoffProfile


def test_summary_in_milliseconds_with_percentiles():
    p = HandoffProfile(window=100)
    for i in range(1, 101):
        p.add("wake", i / 1000)  # 1..100 ms
    s = p.summary()
    assert set(s) == set(STAGES)
    w = s["wake"]
    assert w["count"] == 100 and w["p50_ms"] == 51 and w["p90_ms"] == 91 and w["p99_ms"] == 100
    assert abs(w["mean_ms"] - 50.5) < 1e-9 and w["max_ms"] == 100
    assert s["write"] == {"count": 0}


def test_window_keeps_the_latest_and_count_keeps_all():
    p = HandoffProfile(window=10)
    for i in range(25):
        p.add("detokenize", float(i))
    s = p.summary()["detokenize"]
    assert s["count"] == 25 and s["max_ms"] == 24000 and s["p50_ms"] == 20000  # samples 15..24


def test_socket_stage_skips_unstamped_and_cross_clock_messages():
    p = HandoffProfile()
    p.socket(0.0, 100.0)  # an older sender that stamps nothing
    p.socket(100.0, 99.0)  # the sender's clock ahead: another machine
    p.socket(1.0, 1000.0)  # far apart: another machine's clock
    assert p.summary()["socket"] == {"count": 0}
    p.socket(10.0, 10.002)
    assert p.summary()["socket"]["count"] == 1 and abs(p.summary()["socket"]["p50_ms"] - 2) < 1e-6
    p.reset()
    assert p.summary()["socket"] == {"count": 0}


def test_emit_stage_from_the_sampling_stamp_to_the_send():
    p = HandoffProfile()
    p.socket(10.0, 10.002)  # no sampling stamp (a control reply, an older sender): socket only
    p.socket(10.0, 10.002, 10.5)  # stamped after its send: not a wait, left out
    assert p.summary()["emit"] == {"count": 0} and p.summary()["socket"]["count"] == 2
    p.socket(10.0, 10.002, 9.997)
    assert p.summary()["emit"]["count"] == 1 and abs(p.summary()["emit"]["p50_ms"] - 3) < 1e-6
