"""benchmark/gpu_check.sh --dry-run on CPU: every step is listed, the CPU-runnable parts run
(versions, the bandwidth and FP8 code under the Triton interpreter), and nothing is left running."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _descendants() -> set[int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
    children: dict[int, list[int]] = {}
    for line in out.split("\n"):
        if line.strip():
            pid, ppid = map(int, line.split())
            children.setdefault(ppid, []).append(pid)
    found, todo = set(), [os.getpid()]
    while todo:
        for c in children.get(todo.pop(), []):
            found.add(c)
            todo.append(c)
    return found


@pytest.mark.slow
def test_dry_run_lists_every_step_and_runs_the_cpu_parts():
    pytest.importorskip("triton")
    before = _descendants()
    proc = subprocess.run(["bash", str(ROOT / "benchmark" / "gpu_check.sh"), "--dry-run"], capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for step in ("gpu-tests", "agree", "serve", "bandwidth", "decode", "fp8-tests", "fp8-bench", "speculative"):
        assert f"=== {step}:" in proc.stdout
    assert "torch " in proc.stdout and "triton " in proc.stdout  # versions ran
    assert "bandwidth MLA decode (triton)" in proc.stdout and "bandwidth GQA decode (triton)" in proc.stdout
    assert "fp8 gemm tiny" in proc.stdout and "fp8 moe" in proc.stdout  # the FP8 speed code ran
    assert not {p for p in _descendants() - before if _alive(p)}  # (the ps that listed them has exited)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
