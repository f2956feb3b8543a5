"""benchmark/long_context.py on a short prompt: the bytes table counts every buffer of each pool, and
the served run (colocated, then 1P1D behind pdserve's router) reports equal outputs from KV that
prefill sent. (No timing is asserted: only what the report says.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))

import long_context  # noqa: E402


def test_bytes_table_is_what_each_pool_holds_per_slot():
    rows = long_context.bytes_table(page_size=16)
    assert [r["model"] for r in rows] == ["V3", "V3.2", "V4"]
    v3, v32, v4 = rows
    # the budget's bytes per token are the pool's: latent (C + R) per layer, plus V3.2's index keys
    assert v3["pool_bytes_per_slot"] == v3["kv_bytes_per_token"] == 4 * (64 + 16) * 4
    assert v32["pool_bytes_per_slot"] == v32["kv_bytes_per_token"] == v3["kv_bytes_per_token"] + 4 * 32 * 4
    assert v4["pool_bytes_per_slot"] > 0 and v4["kv_bytes_per_token"] > 0
    assert v3["vs_v3"] == 1.0 and v32["vs_v3"] == v32["pool_bytes_per_slot"] / v3["pool_bytes_per_slot"]
    # as served (colocated and P/D): V4's bounded layout at 64K, V3 and V3.2 as their pages; with pages of
    # 64 (a multiple of every rate) V4 holds under a fifth of V3's bytes per token
    assert (v3["served_bytes_per_token"], v32["served_bytes_per_token"]) == (v3["kv_bytes_per_token"],
                                                                             v32["kv_bytes_per_token"])
    assert v4["served_bytes_per_token"] < v4["kv_bytes_per_token"] / 10
    assert long_context.bytes_table(page_size=64)[2]["served_vs_v3"] <= 0.2


def test_a_short_prompt_serves_alike_colocated_and_through_1p1d(tmp_path):
    out = tmp_path / "long.jsonl"
    assert long_context.main(["--tokens", "300", "--new-tokens", "3", "--page-size", "16",
                              "--output-file", str(out)]) == 0
    (result,) = [json.loads(line) for line in out.read_text().splitlines()]
    pd = result["1P1D"]
    assert pd["equals_colocated"] and len(pd["output_ids"]) == 3
    assert pd["kv_received"] == 1 and pd["fallbacks"] == 0 and pd["kv_pages_received"] == -(-299 // 16)
    assert pd["timeout_s"] >= 30
