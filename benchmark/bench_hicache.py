"""Storage tiers side by side: put/get latency and bytes/s of a 4K-token prefix, file vs Mooncake Store.

    python benchmark/bench_hicache.py --prefix-tokens 4096 --chunk-tokens 256 --bytes-per-token 4096

A prefix of ``--prefix-tokens`` tokens is stored as ``prefix/chunk`` objects of
``chunk * bytes_per_token`` bytes (``--bytes-per-token`` is the KV bytes of one token on one
rank: 2 x layers x KV heads x head dim x dtype bytes for GQA). Each round puts a fresh prefix
(new keys, so no put is a no-op) and then gets it back, checking every byte; rows give the
median over ``--repeats`` rounds of the whole prefix's time, the per-object median latency and
the throughput. Tiers:

* ``file`` with fsync and the OS page cache bypassed (``posix_fadvise(DONTNEED)`` after each
  write and read): what a load costs from the disk itself;
* ``file+pagecache``: the same files served from the page cache (what a warm host sees);
* ``mooncake``: a local ``mooncake_master`` started here and one client lending the segment,
  over TCP on loopback.

This is the storage leg only; TTFT of a prefix hit through the engine is a separate benchmark.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

from pdserve.mem.storage import create_page_store
from pdserve.mem.storage.base import PageStore
from pdserve.mem.storage.keys import chunk_keys, namespace
from pdserve.mem.storage.page_format import HEADER_BYTES

NS = namespace({"model": "bench_hicache", "dtype": "bfloat16"})


def time_round(store: PageStore, keys: list[bytes], payloads: list[bytes]) -> tuple[list[float], list[float]]:
    """Per-object put seconds, then per-object get seconds (every byte checked)."""
    puts, gets = [], []
    for key, payload in zip(keys, payloads):
        t0 = time.perf_counter()
        ok = store.put(key, payload)
        puts.append(time.perf_counter() - t0)
        if not ok:
            raise RuntimeError(f"{store.name}: put failed ({store.stats()})")
    for key, payload in zip(keys, payloads):
        t0 = time.perf_counter()
        got = store.get(key)
        gets.append(time.perf_counter() - t0)
        if got != payload:
            raise RuntimeError(f"{store.name}: get returned {'nothing' if got is None else 'other bytes'}")
    return puts, gets


def run_tier(open_store: Callable[[], PageStore], args: argparse.Namespace) -> dict[str, float]:
    chunk_bytes = args.chunk_tokens * args.bytes_per_token
    chunks = args.prefix_tokens // args.chunk_tokens
    payloads = [os.urandom(chunk_bytes) for _ in range(chunks)]
    store = open_store()
    put_totals, get_totals, put_each, get_each = [], [], [], []
    try:
        for r in range(args.repeats + 1):
            tokens = [(r * 1_000_003 + i) % 2**32 for i in range(chunks * args.chunk_tokens)]
            puts, gets = time_round(store, chunk_keys(NS, tokens, args.chunk_tokens), payloads)
            if r == 0:
                continue  # warm-up: first touches of segment memory and directories
            put_totals.append(sum(puts))
            get_totals.append(sum(gets))
            put_each.extend(puts)
            get_each.extend(gets)
    finally:
        store.close()
    nbytes = chunks * chunk_bytes
    put_s, get_s = statistics.median(put_totals), statistics.median(get_totals)
    return {
        "put_ms": put_s * 1e3,
        "get_ms": get_s * 1e3,
        "put_obj_ms": statistics.median(put_each) * 1e3,
        "get_obj_ms": statistics.median(get_each) * 1e3,
        "put_MBps": nbytes / put_s / 1e6,
        "get_MBps": nbytes / get_s / 1e6,
    }


def tiers(args: argparse.Namespace, directory: str) -> dict[str, Callable[[], PageStore]]:
    object_bytes = args.chunk_tokens * args.bytes_per_token + HEADER_BYTES
    need = object_bytes * (args.prefix_tokens // args.chunk_tokens) * (args.repeats + 1)
    size_gb = max(2 * need, 64 << 20) / 1e9

    def file_store(bypass: bool, sub: str) -> Callable[[], PageStore]:
        return lambda: create_page_store(
            "file",
            directory=os.path.join(directory, sub),
            size_gb=size_gb,
            namespace=NS,
            extra_config={"fsync": True, "bypass_page_cache": bypass},
        )

    def mooncake_store() -> PageStore:
        extra = {"start_master": True, "local_buffer_size": max(2 * object_bytes, 16 << 20)}
        return create_page_store("mooncake", directory=None, size_gb=size_gb, namespace=NS, extra_config=extra)

    out = {"file": file_store(True, "bypass"), "file+pagecache": file_store(False, "cached")}
    if not args.skip_mooncake:
        out["mooncake"] = mooncake_store
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix-tokens", type=int, default=4096)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--bytes-per-token", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--storage-dir", default=None, help="where the file tier writes (default: a temp dir)")
    parser.add_argument("--skip-mooncake", action="store_true")
    args = parser.parse_args()
    if args.prefix_tokens % args.chunk_tokens:
        parser.error("--prefix-tokens must be a multiple of --chunk-tokens")
    chunk_mib = args.chunk_tokens * args.bytes_per_token / 2**20
    print(
        f"prefix {args.prefix_tokens} tokens = {args.prefix_tokens // args.chunk_tokens} objects of "
        f"{chunk_mib:.2f} MiB; median of {args.repeats} rounds"
    )
    print(f"{'tier':<16}{'put ms':>10}{'get ms':>10}{'put/obj ms':>12}{'get/obj ms':>12}", end="")
    print(f"{'put MB/s':>10}{'get MB/s':>10}")
    with tempfile.TemporaryDirectory(dir=args.storage_dir) as directory:
        for name, opener in tiers(args, directory).items():
            row = run_tier(opener, args)
            print(
                f"{name:<16}{row['put_ms']:>10.1f}{row['get_ms']:>10.1f}{row['put_obj_ms']:>12.2f}"
                f"{row['get_obj_ms']:>12.2f}{row['put_MBps']:>10.0f}{row['get_MBps']:>10.0f}"
            )


if __name__ == "__main__":
    main()
