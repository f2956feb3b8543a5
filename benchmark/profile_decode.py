"""Where an offline Engine's decode step spends its wall time, by part: torch profiler over ``Engine.generate``.

    python benchmark/profile_decode.py                                  # both models, batch 32
    python benchmark/profile_decode.py --models tiny-llama --threads 2 --overlap
    python benchmark/profile_decode.py --engine-arg cpu_gemm=plain --engine-arg dtype=bfloat16

Each model (bench_peer.py's directories: the same weights as the vLLM comparison) runs ``--batch``
prompts of ``--prompt-len`` random tokens for ``--output-len`` greedy tokens, once to warm up, once
timed without the profiler, once under it. Parts are ``record_function`` ranges the script wraps
around pdserve's own functions (nothing in the package changes):

- ``gemm``: every linear (projections and the LM head; ``cpu_gemm.linear``);
- ``attention``: the backend's ``forward_gqa`` (pool write, staged KV, SDPA or grouped matmuls);
- ``norm`` (RMSNorm with its residual add), ``rotary``, ``silu*mul``, ``embedding``;
- ``forward, other``: what runs in the model's forward outside those (views, the backend's
  ``prepare``, the final gathers, and the Python between them);
- ``sampling``: the sampler; ``scheduling``: the rest of a scheduler step (batch building, the
  req->token table, stop checks, outputs).

A decode step's wall is its ``Scheduler.step`` range. With overlap on (``--overlap``), the forward
and sampling run on the worker thread while the scheduler thread waits or works beside it, so the
parts are reported per thread and do not add up to the step; the default here is the plain loop,
whose parts do add up. The profiler's own cost per op inflates the small parts: compare the
profiled step with the unprofiled one printed beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.autograd.profiler import record_function

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_peer import DEFAULT_MODELS, MODELS, model_dir  # noqa: E402

PARTS = ("gemm", "attention", "norm", "rotary", "silu*mul", "embedding", "forward, other", "sampling", "scheduling")


def _wrapped(fn, label: str):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with record_function(label):
            return fn(*args, **kwargs)
    return run


@contextlib.contextmanager
def labelled_parts(engine):
    """``record_function`` ranges around the parts (module functions patched for the duration)."""
    import pdserve.layers.embedding as embedding
    import pdserve.layers.linear as linear
    import pdserve.layers.mlp as mlp
    from pdserve.layers.norm import RMSNorm
    from pdserve.layers.rotary import Rotation

    sched = engine.scheduler
    runner, backend = sched.runner, sched.runner.backend
    targets = [(linear, "linear", "gemm"), (embedding, "linear", "gemm"), (mlp, "silu_and_mul", "silu*mul"),
               (RMSNorm, "forward", "norm"), (Rotation, "__call__", "rotary"),
               (embedding.VocabParallelEmbedding, "forward", "embedding"),
               (backend, "forward_gqa", "attention"),
               (sched, "sampler", "sampling"), (type(sched), "step", "step")]
    worker = getattr(sched, "_worker", None)
    if worker is not None:
        targets.append((worker, "sampler", "sampling"))
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in targets] + [(runner, "run", runner.run)]
    run = runner.run

    def labelled_run(fb, *args, **kwargs):
        with record_function("forward" if fb.is_decode else "extend"):
            return run(fb, *args, **kwargs)
    try:
        for obj, name, label in targets:
            setattr(obj, name, _wrapped(getattr(obj, name), label))
        runner.run = labelled_run
        yield
    finally:
        for obj, name, fn in reversed(saved):
            if isinstance(obj, type) or obj in (linear, embedding, mlp):
                setattr(obj, name, fn)
            else:
                setattr(obj, name, fn)


def _walk(ev, acc: dict) -> None:
    """Add the wall of ``ev``'s outermost labelled descendants to ``acc``."""
    for child in ev.cpu_children:
        if child.name in PARTS:
            acc[child.name] += child.cpu_time_total
        else:
            _walk(child, acc)


def decode_breakdown(prof, decode_tokens: int) -> dict:
    """Microseconds per decode step (one token per request) of each part, over the decode phase:
    from the first scheduler step after the last extend (prefill) to the end of the last step."""
    events = prof.events()
    last_extend = max(e.time_range.end for e in events if e.name == "extend")
    steps = [e for e in events if e.name == "step" and e.time_range.start >= last_extend]
    begin, end = min(s.time_range.start for s in steps), max(s.time_range.end for s in steps)
    inside = [e for e in events if begin <= e.time_range.start and e.time_range.end <= end]
    parts: dict[str, float] = defaultdict(float)
    for f in (e for e in inside if e.name == "forward"):
        inner: dict[str, float] = defaultdict(float)
        _walk(f, inner)
        for k, v in inner.items():
            parts[k] += v
        parts["forward, other"] += f.cpu_time_total - sum(inner.values())
        parts["forward"] += f.cpu_time_total
    parts["sampling"] = sum(e.cpu_time_total for e in inside if e.name == "sampling")
    parts["step"] = end - begin
    parts["scheduling"] = parts["step"] - parts["forward"] - parts["sampling"]  # the plain loop's remainder
    parts["scheduler thread busy"] = sum(s.cpu_time_total for s in steps)
    return {k: v / decode_tokens for k, v in parts.items()}


def run_model(name: str, a: argparse.Namespace) -> dict:
    import pdserve

    mdir = model_dir(name, Path(a.model_dir), a.seed)
    kw = dict(kv.split("=", 1) for kv in a.engine_arg)
    engine = pdserve.Engine(model_path=mdir, max_running_requests=a.batch, random_seed=0, num_threads=a.threads,
                            disable_overlap_schedule=not a.overlap, disable_radix_cache=True, **kw)
    g = torch.Generator().manual_seed(a.seed)
    vocab = engine.scheduler.runner.model_config.hf_config.vocab_size
    prompts = lambda: torch.randint(3, vocab, (a.batch, a.prompt_len), generator=g).tolist()  # noqa: E731
    sp = {"max_new_tokens": a.output_len, "temperature": 0, "ignore_eos": True}
    try:
        engine.generate(input_ids=prompts(), sampling_params=sp)  # warm-up
        t0 = time.perf_counter()
        engine.generate(input_ids=prompts(), sampling_params={**sp, "max_new_tokens": 1})
        prefill_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        engine.generate(input_ids=prompts(), sampling_params=sp)
        plain_s = time.perf_counter() - t0
        with labelled_parts(engine), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            engine.generate(input_ids=prompts(), sampling_params=sp)
        layout = engine.scheduler.thread_layout
    finally:
        engine.shutdown()
    decode_steps = a.output_len - 1  # the first token comes from the prefill
    parts = decode_breakdown(prof, decode_steps)
    # Unprofiled decode step: the run less its prefill, over its decode steps.
    return {"model": name, "layout": layout.to_dict() if layout else None, "parts": parts,
            "unprofiled_step_us": (plain_s - prefill_s) / decode_steps * 1e6, "prefill_s": prefill_s,
            "run_s": plain_s, "ops_per_step": _ops_per_step(prof, decode_steps)}


def _ops_per_step(prof, decode_steps: int) -> float:
    """aten ops called (at the top of the dispatcher) per decode step, prefill's included (small)."""
    n = sum(1 for e in prof.events() if e.name.startswith("aten::") and
            (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))
    return n / (decode_steps + 1)


def print_result(r: dict) -> None:
    p, step = r["parts"], r["parts"]["step"]
    print(f"\n## {r['model']}: decode step at batch {ARGS.batch}, {ARGS.prompt_len}+{ARGS.output_len} tokens "
          f"({r['layout']})")
    print(f"unprofiled step {r['unprofiled_step_us'] / 1e3:.2f} ms, profiled {step / 1e3:.2f} ms; "
          f"~{r['ops_per_step']:.0f} top-level aten ops per step; prefill of the batch {r['prefill_s']:.2f} s")
    print("| part | ms per step | share of the step |\n|---|---|---|")
    for k in PARTS:
        if k in p:
            print(f"| {k} | {p[k] / 1e3:.2f} | {p[k] / step:.0%} |")
    print(f"| (forward, all) | {p.get('forward', 0) / 1e3:.2f} | {p.get('forward', 0) / step:.0%} |")


ARGS: argparse.Namespace


def main(argv=None) -> None:
    global ARGS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: the Engine's)")
    ap.add_argument("--overlap", action="store_true", help="overlap scheduling on (default: the plain loop)")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="extra Engine keyword (strings), e.g. cpu_gemm=plain, dtype=bfloat16")
    ap.add_argument("--model-dir", default=str(DEFAULT_MODELS))
    ap.add_argument("--seed", type=int, default=0)
    ARGS = ap.parse_args(argv)
    print(f"torch {torch.__version__}, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    results = [run_model(m, ARGS) for m in ARGS.models]
    for r in results:
        print_result(r)
    print(f"\nload average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
          f"median unprofiled step {statistics.median(r['unprofiled_step_us'] for r in results) / 1e3:.2f} ms")


if __name__ == "__main__":
    main()
