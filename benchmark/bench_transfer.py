"""KV transfer: pdserve's transfer path against a raw Mooncake batch write and memcpy, and 1P1D TTFT
against colocated TTFT, for one long prompt of each preset, side by side in one run; for prefill
and decode with the same TP size and with mismatched ones; on each transfer backend of
``--backends`` (Mooncake and NIXL by default), also side by side.

    python benchmark/bench_transfer.py --prompt-len 2048 --models tiny-llama tiny-deepseek tiny-qwen3-moe \
        --tp-pairs 1:1 2:1 1:2 --backends mooncake nixl

Part 1 (one process, one real Mooncake engine per rank over loopback TCP, as servers have them):
the KV pages of a ``--prompt-len`` prompt move from the prefill ranks' pools (TP ``P``: each its
head range, or the whole MLA latent) to the decode ranks' pools (TP ``D``) (a) through pdserve's
senders exactly as prefill ranks do it (plan the writes, post them layer by layer, the aux rows,
poll until every write landed), (b) as raw ``batch_transfer_sync_write`` calls of the same bytes,
one per (prefill rank, decode rank) pair, side by side as the ranks would, and (c) by memcpy.
Targets: (a)/(b) >= 0.9. Where the TP sizes split GQA heads differently, (d) the packed path
(``--disaggregation-transfer-pack``): head blocks packed into staging, one write per layer,
buffer and head block, and decode's scatter into its pages, beside (a)'s per-page writes.

Part 2 (real processes): the same prompt's time to first token through ``pdserve router`` in
front of 1 prefill (TP ``P``) + 1 decode (TP ``D``) server, against one colocated server of
prefill's TP size; every rank has ``--num-threads`` torch threads. Target: 1P1D / colocated <=
1.1 (the transfer hides behind the prefill's forward passes). Each repeat uses a fresh prompt,
so no cache helps either side. Per backend, also the TTFT share of the transfer (decode's
``transfer`` stage of the request timeline over the TTFT).

With several backends, part 1 runs the pdserve path on each (the raw baseline is Mooncake's
``batch_transfer_sync_write``), and part 2 one prefill/decode/router trio per backend, their
repeats interleaved with the colocated server's.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import random
import statistics
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from pdserve.config import CacheConfig, ModelConfig
from pdserve.disagg.layout import KVLayout, op_addresses, packing_pays, plan_writes, staging_blocks, staging_bytes
from pdserve.disagg.protocol import KVRequest
from pdserve.disagg.sender import KVSender, RoomState
from pdserve.disagg.staging import StagingPool, pool_tensors, unpack_room
from pdserve.distributed.parallel_state import ParallelState
from pdserve.engine.model_runner import create_kv_pool
from pdserve.transfer import BACKEND_NAMES, create_transfer_backend, merge_contiguous

sys.path.insert(0, str(Path(__file__).resolve().parent))
import servers  # noqa: E402  (benchmark/servers.py, beside this script)

PRESETS = ("tiny-llama", "tiny-deepseek", "tiny-qwen3-moe")
POLL_S = 0.0002


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(PRESETS))
    p.add_argument("--tp-pairs", nargs="+", default=[(1, 1), (2, 1), (1, 2)], type=_tp_pair, metavar="P:D",
                   help="prefill TP : decode TP (default: 1:1 2:1 1:2)")
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--num-threads", type=int, default=1, help="torch threads of each server rank (part 2)")
    p.add_argument("--skip-ttft", action="store_true", help="part 1 only")
    p.add_argument("--backends", nargs="+", default=["mooncake", "nixl"],
                   choices=[b for b in BACKEND_NAMES if b != "memory"], help="transfer backends, side by side")
    p.add_argument("--output-file", help="append the results as one JSON line")
    return p.parse_args(argv)


def _tp_pair(text: str) -> tuple[int, int]:
    try:
        src, dst = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tp-pairs: expected P:D such as 2:1, got {text!r}") from None
    if src < 1 or dst < 1:
        raise argparse.ArgumentTypeError(f"--tp-pairs: TP sizes must be >= 1, got {text!r}")
    return src, dst


# ------------------------------------------------------------------ part 1
class Pools:
    """Prefill ranks' pools (TP ``src_tp``) and decode ranks' pools (TP ``dst_tp``) of ``model``, each
    registered with its own engine, with an aux staging row per prefill rank and an aux row per
    decode rank."""

    def __init__(self, model: str, page_size: int, tokens: int, src_tp: int = 1, dst_tp: int = 1,
                 backend: str = "mooncake"):
        mc = ModelConfig.from_path(model)
        cache = CacheConfig(page_size, max_total_tokens=tokens + 4 * page_size)
        kind = "mla" if mc.is_mla else "gqa"
        self.hidden = mc.hf_config.hidden_size
        self.sides: list = []
        self.staging: list = []  # per side: each rank's StagingPool (GQA) or None
        for tp, fill in ((src_tp, 7), (dst_tp, 0)):  # distinct bytes, so a missed write would be visible
            pools = [create_kv_pool(mc, cache, ParallelState(t, tp)) for t in range(tp)]
            layout = KVLayout.from_descriptors(kind, tp, mc.num_kv_heads, page_size, mc.dtype,
                                               pools[0].buffer_descriptors())
            engines = [create_transfer_backend(backend) for _ in range(tp)]
            aux = [torch.zeros(1, self.hidden) for _ in range(tp)]  # [1, hidden] per rank
            room_bytes = staging_bytes(layout, -(-(tokens - 1) // page_size)) if kind == "gqa" else 0
            staging = [StagingPool(room_bytes) if room_bytes else None for _ in range(tp)]  # a whole room each
            for pool, te, row, st in zip(pools, engines, aux, staging):
                te.register([(d.base_addr, d.total_bytes) for d in pool.buffer_descriptors()]
                            + [(row.data_ptr(), row.numel() * 4)] + ([(st.addr, st.nbytes)] if st else []))
                for d in pool.buffer_descriptors():
                    ctypes.memset(d.base_addr, fill, d.total_bytes)
            self.sides.append((pools, layout, engines, aux))
            self.staging.append(staging)
        self.pages = list(range((tokens - 1 + page_size - 1) // page_size))
        for a in self.src[2]:  # every engine learns its peers, as the bootstrap records teach them
            for b in self.dst[2]:
                a.connect(b.session_id, b.peer_info)
                b.connect(a.session_id, a.peer_info)

    @property
    def src(self):
        return self.sides[0]

    @property
    def dst(self):
        return self.sides[1]

    def ops(self, room: int):
        return plan_writes(self.src[1], self.dst[1], self.pages, self.pages, room=room)

    def bases(self, side, rank: int) -> dict[str, int]:
        return {d.name: d.base_addr for d in side[0][rank].buffer_descriptors()}

    def addresses(self, room: int) -> dict[tuple[int, int], tuple[list, list, list]]:
        """Merged (srcs, dsts, lens) per (prefill rank, decode rank), plus each decode rank's aux
        row from its first source (as the senders do)."""
        by_pair: dict[tuple[int, int], list] = {}
        for op in self.ops(room):
            by_pair.setdefault((op.src_rank, op.dst_rank), []).append(op)
        out = {}
        for (s, d), ops in sorted(by_pair.items()):
            srcs, dsts, lens = merge_contiguous(*op_addresses(ops, self.bases(self.src, s), self.bases(self.dst, d)))
            if s == min(k[0] for k in by_pair if k[1] == d):
                srcs, dsts, lens = (srcs + [self.src[3][s].data_ptr()], dsts + [self.dst[3][d].data_ptr()],
                                    lens + [self.hidden * 4])
            out[(s, d)] = (srcs, dsts, lens)
        return out

    def nbytes(self) -> int:
        return sum(op.nbytes for op in self.ops(0)) + len(self.dst[0]) * self.hidden * 4

    def close(self) -> None:
        for side in self.sides:
            for te in side[2]:
                te.close()


def time_pdserve(p: Pools, tokens: int, room: int, packed: bool = False) -> tuple[float, int]:
    """The prefill ranks' path: open the room, stage every page, post layer by layer, aux, drain
    (``packed``: through the staging buffers, and decode's scatter after). Seconds and writes."""
    (src_pools, src_layout, src_te, src_aux), (dst_pools, dst_layout, dst_te, dst_aux) = p.src, p.dst
    src_st, dst_st = p.staging if packed else ([None] * len(src_te), [None] * len(dst_te))
    senders = [KVSender(te, src_layout, s, p.bases(p.src, s), src_aux[s], pools=pool_tensors(src_pools[s]),
                        staging=src_st[s]) for s, te in enumerate(src_te)]
    need = staging_bytes(dst_layout, len(p.pages))
    lent = [st.alloc(need) if st is not None else None for st in dst_st]
    kvs = {d: KVRequest(room, 1, "bench", d, te.session_id, [b.base_addr for b in dst_pools[d].buffer_descriptors()],
                        dst_layout, p.pages, 0, tokens - 1, dst_aux[d].data_ptr(), p.hidden * 4, "tcp://unused:1",
                        *((dst_st[d].addr + lent[d], need) if lent[d] is not None else (0, 0)))
           for d, te in enumerate(dst_te)}
    t0 = time.perf_counter()
    for sender in senders:
        sender.open(room, kvs, tokens - 1, time.monotonic())
        sender.stage(room, p.pages, tokens - 1)
    for layer in range(src_layout.num_layers):
        for sender in senders:
            sender.on_layer(layer)
    for sender in senders:
        sender.forward_done()
        sender.finish(room, torch.ones(p.hidden))
    while any(sender.poll(room) is RoomState.DRAINING for sender in senders):
        time.sleep(POLL_S)  # as the scheduler loop does between polls (it never spins on the GIL)
    for d, at in enumerate(lent):  # decode's scatter: on its critical path before the first step
        if at is not None:
            blocks = staging_blocks(src_layout, dst_layout, d, len(p.pages), room=room)
            unpack_room(dst_st[d], at, blocks, pool_tensors(dst_pools[d]), p.pages)
    elapsed = time.perf_counter() - t0
    for d, at in enumerate(lent):
        if at is not None:
            dst_st[d].free(at)
    for sender in senders:
        assert sender.poll(room) is RoomState.DONE, sender.rooms[room].error
        sender.close_room(room)
    return elapsed, sum(s.writes_posted for s in senders)


def time_raw(p: Pools, room: int, pool: ThreadPoolExecutor) -> float:
    """The same bytes (plus the aux rows) in one raw Mooncake batch write per (prefill rank, decode
    rank) pair, side by side, waited for."""
    pairs = p.addresses(room)

    def write(pair) -> int:
        (s, d), (srcs, dsts, lens) = pair
        te = p.src[2][s]._te  # noqa: SLF001 - the engine under the backend, for the baseline
        return te.batch_transfer_sync_write(p.dst[2][d].session_id, srcs, dsts, lens)

    t0 = time.perf_counter()
    rcs = list(pool.map(write, pairs.items()))
    elapsed = time.perf_counter() - t0
    assert rcs == [0] * len(rcs), rcs
    return elapsed


def time_memcpy(p: Pools, room: int) -> float:
    pairs = list(p.addresses(room).values())
    t0 = time.perf_counter()
    for srcs, dsts, lens in pairs:
        for s, d, n in zip(srcs, dsts, lens):
            ctypes.memmove(d, s, n)
    return time.perf_counter() - t0


def part1(model: str, a: argparse.Namespace, src_tp: int, dst_tp: int) -> dict:
    pools = {b: Pools(model, a.page_size, a.prompt_len, src_tp, dst_tp, b) for b in a.backends}
    p0 = next(iter(pools.values()))
    packs = packing_pays(p0.src[1], p0.dst[1], len(p0.pages), "auto")
    try:
        with ThreadPoolExecutor(src_tp * dst_tp) as pool:
            per_page, packed_writes = {}, {}
            for b, p in pools.items():  # warm-up: the first write opens the peer's connection
                per_page[b] = time_pdserve(p, a.prompt_len, 0)[1]
                packed_writes[b] = time_pdserve(p, a.prompt_len, 0, packed=True)[1] if packs else 0
            if "mooncake" in pools:
                time_raw(pools["mooncake"], 0, pool)
            kinds = [f"{b}_{k}" for b in pools for k in ("pdserve", *(("packed",) if packs else ()))]
            kinds += [*(("raw",) if "mooncake" in pools else ()), "memcpy"]
            times: dict[str, list[float]] = {k: [] for k in kinds}
            for r in range(a.repeats):  # interleaved, so drift hits them all alike
                for b, p in pools.items():
                    times[f"{b}_pdserve"].append(time_pdserve(p, a.prompt_len, r + 1)[0])
                    if packs:
                        times[f"{b}_packed"].append(time_pdserve(p, a.prompt_len, r + 1, packed=True)[0])
                if "mooncake" in pools:
                    times["raw"].append(time_raw(pools["mooncake"], r + 1, pool))
                times["memcpy"].append(time_memcpy(p0, r + 1))
        med = {k: statistics.median(v) for k, v in times.items()}
        nbytes = p0.nbytes()
        row = {"model": model, "prefill_tp": src_tp, "decode_tp": dst_tp, "bytes": nbytes, "backends": list(pools),
               "writes": sum(len(x[0]) for x in p0.addresses(0).values()),
               **{f"{k}_gib_s": nbytes / v / 2**30 for k, v in med.items()}}
        for b in pools:
            row[f"{b}_writes"] = per_page[b]
            row[f"{b}_over_memcpy"] = med["memcpy"] / med[f"{b}_pdserve"]
            if "raw" in med:
                row[f"{b}_over_raw"] = med["raw"] / med[f"{b}_pdserve"]
            if packs:
                row.update({f"{b}_packed_writes": packed_writes[b],
                            f"{b}_packed_over_per_page": med[f"{b}_pdserve"] / med[f"{b}_packed"]})
        return row
    finally:
        for p in pools.values():
            p.close()


# ------------------------------------------------------------------ part 2
def ttft(url: str, ids: list[int]) -> tuple[float, float]:
    """Seconds from sending a streamed /generate to its first token, and the request's
    ``transfer`` stage (decode's timeline, in the last event; 0 when colocated)."""
    body = json.dumps({"input_ids": ids, "stream": True,
                       "sampling_params": {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}}).encode()
    req = urllib.request.Request(url + "/generate", data=body, headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first, last = None, None
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if line.startswith(b"data: {"):
                last = json.loads(line[6:])
                if first is None and last["output_ids"]:
                    first = time.perf_counter() - t0
    if first is None or last is None:
        raise RuntimeError("the stream ended without a token")
    return first, (last["meta_info"].get("timeline") or {}).get("transfer", 0.0)


def part2(model: str, a: argparse.Namespace, src_tp: int, dst_tp: int) -> dict:
    common = ["--model-path", model, "--page-size", str(a.page_size), "--num-threads", str(a.num_threads),
              "--log-level", "error"]
    colo_port = servers.free_port()
    url = {"colo": f"http://127.0.0.1:{colo_port}"}
    procs = [servers.start(["serve", *common, "--port", str(colo_port), "--tp-size", str(src_tp)])]
    try:
        servers.wait_healthy(url["colo"], procs[0])
        for b in a.backends:
            url[b] = _pd_trio(common, b, src_tp, dst_tp, procs)
        rng = random.Random(0)
        prompt = lambda: [rng.randrange(16, 1500) for _ in range(a.prompt_len)]  # noqa: E731
        for k in url:  # warm-up
            ttft(url[k], prompt())
        runs: dict[str, list[tuple[float, float]]] = {k: [] for k in url}
        for _ in range(a.repeats):  # interleaved, so drift hits them all alike
            for k in url:
                runs[k].append(ttft(url[k], prompt()))
        colo = statistics.median(t for t, _ in runs["colo"])
        row = {"colocated_ttft_s": colo}
        for b in a.backends:
            pd = statistics.median(t for t, _ in runs[b])
            row.update({f"{b}_pd_ttft_s": pd, f"{b}_pd_over_colocated_ttft": pd / colo,
                        f"{b}_transfer_share": statistics.median(x / t for t, x in runs[b])})
        return row
    finally:
        for p in reversed(procs):
            servers.stop(p)


def _pd_trio(common: list[str], backend: str, src_tp: int, dst_tp: int, procs: list) -> str:
    """A prefill, a decode and a router on ``backend``, started and healthy (``procs`` collects
    them for the caller to stop); the router's URL."""
    ports = {k: servers.free_port() for k in ("prefill", "boot", "decode", "router")}
    url = {k: f"http://127.0.0.1:{ports[k]}" for k in ports}
    flags = [*common, "--disaggregation-transfer-backend", backend]
    procs.append(servers.start(["serve", *flags, "--port", str(ports["prefill"]), "--disaggregation-mode", "prefill",
                                "--disaggregation-bootstrap-port", str(ports["boot"]), "--tp-size", str(src_tp)]))
    servers.wait_healthy(url["prefill"], procs[-1])
    procs.append(servers.start(["serve", *flags, "--port", str(ports["decode"]), "--disaggregation-mode", "decode",
                                "--tp-size", str(dst_tp)]))
    servers.wait_healthy(url["decode"], procs[-1])
    procs.append(servers.start(["router", "--port", str(ports["router"]), "--prefill", url["prefill"],
                                str(ports["boot"]), "--decode", url["decode"], "--log-level", "error"]))
    servers.wait_healthy(url["router"], procs[-1])
    return url["router"]


def main(argv=None) -> int:
    a = parse_args(argv)
    rows = []
    for model in a.models:
        for src_tp, dst_tp in a.tp_pairs:
            row = part1(model, a, src_tp, dst_tp)
            if not a.skip_ttft:
                row.update(part2(model, a, src_tp, dst_tp))
            rows.append(row)
            print(_line(row, a), flush=True)
    if a.output_file:
        with open(a.output_file, "a") as f:
            f.write(json.dumps({"args": vars(a), "results": rows}) + "\n")
    return 0


def _line(r: dict, a: argparse.Namespace) -> str:
    s = (f"{r['model']} P TP{r['prefill_tp']} -> D TP{r['decode_tp']}: {a.prompt_len}-token prompt, "
         f"{r['bytes'] / 2**20:.1f} MiB in {r['writes']} merged writes | memcpy {r['memcpy_gib_s']:.2f} GiB/s")
    if "raw_gib_s" in r:
        s += f", raw Mooncake {r['raw_gib_s']:.2f} GiB/s"
    for b in r["backends"]:
        s += (f"\n  {b:8s}: pdserve path {r[f'{b}_pdserve_gib_s']:.2f} GiB/s in {r[f'{b}_writes']} writes"
              f" per request (/memcpy {r[f'{b}_over_memcpy']:.2f}"
              + (f", /raw Mooncake {r[f'{b}_over_raw']:.2f})" if f"{b}_over_raw" in r else ")"))
        if f"{b}_packed_gib_s" in r:
            s += (f" | packed {r[f'{b}_packed_gib_s']:.2f} GiB/s in {r[f'{b}_packed_writes']} writes: "
                  f"packed/per-page {r[f'{b}_packed_over_per_page']:.2f}")
        if f"{b}_pd_ttft_s" in r:
            s += (f" | TTFT 1P1D {r[f'{b}_pd_ttft_s'] * 1000:.0f} ms vs colocated TP{r['prefill_tp']} "
                  f"{r['colocated_ttft_s'] * 1000:.0f} ms = {r[f'{b}_pd_over_colocated_ttft']:.2f}, "
                  f"transfer {100 * r[f'{b}_transfer_share']:.0f}% of TTFT")
    return s


if __name__ == "__main__":
    sys.exit(main())
