"""A ``pdserve serve`` whose count nothing pins (no OMP_NUM_THREADS, no --num-threads) tunes its forward's
threads per step (engine/thread_tuner.py), and ``/get_server_info`` shows the tuner beside the layout."""

from __future__ import annotations

import pytest

from pdserve.config import usable_cores
from server_utils import Server

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def server():
    s = Server(model=MODEL, env={"OMP_NUM_THREADS": None, "OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": None})
    try:
        yield s.start()
    finally:
        s.stop()


@pytest.mark.skipif(usable_cores() < 2, reason="one core leaves no thread count to choose")
def test_server_info_shows_the_thread_tuner(server):
    for _ in range(2):  # 2 x 16 one-request decode steps: past the first probe of that step size
        r = server.post("/generate", json={"input_ids": list(range(5, 25)), "sampling_params": {
            "max_new_tokens": 16, "temperature": 0, "ignore_eos": True}})
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 16, r.text
    info = server.info()
    layout, tuning = info["thread_layout"], info["thread_tuning"]
    assert layout["source"] == "cores"
    assert tuning["enabled"] is True and tuning["counts"][0] == layout["torch_threads"], tuning
    assert tuning["counts"][1] in (1, layout["cores"]) and tuning["counts"][1] != tuning["counts"][0]
    decode = tuning["buckets"]["1"]  # one-request decode steps
    assert decode["probes"] >= 1 and decode["threads"] in tuning["counts"]
    assert set(decode["ms_per_token"]) <= {str(c) for c in tuning["counts"]}
    assert tuning["reason"].startswith("chosen per step")
    assert tuning["omp_wait_policy"] == "passive"  # its OpenMP threads sleep between regions (thread_tuner.py)

