"""The CPU decode attention kernel (``decode_attention_cpu.c``) built at several prefetch distances, side by
side in one process: its L2 cursor at the default ``AHEAD_BYTES`` against other values (0: no cursor, only the
one-block L1 prefetch it had before).

    python benchmark/bench_decode_attention.py                                  # tiny-llama's heads, batch 32
    python benchmark/bench_decode_attention.py --ahead-bytes 0 65536 262144 1048576 --context 161 1024 4096

Each case calls the kernel on ``--layers`` separate pools in turn, as a decode step's layers do, so each
call's rows come from memory ("cold"), and on one pool ``--layers`` times ("hot": the rows stay in cache,
the arithmetic alone), through ``decode_attention_cpu.decode_attention`` (its argument checks included)
with the module's library swapped for the variant's. Variants alternate within each repeat, so load from
elsewhere hits them alike; the table gives the median microseconds per call and each variant's ratio to
the first. Every variant gives the same bits (checked). Not part of CI.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "kernels"))
from pdserve_kernels import decode_attention_cpu as dac  # noqa: E402
from pdserve_kernels.cpu_build import CLibrary  # noqa: E402


def library(ahead: int | None) -> CLibrary:
    """The kernel built with ``AHEAD_BYTES`` = ``ahead`` (None: the source's default)."""
    if ahead is None:
        return dac.LIBRARY
    return CLibrary(dac.LIBRARY.source, dac._declare, f"decode attention (AHEAD_BYTES={ahead})",
                    flags=(*dac.LIBRARY.flags, f"-DAHEAD_BYTES={ahead}"), headers=dac.LIBRARY.headers)


@contextlib.contextmanager
def built_as(lib: CLibrary):
    """``decode_attention_cpu.decode_attention`` runs ``lib``'s build meanwhile."""
    saved, dac.LIBRARY = dac.LIBRARY, lib
    try:
        yield
    finally:
        dac.LIBRARY = saved


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ahead-bytes", type=int, nargs="+", default=[0],
                    help="distances built beside the default (0: no L2 cursor)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, nargs="+", default=[161, 1024])
    ap.add_argument("--page-size", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--heads", type=int, nargs=3, default=[8, 4, 32], metavar=("HQ", "HKV", "D"))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=30)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    variants = [("default", library(None))] + [(f"AHEAD_BYTES={n}", library(n)) for n in a.ahead_bytes]
    if any(lib.load() is None for _, lib in variants):
        sys.exit("the kernel could not be built here (no C compiler?)")
    Hq, Hkv, D = a.heads
    g = torch.Generator().manual_seed(0)
    print(f"batch {a.batch}, heads {Hq}/{Hkv} x {D}, {a.layers} pools, one thread; us per call (median), "
          f"ratio to the default")
    print("| context | page size | rows | " + " | ".join(name for name, _ in variants) + " |")
    print("|---" * (3 + len(variants)) + "|")
    for ctx in a.context:
        for S in a.page_size:
            stride = -(-ctx // S) * S + S  # each request's slots: its own pages, one page apart
            P = -(-(a.batch * stride + S) // S)
            pools = [(torch.randn(P, Hkv, S, D, generator=g), torch.randn(P, Hkv, S, D, generator=g))
                     for _ in range(a.layers)]
            slots = torch.stack([torch.arange(ctx) + b * stride + S for b in range(a.batch)])
            lens = torch.full((a.batch,), ctx, dtype=torch.int64)
            q = torch.randn(a.batch, Hq, D, generator=g)
            case = dict(q=q, kv_slots=slots, seq_lens=lens, scale=D ** -0.5)
            first = dict(k_cache=pools[0][0], v_cache=pools[0][1], **case)  # the hot rows' pool
            outs = []
            times = {(name, mode): [] for name, _ in variants for mode in ("cold", "hot")}
            for _ in range(a.repeats):
                for name, lib in variants:
                    with built_as(lib):
                        t0 = time.perf_counter()
                        for k, v in pools:
                            out = dac.decode_attention(k_cache=k, v_cache=v, **case)
                        times[name, "cold"].append((time.perf_counter() - t0) / a.layers)
                        dac.decode_attention(**first)  # its rows into cache
                        t0 = time.perf_counter()
                        for _ in pools:
                            dac.decode_attention(**first)
                        times[name, "hot"].append((time.perf_counter() - t0) / a.layers)
                    if len(outs) < len(variants):
                        outs.append(out)
            for out in outs[1:]:
                assert torch.equal(out, outs[0]), "a prefetch distance changed the result"
            for mode in ("cold", "hot"):
                med = {name: statistics.median(times[name, mode]) * 1e6 for name, _ in variants}
                base = med["default"]
                cells = [f"{med[name]:.0f}" + ("" if name == "default" else f" ({med[name] / base:.2f}x)")
                         for name, _ in variants]
                print(f"| {ctx} | {S} | {mode} | " + " | ".join(cells) + " |")
            del pools


if __name__ == "__main__":
    main()
