"""CPU decode, op by op and end to end: what ``--cpu-gemm`` (oneDNN-packed weights), bf16 and the
element-wise variants buy over the plain path, side by side in one run.

    python benchmark/bench_cpu_ops.py                      # ops, then end to end, both models
    python benchmark/bench_cpu_ops.py --parts ops --threads 1
    python benchmark/bench_cpu_ops.py --parts e2e --models tiny-llama --batch 32 --repeats 3

ops: each decode-shaped op of the two models at M rows (M = decode batch), timed as the best of
``--blocks`` blocks of repeated calls (the least disturbed by other load), microseconds:
  - GEMMs [M, K] x [N, K]^T: F.linear vs the packed oneDNN call, float32 and bfloat16, and which
    one ``--cpu-gemm auto`` picks (engine.device.PACK_FLOAT32 / PACK_BFLOAT16);
  - decode attention (one query row, L keys): SDPA vs torch_native's grouped matmuls;
  - add + RMSNorm, SiLU x mul, rotary: the eager torch code vs the same function under
    torch.compile, and the in-place SiLU x mul the layers' twin uses.
fused: the same element-wise ops, the torch twins vs the plain-C kernels the layers run on CPU
float32 (pdserve_kernels.fused_cpu), at decode and prefill row counts (``--rows 1 7 32 64 2048``),
at ``--threads`` (default: torch's, as the Engine runs the twins).
e2e: offline ``Engine.generate`` output tok/s (greedy, EOS ignored) of --cpu-gemm plain (the path
before packing), auto (the default) and auto with --dtype bfloat16, in alternating rounds, medians
with min..max, at the Engine's default threads unless --threads. Then the numbers that say whether
the fast paths change answers: greedy sequences equal to plain float32's, and bf16's logprob drift
against float32 over float32's own greedy continuations (teacher-forced).

Models: tiny-llama (hidden 256, 4 layers) and llama-512x8 (tiny-llama's config at hidden 512,
intermediate 1376, head dim 64, 8 layers), random weights at a scale whose greedy output does
not collapse to one repeated token.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

MODELS = {
    "tiny-llama": {},
    "llama-512x8": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8, head_dim=64),
}


# ---------------------------------------------------------------- models

def hf_config(name: str):
    from transformers import AutoConfig

    from pdserve.config import resolve_model_path

    path, _ = resolve_model_path("tiny-llama")
    cfg = AutoConfig.from_pretrained(str(path))
    for key, value in MODELS[name].items():
        setattr(cfg, key, value)
    return cfg


def save_model(name: str, out_dir: str, seed: int):
    """Matrices ~ N(0, 2.4^2 / fan_in) (the LM head 1 / fan_in), norms ~ 1 + N(0, 0.1^2): logits
    spread enough that greedy decoding does not repeat one token, so agreement counts mean something."""
    from transformers import AutoModelForCausalLM

    cfg = hf_config(name)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.dim() >= 2:
                p.copy_(noise * (1.0 if pname == "lm_head.weight" else 2.4) / p.shape[-1] ** 0.5)
            else:
                p.copy_(1.0 + 0.1 * noise)
    model.save_pretrained(out_dir)
    return cfg


# ---------------------------------------------------------------- ops

def best_us(calls: int, blocks: int, fn: Callable[..., object], *args, **kwargs) -> float:
    """Best block's mean microseconds per ``fn(*args, **kwargs)`` call (warm-up first)."""
    for _ in range(3):
        fn(*args, **kwargs)
    best = float("inf")
    for _ in range(blocks):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(*args, **kwargs)
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def gemm_shapes(cfg) -> dict[str, tuple[int, int]]:
    """Projection name -> (K, N) of a single-rank decoder layer and the LM head."""
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    H, Hq, Hkv, I = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    return {"qkv": (H, (Hq + 2 * Hkv) * D), "o": (Hq * D, H), "gate_up": (H, 2 * I), "down": (I, H),
            "lm_head": (H, cfg.vocab_size)}


def bench_gemms(cfg, rows: list[int], calls: int, blocks: int) -> list[dict]:
    from pdserve.engine.device import PACK_BFLOAT16, PACK_FLOAT32
    from pdserve.layers.cpu_gemm import PACK_ALWAYS, PackedLinear

    out = []
    for name, (K, N) in gemm_shapes(cfg).items():
        w = torch.randn(N, K)
        for m in rows:
            x = torch.randn(m, K)
            row = {"op": f"{name} {K}x{N}", "M": m}
            for dtype, policy, tag in ((torch.float32, PACK_FLOAT32, "f32"), (torch.bfloat16, PACK_BFLOAT16, "bf16")):
                wd, xd = w.to(dtype), x.to(dtype)
                packed = PackedLinear(wd, PACK_ALWAYS)
                row[f"{tag} F.linear"] = best_us(calls, blocks, F.linear, xd, wd)
                row[f"{tag} packed"] = best_us(calls, blocks, packed, xd)
                row[f"{tag} auto"] = "packed" if policy.pays(m, w.numel()) else "F.linear"
            out.append(row)
    return out


def bench_attention(cfg, rows: list[int], kv_len: int, calls: int, blocks: int) -> list[dict]:
    from pdserve.layers.attention.torch_native import _attend_grouped

    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    Hq, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    out = []
    for b in rows:
        q, k, v = torch.randn(b, Hq, 1, D), torch.randn(b, Hkv, kv_len, D), torch.randn(b, Hkv, kv_len, D)
        lens = torch.randint(kv_len // 2, kv_len + 1, (b,), generator=torch.Generator().manual_seed(0))
        mask = torch.arange(kv_len)[None, None, None, :] < lens[:, None, None, None]  # [B, 1, 1, L]
        row = {"op": f"decode attention L={kv_len}", "M": b}
        for dtype, tag in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
            qd, kd, vd = q.to(dtype), k.to(dtype), v.to(dtype)
            row[f"{tag} SDPA"] = best_us(calls, blocks, F.scaled_dot_product_attention, qd, kd, vd,
                                         attn_mask=mask, scale=D ** -0.5, enable_gqa=Hq != Hkv)
            row[f"{tag} grouped"] = best_us(calls, blocks, _attend_grouped, qd, kd, vd, mask, D ** -0.5)
        out.append(row)
    return out


def _add_rmsnorm(x, residual, w):
    s = x + residual
    return F.rms_norm(s, (s.shape[-1],), w, 1e-6), s


def _silu_mul(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def bench_elementwise(cfg, rows: list[int], calls: int, blocks: int) -> list[dict]:
    """The layers' own eager functions vs the same under torch.compile (static shapes)."""
    from pdserve.layers.activation import silu_and_mul
    from pdserve.layers.rotary import get_rope

    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    H, Hq, Hkv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    rope = get_rope(D, 4096, {"rope_type": "default", "rope_theta": 10000.0})
    ops = {"add+rmsnorm": _add_rmsnorm, "silu*mul": _silu_mul, "rotary": lambda x, c, s: rope.rotate(x, c, s)}
    compiled = {name: torch.compile(fn, dynamic=False) for name, fn in ops.items()}
    out = []
    for m in rows:
        cos, sin = rope.lookup(torch.arange(m) + 100)
        args = {"add+rmsnorm": (torch.randn(m, H), torch.randn(m, H), torch.randn(H)),
                "silu*mul": (torch.randn(m, 2 * cfg.intermediate_size),),
                "rotary": (torch.randn(m, Hq + Hkv, D), cos, sin)}
        for name, fn in ops.items():
            a = args[name]
            row = {"op": name, "M": m, "eager": best_us(calls, blocks, fn, *a),
                   "compiled": best_us(calls, blocks, compiled[name], *a)}
            if name == "silu*mul":
                row["in-place (layers)"] = best_us(calls, blocks, silu_and_mul, *a)
            out.append(row)
    return out


def print_rows(title: str, rows: list[dict]) -> None:
    print(f"\n## {title}")
    keys = list(dict.fromkeys(k for r in rows for k in r))
    print(" | ".join(keys))
    for r in rows:
        cells = (r.get(k, "") for k in keys)
        print(" | ".join(f"{c:.1f}" if isinstance(c, float) else str(c) for c in cells))


def gemm_speedups(rows: list[dict]) -> None:
    for tag in ("f32", "bf16"):
        picked = [r[f"{tag} F.linear"] / min(r[f"{tag} F.linear"], r[f"{tag} packed"])
                  if r[f"{tag} auto"] == "packed" else 1.0 for r in rows]
        print(f"{tag}: auto's speedup over F.linear per GEMM: median {statistics.median(picked):.2f}x "
              f"({min(picked):.2f}..{max(picked):.2f})")


# ---------------------------------------------------------------- end to end

VARIANTS = {"plain f32": dict(cpu_gemm="plain"), "auto f32": dict(cpu_gemm="auto"),
            "auto bf16": dict(cpu_gemm="auto", dtype="bfloat16")}


def build_engines(model_dir: str, args: argparse.Namespace) -> dict:
    import pdserve

    extra = {"num_threads": args.threads} if args.threads else {}
    return {name: pdserve.Engine(model_path=model_dir, tokenizer_path=None, disable_radix_cache=True,
                                 max_running_requests=args.batch, **kw, **extra) for name, kw in VARIANTS.items()}


def generate(engine, prompts, n: int, **kw):
    sp = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
    return engine.generate(input_ids=prompts, sampling_params=sp, **kw)


def e2e(name: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as d:
        cfg = save_model(name, d, args.seed)
        engines = build_engines(d, args)
        g = torch.Generator().manual_seed(args.seed)
        prompts = torch.randint(3, cfg.vocab_size, (args.batch, args.prompt_len), generator=g).tolist()
        for e in engines.values():
            generate(e, prompts[:2], 4)  # warm-up
        rates: dict[str, list[float]] = {v: [] for v in engines}
        outs: dict[str, list] = {}
        for _ in range(args.repeats):
            for v, e in engines.items():  # alternating rounds: load hits every variant alike
                t0 = time.perf_counter()
                outs[v] = generate(e, prompts, args.output_len)
                rates[v].append(args.batch * args.output_len / (time.perf_counter() - t0))
        threads = torch.get_num_threads()
        drift = logprob_drift(engines, prompts, [o["output_ids"] for o in outs["plain f32"]])
        for e in engines.values():
            e.shutdown()
    ref = [o["output_ids"] for o in outs["plain f32"]]
    same = {v: sum(o["output_ids"] == r for o, r in zip(outs[v], ref)) for v in engines}
    prefix = {v: statistics.mean(common_prefix(o["output_ids"], r) for o, r in zip(outs[v], ref)) for v in engines}
    return {"model": name, "threads": threads, "tok_s": rates, "greedy_equal_to_plain_f32": same,
            "mean_common_prefix": prefix, "sequences": len(ref), "output_len": args.output_len, **drift}


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def logprob_drift(engines: dict, prompts, continuations) -> dict:
    """Teacher-forced over float32's greedy continuations: |logprob(bf16) - logprob(f32)| of each
    continuation token, and how often the packed float32 path moves a logprob at all."""
    full = [p + c for p, c in zip(prompts, continuations)]
    start = len(prompts[0])

    def lps(e):
        res = e.generate(input_ids=full, sampling_params={"max_new_tokens": 1, "temperature": 0},
                         return_logprob=True, logprob_start_len=start)
        return torch.tensor([[lp for lp, _, _ in r["meta_info"]["input_token_logprobs"]] for r in res])

    base = lps(engines["plain f32"])
    out = {}
    for v in ("auto f32", "auto bf16"):
        diff = (lps(engines[v]) - base).abs()
        out[f"logprob_drift {v} vs plain f32"] = {"max": diff.max().item(), "mean": diff.mean().item()}
    return out


def print_e2e(r: dict) -> None:
    print(f"\n## end to end: {r['model']} (threads {r['threads']}; {r['sequences']} sequences)")
    base = r["tok_s"]["plain f32"]
    for v, xs in r["tok_s"].items():
        ratios = [x / b for x, b in zip(xs, base)]  # per round: plain and the variant ran back to back
        print(f"{v:>10}: {statistics.median(xs):8.1f} tok/s ({min(xs):.0f}..{max(xs):.0f})  "
              f"x{statistics.median(ratios):.2f} ({min(ratios):.2f}..{max(ratios):.2f}) vs plain f32 per round   "
              f"greedy equal to plain f32: "
              f"{r['greedy_equal_to_plain_f32'][v]}/{r['sequences']} (same first "
              f"{r['mean_common_prefix'][v]:.1f} of {r['output_len']} tokens on average)")
    for key in [k for k in r if k.startswith("logprob_drift")]:
        print(f"{key}: max {r[key]['max']:.2e}, mean {r[key]['mean']:.2e}")


def bench_fused(cfg, rows: list[int], calls: int, blocks: int) -> list[dict]:
    """Each element-wise op's torch twin vs its fused C kernel, microseconds."""
    from pdserve.layers.activation import silu_and_mul_torch
    from pdserve.layers.norm import rms_norm_torch
    from pdserve.layers.rotary import get_rope, rotate_halves
    from pdserve_kernels import fused_cpu

    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    H, Hq, Hkv, I = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    rope = get_rope(D, 4096, {"rope_type": "default", "rope_theta": 10000.0})
    out = []
    for m in rows:
        rot = rope.rotation(torch.arange(m) % 4096)
        x, res, w = torch.randn(m, H), torch.randn(m, H), torch.randn(H)
        qk = torch.randn(m, (Hq + 2 * Hkv) * D)[:, :(Hq + Hkv) * D].view(m, Hq + Hkv, D)  # the layer's view
        gate_up = torch.randn(m, 2 * I)
        ops = {"add+rmsnorm": ((rms_norm_torch, x, w, 1e-6, res), (fused_cpu.rms_norm, x, w, 1e-6, res)),
               "rotary q+k": ((rotate_halves, qk, *rot.halves, D), (fused_cpu.rotate, qk, rot.cos, rot.sin, D, False)),
               "silu*mul": ((silu_and_mul_torch, gate_up), (fused_cpu.silu_and_mul, gate_up))}
        for name, (twin, fused) in ops.items():
            t, f = best_us(calls, blocks, *twin), best_us(calls, blocks, *fused)
            limit = fused_cpu.SILU_MAX_ELEMENTS if name == "silu*mul" else fused_cpu.MAX_ELEMENTS
            out.append({"op": name, "M": m, "torch": t, "fused C": f, "speedup": t / f,
                        "layers run": "fused C" if fused[1].numel() <= limit else "torch"})
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", default=["ops", "e2e"], choices=["ops", "e2e", "fused"])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32], help="ops: M (decode batch sizes)")
    ap.add_argument("--kv-len", type=int, default=128, help="ops: keys per request for decode attention")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--blocks", type=int, default=15)
    ap.add_argument("--threads", type=int, default=None, help="default: ops 1; e2e the Engine's default")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="also print each table as one JSON line")
    args = ap.parse_args(argv)
    print(f"torch {torch.__version__}, cpu {torch.backends.cpu.get_cpu_capability()}, "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if "ops" in args.parts:
        torch.set_num_threads(args.threads or 1)
        with torch.inference_mode():
            for name in args.models:
                cfg = hf_config(name)
                attn = bench_attention(cfg, args.rows, args.kv_len, args.calls, args.blocks)
                tables = {"GEMMs (us)": bench_gemms(cfg, args.rows, args.calls, args.blocks),
                          "decode attention (us)": attn,
                          "element-wise (us)": bench_elementwise(cfg, args.rows, args.calls, args.blocks)}
                for title, rows in tables.items():
                    print_rows(f"{name}: {title}, threads {torch.get_num_threads()}", rows)
                    if args.json:
                        print(json.dumps({"model": name, "table": title, "rows": rows}))
                gemm_speedups(tables["GEMMs (us)"])
    if "fused" in args.parts:
        if args.threads:
            torch.set_num_threads(args.threads)
        with torch.inference_mode():
            for name in args.models:
                rows = bench_fused(hf_config(name), args.rows, args.calls, args.blocks)
                print_rows(f"{name}: element-wise, torch vs fused C (us), threads {torch.get_num_threads()}", rows)
                if args.json:
                    print(json.dumps({"model": name, "table": "fused", "rows": rows}))
    if "e2e" in args.parts:
        for name in args.models:
            r = e2e(name, args)
            print_e2e(r)
            if args.json:
                print(json.dumps(r))
    print(f"\nload average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
