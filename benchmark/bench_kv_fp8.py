"""What ``--kv-cache-dtype fp8_e4m3`` costs on the tiny presets: logprob drift and greedy
agreement against the full-precision KV cache (``auto``: float32 on CPU), and KV tokens per GiB.

    python benchmark/bench_kv_fp8.py --presets tiny-llama tiny-deepseek tiny-qwen3-moe \\
        --prompts 8 --prompt-len 48 --output-len 32

Per preset, one Engine per KV dtype (same random weights: same seed), radix cache off:

* greedy agreement: each prompt decoded greedily under both; the share of prompts whose first
  output token (read from prefill's KV only) is the same, the mean number of leading output
  tokens that agree before the first difference, and the share of whole outputs identical;
* logprob drift, teacher-forced: the full-precision run's prompt + output is scored by both
  (input logprobs from position 1), so both see the same tokens however their greedy outputs
  diverged; max and mean |logprob fp8 - logprob auto| over those tokens;
* KV bytes per token (``ModelConfig.kv_bytes_per_token``), tokens per GiB and the fp8 / auto ratio.

``--calibrate bfloat16 float16`` adds rows where the fp8 run's pool stores that dtype instead
(not a server flag: the storage dtype is swapped in this process), to show how much any KV
rounding moves these random-weight presets.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random

DTYPES = ("auto", "fp8_e4m3")


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def run_dtype(preset: str, kv_dtype: str, ids: list[list[int]], output_len: int, reference=None) -> dict:
    """Greedy outputs of ``ids`` and the teacher-forced logprobs of ``reference`` (or of its own outputs)."""
    from pdserve import Engine

    greedy = {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True}
    with Engine(model_path=preset, kv_cache_dtype=kv_dtype, disable_radix_cache=True, max_total_tokens=8192,
                random_seed=0) as engine:
        outs = [r["output_ids"] for r in engine.generate(input_ids=ids, sampling_params=greedy)]
        seqs = reference or [p + o for p, o in zip(ids, outs)]
        scored = engine.generate(input_ids=seqs, sampling_params={**greedy, "max_new_tokens": 1},
                                 return_logprob=True, logprob_start_len=0)
        kv_bytes = engine_kv_bytes(engine, kv_dtype)
    logprobs = [[lp for lp, _, _ in r["meta_info"]["input_token_logprobs"][1:]] for r in scored]
    return {"outputs": outs, "seqs": seqs, "logprobs": logprobs, "kv_bytes_per_token": kv_bytes}


def engine_kv_bytes(engine, kv_dtype: str) -> int:
    return engine.scheduler.model_config.kv_bytes_per_token(kv_dtype)


def _agreeing_prefix(x: list[int], y: list[int]) -> int:
    n = 0
    while n < min(len(x), len(y)) and x[n] == y[n]:
        n += 1
    return n


def compare(full: dict, fp8: dict) -> dict:
    pairs = list(zip(full["outputs"], fp8["outputs"]))
    diffs = [abs(a - b) for x, y in zip(full["logprobs"], fp8["logprobs"]) for a, b in zip(x, y)]
    gib = 1 << 30
    return {"first_token_agreement": sum(x[0] == y[0] for x, y in pairs) / len(pairs),
            "agreeing_prefix_tokens": sum(_agreeing_prefix(x, y) for x, y in pairs) / len(pairs),
            "output_len": len(pairs[0][0]),
            "identical_outputs": sum(x == y for x, y in pairs) / len(pairs),
            "max_abs_logprob_diff": max(diffs), "mean_abs_logprob_diff": sum(diffs) / len(diffs),
            "scored_tokens": len(diffs),
            "kv_bytes_per_token": {"auto": full["kv_bytes_per_token"], "fp8_e4m3": fp8["kv_bytes_per_token"]},
            "kv_tokens_per_gib": {k: gib // r["kv_bytes_per_token"] for k, r in (("auto", full), ("fp8_e4m3", fp8))},
            "kv_bytes_ratio": fp8["kv_bytes_per_token"] / full["kv_bytes_per_token"]}


def table(results: dict[str, dict]) -> str:
    rows = ["| preset | first token agrees | agreeing leading tokens | identical outputs | "
            "max / mean abs logprob drift (nats) | KV bytes/token auto → fp8 | KV tokens per GiB auto → fp8 | "
            "bytes ratio |",
            "|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        b, t = r["kv_bytes_per_token"], r["kv_tokens_per_gib"]
        rows.append(f"| {name} | {r['first_token_agreement']:.2f} | {r['agreeing_prefix_tokens']:.1f} of "
                    f"{r['output_len']} | {r['identical_outputs']:.2f} | "
                    f"{r['max_abs_logprob_diff']:.4f} / {r['mean_abs_logprob_diff']:.4f} | "
                    f"{b['auto']} → {b['fp8_e4m3']} | {t['auto']:,} → {t['fp8_e4m3']:,} | {r['kv_bytes_ratio']:.2f} |")
    return "\n".join(rows)


@contextlib.contextmanager
def storage_swapped(dtype_name: str):
    """The engine's "fp8_e4m3" pool stores ``dtype_name`` instead, for a calibration row."""
    import torch

    import pdserve.engine.model_runner as runner

    real = runner.kv_storage_dtype
    runner.kv_storage_dtype = lambda kv, model_dtype: getattr(torch, dtype_name) if kv == "fp8_e4m3" else model_dtype
    try:
        yield
    finally:
        runner.kv_storage_dtype = real


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["tiny-llama", "tiny-deepseek", "tiny-qwen3-moe"])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--output-file", default=None, help="JSON with every preset's figures")
    ap.add_argument("--calibrate", nargs="*", default=[], choices=["bfloat16", "float16"],
                    help="also rows with the 'fp8' pool storing this dtype (not a server option)")
    args = ap.parse_args()
    from pdserve.config import ModelConfig

    results = {}
    for preset in args.presets:
        vocab = ModelConfig.from_path(preset).vocab_size
        ids = prompts(args.prompts, args.prompt_len, vocab)
        full = run_dtype(preset, "auto", ids, args.output_len)
        fp8 = run_dtype(preset, "fp8_e4m3", ids, args.output_len, reference=full["seqs"])
        results[preset] = compare(full, fp8)
        for store in args.calibrate:
            with storage_swapped(store):
                other = run_dtype(preset, "fp8_e4m3", ids, args.output_len, reference=full["seqs"])
            row = compare(full, other)
            row["kv_bytes_ratio"] = 0.5  # the byte figures of a 2-byte pool, not of fp8
            row["kv_bytes_per_token"]["fp8_e4m3"] = full["kv_bytes_per_token"] // 2
            row["kv_tokens_per_gib"]["fp8_e4m3"] = (1 << 30) // row["kv_bytes_per_token"]["fp8_e4m3"]
            results[f"{preset} ({store} KV, calibration)"] = row
    print(table(results))
    if args.output_file:
        with open(args.output_file, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
