"""KV transfer: pdserve's transfer path against a raw Mooncake batch write and memcpy, and 1P1D TTFT
against colocated TTFT, for one long prompt of each preset, side by side in one run.

    python benchmark/bench_transfer.py --prompt-len 2048 --models tiny-llama tiny-deepseek tiny-qwen3-moe

Part 1 (one process, two real Mooncake engines over loopback TCP): the KV pages of a
``--prompt-len`` prompt move from a prefill pool to a decode pool (a) through pdserve's sender
exactly as a prefill server does it (plan the writes, post them layer by layer, the aux row,
poll until every write landed), (b) as one raw ``batch_transfer_sync_write`` of the same bytes,
and (c) by memcpy. Targets: (a)/(b) >= 0.9.

Part 2 (real processes): the same prompt's time to first token through ``pdserve router`` in
front of 1 prefill + 1 decode server, against one colocated server; every server has
``--num-threads`` torch threads. Target: 1P1D / colocated <= 1.1 (the transfer hides behind the
prefill's forward passes). Each repeat uses a fresh prompt, so no cache helps either side.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

import torch

from pdserve.config import CacheConfig, ModelConfig
from pdserve.disagg.layout import KVLayout, op_addresses, plan_writes
from pdserve.disagg.protocol import KVRequest
from pdserve.disagg.sender import KVSender, RoomState
from pdserve.disagg.transfer import MooncakeTransferBackend, merge_contiguous
from pdserve.engine.model_runner import create_kv_pool

PRESETS = ("tiny-llama", "tiny-deepseek", "tiny-qwen3-moe")
POLL_S = 0.0002


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(PRESETS))
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--num-threads", type=int, default=1, help="torch threads of each server (part 2)")
    p.add_argument("--skip-ttft", action="store_true", help="part 1 only")
    p.add_argument("--output-file", help="append the results as one JSON line")
    return p.parse_args(argv)


# ------------------------------------------------------------------ part 1
class Pools:
    """A prefill pool and a decode pool of ``model``, each registered with its own engine."""

    def __init__(self, model: str, page_size: int, tokens: int):
        mc = ModelConfig.from_path(model)
        cache = CacheConfig(page_size, max_total_tokens=tokens + 4 * page_size)
        self.src, self.dst = (create_kv_pool(mc, cache, _single()) for _ in range(2))
        self.src_te, self.dst_te = MooncakeTransferBackend(), MooncakeTransferBackend()
        self.aux = torch.zeros(2, mc.hf_config.hidden_size)
        kind = "mla" if mc.is_mla else "gqa"
        self.layouts = [KVLayout.from_descriptors(kind, 1, mc.num_kv_heads, page_size, mc.dtype,
                                                  pool.buffer_descriptors()) for pool in (self.src, self.dst)]
        for te, pool in ((self.src_te, self.src), (self.dst_te, self.dst)):
            te.register([(d.base_addr, d.total_bytes) for d in pool.buffer_descriptors()]
                        + [(self.aux.data_ptr(), self.aux.numel() * 4)])
        for pool in (self.src, self.dst):
            for d in pool.buffer_descriptors():  # distinct bytes, so a missed write would be visible
                ctypes.memset(d.base_addr, 7 if pool is self.src else 0, d.total_bytes)
        self.pages = list(range((tokens - 1 + page_size - 1) // page_size))

    def ops(self):
        src, dst = self.layouts
        return plan_writes(src, dst, self.pages, self.pages)

    def addresses(self):
        bases = [{d.name: d.base_addr for d in pool.buffer_descriptors()} for pool in (self.src, self.dst)]
        return merge_contiguous(*op_addresses(self.ops(), *bases))

    def nbytes(self) -> int:
        return sum(op.nbytes for op in self.ops())

    def close(self) -> None:
        self.src_te.close()
        self.dst_te.close()


def _single():
    from pdserve.distributed.parallel_state import SINGLE

    return SINGLE


def time_pdserve(p: Pools, tokens: int, room: int) -> float:
    """The prefill server's path: open the room, stage every page, post layer by layer, aux, drain."""
    src_layout, dst_layout = p.layouts
    bases = {d.name: d.base_addr for d in p.src.buffer_descriptors()}
    sender = KVSender(p.src_te, src_layout, 0, bases, p.aux[:1])
    kv = KVRequest(room, "bench", 0, p.dst_te.session_id, [d.base_addr for d in p.dst.buffer_descriptors()],
                   dst_layout, p.pages, 0, tokens - 1, p.aux[1].data_ptr(), p.aux.shape[1] * 4, "tcp://unused:1")
    t0 = time.perf_counter()
    sender.open(room, {0: kv}, tokens - 1, time.monotonic())
    sender.stage(room, p.pages, tokens - 1)
    for layer in range(src_layout.num_layers):
        sender.on_layer(layer)
    sender.forward_done()
    sender.finish(room, torch.ones(p.aux.shape[1]))
    while sender.poll(room) is RoomState.DRAINING:
        time.sleep(POLL_S)  # as the scheduler loop does between polls (it never spins on the GIL)
    elapsed = time.perf_counter() - t0
    assert sender.poll(room) is RoomState.DONE, sender.rooms[room].error
    sender.close_room(room)
    return elapsed


def time_raw(p: Pools) -> float:
    """The same bytes (plus the aux row) in one raw Mooncake batch write, waited for."""
    srcs, dsts, lens = p.addresses()
    srcs, dsts, lens = srcs + [p.aux[0].data_ptr()], dsts + [p.aux[1].data_ptr()], lens + [p.aux.shape[1] * 4]
    te = p.src_te._te  # noqa: SLF001 - the engine under the backend, for the baseline
    t0 = time.perf_counter()
    rc = te.batch_transfer_sync_write(p.dst_te.session_id, srcs, dsts, lens)
    elapsed = time.perf_counter() - t0
    assert rc == 0, rc
    return elapsed


def time_memcpy(p: Pools) -> float:
    srcs, dsts, lens = p.addresses()
    t0 = time.perf_counter()
    for s, d, n in zip(srcs, dsts, lens):
        ctypes.memmove(d, s, n)
    return time.perf_counter() - t0


def part1(model: str, a: argparse.Namespace) -> dict:
    p = Pools(model, a.page_size, a.prompt_len)
    try:
        nbytes = p.nbytes() + p.aux.shape[1] * 4
        time_pdserve(p, a.prompt_len, 0)
        time_raw(p)  # warm-up: the first write opens the peer's segment
        times = {"pdserve": [], "raw": [], "memcpy": []}
        for r in range(a.repeats):  # interleaved, so drift hits all three alike
            times["pdserve"].append(time_pdserve(p, a.prompt_len, r + 1))
            times["raw"].append(time_raw(p))
            times["memcpy"].append(time_memcpy(p))
        med = {k: statistics.median(v) for k, v in times.items()}
        return {"model": model, "bytes": nbytes, "writes": len(p.addresses()[0]),
                **{f"{k}_gib_s": nbytes / v / 2**30 for k, v in med.items()},
                "pdserve_over_raw": med["raw"] / med["pdserve"], "pdserve_over_memcpy": med["memcpy"] / med["pdserve"]}
    finally:
        p.close()


# ------------------------------------------------------------------ part 2
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    def __init__(self, args: list[str]):
        self.proc = subprocess.Popen([sys.executable, "-m", "pdserve", *args], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _wait_healthy(url: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} not healthy after {timeout} s")


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


def part2(model: str, a: argparse.Namespace) -> dict:
    common = ["--model-path", model, "--page-size", str(a.page_size), "--num-threads", str(a.num_threads),
              "--log-level", "error"]
    ports = {k: _free_port() for k in ("colo", "prefill", "boot", "decode", "router")}
    url = {k: f"http://127.0.0.1:{ports[k]}" for k in ports}
    procs = [Proc(["serve", *common, "--port", str(ports["colo"])]),
             Proc(["serve", *common, "--port", str(ports["prefill"]), "--disaggregation-mode", "prefill",
                   "--disaggregation-bootstrap-port", str(ports["boot"])]),
             Proc(["serve", *common, "--port", str(ports["decode"]), "--disaggregation-mode", "decode"])]
    try:
        for k in ("colo", "prefill", "decode"):
            _wait_healthy(url[k])
        procs.append(Proc(["router", "--port", str(ports["router"]), "--prefill", url["prefill"], str(ports["boot"]),
                           "--decode", url["decode"], "--log-level", "error"]))
        _wait_healthy(url["router"])
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
            p.stop()


def main(argv=None) -> int:
    a = parse_args(argv)
    rows = []
    for model in a.models:
        row = part1(model, a)
        if not a.skip_ttft:
            row.update(part2(model, a))
        rows.append(row)
        print(_line(row, a), flush=True)
    if a.output_file:
        with open(a.output_file, "a") as f:
            f.write(json.dumps({"args": vars(a), "results": rows}) + "\n")
    return 0


def _line(r: dict, a: argparse.Namespace) -> str:
    s = (f"{r['model']}: {a.prompt_len}-token prompt, {r['bytes'] / 2**20:.1f} MiB in {r['writes']} writes | "
         f"pdserve {r['pdserve_gib_s']:.2f} GiB/s, raw Mooncake {r['raw_gib_s']:.2f} GiB/s, memcpy "
         f"{r['memcpy_gib_s']:.2f} GiB/s | pdserve/raw {r['pdserve_over_raw']:.2f}, "
         f"pdserve/memcpy {r['pdserve_over_memcpy']:.2f}")
    if "pd_over_colocated_ttft" in r:
        s += (f" | TTFT 1P1D {r['pd_ttft_s'] * 1000:.0f} ms vs colocated {r['colocated_ttft_s'] * 1000:.0f} ms "
              f"= {r['pd_over_colocated_ttft']:.2f}")
    return s


if __name__ == "__main__":
    sys.exit(main())
