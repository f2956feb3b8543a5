"""The steps of benchmark/gpu_check.sh that need Python: versions, backend agreement on the tiny
presets, serving them (colocated and 1P1D), decode attention bandwidth vs the HBM roofline, and
the engine's decode tokens/s.

    python benchmark/gpu_bench.py versions
    python benchmark/gpu_bench.py agree
    python benchmark/gpu_bench.py serve
    python benchmark/gpu_bench.py bandwidth [--smoke]
    python benchmark/gpu_bench.py decode
    python benchmark/gpu_bench.py speculative
    python benchmark/gpu_bench.py fp8 [--smoke]

``bandwidth --smoke`` and ``fp8 --smoke`` run the same code on CPU under the Triton interpreter
with tiny shapes (what ``gpu_check.sh --dry-run`` exercises); their numbers mean nothing.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import sys
import time
import urllib.request

PRESETS = ("tiny-llama", "tiny-qwen3-moe", "tiny-deepseek")
PROMPTS = ["The capital of France is", "1 2 3 4 5 6", "Hello, my name is", "def f(x):"]
# Peak HBM bandwidth (bytes/s) of the GPUs this script is sized for; --hbm-tbps overrides.
HBM_PEAK = {"H200": 4.8e12, "H100": 3.35e12, "H20": 4.0e12, "A100": 2.0e12}


def cmd_versions(_ns) -> None:
    import torch

    print(f"python {sys.version.split()[0]}  torch {torch.__version__}  cuda {torch.version.cuda}")
    for pkg in ("triton", "flashinfer-python", "mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda",
                "deep_ep", "deep_gemm"):
        try:
            print(f"{pkg} {importlib.metadata.version(pkg)}")
        except importlib.metadata.PackageNotFoundError:
            print(f"{pkg} (not installed)")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            print(f"GPU {i}: {p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs")
    else:
        print("GPU: none visible to torch")


def _greedy(preset: str, backend: str, dtype: str) -> list[list[int]]:
    from pdserve import Engine

    with Engine(preset, device="cuda", attention_backend=backend, dtype=dtype, page_size=16,
                max_total_tokens=4096) as engine:
        outs = engine.generate(PROMPTS, sampling_params={"max_new_tokens": 16, "temperature": 0.0,
                                                          "ignore_eos": True})
    return [o["output_ids"] for o in outs]


def cmd_agree(_ns) -> int:
    """fp32: every backend's greedy tokens equal torch_native's. bf16: the share of equal tokens."""
    failed = 0
    for preset in PRESETS:
        for dtype in ("float32", "bfloat16"):
            ref = _greedy(preset, "torch_native", dtype)
            for backend in ("triton", "flashinfer"):
                got = _greedy(preset, backend, dtype)
                same = sum(a == b for r, g in zip(ref, got) for a, b in zip(r, g)) / sum(map(len, ref))
                ok = same == 1.0 or dtype == "bfloat16"
                failed += not ok
                print(f"agree {preset:15s} {dtype:8s} {backend:10s} tokens equal to torch_native: {same:6.1%}"
                      f"{'' if ok else '  FAIL'}")
    return 1 if failed else 0


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def cmd_serve(_ns) -> int:
    """A dummy-weight tiny GQA and MLA model served on one GPU, colocated and as 1P1D; one request each."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from servers import free_port, start, stop, wait_healthy

    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    failed = 0
    for preset in ("tiny-llama", "tiny-deepseek"):
        for how, argv in (("colocated", ["serve"]), ("1P1D", ["up", "--num-prefill", "1", "--num-decode", "1"])):
            port = free_port()
            proc = start([*argv, "--model-path", preset, "--device", "cuda", "--port", str(port),
                          "--max-total-tokens", "4096"])
            try:
                wait_healthy(f"http://127.0.0.1:{port}", proc, timeout=300)
                out = _post(f"http://127.0.0.1:{port}/generate", body)
                print(f"serve {preset:15s} {how:9s} ok: {out['meta_info']['completion_tokens']} tokens")
            except Exception as e:  # report and go on: the script's summary counts failures
                failed += 1
                print(f"serve {preset:15s} {how:9s} FAIL: {e}")
            finally:
                stop(proc)
    return 1 if failed else 0


def _time_cuda(fn, repeats: int) -> float:
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def _time_cpu(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _peak(ns) -> float | None:
    import torch

    if ns.hbm_tbps:
        return ns.hbm_tbps * 1e12
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_properties(0).name
    return next((v for k, v in HBM_PEAK.items() if k in name), None)


def cmd_bandwidth(ns) -> int:
    """Decode attention reading the pools in place: bytes moved / time, against the HBM peak."""
    import torch

    if ns.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from pdserve_kernels import decode_attention as da

    dev = "cpu" if ns.smoke else "cuda"
    dtype = torch.float32 if ns.smoke else torch.bfloat16
    B, L, S = (2, 48, 16) if ns.smoke else (ns.batch, ns.context, 64)
    H, C, R = (3, 16, 8) if ns.smoke else (ns.mla_heads, 512, 64)
    Hq, Hkv, D = (4, 2, 16) if ns.smoke else (32, 8, 128)
    pages = B * L // S
    slots = torch.arange(B * L, device=dev).view(B, L)  # each request its own pages, in order
    seq = torch.full((B,), L, device=dev)
    timer = _time_cpu if ns.smoke else _time_cuda
    peak = _peak(ns)
    item = torch.tensor([], dtype=dtype).element_size()
    cases = []
    latent = torch.randn(pages, S, C + R, device=dev, dtype=dtype)
    q = torch.randn(B, H, C + R, device=dev, dtype=dtype)
    cases.append(("MLA decode (triton)", B * L * (C + R) * item,
                  lambda: da.decode_mla(q, latent, C, slots, seq, 0.1, max_len=L)))
    k = torch.randn(pages, Hkv, S, D, device=dev, dtype=dtype)
    v = torch.randn_like(k)
    qg = torch.randn(B, Hq, D, device=dev, dtype=dtype)
    cases.append(("GQA decode (triton)", 2 * B * L * Hkv * D * item,
                  lambda: da.decode_gqa(qg, k, v, slots, seq, 0.1, max_len=L)))
    for name, nbytes, fn in cases:
        t = timer(fn, 2 if ns.smoke else 20)
        frac = f"{nbytes / t / peak:.2f} of the HBM roofline ({peak / 1e12:.2f} TB/s)" if peak else "roofline n/a"
        print(f"bandwidth {name:22s} batch {B} ctx {L}: {t * 1e6:9.1f} us, {nbytes / t / 1e9:8.1f} GB/s, {frac}")
    return 0


def cmd_decode(ns) -> int:
    """The engine's decode tokens/s on a tiny preset (dummy weights), batch ``--batch``."""
    from pdserve import Engine

    for preset in ("tiny-llama", "tiny-deepseek"):
        with Engine(preset, device="cuda", page_size=16, max_total_tokens=ns.batch * 512) as engine:
            params = {"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True}
            ids = [[1 + (i + j) % 100 for j in range(128)] for i in range(ns.batch)]
            engine.generate(input_ids=ids, sampling_params=params)  # warm-up (and radix-cached prompts)
            params["max_new_tokens"] = 256
            t = time.perf_counter()
            engine.generate(input_ids=ids, sampling_params=params)
            dt = time.perf_counter() - t
        print(f"decode {preset:15s} batch {ns.batch}: {ns.batch * 256 / dt:10.0f} tok/s "
              "(SGLang publishes no figure for this shape)")
    return 0


def _fp8_weight(n: int, k: int, dev: str, lead: tuple[int, ...] = ()):
    """A random block-quantized weight: fp8 [*lead, n, k], scale_inv [*lead, ceil(n/128), ceil(k/128)],
    and its bf16 dequantized copy (what a full-precision run multiplies)."""
    import torch

    w = (torch.randn(*lead, n, k, device=dev) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand(*lead, -(-n // 128), -(-k // 128), device=dev) * 2**-9 + 2**-10
    full = (w.float() * s.repeat_interleave(128, -2)[..., :n, :].repeat_interleave(128, -1)[..., :k])
    return w, s, full.to(torch.bfloat16 if dev == "cuda" else torch.float32)


def cmd_fp8(ns) -> int:
    """Block-scaled FP8 GEMM (each backend the dispatch can pick) and fused MoE against bf16 on the
    dequantized weights: time and TFLOP/s at DeepSeek-V3 shapes (TP 8 per rank)."""
    import torch

    if ns.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from pdserve.layers.quant import fp8_kernels
    from pdserve_kernels import fp8_moe, moe

    dev = "cpu" if ns.smoke else "cuda"
    dtype = torch.float32 if ns.smoke else torch.bfloat16
    timer = _time_cpu if ns.smoke else _time_cuda
    reps = 1 if ns.smoke else 20
    tokens = (3,) if ns.smoke else (1, 64, 4096)
    # (name, N, K): q_b_proj (24576 / 8 heads' share), o_proj (7168 x 16384 / 8), a dense gate_up
    gemms = [("tiny", 80, 192)] if ns.smoke else [("q_b_proj", 3072, 1536), ("o_proj", 7168, 2048),
                                                   ("gate_up", 4608, 7168)]
    for name, n, k in gemms:
        w, s, full = _fp8_weight(n, k, dev)
        cap = torch.cuda.get_device_capability() if dev == "cuda" else None
        backends = sorted({"triton", fp8_kernels.select_gemm_backend(cap, dtype, n, k, (128, 128))})
        for t in tokens:
            x = torch.randn(t, k, device=dev, dtype=dtype)
            flop = 2 * t * n * k
            base = timer(lambda: x @ full.T, reps)  # noqa: B023 (timed before the loop moves on)
            for b in backends:
                tt = timer(lambda: fp8_kernels.w8a8_block_matmul(x, w, s, backend=b), reps)  # noqa: B023
                print(f"fp8 gemm {name:9s} T {t:5d} N {n:5d} K {k:5d} {b:9s}: {tt * 1e6:9.1f} us "
                      f"{flop / tt / 1e12:7.1f} TFLOP/s, x{base / tt:5.2f} vs bf16 ({base * 1e6:.1f} us)")
    E, K, H, I = (4, 2, 192, 64) if ns.smoke else (256, 8, 7168, 256)  # V3 at TP 8: I = 2048 / 8
    w13, s13, f13 = _fp8_weight(2 * I, H, dev, (E,))
    w2, s2, f2 = _fp8_weight(H, I, dev, (E,))
    for t in tokens:
        x = torch.randn(t, H, device=dev, dtype=dtype)
        ids = torch.stack([torch.randperm(E, device=dev)[:K] for _ in range(t)])
        tw = torch.rand(t, K, device=dev)
        flop = 2 * t * K * 3 * H * I
        base = timer(lambda: moe.fused_experts(x, f13, f2, tw, ids), reps)  # noqa: B023
        tt = timer(lambda: fp8_moe.fused_moe_fp8(x, w13, s13, w2, s2, tw, ids), reps)  # noqa: B023
        print(f"fp8 moe  E {E} top{K} H {H} I {I} T {t:5d} triton: {tt * 1e6:9.1f} us "
              f"{flop / tt / 1e12:7.1f} TFLOP/s, x{base / tt:5.2f} vs bf16 fused_experts ({base * 1e6:.1f} us)")
    return 0


SPECULATIVE = {"NEXTN": ("tiny-deepseek", {}),
               "EAGLE": ("tiny-llama", {"speculative_draft_model_path": "tiny-llama-eagle"})}


def cmd_speculative(_ns) -> int:
    """Speculative decoding on the GPU (eager draft and verify): greedy tokens equal plain decoding
    on every attention backend (fp32), and the acceptance figures. Random drafts accept almost
    nothing, so no speed-up is expected here."""
    from pdserve import Engine

    failed = 0
    sp = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    for alg, (preset, extra) in SPECULATIVE.items():
        for backend in ("torch_native", "triton", "flashinfer"):
            kw = dict(device="cuda", attention_backend=backend, dtype="float32", page_size=16, max_total_tokens=4096)
            with Engine(preset, **kw) as engine:
                ref = [o["output_ids"] for o in engine.generate(PROMPTS, sampling_params=sp)]
            with Engine(preset, **kw, speculative_algorithm=alg, speculative_num_steps=3, **extra) as engine:
                outs = engine.generate(PROMPTS, sampling_params=sp)
            same = [o["output_ids"] for o in outs] == ref
            failed += not same
            m = outs[0]["meta_info"]
            print(f"speculative {alg:6s} {preset:13s} {backend:12s} greedy equal to plain: {same}  accept length "
                  f"{m.get('spec_accept_length', 0):.2f}  accept rate {m.get('spec_accept_rate', 0):.2f}"
                  f"{'' if same else '  FAIL'}")
    return 1 if failed else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("versions", "agree", "serve", "speculative"):
        sub.add_parser(name)
    b = sub.add_parser("bandwidth")
    b.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    b.add_argument("--batch", type=int, default=64)
    b.add_argument("--context", type=int, default=4096)
    b.add_argument("--mla-heads", type=int, default=16, help="query heads per rank (DeepSeek-V3 at TP 8: 16)")
    b.add_argument("--hbm-tbps", type=float, default=None, help="peak HBM TB/s (default: from the GPU's name)")
    d = sub.add_parser("decode")
    d.add_argument("--batch", type=int, default=64)
    f = sub.add_parser("fp8")
    f.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    ns = p.parse_args()
    return {"versions": cmd_versions, "agree": cmd_agree, "serve": cmd_serve, "bandwidth": cmd_bandwidth,
            "decode": cmd_decode, "fp8": cmd_fp8, "speculative": cmd_speculative}[ns.cmd](ns) or 0


if __name__ == "__main__":
    sys.exit(main())
