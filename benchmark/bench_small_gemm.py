"""The C small-M GEMM (pdserve_kernels.gemm_cpu) against oneDNN's packed call on the decode GEMMs of
tiny-llama and llama-512x8, microseconds (best of --blocks blocks of --calls calls, the least
disturbed by other load) and GFLOPS: oneDNN and C on one thread, C with its helper threads.

    python benchmark/bench_small_gemm.py --rows 32
    python benchmark/bench_small_gemm.py --rows 1 8 64 128 --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch

from pdserve_kernels import gemm_cpu

SHAPES = [(256, 512), (256, 256), (256, 1376), (688, 256), (256, 2048), (512, 1024), (512, 2752), (1376, 512)]


def best_us(fn, calls: int, blocks: int) -> float:
    for _ in range(10):
        fn()
    best = float("inf")
    for _ in range(blocks):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[32])
    ap.add_argument("--threads", type=int, default=2, help="the C kernel's threads in the last column")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--blocks", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if gemm_cpu.load() is None:
        raise SystemExit("the C GEMM could not be built (see the log)")
    for M in args.rows:
        total = [0.0, 0.0, 0.0]
        print(f"M={M}: {'K':>5} {'N':>5}  {'oneDNN':>14}  {'C 1 thread':>14}  C {args.threads} threads")
        for K, N in SHAPES:
            us = shape_us(M, K, N, args)
            gf = [2 * M * N * K / u / 1e3 for u in us]
            total = [t + u for t, u in zip(total, us)]
            print(f"     {K:5d} {N:5d}  " + "  ".join(f"{u:7.1f} ({g:4.0f}GF)" for u, g in zip(us, gf)))
        print("     total        " + "  ".join(f"{t:14.0f}" for t in total))


def shape_us(M: int, K: int, N: int, args: argparse.Namespace) -> list[float]:
    """oneDNN, C on one thread, C on args.threads: microseconds per call of [M, K] x [N, K]^T."""
    x, w = torch.randn(M, K), torch.randn(N, K)
    onednn, panels = torch.ops.mkldnn._reorder_linear_weight(w), gemm_cpu.pack(w)
    return [best_us(lambda: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], ""), args.calls,
                    args.blocks),
            best_us(lambda: gemm_cpu.linear(x, panels, N, threads=1), args.calls, args.blocks),
            best_us(lambda: gemm_cpu.linear(x, panels, N, threads=args.threads), args.calls, args.blocks)]

if __name__ == "__main__":
    main()
