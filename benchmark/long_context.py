"""One long prompt (64K tokens by default) on a tiny DeepSeek preset, served colocated and through
1P1D, and the KV + state bytes one token holds for DeepSeek-V3, V3.2 and V4 at the same tiny dims.

    python benchmark/long_context.py                          # tiny-deepseek-v4, a 65,536-token prompt
    python benchmark/long_context.py --tokens 16384 --model-path tiny-deepseek-v32
    python benchmark/long_context.py --bytes-only             # the bytes table alone (seconds)

1. **Bytes per token** (no server): for tiny-deepseek (V3, dense MLA), tiny-deepseek-v32 (V3.2, MLA
   + index keys) and tiny-deepseek-v4 (V4: window rows, compressor sources, compressed entries, CSA's
   index keys), ``ModelConfig.kv_bytes_per_token`` (what the KV budget divides by) and the pool's
   own bytes per token slot (every buffer of a pool built for ``--page-size``, over its slots).
2. **Colocated**: a ``pdserve serve`` and one ``/generate`` of the prompt (greedy,
   ``--new-tokens``): its wall time, almost all prefill.
3. **1P1D**: a prefill and a decode ``pdserve serve`` with ``pdserve router`` in front, the same
   request. Its output must equal the colocated one (the script fails otherwise), and decode's
   counters must show the prompt's KV arrived from prefill (received 1, no fallback): a fallback
   would recompute the prompt on decode and hide a broken transfer behind the same tokens.

The limits a long prompt meets are passed explicitly, never raised behind the operator's back:

* the presets' ``max_position_embeddings`` is 4096, so the servers get ``--context-length``
  (prompt + new tokens, rounded up to a page), as an operator serving past the config would;
* the KV pool is the servers' default budget (256 MiB) unless ``--kv-cache-memory-bytes`` says
  otherwise; a prompt that does not fit is refused by the server with a 400 naming the cache size
  in tokens, which the script prints (the bytes table says how many tokens a budget holds);
* ``--disaggregation-timeout-s`` bounds a room's wait *without progress* (docs/disaggregation.md,
  "Timeouts are about progress"): prefill reports each room it is computing, so the servers'
  default (30 s) serves a prefill longer than that; ``--pd-timeout-s`` sets another.

The two prefills take most of the time: for 64K tokens of tiny-deepseek-v4 about 41 s of CPU
each, ~100 s of wall time on a shared 2-core host (docs/benchmarking.md); run it alone.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import servers  # noqa: E402  (benchmark/servers.py, beside this script)

BYTES_MODELS = (("V3", "tiny-deepseek"), ("V3.2", "tiny-deepseek-v32"), ("V4", "tiny-deepseek-v4"))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default="tiny-deepseek-v4")
    p.add_argument("--tokens", type=int, default=65536, help="prompt length")
    p.add_argument("--new-tokens", type=int, default=4)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--chunked-prefill-size", type=int, default=None, help="the servers' default unless given")
    p.add_argument("--kv-cache-memory-bytes", default=None, help="the servers' default budget unless given")
    p.add_argument("--pd-timeout-s", type=float, default=None,
                   help="--disaggregation-timeout-s of both P/D servers (default: the servers' own, 30 s)")
    p.add_argument("--bytes-only", action="store_true", help="print the bytes table and stop")
    p.add_argument("--skip-pd", action="store_true", help="colocated only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-file", default=None, help="append the result as one JSON line")
    return p.parse_args(argv)


# ------------------------------------------------------------------ bytes per token
def pool_bytes_per_slot(model_path: str, page_size: int) -> tuple[int, float]:
    """(``ModelConfig.kv_bytes_per_token``, the bytes per slot of a pool built for ``model_path``)."""
    from pdserve.config import CacheConfig, ModelConfig
    from pdserve.distributed.parallel_state import SINGLE
    from pdserve.engine.model_runner import create_kv_pool

    mc = ModelConfig.from_path(model_path)
    pool = create_kv_pool(mc, CacheConfig(page_size=page_size, max_total_tokens=4 * page_size), SINGLE)
    total = sum(buf.numel() * buf.element_size() for _, buf in pool.page_buffers())
    return mc.kv_bytes_per_token(), total / (pool.num_pages * pool.page_size)


def bytes_table(page_size: int, context: int = 65536) -> list[dict]:
    """Per preset: the page layout's bytes per token (declared, and a pool's slots measured), and what the
    servers run, colocated and in P/D: V4's bounded layout at ``context`` tokens (its pages' bytes per
    token plus one request's record spread over them; the same as the page layout for V3 and V3.2)."""
    from pdserve.config import ModelConfig

    rows = []
    for label, path in BYTES_MODELS:
        declared, measured = pool_bytes_per_slot(path, page_size)
        served = ModelConfig.from_path(path).kv_bytes_per_token("auto", page_size, bounded=True, context=context)
        rows.append({"model": label, "preset": path, "kv_bytes_per_token": declared, "pool_bytes_per_slot": measured,
                     "served_bytes_per_token": served})
    base = rows[0]["pool_bytes_per_slot"]
    for r in rows:
        r["vs_v3"] = r["pool_bytes_per_slot"] / base
        r["served_vs_v3"] = r["served_bytes_per_token"] / rows[0]["served_bytes_per_token"]
    return rows


# ------------------------------------------------------------------ serving
def post(url: str, body: dict, timeout: float = 3600.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{url}: {e.code} {e.read().decode(errors='replace')}") from None


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def server_flags(a: argparse.Namespace, context: int) -> list[str]:
    flags = ["--model-path", a.model_path, "--page-size", str(a.page_size), "--context-length", str(context),
             "--log-level", "error"]
    if a.chunked_prefill_size is not None:
        flags += ["--chunked-prefill-size", str(a.chunked_prefill_size)]
    if a.kv_cache_memory_bytes is not None:
        flags += ["--kv-cache-memory-bytes", str(a.kv_cache_memory_bytes)]
    return flags


def generate(url: str, prompt: list[int], new_tokens: int) -> tuple[list[int], float]:
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0.0,
                                                     "ignore_eos": True}}
    t0 = time.perf_counter()
    out = post(url + "/generate", body)
    return out["output_ids"], time.perf_counter() - t0


def run_colocated(a: argparse.Namespace, prompt: list[int], context: int) -> dict:
    port = servers.free_port()
    proc = servers.start(["serve", *server_flags(a, context), "--port", str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        servers.wait_healthy(url, proc)
        ids, wall = generate(url, prompt, a.new_tokens)
        return {"output_ids": ids, "wall_s": wall}
    finally:
        servers.stop(proc)


def run_pd(a: argparse.Namespace, prompt: list[int], context: int, timeout_s: float) -> dict:
    flags = [*server_flags(a, context), "--disaggregation-timeout-s", str(timeout_s)]
    pport, dport, boot, rport = (servers.free_port() for _ in range(4))
    prefill_url, decode_url = f"http://127.0.0.1:{pport}", f"http://127.0.0.1:{dport}"
    procs = [servers.start(["serve", *flags, "--port", str(pport), "--disaggregation-mode", "prefill",
                            "--disaggregation-bootstrap-port", str(boot)]),
             servers.start(["serve", *flags, "--port", str(dport), "--disaggregation-mode", "decode"])]
    try:
        servers.wait_healthy(prefill_url, procs[0])
        servers.wait_healthy(decode_url, procs[1])
        procs.append(servers.start(["router", "--prefill", prefill_url, str(boot), "--decode", decode_url,
                                    "--port", str(rport), "--log-level", "error"]))
        router = f"http://127.0.0.1:{rport}"
        servers.wait_healthy(router, procs[2])
        ids, wall = generate(router, prompt, a.new_tokens)
        d = get(decode_url + "/get_server_info")
        keys = ("kv_received", "fallbacks", "transfer_failures", "kv_pages_received", "kv_bytes_received")
        return {"output_ids": ids, "wall_s": wall, **{k: d.get(k) for k in keys}}
    finally:
        for proc in reversed(procs):
            servers.stop(proc)


def main(argv=None) -> int:
    a = parse_args(argv)
    table = bytes_table(a.page_size, a.tokens)
    print(f"KV + state bytes per token (float32, tiny dims: hidden 128; page layout, and as served at "
          f"{a.tokens:,} tokens: V4's bounded layout, colocated and P/D):")
    for r in table:
        print(f"  {r['model']:5s} {r['preset']:18s} kv_bytes_per_token {r['kv_bytes_per_token']:6,d}  "
              f"pool bytes/slot {r['pool_bytes_per_slot']:8,.0f}  vs V3 {r['vs_v3']:.2f}  "
              f"served {r['served_bytes_per_token']:6,d}  vs V3 {r['served_vs_v3']:.3f}")
    result: dict = {"args": vars(a), "bytes_per_token": table}
    if not a.bytes_only:
        context = -(-(a.tokens + a.new_tokens) // a.page_size) * a.page_size
        g = torch.Generator().manual_seed(a.seed)
        prompt = torch.randint(3, 2000, (a.tokens,), generator=g).tolist()
        colo = run_colocated(a, prompt, context)
        print(f"colocated: {a.tokens:,} prompt tokens + {a.new_tokens} in {colo['wall_s']:.1f} s "
              f"({a.tokens / colo['wall_s']:,.0f} prompt tokens/s)")
        result["colocated"] = colo
        if not a.skip_pd:
            timeout_s = a.pd_timeout_s or 30.0  # the servers' default: a long prefill reports progress
            pd = run_pd(a, prompt, context, timeout_s)
            same = pd["output_ids"] == colo["output_ids"]
            print(f"1P1D: {pd['wall_s']:.1f} s, output {'equals' if same else 'DIFFERS FROM'} colocated; decode "
                  f"received {pd['kv_received']} room(s), {pd['kv_pages_received']} pages, "
                  f"{pd['kv_bytes_received']:,} bytes ({pd['kv_bytes_received'] / (a.tokens - 1):,.0f} per "
                  f"prompt token), fallbacks {pd['fallbacks']} (--disaggregation-timeout-s {timeout_s:.0f})")
            result["1P1D"] = {**pd, "timeout_s": timeout_s, "equals_colocated": same}
            if not same or pd["kv_received"] != 1 or pd["fallbacks"]:
                print("FAILED: 1P1D must give the colocated output from KV that prefill sent", file=sys.stderr)
                return 1
    if a.output_file:
        with open(a.output_file, "a") as f:
            f.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
