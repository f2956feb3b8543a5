"""pdserve's offline Engine at several thread settings, side by side: which layout wins on this machine.

    python benchmark/bench_threads.py --models tiny-llama --variants default 1 2 --rounds 3

Each variant is an Engine in its own interpreter (``peer_worker.py``, as bench_peer.py runs it):
``default`` is the Engine's own ``ThreadLayout`` (``/get_server_info``'s ``thread_layout``), a
number N is ``num_threads=N`` (every forward on N threads); either with ``+compile`` appended also
runs ``enable_torch_compile`` (``default+compile``), whose start-up (compile included) is reported.
Every round sends one fresh prompt set (bench_peer.py's prompts: no shared prefixes) to each
variant in turn, the order rotating per
round, so load from other processes hits each alike. Reports per variant the median (min-max) of
output tok/s and of CPU-seconds per 1,000 output tokens (the worker's process tree), and each
variant's per-round ratio to the first. Greedy outputs must agree between variants on the first
round's prompts (packed GEMMs and thread counts change float summation order only; a rare
near-tie can still flip a token, which is reported, not hidden).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_peer import DEFAULT_MODELS, MODELS, Worker, make_prompts, model_dir  # noqa: E402


def run(a: argparse.Namespace, name: str) -> None:
    mdir = model_dir(name, Path(a.model_dir), a.seed)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(mdir).vocab_size
    workers: dict[str, Worker] = {}
    try:
        log = sys.stderr if a.verbose else subprocess.DEVNULL
        for v in a.variants:
            workers[v] = Worker(sys.executable, "pdserve", mdir, a.batch, {}, log, _worker_flags(v))
        tok_s: dict[str, list[float]] = {v: [] for v in workers}
        cpu: dict[str, list[float]] = {v: [] for v in workers}
        outputs: dict[str, list] = {}
        order = list(workers)
        for r in range(a.rounds):
            prompts = make_prompts(a.num_prompts, tuple(a.input_len), vocab, a.seed + r)
            for v in order[r % len(order):] + order[:r % len(order)]:
                outs, wall, secs = workers[v].generate(prompts, a.output_len)
                tokens = sum(map(len, outs))
                tok_s[v].append(tokens / wall)
                cpu[v].append(secs / tokens * 1000)
                if r == 0:
                    outputs[v] = outs
    finally:
        for w in workers.values():
            w.close()
    first = a.variants[0]
    print(f"\n## {name}: {a.num_prompts} prompts of {a.input_len[0]}-{a.input_len[1]} tokens, {a.output_len} "
          f"output tokens, batch {a.batch}, {a.rounds} rounds; load average {_load()}")
    print(f"| variant | tok/s | vs {first} per round | CPU-s / 1k tokens | greedy = {first} | start-up s |\n"
          "|---|---|---|---|---|---|")
    for v in workers:
        ratios = [x / y for x, y in zip(tok_s[v], tok_s[first])]
        same = sum(x == y for x, y in zip(outputs[v], outputs[first]))
        print(f"| {v} | {_cell(tok_s[v], '.0f')} | **{statistics.median(ratios):.2f}** ({min(ratios):.2f}-"
              f"{max(ratios):.2f}) | {_cell(cpu[v], '.2f')} | {same}/{len(outputs[first])} | "
              f"{workers[v].startup_s:.1f} |")


def _worker_flags(variant: str) -> tuple[str, ...]:
    threads, _, compiled = variant.partition("+")
    flags = () if threads == "default" else ("--num-threads", threads)
    return flags + (("--enable-torch-compile",) if compiled else ())


def _valid_variant(v: str) -> bool:
    threads, plus, compiled = v.partition("+")
    return (threads == "default" or (threads.isdigit() and int(threads) > 0)) and (not plus or compiled == "compile")


def _cell(xs: list[float], fmt: str) -> str:
    return f"{format(statistics.median(xs), fmt)} ({format(min(xs), fmt)}-{format(max(xs), fmt)})"


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--variants", nargs="+", default=["default", "1", "2"],
                    help="'default' (the Engine's layout) or a torch thread count, optionally '+compile' "
                         "(enable_torch_compile); the first is the reference")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, nargs=2, default=[64, 256], metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-dir", default=str(DEFAULT_MODELS))
    ap.add_argument("--verbose", action="store_true", help="the workers' logs on stderr")
    a = ap.parse_args(argv)
    bad = [v for v in a.variants if not _valid_variant(v)]
    if bad:
        ap.error(f"--variants: expected 'default' or a positive thread count, optionally +compile, got {bad}")
    for name in a.models:
        run(a, name)


if __name__ == "__main__":
    main()
