"""Output tokens/s of pdserve's offline Engine vs transformers' ``generate`` on the same
random-weight model, side by side in one run, same thread count.

    python benchmark/bench_engine.py --model tiny-llama --batch-sizes 1 8 32 --enable-torch-compile

Both get identical prompts of equal length (so transformers' batch needs no
padding beyond its static shape) and generate exactly ``--output-len`` tokens
greedily (EOS ignored). Rounds alternate pdserve, HF, pdserve, ... so load from
other processes hits both alike; each side's tokens/s is reported as the median
over ``--repeats`` rounds (with min..max), and the ratio pdserve / HF as the
median of the per-round ratios. With ``--enable-torch-compile`` the Engine
compiles its decode buckets up to the largest batch size first, and that
warm-up time is printed.

``--against plain-loop`` puts pdserve's own plain loop (``--disable-overlap-schedule``) in HF's
place, to measure overlap scheduling; without ``--threads`` each side then runs its default
thread layout (overlap leaves the scheduler thread a core).

    python benchmark/bench_engine.py --model tiny-llama --batch-sizes 32 --against plain-loop
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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
    layout = getattr(engine.scheduler, "thread_layout", None)
    if layout is not None:  # one process, two engines: each round runs its engine's own threads
        torch.set_num_threads(layout.torch_threads)
    sp = {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    res = engine.generate(input_ids=prompts, sampling_params=sp)
    dt = time.perf_counter() - t0
    assert all(len(r["output_ids"]) == output_len for r in res)
    return dt


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-llama", help="a built-in preset name")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads of both sides (default: torch's for HF, the Engine's own layout)")
    ap.add_argument("--against", choices=["hf", "plain-loop"], default="hf",
                    help="the reference: transformers' generate, or pdserve with --disable-overlap-schedule")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds per side and batch size (alternating)")
    ap.add_argument("--enable-torch-compile", action="store_true",
                    help="pdserve compiles its decode steps (buckets up to the largest batch size)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="also print one JSON line per batch size")
    return ap.parse_args(argv)


def build_engine(args: argparse.Namespace, model_dir: str, **flags):
    """The Engine under test, and its start-up seconds (which include compiling, if enabled)."""
    import pdserve

    t0 = time.perf_counter()
    engine = pdserve.Engine(model_path=model_dir, tokenizer_path=None, page_size=args.page_size, **flags,
                            disable_radix_cache=True, num_threads=args.threads,
                            max_running_requests=max(args.batch_sizes),
                            enable_torch_compile=args.enable_torch_compile,
                            torch_compile_max_bs=max(args.batch_sizes))
    return engine, time.perf_counter() - t0


def measure(engine, hf, prompts, args: argparse.Namespace) -> tuple[list[float], list[float]]:
    """Alternating rounds: (pdserve tok/s per round, reference tok/s per round); ``hf``: transformers'
    model, or a plain-loop Engine."""
    def time_ref(p, n):
        return time_pdserve(hf, p, n) if hasattr(hf, "scheduler") else time_hf(hf, p, n)

    time_pdserve(engine, prompts[:1], 4)  # warm-up
    time_ref(prompts[:1], 4)
    tokens = len(prompts) * args.output_len
    pd, ref = [], []
    for _ in range(args.repeats):
        pd.append(tokens / time_pdserve(engine, prompts, args.output_len))
        ref.append(tokens / time_ref(prompts, args.output_len))
    return pd, ref


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):8.1f} ({min(xs):.0f}..{max(xs):.0f})"


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as d:
        hf, cfg = build_hf_model(args.model, d, args.seed)
        engine, startup_s = build_engine(args, d)
        ref_name = "HF"
        if args.against == "plain-loop":
            hf, _ = build_engine(args, d, disable_overlap_schedule=True)
            ref_name = "plain loop"
            for side, e in (("overlap", engine), ("plain loop", hf)):
                print(f"{side}: overlap_schedule={e.scheduler.overlap} threads={e.scheduler.thread_layout}")
        compiled = engine.scheduler.runner.compiled
        print(f"model={args.model} threads={args.threads} prompt_len={args.prompt_len} output_len={args.output_len} "
              f"page_size={args.page_size} torch_compile={'on' if compiled else 'off'} repeats={args.repeats} "
              f"load_average={' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        if compiled is not None:
            print(f"compile warm-up: {compiled.warmup_s:.1f} s for buckets {list(compiled.config.buckets)} "
                  f"(Engine start-up {startup_s:.1f} s)")
        print(f"{'batch':>5} {'pdserve tok/s (min..max)':>26} {ref_name + ' tok/s (min..max)':>26} "
              f"{'ratio (min..max)':>18}")
        for bs in args.batch_sizes:
            prompts = make_prompts(bs, args.prompt_len, cfg.vocab_size, args.seed + bs)
            pd, ref = measure(engine, hf, prompts, args)
            ratios = [p / r for p, r in zip(pd, ref)]
            print(f"{bs:>5} {spread(pd):>26} {spread(ref):>26} "
                  f"{statistics.median(ratios):6.2f}x ({min(ratios):.2f}..{max(ratios):.2f})")
            if args.json:
                print(json.dumps({"batch": bs, "pdserve_tok_s": pd, "hf_tok_s": ref, "ratios": ratios,
                                  "torch_compile": compiled is not None}))
        print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        engine.shutdown()
        if hasattr(hf, "shutdown"):
            hf.shutdown()


if __name__ == "__main__":
    main()
