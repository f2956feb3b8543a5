"""The scheduler thread's CPU per decode step, A/B between source trees: which costs a change removed.

    python benchmark/bench_sched_step.py                        # this tree only
    python benchmark/bench_sched_step.py --tree /tmp/base/python:/tmp/base/kernels --tree .
    python benchmark/bench_sched_step.py --parts                # and its parts' CPU, function by function
    python benchmark/bench_sched_step.py --profile              # cProfile of the scheduler thread instead

With overlap scheduling on, a decode step's forward and sampling run on the worker thread while
the scheduler thread collects the previous step's tokens and builds the next one; on the 2 cores
of a small host both threads share the cores with the frontend, so the scheduler thread's CPU
per step (``time.thread_time`` across ``Scheduler.step``: blocked waits for the worker cost none)
is what this reports beside the step's wall. Each step's outputs are also encoded as the server's
``SchedulerLoop`` sends them (one ``BatchTokenOutput``), and counted as the scheduler's.

Each tree (a PYTHONPATH: ``python`` and ``kernels`` of a checkout, ``.`` for this one) runs in its
own process, trees alternating for ``--rounds``; a process runs an offline ``pdserve.Engine`` on
bench_peer.py's tiny-llama, ``--batch`` greedy requests of ``--prompt-len`` random tokens for
``--output-len`` tokens, ``--runs`` times after a warm-up. A decode step is a ``step`` that starts
with requests running and none waiting. Reported: medians over rounds of each process's median
per decode step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
KEYS = ("step_ms", "sched_cpu_ms", "encode_ms")
# ``--parts``: the scheduler thread's functions timed one by one (nested: a part includes those it calls)
PARTS = (("scheduler", "_launch_decode"), ("scheduler", "_collect"), ("scheduler", "_append_sampled"),
         ("scheduler", "_schedule_extend"), ("scheduler", "_ensure_decode_pages"), ("runner", "build_forward_batch"),
         ("kv_manager", "write_next_slots"), ("worker", "submit"))


def _timed_steps(engine, samples: dict[str, list[float]]) -> None:
    """Wrap ``engine.scheduler.step``: each decode step's wall, scheduler-thread CPU and encode."""
    from pdserve.engine import io_struct
    from pdserve.engine.scheduler_loop import FRONTEND_CODEC

    sched = engine.scheduler
    step = sched.step

    def timed():
        decode = bool(sched.running) and not sched.waiting and sched.chunked is None
        w0, c0 = time.perf_counter(), time.thread_time()
        out = step()
        c1 = time.thread_time()
        if out:
            FRONTEND_CODEC.encode(io_struct.BatchTokenOutput(out, time.monotonic(), sched.outputs_sampled_at))
        c2 = time.thread_time()
        if decode:
            samples["step_ms"].append((time.perf_counter() - w0) * 1e3)
            samples["sched_cpu_ms"].append((c2 - c0) * 1e3)
            samples["encode_ms"].append((c2 - c1) * 1e3)
        return out
    sched.step = timed


def child(a: argparse.Namespace) -> None:
    """One tree's process: the timed runs (or the profile); prints one JSON line."""
    import torch

    import pdserve
    from bench_peer import DEFAULT_MODELS, model_dir

    mdir = model_dir("tiny-llama", Path(DEFAULT_MODELS), 0)
    engine = pdserve.Engine(model_path=mdir, max_running_requests=a.batch, random_seed=0, num_threads=a.threads,
                            disable_overlap_schedule=a.no_overlap, disable_radix_cache=True)
    g = torch.Generator().manual_seed(0)
    vocab = engine.scheduler.runner.model_config.vocab_size
    sp = {"max_new_tokens": a.output_len, "temperature": 0, "ignore_eos": True}

    def run() -> None:
        engine.generate(input_ids=torch.randint(3, vocab, (a.batch, a.prompt_len), generator=g).tolist(),
                        sampling_params=sp)
    try:
        run()  # warm-up
        if a.profile:
            _profile(run)
            return
        samples: dict[str, list[float]] = {k: [] for k in KEYS}
        _timed_steps(engine, samples)
        parts = _timed_parts(engine) if a.parts else {}
        for _ in range(a.runs):
            run()
    finally:
        engine.shutdown()
    steps = len(samples["step_ms"])
    print(json.dumps({**{k: statistics.median(v) for k, v in samples.items()},
                      **{k: v * 1e3 / steps for k, v in parts.items()}}))


def _timed_parts(engine) -> dict[str, float]:
    """Wrap ``PARTS`` (those the tree has): seconds of scheduler-thread CPU each, over every step
    (the few extend steps' share included: admission, the first tokens' outputs)."""
    sched = engine.scheduler
    owners = {"scheduler": sched, "runner": sched.runner, "kv_manager": sched.kv_manager, "worker": sched._worker}
    spent: dict[str, float] = {}

    def wrap(obj, name: str) -> None:
        fn = getattr(obj, name)
        spent[name] = 0.0

        def timed(*args, **kwargs):
            c0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.thread_time() - c0
        setattr(obj, name, timed)
    for owner, name in PARTS:
        if owners[owner] is not None and hasattr(owners[owner], name):
            wrap(owners[owner], name)
    return spent


def _profile(run) -> None:
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    run()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(50)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", default=[],
                    help="a PYTHONPATH to measure ('.': this checkout); repeat for A/B (default: this one)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--runs", type=int, default=3, help="timed generate calls per process")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-overlap", action="store_true", help="the plain loop (default: overlap on)")
    ap.add_argument("--profile", action="store_true", help="cProfile one run per tree (after a warm-up)")
    ap.add_argument("--parts", action="store_true",
                    help="also time the scheduler thread's parts (their wrappers add a little to sched_cpu_ms)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        sys.path.insert(0, str(HERE))
        child(a)
        return
    trees = [f"{ROOT}/python:{ROOT}/kernels" if t == "." else t for t in a.tree or ["."]]
    passed = [x for x in (argv if argv is not None else sys.argv[1:]) if x != "--tree" and x not in a.tree]
    results: dict[str, list[dict]] = {t: [] for t in trees}
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for r in range(1 if a.profile else a.rounds):
        for t in trees:
            proc = subprocess.run([sys.executable, __file__, "--child", *passed], env={**os.environ, "PYTHONPATH": t},
                                  capture_output=True, text=True, check=True)
            if a.profile:
                print(f"## {t}\n{proc.stdout}")
                continue
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            results[t].append(res)
            print(f"round {r} {t}: " + ", ".join(f"{k} {v:.3f}" for k, v in res.items()), flush=True)
    if a.profile:
        return
    print(f"\nmedians over {a.rounds} rounds (ms per decode step, batch {a.batch}, "
          f"{'plain loop' if a.no_overlap else 'overlap'}, {a.threads} threads):")
    keys = [k for k in results[trees[0]][0] if all(k in x for rs in results.values() for x in rs)]
    print("| tree | " + " | ".join(keys) + " |\n|---|" + "---|" * len(keys))
    for t, rs in results.items():
        print(f"| {t} | " + " | ".join(f"{statistics.median(x[k] for x in rs):.3f}" for k in keys) + " |")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
