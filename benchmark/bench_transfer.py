"""KV transfer: pdserve's transfer path against a raw Mooncake batch write and memcpy, and 1P1D TTFT
against colocated TTFT, for one long prompt of each preset, side by side in one run; for prefill
and decode with the same TP size and with mismatched ones.

    python benchmark/bench_transfer.py --prompt-len 2048 --models tiny-llama tiny-deepseek tiny-qwen3-moe \
        --tp-pairs 1:1 2:1 1:2

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
so no cache helps either side.
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
from pdserve.transfer import MooncakeTransferBackend, merge_contiguous

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

    def __init__(self, model: str, page_size: int, tokens: int, src_tp: int = 1, dst_tp: int = 1):
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
            engines = [MooncakeTransferBackend() for _ in range(tp)]
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
    p = Pools(model, a.page_size, a.prompt_len, src_tp, dst_tp)
    packs = packing_pays(p.src[1], p.dst[1], len(p.pages), "auto")
    try:
        with ThreadPoolExecutor(src_tp * dst_tp) as pool:
            _, per_page = time_pdserve(p, a.prompt_len, 0)
            packed_writes = time_pdserve(p, a.prompt_len, 0, packed=True)[1] if packs else 0
            time_raw(p, 0, pool)  # warm-up: the first write opens the peer's segment
            kinds = ("pdserve", "raw", "memcpy", *(("packed",) if packs else ()))
            times: dict[str, list[float]] = {k: [] for k in kinds}
            for r in range(a.repeats):  # interleaved, so drift hits them all alike
                times["pdserve"].append(time_pdserve(p, a.prompt_len, r + 1)[0])
                if packs:
                    times["packed"].append(time_pdserve(p, a.prompt_len, r + 1, packed=True)[0])
                times["raw"].append(time_raw(p, r + 1, pool))
                times["memcpy"].append(time_memcpy(p, r + 1))
        med = {k: statistics.median(v) for k, v in times.items()}
        nbytes = p.nbytes()
        row = {"model": model, "prefill_tp": src_tp, "decode_tp": dst_tp, "bytes": nbytes,
               "writes": sum(len(x[0]) for x in p.addresses(0).values()), "pdserve_writes": per_page,
               **{f"{k}_gib_s": nbytes / v / 2**30 for k, v in med.items()},
               "pdserve_over_raw": med["raw"] / med["pdserve"], "pdserve_over_memcpy": med["memcpy"] / med["pdserve"]}
        if packs:
            row.update(packed_writes=packed_writes, packed_over_per_page=med["pdserve"] / med["packed"])
        return row
    finally:
        p.close()


# ------------------------------------------------------------------ part 2
def ttft(url: str, ids: list[int]) -> float:
    """Seconds from sending a streamed /generate to its first token."""
    body = json.dumps({"input_ids": ids, "stream": True,
                       "sampling_params": {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}}).encode()
    req = urllib.request.Request(url + "/generate", data=body, headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if line.startswith(b"data: {") and json.loads(line[6:])["output_ids"]:
                return time.perf_counter() - t0
    raise RuntimeError("the stream ended without a token")


def part2(model: str, a: argparse.Namespace, src_tp: int, dst_tp: int) -> dict:
    common = ["--model-path", model, "--page-size", str(a.page_size), "--num-threads", str(a.num_threads),
              "--log-level", "error"]
    ports = {k: servers.free_port() for k in ("colo", "prefill", "boot", "decode", "router")}
    url = {k: f"http://127.0.0.1:{ports[k]}" for k in ports}
    procs = [servers.start(["serve", *common, "--port", str(ports["colo"]), "--tp-size", str(src_tp)]),
             servers.start(["serve", *common, "--port", str(ports["prefill"]), "--disaggregation-mode", "prefill",
                   "--disaggregation-bootstrap-port", str(ports["boot"]), "--tp-size", str(src_tp)]),
             servers.start(["serve", *common, "--port", str(ports["decode"]), "--disaggregation-mode", "decode",
                   "--tp-size", str(dst_tp)])]
    try:
        for i, k in enumerate(("colo", "prefill", "decode")):
            servers.wait_healthy(url[k], procs[i])
        procs.append(servers.start(["router", "--port", str(ports["router"]), "--prefill", url["prefill"],
                                    str(ports["boot"]), "--decode", url["decode"], "--log-level", "error"]))
        servers.wait_healthy(url["router"], procs[-1])
        rng = random.Random(0)
        prompt = lambda: [rng.randrange(16, 1500) for _ in range(a.prompt_len)]  # noqa: E731
        ttft(url["colo"], prompt()), ttft(url["router"], prompt())  # warm-up
        colo, pd = [], []
        for _ in range(a.repeats):
            colo.append(ttft(url["colo"], prompt()))
            pd.append(ttft(url["router"], prompt()))
        return {"colocated_ttft_s": statistics.median(colo), "pd_ttft_s": statistics.median(pd),
                "pd_over_colocated_ttft": statistics.median(pd) / statistics.median(colo)}
    finally:
        for p in reversed(procs):
            servers.stop(p)


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
         f"{r['bytes'] / 2**20:.1f} MiB in {r['writes']} writes | "
         f"pdserve {r['pdserve_gib_s']:.2f} GiB/s, raw Mooncake {r['raw_gib_s']:.2f} GiB/s, memcpy "
         f"{r['memcpy_gib_s']:.2f} GiB/s | pdserve/raw {r['pdserve_over_raw']:.2f}, "
         f"pdserve/memcpy {r['pdserve_over_memcpy']:.2f}")
    if "packed_gib_s" in r:
        s += (f" | packed {r['packed_gib_s']:.2f} GiB/s in {r['packed_writes']} writes vs per-page "
              f"{r['pdserve_writes']} writes: packed/per-page {r['packed_over_per_page']:.2f}")
    if "pd_over_colocated_ttft" in r:
        s += (f" | TTFT 1P1D {r['pd_ttft_s'] * 1000:.0f} ms vs colocated TP{r['prefill_tp']} "
              f"{r['colocated_ttft_s'] * 1000:.0f} ms "
              f"= {r['pd_over_colocated_ttft']:.2f}")
    return s


if __name__ == "__main__":
    sys.exit(main())
