"""The two step costs of a running decode batch that are not the model's: the first decode step
after the batch changes (the torch-native backend's decode stage) and the step that finishes a
wave of requests (their sequences into the radix cache).

    python benchmark/bench_steps.py                                   # this tree
    python benchmark/bench_steps.py --baseline-pythonpath /tmp/base/python --rounds 5   # before/after

``join``: tiny-llama's attention shapes (4 layers, 8 query heads over 4 KV heads of 32), 32 requests
of 64-256 prompt tokens decoding; per round the median attention time (prepare + every layer's
forward) of a plain decode step and of the step right after one request leaves and another joins.
``--engine``: the offline Engine's tok/s on that load instead, in waves and with steady joins.
``finish``: the radix cache (page size 1, a keyed hash chain, a KV-event sink) takes 32 finished
requests of 64-256 + 64 tokens; per round the median time of that insert.
With ``--baseline-pythonpath``, each round runs this tree and the other checkout's package in
separate processes, alternating which goes first, so the machine's load hits both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

LAYERS, HQ, HKV, D = 4, 8, 4, 32  # tiny-llama
BATCH, OUTPUT = 32, 64


def _measure_join(samples: int, seed: int) -> dict:
    import torch

    from pdserve.layers.attention.torch_native import TorchNativeBackend
    from pdserve.layers.forward_batch import ForwardBatch, ForwardMode
    from pdserve.mem.kv_pool import GQAKVPool

    torch.manual_seed(seed)
    rng = random.Random(seed)
    pool = GQAKVPool(BATCH * (256 + OUTPUT) * 3, 1, LAYERS, HKV, D, torch.float32)
    free = list(range(pool.num_pages))
    rng.shuffle(free)
    backend, uids = TorchNativeBackend(), iter(range(10**9))
    reqs = []  # [uid, slots]

    def new_request():
        n = rng.randint(64, 256)
        slots = [free.pop() for _ in range(n)]
        loc = torch.tensor(slots)
        for layer in range(LAYERS):
            pool.set_kv(layer, loc, torch.randn(n, HKV, D), torch.randn(n, HKV, D))
        return [next(uids), slots]

    def decode_step() -> float:
        for r in reqs:
            r[1].append(free.pop())
        B, L = len(reqs), max(len(r[1]) for r in reqs)
        seq = torch.tensor([len(r[1]) for r in reqs])
        kv = torch.zeros(B, L, dtype=torch.int64)
        for b, r in enumerate(reqs):
            kv[b, :len(r[1])] = torch.tensor(r[1])
        loc = torch.tensor([r[1][-1] for r in reqs])
        one = torch.ones(B, dtype=torch.int64)
        fb = ForwardBatch(ForwardMode.DECODE, torch.zeros(B, dtype=torch.int64), seq - 1, loc, seq - 1, one, seq, kv,
                          pool, backend, req_uids=tuple(r[0] for r in reqs))
        q, k, v = torch.randn(B, HQ, D), torch.randn(B, HKV, D), torch.randn(B, HKV, D)
        t0 = time.perf_counter()
        fb.attn_metadata = backend.prepare(fb)
        for layer in range(LAYERS):
            backend.forward_gqa(q, k, v, layer, D ** -0.5, fb)
        return time.perf_counter() - t0

    reqs.extend(new_request() for _ in range(BATCH))
    decode_step()
    plain, join = [], []
    for _ in range(samples):
        plain.append(decode_step())
        gone = reqs.pop(rng.randrange(len(reqs)))
        free.extend(gone[1])
        reqs.append(new_request())
        join.append(decode_step())
        if max(len(r[1]) for r in reqs) > 256 + OUTPUT:  # keep lengths in the served range
            for r in reqs:
                free.extend(r[1])
            reqs[:] = [new_request() for _ in range(BATCH)]
            decode_step()
    return {"plain_ms": 1e3 * statistics.median(plain), "join_ms": 1e3 * statistics.median(join)}


def _measure_finish(samples: int, seed: int) -> dict:
    from pdserve.mem.allocator import PageAllocator
    from pdserve.mem.radix_cache import RadixCache
    from pdserve.obs.kv_events import EventBuffer

    rng = random.Random(seed)
    times = []
    for _ in range(samples):
        alloc = PageAllocator(BATCH * (256 + OUTPUT))
        cache = RadixCache(alloc, 1, sink=EventBuffer(), hash_key=bytes(32))
        seqs = [[rng.randrange(32000) for _ in range(rng.randint(64, 256) + OUTPUT)] for _ in range(BATCH)]
        pages = [alloc.alloc(len(s)) for s in seqs]
        t0 = time.perf_counter()
        for s, p in zip(seqs, pages):
            cache.insert(s, p)
        times.append(time.perf_counter() - t0)
    return {"finish_ms": 1e3 * statistics.median(times), "pages": sum(len(s) for s in seqs)}


class _StepProbe:
    """Times the Engine's decode forwards (split: same requests as the decode before, or changed) and
    its ``release`` of finished requests (the radix insert), by wrapping the runner and the KV manager."""

    def __init__(self, engine):
        self.same: list[float] = []
        self.changed: list[float] = []
        self.release: list[float] = []
        self.last: tuple | None = None
        runner, kv = engine.scheduler.runner, engine.scheduler.kv_manager
        run, release = runner.run, kv.release

        def timed_run(fb, *a, **kw):
            t0 = time.perf_counter()
            out = run(fb, *a, **kw)
            if fb.is_decode:
                (self.same if fb.req_uids == self.last else self.changed).append(time.perf_counter() - t0)
                self.last = fb.req_uids
            return out

        def timed_release(*a, **kw):
            t0 = time.perf_counter()
            release(*a, **kw)
            self.release.append(time.perf_counter() - t0)
        runner.run, kv.release = timed_run, timed_release

    def summary(self) -> dict:
        ms = lambda xs: 1e3 * statistics.median(xs) if xs else float("nan")  # noqa: E731
        return {"decode_same_ms": ms(self.same), "decode_changed_ms": ms(self.changed),
                "release_ms": ms(self.release), "changed_steps": len(self.changed)}


def _measure_engine(seed: int) -> dict:
    """Offline tok/s of the Engine at default flags over 64 prompts of 64-256 tokens, 32 running: in waves
    (64 output tokens each: 32 leave and 32 join at once) and steady (32-96 each: a join every step or two)."""
    import pdserve

    rng = random.Random(seed)
    prompt_sets = [[[rng.randrange(3, 2000) for _ in range(rng.randint(64, 256))] for _ in range(64)] for _ in range(2)]
    engine = pdserve.Engine(model_path="tiny-llama", max_running_requests=BATCH)
    probe = _StepProbe(engine)
    try:
        warm = [[rng.randrange(3, 2000) for _ in range(64)] for _ in range(4)]
        engine.generate(input_ids=warm, sampling_params={"max_new_tokens": 8, "temperature": 0})
        out = {}
        shapes = (("waves", [OUTPUT] * 64), ("steady", [rng.randint(32, 96) for _ in range(64)]))
        for (shape, lens), prompts in zip(shapes, prompt_sets):  # fresh prompts each: no prefix-cache hits
            sp = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in lens]
            t0 = time.perf_counter()
            engine.generate(input_ids=prompts, sampling_params=sp)
            out[f"{shape}_tok_s"] = sum(lens) / (time.perf_counter() - t0)
        return {**out, **probe.summary()}
    finally:
        engine.shutdown()


def _child(samples: int, seed: int, engine: bool) -> None:
    import torch

    if engine:
        print(json.dumps(_measure_engine(seed)))
        return
    torch.set_num_threads(1)
    print(json.dumps({**_measure_join(samples, seed), **_measure_finish(samples, seed)}))


def _run(pythonpath: str, samples: int, seed: int, engine: bool) -> dict:
    kernels = str(Path(__file__).resolve().parents[1] / "kernels")
    env = {**os.environ, "PYTHONPATH": f"{pythonpath}{os.pathsep}{kernels}"}
    cmd = [sys.executable, __file__, "--child", "--samples", str(samples), "--seed", str(seed)]
    out = subprocess.run(cmd + ["--engine"] * engine, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline-pythonpath", help="another checkout's python/ to compare against")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--samples", type=int, default=15, help="steps (or inserts) per round and side")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engine", action="store_true", help="the offline Engine's tok/s instead (waves, steady)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return _child(args.samples, args.seed, args.engine)
    tree = str(Path(__file__).resolve().parents[1] / "python")
    sides = {"tree": tree} if not args.baseline_pythonpath else {"tree": tree, "base": args.baseline_pythonpath}
    results: dict[str, list[dict]] = {name: [] for name in sides}
    for rnd in range(args.rounds):
        order = list(sides) if rnd % 2 == 0 else list(sides)[::-1]
        for name in order:
            results[name].append(_run(sides[name], args.samples, args.seed + rnd, args.engine))
        print(f"round {rnd}: " + "; ".join(f"{n} " + ", ".join(f"{k} {v:.1f}" for k, v in results[n][-1].items()
                                                              if k not in ("pages", "changed_steps")) for n in sides),
              flush=True)
    keys = (("waves_tok_s", "steady_tok_s", "decode_same_ms", "decode_changed_ms", "release_ms") if args.engine
            else ("plain_ms", "join_ms", "finish_ms"))
    for name, rows in results.items():
        print(f"{name}: " + ", ".join(f"{k} median {statistics.median(r[k] for r in rows):.1f} "
                                      f"[{min(r[k] for r in rows):.1f}-{max(r[k] for r in rows):.1f}]" for k in keys))


if __name__ == "__main__":
    main()
