"""Overlap scheduling under 1P1D: decode's overlapped loop gives the plain loop's tokens for
transferred requests (mixed lengths, chunked prefill on the prefill side, stop tokens), and both
sides end with their books balanced."""

from __future__ import annotations

import pytest
import torch
from pd_pair import PDPair, greedy

from pdserve.transfer import mooncake_available

BACKENDS = [pytest.param("mooncake", marks=pytest.mark.skipif(not mooncake_available(), reason="needs mooncake")),
            "memory"]


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1500, (n,), generator=g).tolist() for n in lengths]


def _run(backend: str, prompts, sps, **decode_flags) -> tuple[dict, PDPair]:
    pair = PDPair("tiny-llama", backend=backend, page_size=4, chunked_prefill_size=24, decode_flags=decode_flags)
    try:
        for i, (p, sp) in enumerate(zip(prompts, sps)):
            pair.submit(f"r{i}", p, sp)
        pair.run()
        pair.assert_idle_and_accounted()
        return {rid: o["ids"] for rid, o in pair.outputs.items()}, pair
    finally:
        pair.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_overlap_matches_the_plain_loop(backend):
    prompts = _prompts([5, 40, 17, 70, 9, 33])
    sps = [greedy(2 + 4 * i) for i in range(len(prompts))]
    plain, plain_pair = _run(backend, prompts, sps, disable_overlap_schedule=True)
    over, over_pair = _run(backend, prompts, sps)
    assert not plain_pair.decode.overlap and over_pair.decode.overlap
    assert over == plain
    assert [len(over[f"r{i}"]) for i in range(len(prompts))] == [2 + 4 * i for i in range(len(prompts))]
    # a stop token only sampling reveals, mid-stream: nothing after it
    stops = [greedy(20, stop_token_ids=[plain[f"r{i}"][1]]) if i % 2 else greedy(20) for i in range(len(prompts))]
    plain, _ = _run(backend, prompts, stops, disable_overlap_schedule=True)
    over, _ = _run(backend, prompts, stops)
    assert over == plain
    assert all(len(over[f"r{i}"]) <= 2 for i in range(1, len(prompts), 2))
