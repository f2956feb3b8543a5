"""A CPU prefill with and without the plain-C extend attention and the threaded SiLU x mul (docs/cpu.md,
"Prefill attention and SiLU in C"), alternating in one process so the machine's other load hits both.

    python benchmark/bench_prefill_cpu.py                     # tiny-llama, 13 prompts of 64-256 tokens
    python benchmark/bench_prefill_cpu.py --models llama-512x8 --rounds 10
    python benchmark/bench_prefill_cpu.py --num-prompts 32 --baseline /tmp/old/extend_attention_cpu.c

Per model (bench_peer.py's directories): one offline Engine (``--threads`` torch threads, radix cache
off so every round prefills the same prompts, 1 output token). First every forward's extend attention
calls are recorded; then

- ``layer``: one layer's extend attention over exactly those calls' shapes (random values, page size
  and slots as the engine gave them), the SDPA path ``_gqa_ragged`` runs (torch at ``--threads``)
  against the kernel on 1 and ``--threads`` helper threads (the one-thread kernels also in the calling
  thread's CPU time, which the machine's other load does not stretch);
- ``engine``: the whole prefill (``Engine.generate``) with the backend's ``extend_attention_impl`` set
  to "sdpa" or "cpu_kernel", and SiLU x mul's limit at its value before the helper threads (2^17: the
  prefill's calls go to torch) or now; the greedy token of every setting must agree.

With ``--baseline`` (another tree's ``extend_attention_cpu.c``, copied out beside its headers) that
kernel runs too, in both, as "baseline": built under its own cache key and swapped in for this tree's
library for its turns. Each setting's rounds alternate with the others'; min and median per setting are
printed (the engine's also per prompt token).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_peer import DEFAULT_MODELS, MODELS, model_dir  # noqa: E402

OLD_SILU_MAX_ELEMENTS = 1 << 17  # fused_cpu's limit before the helper threads


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["tiny-llama"], help=f"built-in ({', '.join(MODELS)}) or a dir")
    ap.add_argument("--num-prompts", type=int, default=13)
    ap.add_argument("--input-len", type=int, nargs=2, default=[64, 256], metavar=("MIN", "MAX"))
    ap.add_argument("--threads", type=int, default=2, help="torch threads, and the kernel's")
    ap.add_argument("--rounds", type=int, default=10, help="alternating rounds per setting")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--baseline", type=Path, help="another extend_attention_cpu.c (its headers beside it) to time "
                    "against this tree's in the same rounds")
    return ap.parse_args(argv)


def _baseline_library(source: Path):
    """The kernel built from another tree's source with this tree's flags (its own cache key)."""
    from pdserve_kernels import extend_attention_cpu as K
    from pdserve_kernels.cpu_build import CLibrary

    headers = tuple(source.with_name(h) for h in ("cpu_threads.h", "cpu_simd.h", "cpu_attention.h"))
    lib = CLibrary(source, K._declare, "extend attention (baseline)", flags=K.LIBRARY.flags, headers=headers).load()
    if lib is None:
        raise SystemExit(f"--baseline: {source} did not build (see the log)")
    return lib


@contextlib.contextmanager
def _kernel_library(lib):
    """extend_attention_cpu's calls go to ``lib`` (None: this tree's library) meanwhile."""
    from pdserve_kernels import extend_attention_cpu as K

    real = K.load
    if lib is not None:
        K.load = lambda: lib
    try:
        yield
    finally:
        K.load = real


def _summary(times: dict[str, list[float]]) -> str:
    return ", ".join(f"{k} {min(v):.2f} / {statistics.median(v):.2f}" for k, v in times.items())


def _alternate(settings: dict, rounds: int, run) -> dict[str, list[float]]:
    """run(setting) -> ms, each round once per setting in turn."""
    times: dict[str, list[float]] = {k: [] for k in settings}
    for _ in range(rounds):
        for name, setting in settings.items():
            times[name].append(run(setting))
    return times


def _recorded_calls(engine, prompts, sp) -> list[tuple]:
    """(prefix_lens, ext_lens, kv_slots, pool k shape) of one layer's extend attention per forward."""
    from pdserve_kernels import extend_attention_cpu

    real, calls = extend_attention_cpu.extend_attention, []
    extend_attention_cpu.extend_attention = lambda *a, **k: calls.append(a) or real(*a, **k)
    try:
        engine.scheduler.runner.backend.extend_attention_impl = "cpu_kernel"
        engine.generate(input_ids=prompts, sampling_params=sp)
    finally:
        extend_attention_cpu.extend_attention = real
    layers = engine.scheduler.runner.model.config.num_hidden_layers
    return [(a[4].clone(), a[5].clone(), a[3].clone(), tuple(a[1].shape), a[0].shape[1], a[6])
            for a in calls[::layers]]


def _sdpa_path(q, kc, vc, slots, pre, ext, scale):
    """_gqa_ragged's work per request: SDPA over its rows (is_causal) or its gathered keys (a mask)."""
    from pdserve.layers.attention.torch_native import _sdpa

    S, outs, st = kc.shape[2], [], 0
    for b, (p, e) in enumerate(zip(pre.tolist(), ext.tolist())):
        s = slots[b, :p + e]
        k = kc[s // S, :, s % S].transpose(0, 1)[None]  # [1, Hkv, n, D]
        v = vc[s // S, :, s % S].transpose(0, 1)[None]
        qi = q[st:st + e].transpose(0, 1)[None]  # [1, Hq, e, D]
        st += e
        mask = None if p == 0 else (torch.arange(p + e)[None] <= p + torch.arange(e)[:, None])[None, None]
        outs.append(_sdpa(qi, k, v, mask, scale, True)[0].transpose(0, 1))
    return torch.cat(outs)


def bench_layer(calls, threads: int, rounds: int, baseline=None) -> str:
    from pdserve_kernels.extend_attention_cpu import extend_attention

    g = torch.Generator().manual_seed(0)
    cases = []
    for pre, ext, slots, (P, Hkv, S, D), Hq, scale in calls:
        kc, vc = (torch.randn(P, Hkv, S, D, generator=g) for _ in range(2))
        cases.append((torch.randn(int(ext.sum()), Hq, D, generator=g), kc, vc, slots, pre, ext, scale))
    for c in cases:
        torch.testing.assert_close(extend_attention(*c, threads=threads), _sdpa_path(*c), atol=1e-5, rtol=1e-5)
    fns = {"sdpa": (None, lambda c: _sdpa_path(*c)), "kernel x1": (None, lambda c: extend_attention(*c, threads=1)),
           f"kernel x{threads}": (None, lambda c: extend_attention(*c, threads=threads))}
    if baseline is not None:
        for n in (1, threads):
            fns[f"baseline x{n}"] = (baseline, fns[f"kernel x{n}"][1])

    cpu: dict[str, list[float]] = {}  # the x1 settings run on the calling thread alone: its CPU time

    def run(setting) -> float:
        name, (lib, fn) = setting
        with _kernel_library(lib):
            t, c0 = time.perf_counter(), time.thread_time()
            for _ in range(20):
                for c in cases:
                    fn(c)
            if name.endswith(" x1"):
                cpu.setdefault(name, []).append((time.thread_time() - c0) / 20 * 1e3)
            return (time.perf_counter() - t) / 20 * 1e3

    wall = _summary(_alternate({name: (name, f) for name, f in fns.items()}, rounds, run))
    return f"{wall}\n  layer x1, the calling thread's CPU ms (not the machine's other load): {_summary(cpu)}"


def bench_engine(engine, prompts, sp, rounds: int, baseline=None) -> str:
    from pdserve_kernels import fused_cpu

    backend, silu_limit = engine.scheduler.runner.backend, fused_cpu.SILU_MAX_ELEMENTS
    settings = {"sdpa, old silu": ("sdpa", OLD_SILU_MAX_ELEMENTS, None), "sdpa, silu": ("sdpa", silu_limit, None),
                "kernel, old silu": ("cpu_kernel", OLD_SILU_MAX_ELEMENTS, None),
                "kernel, silu": ("cpu_kernel", silu_limit, None)}
    if baseline is not None:
        settings["baseline kernel, silu"] = ("cpu_kernel", silu_limit, baseline)
    tokens: set[str] = set()

    def run(setting) -> float:
        backend.extend_attention_impl, fused_cpu.SILU_MAX_ELEMENTS, lib = setting
        with _kernel_library(lib):
            t = time.perf_counter()
            out = engine.generate(input_ids=prompts, sampling_params=sp)
            ms = (time.perf_counter() - t) * 1e3
        tokens.add(str([o["output_ids"] for o in out]))
        return ms

    try:
        times = _alternate(settings, rounds, run)
    finally:
        fused_cpu.SILU_MAX_ELEMENTS = silu_limit
    assert len(tokens) == 1, "the settings' greedy tokens differ"
    n = sum(map(len, prompts))
    per_token = ", ".join(f"{k} {statistics.median(v) / n:.3f}" for k, v in times.items())
    return f"{_summary(times)}\n  engine ms per prompt token (median): {per_token}"


def main(argv=None) -> None:
    import pdserve

    args = parse_args(argv)
    baseline = _baseline_library(args.baseline) if args.baseline else None
    for name in args.models:
        engine = pdserve.Engine(model_path=model_dir(name, DEFAULT_MODELS, args.seed), num_threads=args.threads,
                                disable_radix_cache=True, random_seed=args.seed)
        rng = random.Random(args.seed)
        prompts = [[rng.randrange(3, 2000) for _ in range(rng.randint(*args.input_len))]
                   for _ in range(args.num_prompts)]
        sp = {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}
        engine.generate(input_ids=prompts, sampling_params=sp)  # warm-up: kernels built, weights touched
        calls = _recorded_calls(engine, prompts, sp)
        print(f"{name}: {sum(map(len, prompts))} prompt tokens, {len(calls)} forwards, "
              f"ext per forward {[int(c[1].sum()) for c in calls]}; ms min / median")
        print(f"  layer:  {bench_layer(calls, args.threads, args.rounds, baseline)}")
        print(f"  engine: {bench_engine(engine, prompts, sp, args.rounds, baseline)}")
        print(f"  {engine.get_server_info()['attention']}")
        engine.shutdown()


if __name__ == "__main__":
    main()
