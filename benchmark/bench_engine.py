"""Output tokens/s of pdserve's offline Engine vs transformers' ``generate`` on the same
random-weight model, side by side in one run, same thread count.

    python benchmark/bench_engine.py --model tiny-llama --batch-sizes 1 8 32

Both get identical prompts of equal length (so transformers' batch needs no
padding beyond its static shape) and generate exactly ``--output-len`` tokens
greedily (EOS ignored). Prints tokens/s for each and the ratio pdserve / HF.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch


def build_hf_model(preset: str, out_dir: str, seed: int):
    """Random weights from the preset's config, saved so pdserve loads the very same tensors."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pdserve.config import resolve_model_path

    path, _ = resolve_model_path(preset)
    cfg = AutoConfig.from_pretrained(str(path))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.save_pretrained(out_dir)
    return model, cfg


def make_prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 1, (batch, prompt_len), generator=g).tolist()


def time_hf(model, prompts, output_len: int) -> float:
    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=output_len,
                             min_new_tokens=output_len, do_sample=False, pad_token_id=0)
        dt = time.perf_counter() - t0
    assert out.shape[1] - ids.shape[1] == output_len
    return dt


def time_pdserve(engine, prompts, output_len: int) -> float:
    sp = {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    res = engine.generate(input_ids=prompts, sampling_params=sp)
    dt = time.perf_counter() - t0
    assert all(len(r["output_ids"]) == output_len for r in res)
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-llama", help="a built-in preset name")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="also print one JSON line per batch size")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import pdserve

    with tempfile.TemporaryDirectory() as d:
        hf, cfg = build_hf_model(args.model, d, args.seed)
        engine = pdserve.Engine(model_path=d, tokenizer_path=None, page_size=args.page_size,
                                disable_radix_cache=True, num_threads=args.threads,
                                max_running_requests=max(args.batch_sizes))
        print(f"model={args.model} threads={args.threads} prompt_len={args.prompt_len} "
              f"output_len={args.output_len} page_size={args.page_size}")
        print(f"{'batch':>5} {'pdserve tok/s':>14} {'HF tok/s':>10} {'ratio':>7}")
        for bs in args.batch_sizes:
            prompts = make_prompts(bs, args.prompt_len, cfg.vocab_size, args.seed + bs)
            time_pdserve(engine, prompts[:1], 4)  # warm-up
            time_hf(hf, prompts[:1], 4)
            tp = bs * args.output_len / time_pdserve(engine, prompts, args.output_len)
            th = bs * args.output_len / time_hf(hf, prompts, args.output_len)
            print(f"{bs:>5} {tp:>14.1f} {th:>10.1f} {tp / th:>6.2f}x")
            if args.json:
                print(json.dumps({"batch": bs, "pdserve_tok_s": tp, "hf_tok_s": th, "ratio": tp / th}))
        engine.shutdown()


if __name__ == "__main__":
    main()
