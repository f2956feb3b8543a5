"""Decode's own prefix cache across P/D (1 prefill + 1 decode + pdserve's router, real processes).

Turn 2 of a conversation extends turn 1's prompt and answer. Prefill saw only turn 1's prompt,
decode also computed the answer's KV and still caches it: decode's hit is the longer one, so it
asks prefill only for the pages past it. Each turn reports both hits (``meta_info``:
``cached_tokens`` is prefill's, ``decode_cached_tokens`` decode's), the pages decode asked for
(``kv_pages_requested`` on both servers), the KV bytes moved (prefill's ``kv_bytes_sent``, decode's
``kv_bytes_received``), and the tokens are the colocated engine's. A third turn whose
``prompt[:-1]`` decode holds whole asks for nothing. One deployment per transfer backend: Mooncake,
and NIXL once ``pdserve.transfer`` offers it.
"""

from __future__ import annotations

import httpx
import pytest
import torch
from pd_servers import RoutedPair

import pdserve
from pdserve.transfer import BACKEND_NAMES

MODEL = "tiny-llama"
PAGE = 4
NEW = 8
BACKENDS = ["mooncake"] + (["nixl"] if "nixl" in BACKEND_NAMES else [])
# Counters a turn moves: pages decode asked for (each side's view), KV bytes (prefill's and decode's).
MOVED = (("prefill", "kv_pages_requested"), ("decode", "kv_pages_requested"), ("prefill", "kv_bytes_sent"),
         ("decode", "kv_bytes_received"), ("decode", "decode_cached_tokens"), ("decode", "fallbacks"),
         ("decode", "local_prefills"))


def _pages(tokens: int) -> int:
    return -(-tokens // PAGE)


def _greedy() -> dict:
    return {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}


class Deployment(RoutedPair):
    def __init__(self, backend: str):
        super().__init__(MODEL, "--page-size", str(PAGE), "--max-total-tokens", "4096", "--num-threads", "1",
                         "--disaggregation-transfer-backend", backend)

    def counters(self) -> dict[tuple[str, str], int]:
        info = {"prefill": self.prefill.info(), "decode": self.decode.info()}
        return {(side, key): info[side][key] for side, key in MOVED}

    def turn(self, prompt: list[int], **fields) -> tuple[dict, dict[tuple[str, str], int]]:
        """One request through the router: its answer and what it moved (counter deltas)."""
        assert self.router is not None
        before = self.counters()
        r = httpx.post(self.router.url + "/generate",
                       json={"input_ids": prompt, "sampling_params": _greedy(), **fields}, timeout=120)
        r.raise_for_status()
        for server in (self.prefill, self.decode):
            server.wait_idle(60)
        after = self.counters()
        return r.json(), {k: after[k] - before[k] for k in after}


@pytest.fixture(scope="module", params=BACKENDS)
def pd(request):
    dep = Deployment(request.param)
    try:
        yield dep.start()
    finally:
        dep.stop()


def _conversation(seed: int, first: int, extra: int) -> tuple[list[int], int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 1500, (first + extra,), generator=g).tolist(), first


def test_turn_two_asks_prefill_only_for_the_pages_decode_lacks(pd):
    tokens, first = _conversation(seed=1, first=30, extra=10)
    turn1 = tokens[:first]
    out1, moved1 = pd.turn(turn1)
    # Turn 1: neither side holds anything; decode asks for every page of prompt[:-1].
    assert out1["meta_info"]["cached_tokens"] == 0 and out1["meta_info"]["decode_cached_tokens"] == 0
    assert moved1[("decode", "kv_pages_requested")] == moved1[("prefill", "kv_pages_requested")] == _pages(first - 1)
    assert moved1[("decode", "fallbacks")] == moved1[("decode", "local_prefills")] == 0
    page_bytes = moved1[("prefill", "kv_bytes_sent")] // _pages(first - 1)
    assert page_bytes > 0 and moved1[("decode", "kv_bytes_received")] == moved1[("prefill", "kv_bytes_sent")]

    turn2 = turn1 + out1["output_ids"] + tokens[first:]
    out2, moved2 = pd.turn(turn2)
    # Decode cached turn 1's full pages up to its last computed position (the answer's last token
    # has no KV yet); prefill cached only turn 1's prompt[:-1].
    decode_hit = (first + NEW - 1) // PAGE * PAGE
    prefill_hit = (first - 1) // PAGE * PAGE
    meta = out2["meta_info"]
    assert (meta["cached_tokens"], meta["decode_cached_tokens"]) == (prefill_hit, decode_hit)
    lacking = _pages(len(turn2) - 1) - decode_hit // PAGE
    assert 0 < lacking < _pages(len(turn2) - 1)  # a partial hit: decode still needs some pages
    assert moved2[("decode", "kv_pages_requested")] == moved2[("prefill", "kv_pages_requested")] == lacking
    assert moved2[("prefill", "kv_bytes_sent")] == moved2[("decode", "kv_bytes_received")] == lacking * page_bytes
    assert moved2[("decode", "decode_cached_tokens")] == decode_hit
    assert moved2[("decode", "fallbacks")] == moved2[("decode", "local_prefills")] == 0

    # A prompt whose prompt[:-1] decode holds whole: nothing to ask for, decode prefills the last token.
    turn3 = turn2[:8 * PAGE + 1]
    out3, moved3 = pd.turn(turn3)
    assert out3["meta_info"]["decode_cached_tokens"] == out3["meta_info"]["cached_tokens"] == 8 * PAGE
    assert moved3[("decode", "local_prefills")] == 1 and moved3[("decode", "kv_pages_requested")] == 0
    assert moved3[("prefill", "kv_bytes_sent")] == moved3[("decode", "kv_bytes_received")] == 0

    with pdserve.Engine(model_path=MODEL, page_size=PAGE, num_threads=1) as eng:
        want = [eng.generate(input_ids=p, sampling_params=_greedy())["output_ids"] for p in (turn1, turn2, turn3)]
    assert [out1["output_ids"], out2["output_ids"], out3["output_ids"]] == want


def test_decode_hit_is_on_metrics(pd):
    text = pd.decode.get("/metrics").text
    assert "pdserve:decode_cached_tokens" in text and "pdserve:kv_transfer_bytes_received" in text
    assert "pdserve:kv_pages_requested" in pd.prefill.get("/metrics").text


def test_a_cache_salt_isolates_both_halves(pd):
    """cache_salt reaches prefill and decode in the body: the same prompt under another salt hits
    neither prefill's cache nor decode's (decode asks for every page), under its own salt both."""
    prompt, _ = _conversation(seed=5, first=33, extra=0)
    first, _ = pd.turn(prompt, cache_salt="tenant-a")
    other, moved = pd.turn(prompt, cache_salt="tenant-b")
    assert (other["meta_info"]["cached_tokens"], other["meta_info"]["decode_cached_tokens"]) == (0, 0)
    assert moved[("decode", "kv_pages_requested")] == _pages(len(prompt) - 1)
    again, moved = pd.turn(prompt, cache_salt="tenant-a")
    assert again["meta_info"]["cached_tokens"] > 0 and again["meta_info"]["decode_cached_tokens"] > 0
    assert moved[("decode", "kv_pages_requested")] < _pages(len(prompt) - 1)
    assert first["output_ids"] == other["output_ids"] == again["output_ids"]
