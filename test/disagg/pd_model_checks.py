"""One model's 1P1D checks against transformers, shared by the per-model P/D modules
(test_pd_deepseek_v32.py, test_pd_deepseek_v4.py): a deployment of real processes per transfer
backend, greedy tokens through pdserve's router and sglang-router, the bytes decode received per
page, and decode's own prefix hit asking prefill only for the pages it lacks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import torch
from pd_servers import RoutedPair

from entrypoints.server_utils import free_port
from fixtures.tiny_models import greedy_continuation
from router.router_utils import wait_for

PAGE = 4
NEW = 6


def greedy() -> dict:
    return {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 400, (n,), generator=g).tolist()


def pages(tokens: int) -> int:
    return -(-tokens // PAGE)


class Deployment(RoutedPair):
    def __init__(self, path: str, backend: str, *flags: str):
        """``flags``: more flags for both servers (``--speculative-algorithm NEXTN``)."""
        super().__init__(path, "--page-size", str(PAGE), "--chunked-prefill-size", "16", "--max-total-tokens", "4096",
                         "--num-threads", "1", "--disaggregation-transfer-backend", backend, *flags)


def send(url: str, prompts: list[list[int]]) -> list[list[int]]:
    def one(p: list[int]) -> list[int]:
        r = httpx.post(url + "/generate", json={"input_ids": p, "sampling_params": greedy()}, timeout=180)
        r.raise_for_status()
        return r.json()["output_ids"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def idle(pd) -> tuple[dict, dict]:
    return pd.prefill.wait_idle(60), pd.decode.wait_idle(60)


def check_router_tokens(pd, hf, lengths, page_bytes: int, record_bytes: int = 0) -> None:
    """Transformers' tokens through pdserve's router; every page moved ``page_bytes`` (every region
    its layers keep) and every room ``record_bytes`` (its per-request record, whatever its length),
    nothing more; no fallback, failure or quarantine."""
    prompts = [prompt(n, seed=n) for n in lengths]
    before = pd.decode.info()
    assert send(pd.router.url, prompts) == [greedy_continuation(hf, p, NEW) for p in prompts]
    p, d = idle(pd)
    moved = d["kv_received"] - before["kv_received"]
    requested = d["kv_pages_requested"] - before["kv_pages_requested"]
    assert moved == sum(n > 1 for n in lengths) and d["fallbacks"] == 0 and d["transfer_failures"] == 0, d
    assert requested == sum(pages(len(x) - 1) for x in prompts)
    assert d["kv_bytes_received"] - before["kv_bytes_received"] == requested * page_bytes + moved * record_bytes
    assert p["rooms_failed"] == p["rooms_expired"] == 0 and d["quarantined_pages"] == 0


def check_turn_two(pd, hf, turn1_len: int, more_len: int, page_bytes: int, record_bytes: int = 0,
                   reuse: int = PAGE) -> None:
    """Decode caches turn 1's prompt and answer (every region of the same pages): turn 2 receives only
    the pages after its own hit (at a multiple of ``reuse`` tokens, the pool's reusable boundaries) and
    its record whole, and still decodes transformers' tokens, which it could not with a region missing
    from the pages it already held."""
    turn1 = prompt(turn1_len, seed=100)
    r1 = httpx.post(pd.router.url + "/generate", json={"input_ids": turn1, "sampling_params": greedy()},
                    timeout=180).json()
    turn2 = turn1 + r1["output_ids"] + prompt(more_len, seed=101)
    idle(pd)
    before = pd.decode.info()
    r2 = httpx.post(pd.router.url + "/generate", json={"input_ids": turn2, "sampling_params": greedy()},
                    timeout=180).json()
    _, d = idle(pd)
    decode_hit = (len(turn1) + NEW - 1) // reuse * reuse
    assert decode_hit > 0, "turn 1 too short for a hit at a reusable boundary"
    assert r2["meta_info"]["decode_cached_tokens"] == decode_hit
    lacking = pages(len(turn2) - 1) - decode_hit // PAGE
    assert d["kv_pages_requested"] - before["kv_pages_requested"] == lacking
    assert d["kv_bytes_received"] - before["kv_bytes_received"] == lacking * page_bytes + record_bytes
    assert (r1["output_ids"], r2["output_ids"]) == (greedy_continuation(hf, turn1, NEW),
                                                    greedy_continuation(hf, turn2, NEW))


def check_sglang_router(pd, hf, lengths) -> None:
    """The same tokens through the PyPI sglang-router in front of the same pair (stopped after)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation", "--prefill", pd.prefill.url,
           str(pd.boot), "--decode", pd.decode.url, "--host", "127.0.0.1", "--port", str(port),
           "--prometheus-port", str(free_port())]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        prompts = [prompt(n, seed=200 + n) for n in lengths]
        probe = prompt(3, seed=299)  # not one of the prompts, which decode would then hold whole
        wait_for(lambda: _answers(url, probe, proc), 120, "sglang-router forwards requests")
        before = pd.decode.info()["kv_received"]
        assert send(url, prompts) == [greedy_continuation(hf, p, NEW) for p in prompts]
        assert pd.decode.info()["kv_received"] - before == len(prompts)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _answers(url: str, probe: list[int], proc: subprocess.Popen) -> bool:
    assert proc.poll() is None, f"sglang-router exited with {proc.returncode}"
    try:
        return httpx.post(url + "/generate", json={"input_ids": probe, "sampling_params": greedy()},
                          timeout=60).status_code == 200
    except httpx.HTTPError:
        return False

