"""A ``pdserve serve`` start, to ready: wall time and CPU seconds of each process.

Each round starts a server, polls ``/health`` until 200 (the wall time), then reads every process of
the server's tree from /proc (user + system CPU so far): the HTTP frontend, the scheduler process(es)
and anything else spawned (multiprocessing's resource tracker). With ``--baseline-pythonpath`` the
rounds alternate between this tree and another checkout's package, so both see the same load::

    python benchmark/bench_startup.py --model-path tiny-llama --repeats 3 \\
        --baseline-pythonpath /path/to/old/python:/path/to/old/kernels
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from servers import free_port, start, stop, wait_healthy

HERE = Path(__file__).resolve().parent.parent
TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds) of a live process, None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # the name may hold spaces
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK


def _tree_cpu(root: int) -> dict[str, float]:
    """CPU seconds of ``root`` ("frontend") and each descendant, named by its command line."""
    stats = {int(p.name): _stat(int(p.name)) for p in Path("/proc").iterdir() if p.name.isdigit()}
    children: dict[int, list[int]] = {}
    for pid, st in stats.items():
        if st is not None:
            children.setdefault(st[0], []).append(pid)
    out, todo = {"frontend": stats[root][1]}, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        name = "scheduler" if "spawn_main" in cmd and "resource_tracker" not in cmd else "other"
        out[name] = out.get(name, 0.0) + stats[pid][1]
    return out


def one_start(model: str, pythonpath: str | None, extra: list[str]) -> dict[str, float]:
    port = free_port()
    env = None if pythonpath is None else {"PYTHONPATH": pythonpath}
    t0 = time.monotonic()
    proc = start(["serve", "--model-path", model, "--port", str(port), "--log-level", "warning", *extra], env=env)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc)
        wall = time.monotonic() - t0
        return {"wall": wall, **_tree_cpu(proc.pid)}
    finally:
        stop(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default="tiny-llama")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--baseline-pythonpath", help="another checkout's python/ (and kernels/) to compare against")
    ap.add_argument("serve_flags", nargs="*", help="more flags for pdserve serve (after --)")
    ns = ap.parse_args()
    this = f"{HERE / 'python'}{os.pathsep}{HERE / 'kernels'}"
    trees = {"this tree": this} | ({"baseline": ns.baseline_pythonpath} if ns.baseline_pythonpath else {})
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for i in range(ns.repeats):
        for name, path in trees.items():
            r = one_start(ns.model_path, path, ns.serve_flags)
            runs[name].append(r)
            print(f"round {i + 1} {name}: " + ", ".join(f"{k} {v:.2f} s" for k, v in r.items()), flush=True)
    for name, rs in runs.items():
        keys = sorted({k for r in rs for k in r}, key=["wall", "frontend", "scheduler", "other"].index)
        print(f"{name} (median of {len(rs)}): "
              + ", ".join(f"{k} {statistics.median(r.get(k, 0.0) for r in rs):.2f} s" for k in keys))


if __name__ == "__main__":
    main()
