"""Where the offline Engine's threads spend a round: context switches and run-queue waits per thread.

    python benchmark/thread_profile.py --model tiny-llama --rounds 2
    python benchmark/thread_profile.py --model llama-512x8 --num-threads 2

Runs one ``Engine`` on bench_peer.py's model directory and prompts (no shared prefixes), warms it,
then for each round reads every thread's ``/proc/self/task/<tid>/status`` (voluntary and involuntary
context switches) and ``schedstat`` (seconds on a CPU, seconds runnable but waiting for one) before
and after ``generate``. Voluntary switches are the threads' own hand-offs (a future, the GIL, a
queue); involuntary ones are other processes taking the core. Linux only.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_peer import DEFAULT_MODELS, MODELS, make_prompts, model_dir  # noqa: E402


def snapshot() -> dict[str, tuple[str, int, int, float, float]]:
    """tid -> (name, voluntary, involuntary, on-CPU s, run-queue s) of this process's threads."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        base = f"/proc/self/task/{tid}"
        try:
            status = dict(line.split(":", 1) for line in open(f"{base}/status").read().splitlines() if ":" in line)
            run, wait = open(f"{base}/schedstat").read().split()[:2]
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        out[tid] = (status["Name"].strip(), int(status["voluntary_ctxt_switches"]),
                    int(status["nonvoluntary_ctxt_switches"]), int(run) / 1e9, int(wait) / 1e9)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-llama", choices=list(MODELS))
    ap.add_argument("--num-threads", type=int, default=None, help="torch threads (default: the Engine's layout)")
    ap.add_argument("--disable-overlap-schedule", action="store_true")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, nargs=2, default=[64, 256], metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-dir", default=str(DEFAULT_MODELS))
    a = ap.parse_args(argv)
    mdir = model_dir(a.model, Path(a.model_dir), a.seed)
    import pdserve

    engine = pdserve.Engine(model_path=mdir, max_running_requests=a.num_prompts, random_seed=0,
                            num_threads=a.num_threads, disable_overlap_schedule=a.disable_overlap_schedule)
    try:
        print(engine.get_server_info().get("thread_layout"))
        vocab = engine.scheduler.limits.vocab_size
        sp = {"max_new_tokens": a.output_len, "temperature": 0, "ignore_eos": True}
        engine.generate(input_ids=make_prompts(8, tuple(a.input_len), vocab, a.seed + 1000), sampling_params=sp)
        for r in range(a.rounds):
            prompts = make_prompts(a.num_prompts, tuple(a.input_len), vocab, a.seed + r)
            before, cpu0, t0 = snapshot(), time.process_time(), time.perf_counter()
            outs = engine.generate(input_ids=prompts, sampling_params=sp)
            wall, cpu, after = time.perf_counter() - t0, time.process_time() - cpu0, snapshot()
            tokens = sum(len(o["output_ids"]) for o in outs)
            names = {str(t.native_id): t.name for t in threading.enumerate()}  # the OS names them all python
            print(f"\nround {r}: {tokens / wall:.0f} tok/s, {wall:.2f} s wall, {cpu / wall:.2f} cores, "
                  f"{cpu / tokens * 1000:.2f} CPU-s per 1k tokens, load average {os.getloadavg()[0]:.1f}")
            print("| thread | voluntary | involuntary | on a CPU (s) | waiting for one (s) |\n|---|---|---|---|---|")
            for tid, (name, vol, invol, run, wait) in after.items():
                if tid not in before:
                    continue
                _, vol0, invol0, run0, wait0 = before[tid]
                if run - run0 > 0.01:
                    name = names.get(tid, name)
                    print(f"| {name} ({tid}) | {vol - vol0} | {invol - invol0} | {run - run0:.2f} | "
                          f"{wait - wait0:.2f} |")
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
