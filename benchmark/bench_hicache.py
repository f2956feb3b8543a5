"""Hierarchical KV cache: TTFT of a 4K-token prefix hit per tier vs recomputing it, and the storage tiers' put/get.

    python benchmark/bench_hicache.py --prefix-tokens 4096 --chunk-tokens 256 --bytes-per-token 4096

**TTFT** (first table): an in-process ``Engine`` on ``--model`` (tiny-llama, context raised to
``--context-length``) serves a ``--prefix-tokens`` prompt plus a short fresh suffix, one new
token, three ways: nothing cached (recomputed), the prefix only in host memory (the device copy
evicted; loaded back), the prefix only in the file tier (device and host flushed; read from
disk with the OS page cache bypassed, ``posix_fadvise(DONTNEED)``, then loaded). Each row is the
median over ``--repeats`` fresh prefixes, with its ratio to recomputation, the KV bytes moved
and the tokens the engine reports from each tier (so a row that silently recomputed shows it).

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

The put/get table is the storage leg alone, without the engine.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

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


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 2000) for _ in range(n)]


def _ttft_once(engine: Any, prompt: list[int]) -> tuple[float, dict[str, int]]:
    """Seconds to the first (only) token and the tokens each tier served."""
    t0 = time.perf_counter()
    out = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1, "temperature": 0.0})
    return time.perf_counter() - t0, dict(out["meta_info"].get("cached_tokens_by_tier") or {})


def _evict_device(engine: Any) -> None:
    kv = engine.scheduler.kv_manager
    kv.evict(kv.num_evictable_pages)  # write-through already left host copies


def _flush_to_storage(engine: Any) -> None:
    cache = engine.scheduler.cache
    cache.storage.flush()  # every put has landed on disk
    if not engine.flush_cache():  # device and host emptied; storage keeps its files
        raise RuntimeError("flush_cache refused: a request still holds cache pages")


def engine_ttft(args: argparse.Namespace, directory: str) -> dict[str, dict[str, Any]]:
    import pdserve

    total = args.prefix_tokens + 64
    kw = dict(context_length=args.context_length, page_size=16, max_total_tokens=3 * total,
              chunked_prefill_size=2 * total, max_prefill_tokens=2 * total, max_running_requests=2,
              enable_hierarchical_cache=True, hicache_ratio=2.0, hicache_storage_backend="file",
              hicache_storage_dir=os.path.join(directory, "engine"), hicache_storage_size_gb=2.0,
              hicache_storage_chunk_tokens=args.chunk_tokens, hicache_storage_prefetch_policy="wait_complete",
              hicache_storage_backend_extra_config='{"fsync": true, "bypass_page_cache": true}')
    rng = random.Random(0)
    rows: dict[str, dict[str, Any]] = {k: {"ms": [], "tiers": None} for k in ("recompute", "host", "file")}
    with pdserve.Engine(model_path=args.model, **kw) as engine:
        _ttft_once(engine, _prompt(rng, total))  # warm-up: first-touch allocations, kernels
        for _ in range(args.repeats):
            prefix = _prompt(rng, args.prefix_tokens)
            dt, tiers = _ttft_once(engine, prefix + _prompt(rng, 64))
            rows["recompute"]["ms"].append(dt * 1e3)
            rows["recompute"]["tiers"] = tiers
            _evict_device(engine)
            dt, tiers = _ttft_once(engine, prefix + _prompt(rng, 64))
            rows["host"]["ms"].append(dt * 1e3)
            rows["host"]["tiers"] = tiers
            _flush_to_storage(engine)
            dt, tiers = _ttft_once(engine, prefix + _prompt(rng, 64))
            rows["file"]["ms"].append(dt * 1e3)
            rows["file"]["tiers"] = tiers
            _flush_to_storage(engine)  # the next prefix starts from an empty device and host
        info = engine.get_server_info()
    bytes_per_token = info["host_load_bytes"] / max(1, info["cache_hit_tokens_host"] + info["cache_hit_tokens_storage"])
    for row in rows.values():
        row["median_ms"] = statistics.median(row["ms"])
        hit = sum(v for k, v in (row["tiers"] or {}).items() if k != "device")
        row["bytes"] = int(hit * bytes_per_token)
    base = rows["recompute"]["median_ms"]
    for row in rows.values():
        row["ratio"] = row["median_ms"] / base
    rows["recompute"]["info"] = {k: v for k, v in info.items() if k.startswith("tier_")}
    return rows


def print_ttft(rows: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    target = {"host": 0.25, "file": 0.5}
    print(f"TTFT of a {args.prefix_tokens}-token prefix hit + 64 fresh tokens, {args.model}, median of "
          f"{args.repeats}")
    print(f"{'served from':<12}{'TTFT ms':>10}{'ratio':>8}{'target':>8}{'KV bytes':>12}  tokens by tier")
    for name, row in rows.items():
        tgt = f"<={target[name]}" if name in target else ""
        print(f"{name:<12}{row['median_ms']:>10.1f}{row['ratio']:>8.2f}{tgt:>8}{row['bytes']:>12}  {row['tiers']}")
    print("start-up measurement:", {k: round(v, 4) for k, v in rows["recompute"]["info"].items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix-tokens", type=int, default=4096)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--bytes-per-token", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--storage-dir", default=None, help="where the file tier writes (default: a temp dir)")
    parser.add_argument("--skip-mooncake", action="store_true")
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--context-length", type=int, default=8192)
    parser.add_argument("--skip-ttft", action="store_true", help="only the storage put/get table")
    parser.add_argument("--skip-storage", action="store_true", help="only the TTFT table")
    args = parser.parse_args()
    if args.prefix_tokens % args.chunk_tokens:
        parser.error("--prefix-tokens must be a multiple of --chunk-tokens")
    if not args.skip_ttft:
        with tempfile.TemporaryDirectory(dir=args.storage_dir) as directory:
            print_ttft(engine_ttft(args, directory), args)
    if args.skip_storage:
        return
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
