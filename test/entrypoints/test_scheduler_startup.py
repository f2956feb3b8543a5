"""What a scheduler process's start leaves behind: a colocated server imports nothing of disaggregation
(``disagg/``, and the transfer engines' libraries, load only on a P/D server), and what the start built is
frozen out of the cyclic collector's later passes, with the collector back on for the loop.

Each check runs in a fresh interpreter: ``sys.modules`` and the collector's state are process-wide."""

from __future__ import annotations

import json
import subprocess
import sys

ENGINE_LIBRARIES = ("mooncake", "nixl", "nixl_cu12")  # what the transfer backends load when chosen

# The spawn target's start (``run_scheduler_process``), without its sockets.
START = """
import gc, json, sys
from pdserve.config import ServerArgs
from pdserve.entrypoints.scheduler_process import build_server_scheduler, startup_without_gc

with startup_without_gc():
    scheduler, roles = build_server_scheduler(ServerArgs(model_path="tiny-llama", max_total_tokens=2048))
live = gc.get_objects()  # what later passes walk: the permanent generation is not among it
json.dump({"modules": sorted(sys.modules), "roles": roles is not None, "enabled": gc.isenabled(),
           "frozen": gc.get_freeze_count(), "scheduler_walked": any(o is scheduler for o in live),
           "pages": scheduler.allocator.num_pages}, sys.stdout)
"""


def _start() -> dict:
    done = subprocess.run([sys.executable, "-c", START], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_colocated_scheduler_start_imports_no_disaggregation_and_freezes_what_it_built():
    out = _start()
    assert out["pages"] > 0 and not out["roles"]
    assert "pdserve.engine.scheduler" in out["modules"], "the check sees the scheduler's own imports"
    assert not [m for m in out["modules"] if m.startswith("pdserve.disagg") or m.split(".")[0] in ENGINE_LIBRARIES]
    assert out["enabled"], "the loop runs with the cyclic collector on"
    assert out["frozen"] > 0 and not out["scheduler_walked"]
