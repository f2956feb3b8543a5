"""Decode step time against context length: dense MLA (DeepSeek-V3) beside DSA sparse MLA
(DeepSeek-V3.2), same tiny dims, one run.

    python benchmark/bench_sparse.py --contexts 1024 4096 16384 32768 --steps 4

Each model in ``MODELS`` is built once (seeded dummy weights) with a pool large enough for the
longest context. Per context, one request's pool rows are filled with random latents (and, for
V3.2, index keys) instead of a prefill: the step's cost depends on how many rows are read, not
on what they hold, and a 32K prefill of either model would take minutes on a CPU. Then
``--warmup`` decode steps run (the first rebuilds the backend's decode stage) and ``--steps``
more are timed, each one token longer, as the engine's decode loop would run them.

Reported per model and context: the median step time (ms), the step's ratio to the first
model's at the same context, its growth since the smallest context, the indexer's share of
the step (its projections plus the paged score and top-k over the index keys), and the
state bytes per token (``ModelConfig.kv_bytes_per_token``: latent plus index keys). On a
shared machine compare the ratios, not the absolute times.

A model is one ``BenchModel`` (a preset and the config fields it overrides), so another
architecture (DeepSeek-V4) is one more entry in ``MODELS``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class BenchModel:
    label: str
    preset: str
    overrides: dict = field(default_factory=dict)  # hf_config fields set after loading the preset's


MAX_POSITIONS = 1 << 17  # the presets' 4096 raised so rope covers the longest context
MODELS = (
    BenchModel("V3 (dense MLA)", "tiny-deepseek", {"max_position_embeddings": MAX_POSITIONS}),
    BenchModel("V3.2 (DSA, topk 256)", "tiny-deepseek-v32",
               {"max_position_embeddings": MAX_POSITIONS, "index_topk": 256}),
)


class Timer:
    """Seconds spent inside the wrapped callables, summed until ``reset``."""

    def __init__(self):
        self.total = 0.0

    def reset(self) -> None:
        self.total = 0.0

    def wrap(self, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total += time.perf_counter() - t0
        return timed


# What the indexer runs, by backend: its projections, then the paged score + top-k over the index keys.
INDEXER_FUNCTIONS = {
    "torch_native": (("pdserve.models.deepseek_v32", "Indexer", "forward"),
                     ("pdserve.layers.attention.torch_native", None, "select_top_tokens")),
    "triton": (("pdserve.models.deepseek_v32", "Indexer", "forward"),
               ("pdserve_kernels.sparse_mla", None, "index_topk")),
}


@contextmanager
def indexer_timed(timer: Timer, backend: str) -> Iterator[None]:
    """``timer`` accumulates the time spent in the indexer's functions (``INDEXER_FUNCTIONS``)."""
    import importlib

    patched = []
    for module, cls, name in INDEXER_FUNCTIONS.get(backend, ()):
        owner = importlib.import_module(module)
        owner = getattr(owner, cls) if cls else owner
        patched.append((owner, name, getattr(owner, name)))
        setattr(owner, name, timer.wrap(getattr(owner, name)))
    try:
        yield
    finally:
        for owner, name, fn in reversed(patched):
            setattr(owner, name, fn)


def build_runner(model: BenchModel, max_context: int, page_size: int, backend: str):
    from pdserve.config import CacheConfig, ModelConfig
    from pdserve.engine.model_runner import ModelRunner

    mc = ModelConfig.from_path(model.preset)
    for name, value in model.overrides.items():
        setattr(mc.hf_config, name, value)
    pages = -(-max_context // page_size) + 2
    return mc, ModelRunner(mc, CacheConfig(page_size=page_size, max_total_tokens=pages * page_size),
                           attention_backend=backend)


def fill_pool(runner, context: int, seed: int) -> None:
    """Random rows (unit scale, as the normed latent and index keys are) for slots [0, context)."""
    pool = runner.pool
    g = torch.Generator().manual_seed(seed)
    pages = -(-context // pool.page_size)
    pool.latent[:, :pages].copy_(torch.randn(pool.latent[:, :pages].shape, generator=g))
    if getattr(pool, "index_k", None) is not None:
        pool.index_k[:, :pages].copy_(torch.randn(pool.index_k[:, :pages].shape, generator=g))


def time_steps(runner, context: int, warmup: int, steps: int, timer: Timer) -> tuple[list[float], list[float]]:
    """Per timed decode step from ``context`` on: (wall seconds, seconds inside the indexer)."""
    from pdserve.engine.model_runner import ScheduledBatch
    from pdserve.layers.forward_batch import ForwardMode

    table = torch.arange(context + warmup + steps, dtype=torch.int64)[None]  # one request; slot j holds position j
    walls, idx = [], []
    for i in range(warmup + steps):
        pos = context + i
        batch = ScheduledBatch(ForwardMode.DECODE, [7], [pos], [pos], [pos], [1], [0], req_uids=(context,))
        timer.reset()
        t0 = time.perf_counter()
        runner.forward(batch, table)
        if i >= warmup:
            walls.append(time.perf_counter() - t0)
            idx.append(timer.total)
    return walls, idx


def run(models: tuple[BenchModel, ...], contexts: list[int], warmup: int, steps: int, repeats: int,
        page_size: int, backend: str) -> list[dict]:
    """Every model is built first; then per context the models take turns, ``repeats`` rounds, so
    load from other processes falls on all of them alike."""
    timer = Timer()
    runners = [build_runner(m, max(contexts) + warmup + steps, page_size, backend) for m in models]
    rows = []
    with indexer_timed(timer, backend):
        for context in contexts:
            walls: dict[str, list[float]] = {m.label: [] for m in models}
            shares: dict[str, list[float]] = {m.label: [] for m in models}
            for _ in range(repeats):
                for model, (_, runner) in zip(models, runners):
                    fill_pool(runner, context, seed=context)
                    w, i = time_steps(runner, context, warmup, steps, timer)
                    walls[model.label] += w
                    shares[model.label] += [a / b for a, b in zip(i, w)]
            for model, (mc, _) in zip(models, runners):
                rows.append({"model": model.label, "context": context,
                             "step_ms": statistics.median(walls[model.label]) * 1e3,
                             "indexer_share": statistics.median(shares[model.label]),
                             "state_bytes_per_token": mc.kv_bytes_per_token()})
    rows.sort(key=lambda r: [m.label for m in models].index(r["model"]))
    return with_ratios(rows, models[0].label, min(contexts))


def with_ratios(rows: list[dict], baseline: str, first_context: int) -> list[dict]:
    base = {r["context"]: r["step_ms"] for r in rows if r["model"] == baseline}
    start = {r["model"]: r["step_ms"] for r in rows if r["context"] == first_context}
    for r in rows:
        r["vs_baseline"] = r["step_ms"] / base[r["context"]]
        r["growth"] = r["step_ms"] / start[r["model"]]
    return rows


def table(rows: list[dict], baseline: str) -> str:
    out = [f"| model | context | step ms | vs {baseline} | growth from {rows[0]['context']} | indexer share | "
           "state B/token |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['model']} | {r['context']} | {r['step_ms']:.2f} | {r['vs_baseline']:.2f}x | "
                   f"{r['growth']:.2f}x | {r['indexer_share']:.0%} | {r['state_bytes_per_token']} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    p.add_argument("--steps", type=int, default=4, help="timed decode steps per context")
    p.add_argument("--warmup", type=int, default=2, help="untimed decode steps first (the first rebuilds the stage)")
    p.add_argument("--repeats", type=int, default=3, help="rounds per context, the models taking turns")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--attention-backend", default="torch_native")
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print the rows as JSON lines too")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.repeats < 1:
        p.error("--steps and --repeats must be >= 1, --warmup >= 0")
    torch.set_num_threads(args.num_threads)
    rows = run(MODELS, sorted(args.contexts), args.warmup, args.steps, args.repeats, args.page_size,
               args.attention_backend)
    print(table(rows, MODELS[0].label))
    if args.json:
        for r in rows:
            print(json.dumps(r))


if __name__ == "__main__":
    main()
