"""Processes that die in the middle of a transfer (kill -9, real servers, real Mooncake).

Prefill servers A and B write their KV 3 s late (PDSERVE_TRANSFER_FAULTS), so requests are
reliably in flight when a test pulls the plug. Decode L falls back to a local prefill, decode E
fails requests instead, decode X is killed in phase 3. The test plays the router (it must pick
which prefill serves a request).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from pd_servers import decode_server, kill9, prefill_server, routed, start_all

import pdserve
from router.router_utils import wait_for

MODEL = "tiny-llama"
NEW = 12
FLAGS = ("--page-size", "4", "--max-total-tokens", "8192", "--num-threads", "1")
SLOW = {"PDSERVE_TRANSFER_FAULTS": "delay_posts=3"}  # wide enough for 8 rooms to overlap on a loaded host
TIMEOUT_S = 10


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1500, (20 + 7 * i,), generator=g).tolist() for i in range(n)]


def _colocated(prompts):
    eng = pdserve.Engine(model_path=MODEL, page_size=4, num_threads=1)
    return [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=_greedy())]


def _greedy():
    return {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def cluster():
    a, boot_a = prefill_server(MODEL, *FLAGS, env=SLOW)
    b, boot_b = prefill_server(MODEL, *FLAGS, env=SLOW)
    timeout = ("--disaggregation-timeout-s", str(TIMEOUT_S), "--disaggregation-heartbeat-s", "0.5")
    local = decode_server(MODEL, *FLAGS, *timeout)
    error = decode_server(MODEL, *FLAGS, *timeout, "--disaggregation-fallback", "error")
    doomed = decode_server(MODEL, *FLAGS, *timeout)
    servers = [a, b, local, error, doomed]
    try:
        start_all(servers)
        yield {"A": (a, boot_a), "B": (b, boot_b), "L": local, "E": error, "X": doomed}
    finally:
        for s in servers:
            s.stop()


def _in_flight(decode, at_least: int) -> bool:
    return decode.info()["num_waiting_for_kv"] >= at_least


def test_killed_prefill_local_fallback_error_policy_and_a_second_prefill(cluster):
    (a, boot_a), (b, boot_b), local, error = cluster["A"], cluster["B"], cluster["L"], cluster["E"]
    prompts = _prompts(4, seed=1)
    bodies = [{"input_ids": p, "sampling_params": _greedy()} for p in prompts]
    with ThreadPoolExecutor(8) as pool:
        to_local = [pool.submit(routed, a, boot_a, local, body) for body in bodies]
        to_error = [pool.submit(routed, a, boot_a, error, body) for body in bodies]
        wait_for(lambda: _in_flight(local, 4) and _in_flight(error, 4), 60, "KV in flight on both decodes")
        kill9(a)
        got_local = [f.result()["output_ids"] for f in to_local]
        got_error = [f.result()["meta_info"]["finish_reason"] for f in to_error]
    assert got_local == _colocated(prompts)  # the client never saw the failure
    assert local.info()["fallbacks"] >= 1
    assert all(r["type"] == "abort" and "KV transfer failed" in r["message"] for r in got_error), got_error
    # Both keep serving, through the other prefill, with real transfers.
    more = _prompts(2, seed=2)
    received = local.info()["kv_received"]
    assert [routed(b, boot_b, local, {"input_ids": p, "sampling_params": _greedy()})["output_ids"]
            for p in more] == _colocated(more)
    assert local.info()["kv_received"] == received + 2
    assert routed(b, boot_b, error, {"input_ids": more[0], "sampling_params": _greedy()})["output_ids"] == \
        _colocated(more[:1])[0]
    # After the quarantine, every page is back: free + cached == total.
    for decode in (local, error):
        decode.wait_idle(3 * TIMEOUT_S)
        assert decode.info()["quarantined_pages"] == 0


def test_killed_decode_frees_prefill_pages_and_prefill_keeps_serving(cluster):
    (b, boot_b), doomed, local = cluster["B"], cluster["X"], cluster["L"]
    prompts = _prompts(2, seed=3)
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(routed, b, boot_b, doomed, {"input_ids": p, "sampling_params": _greedy()})
                   for p in prompts]
        wait_for(lambda: b.info()["rooms_transferring"] >= 1, 60, "prefill B writing to decode X")
        kill9(doomed)
        for f in futures:
            with pytest.raises(Exception):  # noqa: B017 - the client of a dead decode gets a broken connection
                f.result()
    info = wait_for(lambda: _idle(b), TIMEOUT_S * 3, "prefill B released the dead decode's rooms")
    assert info["rooms_failed"] + info["rooms_aborted"] >= 1, info
    again = _prompts(1, seed=4)
    assert routed(b, boot_b, local, {"input_ids": again[0], "sampling_params": _greedy()})["output_ids"] == \
        _colocated(again)[0]


def _idle(server) -> dict | None:
    info = server.info()
    done = (info["rooms_transferring"] == 0 and info["num_running_reqs"] == 0
            and info["free_pages"] + info["cached_pages"] == info["total_pages"])
    if not done:
        time.sleep(0.1)
    return info if done else None
