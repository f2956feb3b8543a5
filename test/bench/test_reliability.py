"""benchmark/reliability.py in a short mode against real servers: two scenarios and a few
seconds of soak; every row that must be zero is zero, and the report says how it was made."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from server_utils import IDLE_ZERO

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmark" / "reliability.py"
sys.path.insert(0, str(SCRIPT.parent))

import reliability  # noqa: E402


def test_the_script_checks_the_same_resources_as_the_tests():
    assert reliability.IDLE_ZERO == IDLE_ZERO


def test_an_unknown_scenario_is_named():
    with pytest.raises(SystemExit):
        reliability.parse_args(["--scenarios", "duplicate_rooms,bogus"])


def test_the_cache_privacy_attack_reads_an_unkeyed_chain_and_nothing_of_a_keyed_one():
    """The row's attacker (run against real servers by ``--scenarios cache_privacy``) on chains built here."""
    from pdserve.mem.radix_cache import ROOT_HASH, hash_block

    def chain(key: bytes) -> list[tuple[int, int | None]]:
        blocks, parent = [], ROOT_HASH
        for t in reliability.PRIVACY_PROMPT:
            h = hash_block(parent, [t], key)
            blocks.append((h, None if parent == ROOT_HASH else parent))
            parent = h
        return blocks

    key = bytes(range(32))
    assert reliability.rebuild_prompt(chain(b""), b"") == reliability.PRIVACY_PROMPT
    assert reliability.rebuild_prompt(chain(key), b"") == []
    assert reliability.rebuild_prompt(chain(key), key) == reliability.PRIVACY_PROMPT
    every = set(reliability.parse_args([]).scenarios.split(","))
    assert set(reliability.STANDALONE) <= set(reliability.SCENARIOS) == every


def test_short_run_has_zero_hung_wrong_and_leaked(tmp_path):
    out, rows = tmp_path / "reliability.md", tmp_path / "rows.json"
    cmd = [sys.executable, str(SCRIPT), "--scenarios", "duplicate_rooms,soak", "--requests", "1", "--soak-s", "3",
           "--decodes", "1", "--soak-concurrency", "2", "--sample-s", "1", "--out", str(out), "--json", str(rows)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = {r["scenario"]: r for r in json.loads(rows.read_text())}
    assert set(summary) == {"duplicate_rooms", "soak"}
    for r in summary.values():
        assert (r["hung"], r["wrong_tokens"], r["leaked"], r["unclear"]) == (0, 0, 0, 0), r
        assert r["sent"] == r["completed"] + r["failed_clear"], r
    dup = summary["duplicate_rooms"]
    assert dup["completed"] >= 2 and dup["failed_clear"] >= 2, dup  # the first pair served, the reuses refused
    assert summary["soak"]["completed"] >= 1
    text = out.read_text()
    assert "benchmark/reliability.py --scenarios duplicate_rooms,soak" in text and "| scenario |" in text
    assert "ATTENTION" not in text
