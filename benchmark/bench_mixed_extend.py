"""Prefill of mixed prompt lengths in one batch vs each length apart (torch_native, offline Engine).

    python benchmark/bench_mixed_extend.py --models tiny-llama tiny-deepseek --num-threads 1

One long prompt and a few short ones (fresh ids each round, no shared prefixes), one output token
each: the time of all of them in one ``generate`` beside the long one alone plus the short ones
together. Prints the median over rounds and the ratio together / apart (1.0: mixing costs nothing).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time


def prompts(lens: list[int], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[10 + i] + [rng.randrange(10, vocab) for _ in range(n - 1)] for i, n in enumerate(lens)]


def timed(engine, ids: list[list[int]]) -> float:
    t = time.perf_counter()
    engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0.0})
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["tiny-llama", "tiny-deepseek"])
    p.add_argument("--long", type=int, default=1500)
    p.add_argument("--short", type=int, default=128)
    p.add_argument("--num-short", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-threads", type=int, default=1)
    a = p.parse_args()
    import pdserve

    for name in a.models:
        with pdserve.Engine(model_path=name, num_threads=a.num_threads, disable_radix_cache=True) as engine:
            vocab = engine.scheduler.model_config.vocab_size
            timed(engine, prompts([a.short], vocab, 0))  # warm-up
            mixed, apart = [], []
            for r in range(a.rounds):
                ids = prompts([a.long] + [a.short] * a.num_short, vocab, r + 1)
                apart.append(timed(engine, ids[:1]) + timed(engine, ids[1:]))
                mixed.append(timed(engine, ids))
            m, s = statistics.median(mixed), statistics.median(apart)
            print(f"{name}: {a.long} + {a.num_short}x{a.short} tokens together {m:.3f} s, apart {s:.3f} s, "
                  f"ratio {m / s:.2f} (median of {a.rounds})", flush=True)


if __name__ == "__main__":
    main()
