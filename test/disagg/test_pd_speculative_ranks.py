"""Speculative decoding across P/D with different TP on the two sides, as real servers: a TP2
prefill (the MTP layer replicated on both ranks) computes and sends the MTP layer's prompt KV to
a TP1 decode that drafts with it; greedy tokens equal the single-rank colocated engine without
speculation, and no request falls back."""

from __future__ import annotations

import pytest
import torch
from pd_servers import decode_server, prefill_server, routed, start_all

import pdserve

pytestmark = pytest.mark.skipif(not pytest.importorskip("mooncake"), reason="needs mooncake")

MODEL = "tiny-deepseek"
COMMON = ("--page-size", "4", "--num-threads", "1", "--speculative-algorithm", "NEXTN",
          "--speculative-num-steps", "2", "--max-total-tokens", "2048")
NEW = 8


@pytest.fixture(scope="module")
def servers():
    prefill, boot = prefill_server(MODEL, *COMMON, "--tp-size", "2")
    decode = decode_server(MODEL, *COMMON)
    start_all([prefill, decode])
    try:
        yield prefill, boot, decode
    finally:
        for s in (prefill, decode):
            s.stop()


def test_tp2_prefill_to_tp1_decode_matches_colocated_plain(servers):
    prefill, boot, decode = servers
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 1500, (n,), generator=g).tolist() for n in (7, 18)]
    sp = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
    ref = pdserve.Engine(model_path=MODEL, num_threads=1, page_size=4).generate(input_ids=prompts,
                                                                                sampling_params=sp)
    for p, want in zip(prompts, ref):
        got = routed(prefill, boot, decode, {"input_ids": p, "sampling_params": sp})
        assert got["output_ids"] == want["output_ids"]
        assert got["meta_info"]["spec_verify_ct"] >= 1
    d, p = decode.wait_idle(60), prefill.wait_idle(60)
    assert d["fallbacks"] == 0 and d["transfer_failures"] == 0 and d["kv_received"] == len(prompts), d
    assert p["rooms_completed"] == len(prompts), p
