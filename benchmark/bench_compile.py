"""Compiled decode against eager, decode steps only: CPU time per step, both engines in one process.

    python benchmark/bench_compile.py --models tiny-llama llama-512x8 --rounds 6

Each model (bench_peer.py's directories) gets an eager Engine and an ``enable_torch_compile`` one in
this interpreter, one torch thread each, overlap off (so the forward runs on the calling thread and
the process CPU time is the step's). Each round sends the same ``--batch`` four-token prompts to both,
back to back, for ``--output-len`` greedy tokens: almost all decode steps, of the bucket ``--batch``.
Reports the start-up (the compile: every bucket, ``warmup_s``), CPU ms per decode step (median, min)
and the per-round ratio compiled / eager; greedy outputs must be equal. Process CPU time, not wall:
on a loaded machine wall time mostly measures the other processes. bench_threads.py with
``--variants default default+compile`` gives the offline benchmark's view (prefill included).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_peer import DEFAULT_MODELS, MODELS, model_dir  # noqa: E402


def run(a: argparse.Namespace, name: str) -> None:
    import pdserve

    mdir = model_dir(name, Path(a.model_dir), a.seed)
    kw = dict(model_path=mdir, num_threads=1, disable_radix_cache=True, torch_compile_max_bs=a.batch,
              max_running_requests=a.batch, disable_overlap_schedule=True)
    engines, startup = {}, {}
    for variant, compiled in (("eager", False), ("compiled", True)):
        t0 = time.perf_counter()
        engines[variant] = pdserve.Engine(enable_torch_compile=compiled, **kw)
        startup[variant] = time.perf_counter() - t0
    prompts = [[16 + i, 17, 18, 19] for i in range(a.batch)]
    sp = {"max_new_tokens": a.output_len, "temperature": 0, "ignore_eos": True}
    cpu: dict[str, list[float]] = {v: [] for v in engines}
    outputs = {}
    try:
        for r in range(a.rounds + 1):  # round 0 warms up
            for v, engine in engines.items():
                c = time.process_time()
                outs = engine.generate(input_ids=prompts, sampling_params=sp)
                if r:
                    cpu[v].append((time.process_time() - c) / (a.output_len - 1) * 1e3)
                outputs[v] = [o["output_ids"] for o in outs]
    finally:
        for engine in engines.values():
            engine.shutdown()
    ratios = [c / e for c, e in zip(cpu["compiled"], cpu["eager"])]
    print(f"\n## {name}: batch {a.batch}, {a.output_len} tokens, {a.rounds} rounds; greedy equal: "
          f"{outputs['compiled'] == outputs['eager']}")
    print("| variant | start-up s | CPU ms / decode step, median (min) | compiled / eager per round |\n"
          "|---|---|---|---|")
    for v in engines:
        print(f"| {v} | {startup[v]:.1f} | {statistics.median(cpu[v]):.2f} ({min(cpu[v]):.2f}) | "
              + (f"**{statistics.median(ratios):.3f}** ({min(ratios):.3f}-{max(ratios):.3f}) |" if v == "compiled"
                 else "1 |"))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--batch", type=int, default=32, help="requests per step (and the largest bucket)")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-dir", default=str(DEFAULT_MODELS))
    a = ap.parse_args(argv)
    for name in a.models:
        run(a, name)


if __name__ == "__main__":
    main()
