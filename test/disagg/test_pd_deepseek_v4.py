"""DeepSeek-V4 (sliding, CSA and HCA layers) across P/D: 1 prefill + 1 decode as real processes, on each
transfer backend (Mooncake, NIXL), against transformers' ``DeepseekV4ForCausalLM`` on a tiny float32
checkpoint with a window of 8 and compression rates 4 (CSA) and 8 (HCA).

Every region of a token's slot (the window's K=V rows, the compressors' source rows, the compressed
entries, CSA's index keys) is a replicated region of a regions layout: each moves layer by layer for
the layers that keep it, from the request's random source rank, counted like MLA's latent. Decode's
received bytes are exactly those regions' pages, and its greedy tokens are transformers' for prompts
from one token to many windows and compression blocks long, through pdserve's router and the
PyPI sglang-router. Decode's own
prefix hit (turn 2) asks prefill only for the pages it lacks. One deployment per backend.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from pd_servers import RoutedPair

from entrypoints.server_utils import free_port
from fixtures.tiny_models import fill_hash_table, greedy_continuation, make_hf_model_and_dir
from pdserve.transfer import BACKEND_NAMES
from router.router_utils import wait_for

pytestmark = pytest.mark.skipif(not pytest.importorskip("mooncake"), reason="needs mooncake")

ARCH = "DeepseekV4ForCausalLM"
WINDOW, CSA_RATE, HCA_RATE = 8, 4, 8
PAGE = 4
NEW = 6
BACKENDS = ["mooncake"] + (["nixl"] if "nixl" in BACKEND_NAMES else [])
# one token (decode prefills it), inside a window, past it, and over many windows and blocks
LENGTHS = (1, WINDOW - 3, 3 * WINDOW + 1, 6 * WINDOW + 5, 12 * WINDOW)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf, path = make_hf_model_and_dir(ARCH, tmp_path_factory.mktemp("v4-pd"))
    fill_hash_table(hf)
    hf.save_pretrained(path, safe_serialization=True)  # again, with the hash table
    c = hf.config
    assert c.sliding_window == WINDOW and c.compress_rates == {"compressed_sparse_attention": CSA_RATE,
                                                               "heavily_compressed_attention": HCA_RATE}
    return hf, path


def _greedy() -> dict:
    return {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 400, (n,), generator=g).tolist()


def _pages(tokens: int) -> int:
    return -(-tokens // PAGE)


class Deployment(RoutedPair):
    def __init__(self, path: str, backend: str):
        super().__init__(path, "--page-size", str(PAGE), "--chunked-prefill-size", "16", "--max-total-tokens", "4096",
                         "--num-threads", "1", "--disaggregation-transfer-backend", backend)


@pytest.fixture(scope="module", params=BACKENDS)
def pd(request, tiny):
    dep = Deployment(tiny[1], request.param)
    try:
        yield dep.start()
    finally:
        dep.stop()


def _page_bytes(hf) -> int:
    """One page of every region on the layers keeping it (float32): every layer's K=V row; a CSA
    layer's sources (kv and gate of two series), entry, index sources and index key; an HCA layer's
    sources (kv and gate) and entry."""
    c = hf.config
    D, Di = c.head_dim, c.index_head_dim
    per_kind = {"sliding_attention": D, "compressed_sparse_attention": D + 4 * D + D + 4 * Di + Di,
                "heavily_compressed_attention": D + 2 * D + D}
    return PAGE * sum(per_kind[k] for k in c.layer_types) * 4


def _send(url: str, prompts: list[list[int]]) -> list[list[int]]:
    def one(p: list[int]) -> list[int]:
        r = httpx.post(url + "/generate", json={"input_ids": p, "sampling_params": _greedy()}, timeout=180)
        r.raise_for_status()
        return r.json()["output_ids"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def _idle(pd) -> tuple[dict, dict]:
    return pd.prefill.wait_idle(60), pd.decode.wait_idle(60)


def test_greedy_tokens_match_transformers_through_the_router(pd, tiny):
    hf, _ = tiny
    prompts = [_prompt(n, seed=n) for n in LENGTHS]
    before = pd.decode.info()
    assert _send(pd.router.url, prompts) == [greedy_continuation(hf, p, NEW) for p in prompts]
    p, d = _idle(pd)
    moved = d["kv_received"] - before["kv_received"]
    pages = d["kv_pages_requested"] - before["kv_pages_requested"]
    assert moved == len(prompts) - 1 and d["fallbacks"] == 0 and d["transfer_failures"] == 0, d
    assert pages == sum(_pages(len(x) - 1) for x in prompts)
    # every page moved every region its layers keep, nothing more
    assert d["kv_bytes_received"] - before["kv_bytes_received"] == pages * _page_bytes(hf)
    assert p["rooms_failed"] == p["rooms_expired"] == 0 and d["quarantined_pages"] == 0


def test_turn_two_asks_prefill_only_for_the_pages_decode_lacks(pd, tiny):
    """Decode caches turn 1's prompt and answer (every region of the same pages): turn 2 receives
    only the pages after its own hit, and still decodes transformers' tokens, which it could not
    with compressed entries or window rows missing from the pages it already held."""
    hf, _ = tiny
    turn1 = _prompt(5 * WINDOW + 2, seed=100)
    r1 = httpx.post(pd.router.url + "/generate", json={"input_ids": turn1, "sampling_params": _greedy()},
                    timeout=180).json()
    turn2 = turn1 + r1["output_ids"] + _prompt(3 * WINDOW, seed=101)
    _idle(pd)
    before = pd.decode.info()
    r2 = httpx.post(pd.router.url + "/generate", json={"input_ids": turn2, "sampling_params": _greedy()},
                    timeout=180).json()
    _, d = _idle(pd)
    decode_hit = (len(turn1) + NEW - 1) // PAGE * PAGE
    assert r2["meta_info"]["decode_cached_tokens"] == decode_hit
    lacking = _pages(len(turn2) - 1) - decode_hit // PAGE
    assert d["kv_pages_requested"] - before["kv_pages_requested"] == lacking
    assert d["kv_bytes_received"] - before["kv_bytes_received"] == lacking * _page_bytes(hf)
    assert (r1["output_ids"], r2["output_ids"]) == (greedy_continuation(hf, turn1, NEW),
                                                    greedy_continuation(hf, turn2, NEW))


@pytest.mark.skipif(importlib.util.find_spec("sglang_router") is None, reason="sglang-router is not installed")
def test_the_same_through_sglang_router(pd, tiny):
    hf, _ = tiny
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation", "--prefill", pd.prefill.url,
           str(pd.boot), "--decode", pd.decode.url, "--host", "127.0.0.1", "--port", str(port),
           "--prometheus-port", str(free_port())]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        prompts = [_prompt(n, seed=200 + n) for n in (3 * WINDOW + 1, 6 * WINDOW + 5)]
        probe = _prompt(3, seed=299)  # not one of the prompts, which decode would then hold whole
        wait_for(lambda: _answers(url, probe, proc), 120, "sglang-router forwards requests")
        before = pd.decode.info()["kv_received"]
        assert _send(url, prompts) == [greedy_continuation(hf, p, NEW) for p in prompts]
        assert pd.decode.info()["kv_received"] - before == len(prompts)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _answers(url: str, prompt: list[int], proc: subprocess.Popen) -> bool:
    assert proc.poll() is None, f"sglang-router exited with {proc.returncode}"
    try:
        return httpx.post(url + "/generate", json={"input_ids": prompt, "sampling_params": _greedy()},
                          timeout=60).status_code == 200
    except httpx.HTTPError:
        return False
