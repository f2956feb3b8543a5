"""What clients see when the only prefill server dies, behind ``pdserve router`` or sglang-router.

1 prefill + 1 decode pdserve server and a router in front. 8 greedy streams are sent, the prefill
is killed (SIGKILL of its process group) while they run, 8 more requests follow. For each request:
completed or failed (HTTP status or error event), seconds to its end, tokens right or wrong
(against the decode server's own colocated answer). Then the prefill is restarted on the same
ports and we measure how long until the router sends it requests again (the prefill's own request
counter grows), sending one request a second.

    python benchmark/prefill_kill.py --router pdserve
    python benchmark/prefill_kill.py --router sglang   # needs sglang-router (pip install sglang-router)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

from servers import free_port, start, stop, wait_healthy

PROMPTS = [f"Request {i}: tell me about the number {i * 7}" for i in range(16)]
REQUEST_TIMEOUT_S = 300.0
COME_BACK_LIMIT_S = 300.0


@dataclass
class Outcome:
    index: int
    ok: bool
    right: bool | None
    seconds: float
    detail: str


def sampling(n: int) -> dict:
    return {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}


def ask(url: str, prompt: str, n: int, stream: bool) -> list[int]:
    body = {"text": prompt, "sampling_params": sampling(n), "stream": stream}
    if not stream:
        r = httpx.post(url + "/generate", json=body, timeout=REQUEST_TIMEOUT_S)
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:120]}")
        return r.json()["output_ids"]
    last = None
    with httpx.stream("POST", url + "/generate", json=body, timeout=REQUEST_TIMEOUT_S) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:120]!r}")
        for line in r.iter_lines():
            if line.startswith("data: {"):
                last = json.loads(line[6:])
                if "error" in last:
                    raise RuntimeError(f"error event: {last['error'].get('message', '')[:120]}")
    if last is None:
        raise RuntimeError("stream ended with no event")
    return last["output_ids"]


def timed(i: int, url: str, prompt: str, n: int, stream: bool, want: list[int]) -> Outcome:
    t0 = time.monotonic()
    try:
        got = ask(url, prompt, n, stream)
        return Outcome(i, True, got == want, time.monotonic() - t0, "")
    except (RuntimeError, httpx.HTTPError) as e:
        return Outcome(i, False, None, time.monotonic() - t0, f"{type(e).__name__}: {e}")


class Deployment:
    def __init__(self, router: str, model: str, health_interval: float | None):
        self.kind, self.model = router, model
        self.pport, self.dport, self.rport, self.boot = free_port(), free_port(), free_port(), free_port()
        self.prefill_args = ["serve", "--model-path", model, "--port", str(self.pport), "--disaggregation-mode",
                             "prefill", "--disaggregation-bootstrap-port", str(self.boot), "--num-threads", "1"]
        self.decode_args = ["serve", "--model-path", model, "--port", str(self.dport), "--disaggregation-mode",
                            "decode", "--num-threads", "1"]
        self.health_interval = health_interval
        self.procs: dict[str, subprocess.Popen] = {}

    url = property(lambda self: f"http://127.0.0.1:{self.rport}")
    purl = property(lambda self: f"http://127.0.0.1:{self.pport}")
    durl = property(lambda self: f"http://127.0.0.1:{self.dport}")

    def start(self) -> None:
        self.procs["prefill"] = start(self.prefill_args, [0])
        self.procs["decode"] = start(self.decode_args, [1] if os.cpu_count() > 1 else [0])
        wait_healthy(self.purl, self.procs["prefill"])
        wait_healthy(self.durl, self.procs["decode"])
        self.procs["router"] = subprocess.Popen(self.router_cmd(), stdout=subprocess.DEVNULL,
                                                stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # sglang-router registers workers in the background
            try:
                if httpx.post(self.url + "/generate", json={"text": "hi", "sampling_params": sampling(1)},
                              timeout=30).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("router not serving after 120 s")

    def router_cmd(self) -> list[str]:
        workers = ["--prefill", self.purl, str(self.boot), "--decode", self.durl, "--host", "127.0.0.1",
                   "--port", str(self.rport)]
        interval = [] if self.health_interval is None else ["--health-check-interval-secs", f"{self.health_interval:g}"]
        if self.kind == "sglang":
            return [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation", *workers, *interval]
        return [sys.executable, "-m", "pdserve", "router", *workers, *interval]

    def kill_prefill(self) -> None:
        os.killpg(self.procs["prefill"].pid, signal.SIGKILL)
        self.procs["prefill"].wait()

    def restart_prefill(self) -> float:
        self.procs["prefill"] = start(self.prefill_args, [0])
        wait_healthy(self.purl, self.procs["prefill"])
        return time.monotonic()

    def decode_info(self) -> dict:
        return httpx.get(self.durl + "/get_server_info", timeout=30).json()

    def close(self) -> None:
        for p in self.procs.values():
            stop(p)


def prefill_requests(dep: Deployment) -> float:
    """Requests the prefill server has finished (its own counter, summed over finish reasons)."""
    text = httpx.get(dep.purl + "/metrics", timeout=30).text
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.startswith("pdserve:num_requests_total"))


def come_back(dep: Deployment, n: int) -> dict:
    """Seconds from the restarted prefill's first healthy answer until the router sends it a request
    (its request counter grows; one request a second), requests sent meanwhile, and whether decode
    then took the KV from it."""
    healthy_at = dep.restart_prefill()
    sent = 0
    kv_before = dep.decode_info()["kv_received"]
    while time.monotonic() - healthy_at < COME_BACK_LIMIT_S:
        before = prefill_requests(dep)
        # a prompt decode has not cached: with all of it cached decode asks for no KV at all
        timed(0, dep.url, f"Come back, prefill: attempt {sent}", n, False, [])
        sent += 1
        if prefill_requests(dep) > before:
            return {"back_after_s": round(time.monotonic() - healthy_at, 1), "requests_until_back": sent,
                    "decode_took_kv_after_restart": dep.decode_info()["kv_received"] > kv_before}
        time.sleep(1.0)
    return {"back_after_s": None, "requests_until_back": sent, "decode_took_kv_after_restart": False}


def run(args) -> dict:
    dep = Deployment(args.router, args.model, args.health_check_interval_secs)
    try:
        dep.start()
        want = [ask(dep.durl, p, args.max_new_tokens, False) for p in PROMPTS]  # decode alone: colocated
        before = dep.decode_info()
        with ThreadPoolExecutor(16) as pool:
            first = [pool.submit(timed, i, dep.url, p, args.max_new_tokens, True, want[i])
                     for i, p in enumerate(PROMPTS[:8])]
            killer = threading.Timer(args.kill_after_s, dep.kill_prefill)
            killer.start()
            killer.join()
            after = [pool.submit(timed, 8 + i, dep.url, p, args.max_new_tokens, i % 2 == 0, want[8 + i])
                     for i, p in enumerate(PROMPTS[8:])]
            outcomes = [f.result() for f in first + after]
        mid = dep.decode_info()
        back = come_back(dep, args.max_new_tokens)
        return {"router": args.router, "outcomes": [o.__dict__ for o in outcomes],
                "completed": sum(o.ok for o in outcomes), "right": sum(bool(o.right) for o in outcomes),
                "failed": sum(not o.ok for o in outcomes),
                "slowest_s": max(o.seconds for o in outcomes),
                "decode_fallbacks": mid.get("fallbacks", 0) - before.get("fallbacks", 0),
                "decode_local_prefills": mid.get("local_prefills", 0) - before.get("local_prefills", 0),
                **back}
    finally:
        dep.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--router", choices=("pdserve", "sglang"), default="pdserve")
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--kill-after-s", type=float, default=0.3, help="after the first 8 requests are sent")
    p.add_argument("--health-check-interval-secs", type=float, default=None, help="default: the router's own")
    args = p.parse_args()
    result = run(args)
    for o in result["outcomes"]:
        print(f"  #{o['index']:2d} {'ok ' if o['ok'] else 'ERR'} {o['seconds']:6.1f} s"
              f" {'' if o['right'] is None else ('right' if o['right'] else 'WRONG')} {o['detail']}")
    print(json.dumps({k: v for k, v in result.items() if k != "outcomes"}))


if __name__ == "__main__":
    main()
