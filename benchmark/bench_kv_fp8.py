"""What ``--kv-cache-dtype fp8_e4m3`` costs on the tiny presets: logprob drift and greedy
agreement against the full-precision KV cache (``auto``: float32 on CPU), and KV tokens per GiB.

    python benchmark/bench_kv_fp8.py --presets tiny-llama tiny-deepseek tiny-qwen3-moe \\
        --prompts 8 --prompt-len 48 --output-len 32

Per preset, one Engine per KV dtype (same random weights: same seed), radix cache off:

* greedy agreement: each prompt decoded greedily under both; the share of output positions
  where fp8 picks the same token, and the share of prompts whose whole output is identical;
* logprob drift, teacher-forced: the full-precision run's prompt + output is scored by both
  (input logprobs from position 1), so both see the same tokens however their greedy outputs
  diverged; max and mean |logprob fp8 - logprob auto| over those tokens;
* KV bytes per token (``ModelConfig.kv_bytes_per_token``), tokens per GiB and the fp8 / auto ratio.
"""

from __future__ import annotations

import argparse
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


def compare(full: dict, fp8: dict) -> dict:
    pos = [a == b for x, y in zip(full["outputs"], fp8["outputs"]) for a, b in zip(x, y)]
    diffs = [abs(a - b) for x, y in zip(full["logprobs"], fp8["logprobs"]) for a, b in zip(x, y)]
    gib = 1 << 30
    return {"greedy_token_agreement": sum(pos) / len(pos),
            "identical_outputs": sum(x == y for x, y in zip(full["outputs"], fp8["outputs"])) / len(full["outputs"]),
            "max_abs_logprob_diff": max(diffs), "mean_abs_logprob_diff": sum(diffs) / len(diffs),
            "scored_tokens": len(diffs),
            "kv_bytes_per_token": {"auto": full["kv_bytes_per_token"], "fp8_e4m3": fp8["kv_bytes_per_token"]},
            "kv_tokens_per_gib": {"auto": gib // full["kv_bytes_per_token"], "fp8_e4m3": gib // fp8["kv_bytes_per_token"]},
            "kv_bytes_ratio": fp8["kv_bytes_per_token"] / full["kv_bytes_per_token"]}


def table(results: dict[str, dict]) -> str:
    rows = ["| preset | greedy token agreement | identical outputs | max / mean abs logprob drift | "
            "KV bytes/token auto → fp8 | KV tokens per GiB auto → fp8 | bytes ratio |",
            "|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        b, t = r["kv_bytes_per_token"], r["kv_tokens_per_gib"]
        rows.append(f"| {name} | {r['greedy_token_agreement']:.3f} | {r['identical_outputs']:.2f} | "
                    f"{r['max_abs_logprob_diff']:.4f} / {r['mean_abs_logprob_diff']:.4f} | "
                    f"{b['auto']} → {b['fp8_e4m3']} | {t['auto']:,} → {t['fp8_e4m3']:,} | {r['kv_bytes_ratio']:.2f} |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["tiny-llama", "tiny-deepseek", "tiny-qwen3-moe"])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--output-file", default=None, help="JSON with every preset's figures")
    args = ap.parse_args()
    from pdserve.config import ModelConfig

    results = {}
    for preset in args.presets:
        vocab = ModelConfig.from_path(preset).vocab_size
        ids = prompts(args.prompts, args.prompt_len, vocab)
        full = run_dtype(preset, "auto", ids, args.output_len)
        fp8 = run_dtype(preset, "fp8_e4m3", ids, args.output_len, reference=full["seqs"])
        results[preset] = compare(full, fp8)
    print(table(results))
    if args.output_file:
        with open(args.output_file, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
