"""Decode step time with and without the one-call decode stack (models/fused_decode.py), A/B alternated in
one process on one Engine, so both sides see the same load on a shared machine.

    python benchmark/bench_decode_stack.py                          # tiny-llama, batch 32, 160+64, 3 rounds
    python benchmark/bench_decode_stack.py --models llama-512x8 --rounds 2

Each round runs the batch once per side: ``--batch`` prompts of ``--prompt-len`` random tokens for
``--output-len`` greedy tokens. Timed: every scheduler step whose forward was a decode (``Scheduler.step``,
sampling and scheduling included) and that forward alone (``ModelRunner.run``, logits included).
"layers" sets the stack's call aside (``DecoderStack.fused_decode`` None: every layer one by one, the
per-op C kernels), "one call" puts it back. Prints the medians per side.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_peer import DEFAULT_MODELS, MODELS, model_dir  # noqa: E402


@contextlib.contextmanager
def decode_steps(engine, times: list[float], forwards: list[float]):
    """Wall time of every scheduler step whose forward was a decode (into ``times``, seconds) and of
    that forward alone (``forwards``): the instance's ``step`` and ``runner.run`` wrapped meanwhile."""
    sched, runner = engine.scheduler, engine.scheduler.runner
    step, run = sched.step, runner.run
    kinds: list[bool] = []

    def timed_run(fb, *args, **kwargs):
        t0 = time.perf_counter()
        out = run(fb, *args, **kwargs)
        kinds.append(fb.is_decode)
        if fb.is_decode:
            forwards.append(time.perf_counter() - t0)
        return out

    def timed_step(*args, **kwargs):
        kinds.clear()
        t0 = time.perf_counter()
        out = step(*args, **kwargs)
        if kinds and all(kinds):
            times.append(time.perf_counter() - t0)
        return out

    sched.step, runner.run = timed_step, timed_run
    try:
        yield
    finally:
        del sched.step, runner.run  # the class's methods again


def run_model(name: str, a: argparse.Namespace) -> dict[str, tuple[list[float], list[float]]]:
    import pdserve

    engine = pdserve.Engine(model_path=model_dir(name, Path(a.model_dir), a.seed), max_running_requests=a.batch,
                            random_seed=0, disable_overlap_schedule=True, disable_radix_cache=True)
    stack = engine.scheduler.runner.model.model
    fused = stack.fused_decode
    if fused is None or fused.refusal is not None:
        engine.shutdown()
        raise SystemExit(f"{name}: the decode stack does not run here ({getattr(fused, 'refusal', 'not packed')})")
    g = torch.Generator().manual_seed(a.seed)
    vocab = engine.scheduler.runner.model_config.hf_config.vocab_size
    prompts = torch.randint(3, vocab, (a.batch, a.prompt_len), generator=g).tolist()
    sp = {"max_new_tokens": a.output_len, "temperature": 0, "ignore_eos": True}
    times: dict[str, tuple[list[float], list[float]]] = {"layers": ([], []), "one call": ([], [])}
    try:
        engine.generate(input_ids=prompts, sampling_params=sp)  # warm-up (the one call's library, the helpers)
        for _ in range(a.rounds):
            for side, f in (("layers", None), ("one call", fused)):
                stack.fused_decode = f
                with decode_steps(engine, *times[side]):
                    engine.generate(input_ids=prompts, sampling_params=sp)
        assert engine.scheduler.runner.backend.decode_stack_steps > 0
    finally:
        engine.shutdown()
    return times


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["tiny-llama"], choices=list(MODELS))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=160)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model-dir", default=str(DEFAULT_MODELS))
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    print(f"torch {torch.__version__}, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for name in a.models:
        times = run_model(name, a)
        print(f"\n## {name}: decode step at batch {a.batch}, {a.prompt_len}+{a.output_len} tokens, {a.rounds} rounds")
        print("| path | decode step, median ms | its forward, median ms | steps |\n|---|---|---|---|")
        for side, (steps, forwards) in times.items():
            print(f"| {side} | {statistics.median(steps) * 1e3:.2f} | {statistics.median(forwards) * 1e3:.2f} | "
                  f"{len(steps)} |")
    print(f"\nload average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
