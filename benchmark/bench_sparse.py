"""Decode step time and state bytes against context length: dense MLA (DeepSeek-V3), DSA sparse MLA
(DeepSeek-V3.2) and hybrid compressed attention (DeepSeek-V4), tiny dims, one run.

    python benchmark/bench_sparse.py                        # contexts 1K 8K 64K
    python benchmark/bench_sparse.py --contexts 1024 4096 16384 32768 65536 --steps 4 --repeats 3

Each model in ``MODELS`` is built once (seeded dummy weights) with a pool large enough for
``--batch-size`` requests at the longest context. Per context, the requests' pool rows are
filled with random rows (latents, V3.2's index keys, every V4 region) instead of a prefill: a step's cost
depends on how many rows it reads, not on what they hold, and a 32K prefill of either model
would take minutes on a CPU. Then ``--warmup`` decode steps run (the first rebuilds the
backend's decode stage) and ``--steps`` more are timed, each one token longer, as the engine's
decode loop runs them. The models take turns per context, ``--repeats`` rounds.

Reported per model and context, from its fastest timed step (as timeit: other processes only
ever add time, so the minimum is the steadiest estimate on a shared machine):

* the step (ms), its ratio to the first model's at the same context, its growth since the
  smallest context;
* attention (ms), the backend's MLA call (for V3.2 that includes the paged score and top-k over
  the index keys, and the sparse MLA), and its ratio to the first model's;
* the indexer's share of the step: its projections plus the paged score and top-k;
* which indexer top-k ran (torch_native: the CPU kernel, or the torch twin for the "torch top-k" row);
* the state bytes per token (``ModelConfig.kv_bytes_per_token``: latent plus index keys; for V4 the
  page layout, every per-token row in pages: a pool built without records);
* for V4 also the bounded layout's bytes per token at that context, what every server keeps
  (colocated, P/D and the tiers)
  (docs/kv-cache.md "What is built for DeepSeek-V4": compressed entries and index keys at 1 per 4 or
  m' tokens, the reusable boundaries' tails, one request's record spread over the context), and both
  as a ratio to the first model's.

Times are this process's CPU time by default (``--clock cpu``, one torch thread), which other
processes inflate less than elapsed time; compare the ratios, not the absolute times.

A model is one ``BenchModel`` (a preset and the config fields it overrides), so another
architecture (DeepSeek-V4) is one more entry in ``MODELS``.
"""

from __future__ import annotations

import argparse
import json
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
    # The indexer's score + top-k forced to one implementation of the torch_native backend ("torch":
    # the twin over the staged keys); None: the backend's own choice (the CPU kernel where it builds).
    index_topk: str | None = None


MAX_POSITIONS = 1 << 17  # the presets' 4096 raised so rope covers the longest context
MODELS = (
    BenchModel("V3 (dense MLA)", "tiny-deepseek", {"max_position_embeddings": MAX_POSITIONS}),
    BenchModel("V3.2 (DSA, topk 256)", "tiny-deepseek-v32",
               {"max_position_embeddings": MAX_POSITIONS, "index_topk": 256}),
    # the same model with the indexer's torch twin instead of the CPU kernel, side by side
    BenchModel("V3.2 (DSA, torch top-k)", "tiny-deepseek-v32",
               {"max_position_embeddings": MAX_POSITIONS, "index_topk": 256}, index_topk="torch"),
    BenchModel("V4 (SWA/CSA/HCA)", "tiny-deepseek-v4", {"max_position_embeddings": MAX_POSITIONS}),
)
# DeepSeek-V4's attention runs in the model, not the backend: its call and its indexer's selection.
V4_FUNCTIONS = ((("pdserve.models.deepseek_v4_attention", "DeepseekV4Attention", "forward"), "attention"),
                (("pdserve.models.deepseek_v4_attention", "Indexer", "queries"), "indexer"),
                (("pdserve.models.deepseek_v4_attention", "Indexer", "select"), "indexer"))


CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


class Timer:
    """Seconds spent inside the wrapped callables, summed per name until ``reset``, on ``clock``."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.totals: dict[str, float] = {}

    def reset(self) -> None:
        self.totals = {}

    def wrap(self, fn: Callable, name: str) -> Callable:
        def timed(*args, **kwargs):
            t0 = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[name] = self.totals.get(name, 0.0) + self.clock() - t0
        return timed


# What the indexer runs, by backend: its projections, then the paged score + top-k over the index keys.
INDEXER_FUNCTIONS = {
    "torch_native": (("pdserve.models.deepseek_v32", "Indexer", "forward"),
                     ("pdserve.layers.attention.torch_native", None, "select_top_tokens"),
                     ("pdserve.layers.attention.torch_native", None, "select_top_tokens_paged")),
    "triton": (("pdserve.models.deepseek_v32", "Indexer", "forward"),
               ("pdserve_kernels.sparse_mla", None, "index_topk")),
}
# The backend's attention call (for V3.2 it includes the score + top-k, not the projections).
ATTENTION_METHODS = ("forward_mla", "forward_mla_sparse")


@contextmanager
def timed(timer: Timer, backend) -> Iterator[None]:
    """``timer`` accumulates "indexer" (``INDEXER_FUNCTIONS``) and "attention" (``backend``'s
    ``ATTENTION_METHODS``) time until the block ends."""
    import importlib

    patched = []
    functions = [(f, "indexer") for f in INDEXER_FUNCTIONS.get(backend.name, ())] + list(V4_FUNCTIONS)
    for (module, cls, name), label in functions:
        owner = importlib.import_module(module)
        owner = getattr(owner, cls) if cls else owner
        patched.append((owner, name, getattr(owner, name), label))
    patched += [(backend, name, getattr(backend, name), "attention") for name in ATTENTION_METHODS]
    for owner, name, fn, label in patched:
        setattr(owner, name, timer.wrap(fn, label))
    try:
        yield
    finally:
        for owner, name, fn, _ in reversed(patched):
            if owner is backend:
                delattr(backend, name)  # the instance attribute set above; the class's method shows again
            else:
                setattr(owner, name, fn)


def build_runner(model: BenchModel, tokens: int, page_size: int, backend: str):
    from pdserve.config import CacheConfig, ModelConfig
    from pdserve.engine.model_runner import ModelRunner

    mc = ModelConfig.from_path(model.preset)
    for name, value in model.overrides.items():
        setattr(mc.hf_config, name, value)
    pages = -(-tokens // page_size) + 2
    runner = ModelRunner(mc, CacheConfig(page_size=page_size, max_total_tokens=pages * page_size),
                         attention_backend=backend)
    if model.index_topk is not None:  # chosen once, at the first sparse step: set before it
        runner.backend.index_topk_impl = model.index_topk
    return mc, runner


def fill_pool(runner, tokens: int, seed: int) -> None:
    """Random rows (unit scale, as the normed latent and index keys are) for slots [0, tokens)."""
    pool = runner.pool
    g = torch.Generator().manual_seed(seed)
    pages = -(-tokens // pool.page_size)
    if hasattr(pool, "buffers"):  # DeepSeek-V4's regions: [layers, pages, page, width] each
        for buf in pool.buffers.values():
            buf[:, :pages].copy_(torch.randn(buf[:, :pages].shape, generator=g))
        return
    pool.latent[:, :pages].copy_(torch.randn(pool.latent[:, :pages].shape, generator=g))
    if getattr(pool, "index_k", None) is not None:
        pool.index_k[:, :pages].copy_(torch.randn(pool.index_k[:, :pages].shape, generator=g))


def span(context: int, extra: int, page_size: int) -> int:
    """Slots per request: its context and the steps after it, rounded up to whole pages."""
    return -(-(context + extra) // page_size) * page_size


def time_steps(runner, context: int, batch_size: int, warmup: int, steps: int, timer: Timer) -> list[dict]:
    """Per timed decode step of ``batch_size`` requests from ``context`` on: its seconds and the
    seconds inside the indexer and the attention calls, on the timer's clock."""
    from pdserve.engine.model_runner import ScheduledBatch
    from pdserve.layers.forward_batch import ForwardMode

    n = span(context, warmup + steps, runner.pool.page_size)
    table = torch.arange(batch_size * n, dtype=torch.int64).view(batch_size, n)  # request b: slots b*n on
    rows, B = [], batch_size
    for i in range(warmup + steps):
        pos = context + i
        batch = ScheduledBatch(ForwardMode.DECODE, [7] * B, [pos] * B, [b * n + pos for b in range(B)], [pos] * B,
                               [1] * B, list(range(B)), req_uids=tuple(context * B + b for b in range(B)))
        timer.reset()
        t0 = timer.clock()
        runner.forward(batch, table)
        if i >= warmup:
            rows.append({"step": timer.clock() - t0, **timer.totals})
    return rows


def run(models: tuple[BenchModel, ...], contexts: list[int], batch_size: int, warmup: int, steps: int,
        repeats: int, page_size: int, backend: str, clock: str = "cpu") -> list[dict]:
    """Every model is built first; then per context the models take turns, ``repeats`` rounds, so
    load from other processes falls on all of them alike."""
    timer = Timer(CLOCKS[clock])
    if backend != "torch_native":  # only torch_native has the choice
        models = tuple(m for m in models if m.index_topk is None)
    tokens = batch_size * span(max(contexts), warmup + steps, page_size)
    runners = [build_runner(m, tokens, page_size, backend) for m in models]
    rows = []
    for context in contexts:
        samples: dict[str, list[dict]] = {m.label: [] for m in models}
        for _ in range(repeats):
            for model, (_, runner) in zip(models, runners):
                fill_pool(runner, batch_size * span(context, warmup + steps, page_size), seed=context)
                with timed(timer, runner.backend):
                    samples[model.label] += time_steps(runner, context, batch_size, warmup, steps, timer)
        for model, (mc, runner) in zip(models, runners):
            rows.append(summarize(model.label, context, samples[model.label], mc.kv_bytes_per_token(),
                                  design_bytes_per_token(mc, context, page_size)))
            # which indexer top-k ran (torch_native chooses at the first sparse step; "" where none ran)
            chosen = getattr(runner.backend, "index_topk_impl", None)
            rows[-1]["index_topk"] = chosen or ""
    rows.sort(key=lambda r: [m.label for m in models].index(r["model"]))
    return with_ratios(rows, models[0].label, min(contexts))


def design_bytes_per_token(mc, context: int, page_size: int | None = None) -> float:
    """Bytes per token a server keeps at ``context`` tokens of one request: V4's bounded layout
    as built (docs/kv-cache.md "What is built for DeepSeek-V4": compressed entries and index keys at
    their rate, the reusable boundaries' tails, one request's record spread over the context) in pages
    of ``page_size``. Other models: as built."""
    if not mc.state_regions:
        return float(mc.kv_bytes_per_token())
    return float(mc.kv_bytes_per_token(page_size=page_size, bounded=True, context=context))


def summarize(label: str, context: int, samples: list[dict], state_bytes: int, design_bytes: float) -> dict:
    """The best (fastest) timed step, as timeit reports: other processes only ever add time, so
    the minimum is the steadiest estimate on a shared machine. Attention and the indexer's share
    are those of that step."""
    best = min(samples, key=lambda s: s["step"])
    return {"model": label, "context": context, "step_ms": best["step"] * 1e3,
            "attention_ms": best.get("attention", 0.0) * 1e3,
            "indexer_share": best.get("indexer", 0.0) / best["step"], "state_bytes_per_token": state_bytes,
            "design_bytes_per_token": design_bytes}


def with_ratios(rows: list[dict], baseline: str, first_context: int) -> list[dict]:
    base = {r["context"]: r for r in rows if r["model"] == baseline}
    start = {r["model"]: r["step_ms"] for r in rows if r["context"] == first_context}
    for r in rows:
        r["vs_baseline"] = r["step_ms"] / base[r["context"]]["step_ms"]
        r["attention_vs_baseline"] = r["attention_ms"] / base[r["context"]]["attention_ms"]
        r["growth"] = r["step_ms"] / start[r["model"]]
        r["bytes_vs_baseline"] = r["state_bytes_per_token"] / base[r["context"]]["state_bytes_per_token"]
        r["design_bytes_vs_baseline"] = r["design_bytes_per_token"] / base[r["context"]]["design_bytes_per_token"]
    return rows


def table(rows: list[dict], baseline: str) -> str:
    out = [f"| model | context | step ms | step vs {baseline} | growth from {rows[0]['context']} | attention ms | "
           f"attention vs {baseline} | indexer share | state B/token (page layout) | vs {baseline} | "
           f"served B/token (V4 bounded) | vs {baseline} | indexer top-k |", "|---|" + "---:|" * 11 + "---|"]
    for r in rows:
        out.append(f"| {r['model']} | {r['context']} | {r['step_ms']:.2f} | {r['vs_baseline']:.2f}x | "
                   f"{r['growth']:.2f}x | {r['attention_ms']:.2f} | {r['attention_vs_baseline']:.2f}x | "
                   f"{r['indexer_share']:.0%} | {r['state_bytes_per_token']} | {r['bytes_vs_baseline']:.2f}x | "
                   f"{r['design_bytes_per_token']:.0f} | {r['design_bytes_vs_baseline']:.3f}x | "
                   f"{r.get('index_topk', '')} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 65536])
    p.add_argument("--batch-size", type=int, default=1, help="requests decoding together, each at the context")
    p.add_argument("--steps", type=int, default=4, help="timed decode steps per context")
    p.add_argument("--warmup", type=int, default=2, help="untimed decode steps first (the first rebuilds the stage)")
    p.add_argument("--repeats", type=int, default=3, help="rounds per context, the models taking turns")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--attention-backend", default="torch_native")
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--clock", choices=sorted(CLOCKS), default="cpu",
                   help="cpu: this process's CPU time (steadier on a shared machine, meant with --num-threads 1); "
                        "wall: elapsed time")
    p.add_argument("--json", action="store_true", help="print the rows as JSON lines too")
    args = p.parse_args(argv)
    if min(args.steps, args.repeats, args.batch_size) < 1 or args.warmup < 0:
        p.error("--steps, --repeats and --batch-size must be >= 1, --warmup >= 0")
    torch.set_num_threads(args.num_threads)
    rows = run(MODELS, sorted(args.contexts), args.batch_size, args.warmup, args.steps, args.repeats, args.page_size,
               args.attention_backend, args.clock)
    print(table(rows, MODELS[0].label))
    if args.json:
        for r in rows:
            print(json.dumps(r))


if __name__ == "__main__":
    main()
