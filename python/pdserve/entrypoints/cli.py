"""The ``pdserve`` command line: ``pdserve serve | router | up | bench | plan``.

Flag names are SGLang's. Each flag's ``dest`` is the ServerArgs field it sets,
so a flag added to a group below only needs a matching ServerArgs field.
Errors in the arguments (argparse's or ServerArgs validation) exit with code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import secrets
import sys

from pdserve import __version__
from pdserve.bench import config as bench_config
from pdserve.config import (
    API_KEY_ENV,
    ATTENTION_BACKENDS,
    CPU_GEMMS,
    DEEPEP_MODES,
    DEVICES,
    DISAGG_MODES,
    DTYPES,
    FALLBACK_POLICIES,
    GRAMMAR_BACKENDS,
    HICACHE_MEM_LAYOUTS,
    HICACHE_PREFETCH_POLICIES,
    HICACHE_STORAGE_BACKENDS,
    HICACHE_WRITE_POLICIES,
    INDEX_CACHE_DTYPES,
    KV_CACHE_DTYPES,
    KV_HASH_KEY_ENV,
    LOAD_FORMATS,
    MOE_A2A_BACKENDS,
    PACK_POLICIES,
    REASONING_PARSERS,
    SCHEDULE_POLICIES,
    SPECULATIVE_ALGORITHMS,
    TOOL_CALL_PARSERS,
    TRANSFER_BACKENDS,
    ServerArgs,
    resolve_token,
)
from pdserve.router.config import PrefillSpec, RouterArgs, normalize_url
from pdserve.router.policy import POLICIES
from pdserve.web.api_key import ADMIN_KEY_ENV, unauthenticated_refusal

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_FIELDS = {f.name: f for f in dataclasses.fields(ServerArgs)}


def _default(name: str):
    return _FIELDS[name].default


ORIGIN_HELP = {
    "hosts": "comma-separated Host names a request may carry besides the bound address (and loopback names on a "
             "loopback bind); '*': any. Bound to 0.0.0.0 without it, Host is not checked (docs/security.md)",
    "origins": "comma-separated origins (scheme://host:port) a browser's POST may come from besides the server's "
               "own; '*': any (docs/security.md)"}


def names_list(text: str) -> tuple[str, ...]:
    """``a.example,b.example`` -> ("a.example", "b.example")."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _flag(group, name: str, help: str, **kw) -> None:
    """``--page-size`` -> ServerArgs.page_size, defaulting to the dataclass default."""
    dest = name.lstrip("-").replace("-", "_")
    if kw.get("action") != "store_true":
        kw.setdefault("default", _default(dest))
        if kw["default"] not in (None, ()):
            help += " (default: %(default)s)"
    group.add_argument(name, dest=dest, help=help, **kw)


def _byte_size(text: str) -> int:
    """``--kv-cache-memory-bytes``: an integer with an optional K/M/G (1000s) or Ki/Mi/Gi (1024s) suffix."""
    units = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30}
    t = text.strip().lower().removesuffix("b")
    digits = t.rstrip("kmgi")
    try:
        return int(float(digits) * units[t[len(digits):]])
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size in bytes (e.g. 4294967296, 4Gi, 512M)") from None


def _admin_key_flag(group, more: str = "") -> None:
    """``--admin-api-key``, defaulting to $PDSERVE_ADMIN_API_KEY (how pdserve up passes it: not on argv,
    where ps shows it); the help never prints the default."""
    group.add_argument("--admin-api-key", dest="admin_api_key", default=os.environ.get(ADMIN_KEY_ENV) or None,
                       help="admin routes (/flush_cache, /pd_role_switch, abort_all, aborting other clients' "
                       f"requests) need 'Authorization: Bearer KEY'; the --api-key is not enough{more} "
                       f"(default: ${ADMIN_KEY_ENV})")


# ----------------------------------------------------------- flag groups
def add_model_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model")
    g.add_argument("--model-path", dest="model_path", required=True,
                   help="model directory (HF layout) or a built-in preset name, e.g. tiny-deepseek")
    _flag(g, "--tokenizer-path", "tokenizer directory (default: the model's)")
    _flag(g, "--load-format", "weight format; presets default to random 'dummy' weights",
          choices=LOAD_FORMATS)
    _flag(g, "--dtype", "weight dtype, and KV dtype unless --kv-cache-dtype; auto: bfloat16 on CUDA, float32 on CPU",
          choices=("auto", *DTYPES))
    _flag(g, "--context-length", "override the model's max_position_embeddings", type=int)
    _flag(g, "--served-model-name", "model name reported by the OpenAI API (default: --model-path)")
    _flag(g, "--skip-tokenizer-init", "serve input_ids only; no tokenizer is loaded", action="store_true")


def add_http_args(parser: argparse.ArgumentParser, per_server: bool = True) -> None:
    """``per_server`` False (``pdserve up``): without the flags up has its own of."""
    g = parser.add_argument_group("HTTP server")
    if per_server:
        _flag(g, "--host", "interface to listen on")
        _flag(g, "--port", "port to listen on", type=int)
        _flag(g, "--api-key", "require 'Authorization: Bearer <key>' on every API call (default: $PDSERVE_API_KEY, "
              "which ps does not show)")
        _admin_key_flag(g)
        _flag(g, "--allow-no-api-key", "listen beyond the loopback (--host) without --api-key: refused otherwise",
              action="store_true")
    _flag(g, "--allowed-hosts", ORIGIN_HELP["hosts"], type=names_list)
    _flag(g, "--allowed-origins", ORIGIN_HELP["origins"], type=names_list)
    _flag(g, "--max-request-bytes", "refuse larger request bodies with a 413, before parsing them", type=int)
    _flag(g, "--kv-events-config", 'publish KV cache events (JSON, SGLang\'s): {"publisher": "zmq"} binds --host '
          'port 5557 (or give "endpoint"); the address is reported in /get_server_info, GET /kv_events/snapshot '
          'resyncs; token ids only on a loopback bind (docs/security.md)')
    _flag(g, "--cache-salt-per-client", "cache isolation: each client (API key and X-Client-Token) matches and "
          "fills its own prefix cache, as if every request carried its own cache_salt (docs/security.md)",
          action="store_true")
    if per_server:  # up has its own (a key it makes when none is given)
        _flag(g, "--kv-hash-key-file", "a file whose first line keys the KV block hashes (KV events, the router's "
              "cache_aware matching, storage keys): the same in every server and router of a deployment; without "
              f"it ${KV_HASH_KEY_ENV}, else unkeyed, and then KV events stay on loopback (docs/security.md)")


def add_memory_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("memory and scheduling")
    _flag(g, "--page-size", "tokens per KV page", type=int)
    _flag(g, "--kv-cache-dtype", "KV pool dtype; auto: the model's (--dtype), fp8_e4m3: float8_e4m3fn with "
          "per-tensor scales 1.0, a quarter of fp32's bytes (docs/kv-cache.md)", choices=KV_CACHE_DTYPES)
    _flag(g, "--index-cache-dtype", "DeepSeek-V3.2's index keys; auto: fp8_e4m3 on CUDA, the model's dtype on CPU; "
          "fp8_e4m3: e4m3 with a float32 scale per 128 values, as DeepSeek's reference (docs/models.md)",
          choices=INDEX_CACHE_DTYPES)
    _flag(g, "--max-total-tokens", "KV pool size in tokens; with a budget flag below, a cap on what it gives "
          "(default: from the budget)", type=int)
    _flag(g, "--mem-fraction-static", "the KV pool gets this fraction of the device's memory less what is in use "
          "after loading the weights (GPU: all of it; CPU: this process's); docs/kv-cache.md", type=float)
    _flag(g, "--kv-cache-memory-bytes", "the KV pool's memory in bytes (suffixes K, M, G, Ki, Mi, Gi; vLLM's flag); "
          "default without it or --mem-fraction-static: 256 MiB", type=_byte_size)
    _flag(g, "--max-running-requests", "most requests in the running batch", type=int)
    _flag(g, "--chunked-prefill-size", "prefill tokens per step; <= 0 disables chunking", type=int)
    _flag(g, "--max-prefill-tokens", "most prompt tokens in one prefill batch", type=int)
    _flag(g, "--schedule-policy", "order in which waiting requests are admitted", choices=SCHEDULE_POLICIES)
    _flag(g, "--disable-radix-cache", "do not reuse KV of shared prefixes", action="store_true")
    _flag(g, "--max-seqs-per-request", "most sequences one API request may run (prompts x n, or x best_of); "
          "more get a 400. Requests take turns at admission, so a big one does not hold up the others", type=int)
    _flag(g, "--max-logprobs", "most top logprobs per token a request may ask for (top_logprobs_num, logprobs, "
          "top_logprobs), prompt tokens included; more get a 400. -1: up to the vocabulary", type=int)


def add_hicache_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("hierarchical KV cache (docs/hicache.md)")
    _flag(g, "--enable-hierarchical-cache", "keep evicted prefix KV in host memory (and storage) and load it "
          "back on a hit", action="store_true")
    _flag(g, "--hicache-ratio", "host pool pages per device pool page", type=float)
    _flag(g, "--hicache-size", "host pool size in GB; > 0 overrides --hicache-ratio", type=float)
    _flag(g, "--hicache-write-policy", "when device pages are copied to host", choices=HICACHE_WRITE_POLICIES)
    _flag(g, "--hicache-mem-layout", "host pool layout (page_first: one page contiguous, for storage)",
          choices=HICACHE_MEM_LAYOUTS)
    _flag(g, "--hicache-storage-backend", "tier below host memory (default: none)",
          choices=HICACHE_STORAGE_BACKENDS)
    _flag(g, "--hicache-storage-dir", "directory of the file storage tier")
    _flag(g, "--hicache-storage-size-gb", "bound on the storage tier's bytes (0: 4 GB)", type=float)
    _flag(g, "--hicache-storage-prefetch-policy", "how long a storage hit may keep a request waiting",
          choices=HICACHE_PREFETCH_POLICIES)
    _flag(g, "--hicache-storage-chunk-tokens", "tokens per storage object, a multiple of --page-size (0: the "
          "smallest multiple >= 64)", type=int)
    _flag(g, "--hicache-storage-backend-extra-config", "JSON object of backend settings (Mooncake's key names)")


def add_runtime_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("runtime")
    _flag(g, "--random-seed", "seed for weights of dummy models and for sampling", type=int)
    _flag(g, "--num-threads", "torch threads of the scheduler process (default: OMP_NUM_THREADS, else all "
          "cores but one for the HTTP frontend and one for the overlapped scheduler thread; at least 1); given, it "
          "also pins the count the thread tuner would choose per step", type=int)
    _flag(g, "--disable-overlap-schedule", "run decode forwards on the scheduler thread instead of one step ahead "
          "on a worker thread (docs/overlap.md)", action="store_true")
    _flag(g, "--disable-thread-tuning", "keep the forward's torch threads at the start-up layout's count instead "
          "of choosing per step from measured step times between it and all cores (docs/overlap.md)",
          action="store_true")
    _flag(g, "--cpu-gemm", "CPU linears: auto (oneDNN-packed weights where they pay), packed (always), plain "
          "(F.linear)", choices=CPU_GEMMS)
    _flag(g, "--enable-torch-compile", "compile decode forwards with torch.compile (inductor), per batch-size "
          "bucket; compiled at start-up", action="store_true")
    _flag(g, "--torch-compile-max-bs", "largest decode batch run compiled (buckets 1, 2, 4, ... up to it)",
          type=int)
    _flag(g, "--speculative-algorithm", "speculative decoding: NEXTN (DeepSeek's MTP layer drafts) or EAGLE "
          "(a draft checkpoint)", choices=SPECULATIVE_ALGORITHMS)
    _flag(g, "--speculative-draft-model-path", "draft checkpoint (EAGLE; NEXTN: default the target's own MTP "
          "layer)")
    _flag(g, "--speculative-num-steps", "draft tokens proposed per decode step", type=int)
    _flag(g, "--speculative-eagle-topk", "draft branches per step (1: chain drafts, the only kind for now)",
          type=int)
    _flag(g, "--speculative-num-draft-tokens", "tokens verified per step (num-steps + 1 with topk 1)", type=int)
    _flag(g, "--grammar-backend", "constrained decoding backend for json_schema / regex / ebnf requests "
          "(none: such requests get a 400; docs/structured-outputs.md)", choices=GRAMMAR_BACKENDS)
    _flag(g, "--grammar-compile-timeout", "seconds a grammar may take to compile; past it only that request fails",
          type=float)
    _flag(g, "--grammar-cache-size", "compiled grammars kept, by kind and text (least recently used dropped)",
          type=int)
    _flag(g, "--grammar-max-compiles-per-client", "new grammar compiles one client (API key, X-Client-Token, peer) "
          "may have queued or running; one more is a 429", type=int)
    _flag(g, "--constrained-json-disable-any-whitespace", "JSON output without free whitespace between tokens "
          "(SGLang's flag; the default now)", action="store_true")
    _flag(g, "--constrained-json-any-whitespace", "JSON output may carry any whitespace between its tokens (a "
          "model may pad with newlines until max_tokens; docs/structured-outputs.md)", action="store_true")
    _flag(g, "--grammar-jump-forward", "append the text a grammar allows as its only continuation without "
          "sampling it (fewer steps, other tokens; --no-grammar-jump-forward samples every token; "
          "docs/structured-outputs.md)", action=argparse.BooleanOptionalAction)
    _flag(g, "--grammar-compile-isolation", "check a client's constraint by compiling it in a child process with "
          "CPU and memory limits, killed when nobody waits for it (--no-grammar-compile-isolation: on the "
          "frontend's threads; docs/structured-outputs.md)", action=argparse.BooleanOptionalAction)
    _flag(g, "--grammar-compile-memory-mb", "address space (MiB) one isolated grammar compile may add; past it the "
          "request gets a 400", type=int)
    _flag(g, "--log-level", "logging level of every process", choices=LOG_LEVELS)
    _flag(g, "--stream-interval", "send streamed text every N tokens (first and last always)", type=int)


def add_parallel_args(parser: argparse.ArgumentParser, per_server: bool = True) -> None:
    """``per_server`` False (``pdserve up``): without the flags of a server over several nodes."""
    g = parser.add_argument_group("parallelism (one scheduler process per rank)")
    _flag(g, "--tp-size", "tensor-parallel ranks (with --enable-dp-attention: every rank)", type=int)
    _flag(g, "--dp-size", "data-parallel replicas, or attention groups with --enable-dp-attention", type=int)
    _flag(g, "--enable-dp-attention", "attention in --dp-size groups owning whole requests; dense and MoE "
          "layers over all --tp-size ranks (MLA models)", action="store_true")
    _flag(g, "--ep-size", "expert-parallel ranks: 1, or --tp-size to place routed experts whole", type=int)
    _flag(g, "--moe-a2a-backend", "how EP moves tokens to experts: torch.distributed all-to-all, or DeepEP "
          "(CUDA only)", choices=MOE_A2A_BACKENDS)
    if not per_server:
        return
    _flag(g, "--dist-init-addr", "host:port of node 0 for the ranks' rendezvous (needed with --nnodes > 1)")
    _flag(g, "--nnodes", "nodes the ranks are spread over", type=int)
    _flag(g, "--node-rank", "this node's index; nodes > 0 run their ranks only, node 0 the server too", type=int)


def add_disagg_args(parser: argparse.ArgumentParser, per_server: bool = True) -> None:
    """``per_server`` False (``pdserve up``): the flags every server of a deployment shares."""
    g = parser.add_argument_group("prefill/decode disaggregation")
    if per_server:
        _flag(g, "--disaggregation-mode", "run as a colocated server (null), a prefill or a decode server",
              choices=DISAGG_MODES)
        _flag(g, "--disaggregation-bootstrap-port", "prefill: port of the bootstrap registry decode servers read",
              type=int)
        _flag(g, "--disaggregation-bootstrap-allow", "decode: prefill registries (HOST:PORT ...) a request may "
              "name without the router's signature (sglang-router); otherwise only a router holding the P/D token, "
              "or on a server without one the loopback", nargs="+", metavar="HOST:PORT")
    _flag(g, "--disaggregation-transfer-backend", "KV transfer engine (mooncake or nixl; memory: in-process test "
          "pairs only, refused by servers)", choices=TRANSFER_BACKENDS)
    _flag(g, "--disaggregation-ib-device", "RDMA device(s) for KV transfer, e.g. mlx5_0 (default: TCP)")
    _flag(g, "--disaggregation-timeout-s", "the longest wait without progress: an unpaired room, a room's KV "
          "(a slow but progressing prefill never trips it), writes draining", type=float)
    _flag(g, "--disaggregation-heartbeat-s", "decode: how often it checks the prefill servers it waits on",
          type=float)
    _flag(g, "--disaggregation-fallback", "decode, when a transfer fails: prefill locally or fail the request",
          choices=FALLBACK_POLICIES)
    _flag(g, "--disaggregation-min-prefill-tokens", "decode: prefill locally when it would receive fewer "
          "tokens than this (0: always transfer)", type=int)
    _flag(g, "--disaggregation-transfer-pack", "decode: move a room's KV as one packed write per forward and head "
          "block instead of one per page (auto: when prefill and decode split heads differently)",
          choices=PACK_POLICIES)
    _flag(g, "--disaggregation-pack-staging-mb", "registered staging buffer per rank for packed transfers, in MiB "
          "(0: none; a room that does not fit moves unpacked)", type=int)
    _flag(g, "--disaggregation-auth-token", "token shared by every prefill and decode server: bootstrap requests "
          "and control messages carry an HMAC under it (prefer the file or PDSERVE_DISAGGREGATION_AUTH_TOKEN: a "
          "flag shows in the process list)")
    _flag(g, "--disaggregation-auth-token-file", "file whose first line is the shared token")
    _flag(g, "--disaggregation-allow-unauthenticated", "without a token, accept P/D peers off the loopback "
          "(a private network you trust)", action="store_true")


def add_device_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("device and kernels (docs/gpu.md)")
    _flag(g, "--device", "where the model runs (default: cuda when torch sees a GPU, else cpu)", choices=DEVICES)
    _flag(g, "--attention-backend", "attention kernels (default: flashinfer on cuda, torch_native on cpu; "
          "triton on cpu needs TRITON_INTERPRET=1)", choices=ATTENTION_BACKENDS)
    _flag(g, "--cuda-graph-max-bs", "largest decode batch run as a captured CUDA graph", type=int)
    _flag(g, "--disable-cuda-graph", "run every decode step eagerly (CUDA graphs are never used on cpu)",
          action="store_true")
    _flag(g, "--deepep-mode", "with --moe-a2a-backend deepep: normal kernels (prefill), low_latency (decode), "
          "or auto (by step)", choices=DEEPEP_MODES)


def add_parser_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("OpenAI API output parsing (docs/structured-outputs.md)")
    _flag(g, "--tool-call-parser", "the model family's tool-call format, parsed into message.tool_calls under "
          "tool_choice auto (required and named choices need none)", choices=TOOL_CALL_PARSERS, type=str.lower)
    _flag(g, "--reasoning-parser", "split the model's thinking part into reasoning_content", choices=REASONING_PARSERS,
          type=str.lower)


SERVER_ARG_GROUPS = (add_model_args, add_http_args, add_memory_args, add_hicache_args, add_parallel_args,
                     add_runtime_args, add_disagg_args, add_device_args, add_parser_args)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    for add in SERVER_ARG_GROUPS:
        add(parser)


def server_args_from_namespace(ns: argparse.Namespace) -> ServerArgs:
    """ServerArgs from parsed flags; raises ValueError (naming the field) if they are invalid."""
    return _checked_args(ns)[0]


def _checked_args(ns: argparse.Namespace):
    """(ServerArgs, ModelFiles): the model path and architecture are resolved and every refusal
    checked now, not after forking, and the model read here is the frontend's one read of
    config.json. Imports no torch for a CPU server (the frontend's start-up: seconds of CPU)."""
    from pdserve.engine.device_check import require_device

    kwargs = {k: v for k, v in vars(ns).items() if k in _FIELDS}
    kwargs["api_key"] = _api_key(kwargs.get("api_key"))
    args = ServerArgs(**kwargs)
    args.disagg_config().check_servable()
    model_files = args.model_files()
    if args.moe_a2a_backend != "none":  # whether the EP backend can run on this host ("none" needs nothing)
        from pdserve.layers.moe.dispatch import require_backend  # imports torch

        require_backend(args.moe_a2a_backend)
    require_device(args.device_config())  # --device / --attention-backend on this host
    return args, model_files


def _api_key(flag: str | None) -> str | None:
    """``--api-key``, else ``PDSERVE_API_KEY`` (a flag shows in ps; ``pdserve up`` uses the variable)."""
    return flag or os.environ.get(API_KEY_ENV, "").strip() or None


# ------------------------------------------------------------- router
_ROUTER_FIELDS = {f.name: f for f in dataclasses.fields(RouterArgs)}


def _router_flag(group, name: str, help: str, **kw) -> None:
    """``--health-check-interval-secs`` -> RouterArgs.health_check_interval_secs (sglang-router's names)."""
    dest = name.lstrip("-").replace("-", "_")
    kw.setdefault("default", _ROUTER_FIELDS[dest].default)
    if kw["default"] not in (None, False, ()):  # a switch or a list says nothing by its default
        help += " (default: %(default)s)"
    group.add_argument(name, dest=dest, help=help, **kw)


def add_router_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workers")
    g.add_argument("--prefill", nargs="+", action="append", metavar=("URL", "BOOTSTRAP_PORT"),
                   help="a prefill server and its bootstrap port (default: 8998); repeat for more (needed unless "
                   "--service-discovery or --workers-file finds them)")
    g.add_argument("--decode", action="append", metavar="URL",
                   help="a decode server; repeat for more (needed unless discovery finds them)")
    g = parser.add_argument_group("routing")
    _router_flag(g, "--host", "interface to listen on")
    _router_flag(g, "--port", "port to listen on", type=int)
    _router_flag(g, "--policy", "how a worker is picked, on both sides", choices=tuple(POLICIES))
    _router_flag(g, "--prefill-policy", "prefill side's policy (default: --policy)", choices=tuple(POLICIES))
    _router_flag(g, "--decode-policy", "decode side's policy (default: --policy)", choices=tuple(POLICIES))
    _router_flag(g, "--cache-threshold", "cache_aware: route by cache only when a worker holds at least this share "
                 "of the prompt's pages, else by load", type=float)
    _router_flag(g, "--balance-abs-threshold", "cache_aware: the worker with the longest cached prefix is skipped "
                 "when it has more than this many requests in flight above the least loaded one ...", type=int)
    _router_flag(g, "--balance-rel-threshold", "... and more than this many times as many", type=float)
    _router_flag(g, "--tokenizer-path", "cache_aware: local tokenizer directory to hash prompts with (default: the "
                 "path the prefill workers report, when it exists here)")
    _router_flag(g, "--kv-events-timeout-secs", "cache_aware: a prefill worker whose KV events (and heartbeats) "
                 "stop this long is routed on the router's guess of its cache", type=float)
    g.add_argument("--no-approximate-index", dest="approximate_index", action="store_false",
                   help="cache_aware: do not guess what a prefill worker caches from the requests routed to it (a "
                   "worker without fresh KV events then counts as caching nothing)")
    _router_flag(g, "--request-timeout-secs", "longest a request (a whole stream) may take", type=float)
    _router_flag(g, "--max-request-bytes", "refuse larger request bodies with a 413 as they arrive (the servers' "
                 "flag and default)", type=int)
    g = parser.add_argument_group("health")
    _router_flag(g, "--health-check-interval-secs", "seconds between GET /health of every worker", type=float)
    _router_flag(g, "--health-check-timeout-secs", "a health check slower than this fails", type=float)
    _router_flag(g, "--worker-startup-timeout-secs", "the router serves at once; a worker not healthy after "
                 "this long is reported as an error (and still probed)", type=float)
    _router_flag(g, "--worker-startup-check-interval", "seconds between checks of workers not yet seen healthy",
                 type=float)
    _router_flag(g, "--log-level", "logging level", choices=LOG_LEVELS)
    g = parser.add_argument_group("authentication")
    _router_flag(g, "--api-key", "clients must send 'Authorization: Bearer KEY' (401 otherwise); also sent to "
                 "the workers unless --worker-api-key is given (default: $PDSERVE_API_KEY)")
    _admin_key_flag(g, "; also sent to the workers for admin calls (give them the same key)")
    _router_flag(g, "--worker-api-key", "key sent to the workers (servers started with --api-key); default: "
                 "--api-key, or else the client's own Authorization header")
    _router_flag(g, "--allowed-hosts", ORIGIN_HELP["hosts"], type=names_list)
    _router_flag(g, "--allowed-origins", ORIGIN_HELP["origins"], type=names_list)
    _router_flag(g, "--allow-no-api-key", "listen beyond the loopback (--host) without --api-key: refused "
                 "otherwise", action="store_true")
    _router_flag(g, "--disaggregation-auth-token", "the servers' P/D token: the router signs the bootstrap fields it "
                 "adds, and decode servers holding it act on no others (prefer the file or "
                 "PDSERVE_DISAGGREGATION_AUTH_TOKEN: a flag shows in the process list)")
    g.add_argument("--disaggregation-auth-token-file", dest="disaggregation_auth_token_file",
                   help="file whose first line is the P/D token")
    _add_fleet_flags(parser)


def _add_fleet_flags(parser: argparse.ArgumentParser) -> None:
    """Breakers, retries, the concurrency cap, health thresholds, discovery (sglang-router's names)."""
    g = parser.add_argument_group("circuit breakers (per worker)")
    _router_flag(g, "--cb-failure-threshold", "consecutive failed requests that open a worker's breaker (it is "
                 "not picked while open)", type=int)
    _router_flag(g, "--cb-success-threshold", "consecutive successful probes that close a half-open breaker",
                 type=int)
    _router_flag(g, "--cb-timeout-duration-secs", "seconds a breaker stays open before it lets probes through",
                 type=float)
    _router_flag(g, "--disable-circuit-breaker", "no breakers", action="store_true")
    g = parser.add_argument_group("retries (connection failures before any byte reached the client)")
    _router_flag(g, "--retry-max-retries", "retries of one request, each on a newly picked pair", type=int)
    _router_flag(g, "--retry-initial-backoff-ms", "wait before the first retry", type=int)
    _router_flag(g, "--retry-max-backoff-ms", "longest wait between retries", type=int)
    _router_flag(g, "--retry-backoff-multiplier", "each wait is this many times the one before", type=float)
    _router_flag(g, "--retry-jitter-factor", "each wait varies at random by up to this share", type=float)
    _router_flag(g, "--disable-retries", "no retries", action="store_true")
    g = parser.add_argument_group("concurrency cap")
    _router_flag(g, "--max-concurrent-requests", "generation requests in flight at once; more wait in a queue "
                 "(-1: no cap)", type=int)
    _router_flag(g, "--queue-size", "requests that may wait; beyond, 429 with Retry-After", type=int)
    _router_flag(g, "--queue-timeout-secs", "a request waiting longer gets 408", type=float)
    g = parser.add_argument_group("health thresholds")
    _router_flag(g, "--health-failure-threshold", "consecutive failed checks that mark a healthy worker dead",
                 type=int)
    _router_flag(g, "--health-success-threshold", "consecutive passed checks that bring a dead worker back",
                 type=int)
    _router_flag(g, "--health-check-endpoint", "the path every worker is checked on")
    g = parser.add_argument_group("worker discovery")
    _router_flag(g, "--service-discovery", "find workers as Kubernetes pods by label (pip install "
                 "'pdserve[router-k8s]'; in-cluster service account, else the kubeconfig)", action="store_true")
    _router_flag(g, "--selector", "labels every worker pod has (key=value ...)", nargs="+", metavar="KEY=VALUE")
    _router_flag(g, "--prefill-selector", "labels of the prefill pods (key=value ...)", nargs="+",
                 metavar="KEY=VALUE")
    _router_flag(g, "--decode-selector", "labels of the decode pods (key=value ...)", nargs="+", metavar="KEY=VALUE")
    _router_flag(g, "--service-discovery-namespace", "the namespace of the worker pods (required with "
                 "--service-discovery)")
    _router_flag(g, "--service-discovery-port", "the workers' HTTP port in their pods", type=int)
    _router_flag(g, "--bootstrap-port-annotation", "pod annotation holding a prefill's bootstrap port")
    _router_flag(g, "--workers-file", "a JSON or YAML file {prefill: [{url, bootstrap_port}], decode: [url]}, "
                 "watched: workers added or removed there are added or removed here")
    _router_flag(g, "--kv-hash-key-file", "cache_aware: the file keying the workers' KV block hashes (their "
                 f"--kv-hash-key-file; without it ${KV_HASH_KEY_ENV})")


def router_args_from_namespace(ns: argparse.Namespace) -> RouterArgs:
    """RouterArgs from parsed flags; raises ValueError (naming the field) if they are invalid."""
    kwargs = {k: v for k, v in vars(ns).items() if k in _ROUTER_FIELDS}
    kwargs["api_key"] = _api_key(kwargs.get("api_key"))
    kwargs["disaggregation_auth_token"] = resolve_token(ns.disaggregation_auth_token,
                                                        ns.disaggregation_auth_token_file)
    kwargs["prefill"] = tuple(PrefillSpec.parse(values) for values in ns.prefill or ())
    kwargs["decode"] = tuple(normalize_url(url) for url in ns.decode or ())
    for name in ("selector", "prefill_selector", "decode_selector"):
        kwargs[name] = tuple(kwargs.get(name) or ())
    return RouterArgs(**kwargs)


# -------------------------------------------------------------- commands
def cmd_serve(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        args, model_files = _checked_args(ns)
    except (ValueError, TypeError) as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    refusal = unauthenticated_refusal(args.host, args.api_key, args.allow_no_api_key, "the server")
    if refusal and args.node_rank == 0:
        parser.exit(2, f"{parser.prog}: error: {refusal}\n")
    if args.node_rank > 0:
        from pdserve.entrypoints.node_launcher import launch_ranks_only

        return launch_ranks_only(args)
    from pdserve.entrypoints.http_server import launch_server

    return launch_server(args, model_files=model_files)


def cmd_router(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        args = router_args_from_namespace(ns)
    except ValueError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    refusal = unauthenticated_refusal(args.host, args.api_key, args.allow_no_api_key, "the router")
    if refusal:
        parser.exit(2, f"{parser.prog}: error: {refusal}\n")
    from pdserve.router.app import launch_router

    return launch_router(args)


# --------------------------------------------------------------------- up
UP_SERVER_GROUPS = (add_model_args, add_memory_args, add_hicache_args, add_runtime_args, add_device_args,
                    add_parser_args)
# Server flags up does not take (test/entrypoints/test_cli.py checks every other serve flag passes
# through up), and why; --host, --port, --api-key and --admin-api-key are up's own, for every child.
UP_EXCLUDED_FLAGS = {
    "--disaggregation-mode": "up gives each server its role",
    "--disaggregation-bootstrap-port": "up gives prefill i --bootstrap-port + i",
    "--dist-init-addr": "up runs on one machine: a server over several nodes is started by hand",
    "--nnodes": "up runs on one machine",
    "--node-rank": "up runs on one machine",
    "--disaggregation-bootstrap-allow": "for routers that cannot sign (sglang-router); up's own router signs the "
                                        "bootstrap fields it adds with the P/D token",
}
# Set per server by up (its own file directory, the shared Mooncake master): not passed through as given.
UP_STORAGE_FIELDS = ("hicache_storage_backend", "hicache_storage_dir", "hicache_storage_backend_extra_config")
UP_SECRET_FIELDS = ("disaggregation_auth_token",)  # to the servers by environment, never a command line


def add_up_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("deployment")
    g.add_argument("--num-prefill", type=int, default=1, help="prefill servers (default: %(default)s)")
    g.add_argument("--num-decode", type=int, default=1, help="decode servers (default: %(default)s)")
    g.add_argument("--host", default="127.0.0.1", help="interface of the router and the servers "
                   "(default: %(default)s)")
    g.add_argument("--port", type=int, default=30000, help="the router's port; servers take the next ones "
                   "(default: %(default)s)")
    g.add_argument("--bootstrap-port", dest="up_bootstrap_port", type=int, default=8998,
                   help="prefill i's bootstrap registry listens on this + i (default: %(default)s)")
    g.add_argument("--policy", dest="up_policy", choices=POLICIES, default="cache_aware",
                   help="the router's policy for both sides (default: %(default)s)")
    g.add_argument("--api-key", dest="up_api_key", default=None,
                   help="clients must send 'Authorization: Bearer KEY' to the router and every server (default: "
                   "$PDSERVE_API_KEY); up hands it and the P/D token to them by environment, never on a command line")
    g.add_argument("--admin-api-key", dest="up_admin_api_key", default=os.environ.get(ADMIN_KEY_ENV) or None,
                   help="admin routes of the router and every server need it (passed to them by the environment; "
                   f"default: ${ADMIN_KEY_ENV})")
    g.add_argument("--allow-no-api-key", dest="up_allow_no_api_key", action="store_true",
                   help="listen beyond the loopback (--host) without --api-key: refused otherwise")
    g.add_argument("--health-check-interval-secs", dest="up_health_check_interval_secs", type=float, default=5.0,
                   help="the router's health checks: a restarted server is used again within this "
                   "(default: %(default)s)")
    g.add_argument("--kv-hash-key-file", dest="kv_hash_key_file", default=None,
                   help="the file keying the KV block hashes of every server and the router (default: "
                   f"${KV_HASH_KEY_ENV}, else a random key up makes and hands them by environment)")
    add_elastic_args(parser)
    for add in UP_SERVER_GROUPS:
        add(parser)
    add_http_args(parser, per_server=False)
    add_parallel_args(parser, per_server=False)
    add_disagg_args(parser, per_server=False)


def add_elastic_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("elastic P/D (--elastic: servers switch roles as the traffic mix changes)")
    g.add_argument("--elastic", action="store_true", help="run a controller that asks the planner for the P:D split "
                   "meeting --slo at the observed mix and switches one server at a time (POST /pd_role_switch)")
    g.add_argument("--num-servers", type=int, default=None, help="with --elastic: servers in all, --num-prefill of "
                   "them prefill at the start (default: 2; with 2 the split stays 1P1D, as each role keeps one)")
    g.add_argument("--slo", dest="up_slo", default="ttft:2000,tpot:200",
                   help="with --elastic: per-request SLOs in ms the split should meet (default: %(default)s)")
    g.add_argument("--slo-attainment", dest="up_slo_attainment", type=float, default=0.9,
                   help="with --elastic: fraction of requests that must meet --slo (default: %(default)s)")
    g.add_argument("--elastic-interval", type=float, default=5.0,
                   help="with --elastic: seconds between the controller's decisions (default: %(default)s)")
    g.add_argument("--elastic-patience", type=int, default=2, help="with --elastic: intervals in a row the "
                   "planner must want a switch before one is made (default: %(default)s)")
    g.add_argument("--prefill-profile", dest="up_prefill_profile", default=None,
                   help="with --elastic: a prefill profile (pdserve bench --profile prefill); default: "
                   "estimated from the servers' metrics")
    g.add_argument("--decode-profile", dest="up_decode_profile", default=None,
                   help="with --elastic: a decode profile (pdserve bench --profile decode); default: estimated")


def elastic_from_namespace(ns: argparse.Namespace):
    """The controller's config, or None without --elastic."""
    if not ns.elastic:
        for flag, value in (("--num-servers", ns.num_servers),):
            if value is not None:
                raise ValueError(f"{flag}: only with --elastic")
        return None
    from pdserve.bench import planner, profiles
    from pdserve.bench.config import parse_slo
    from pdserve.entrypoints.elastic import ElasticConfig

    slo_ms = parse_slo(ns.up_slo)
    if "e2e" in slo_ms:
        raise ValueError("--slo: the planner takes ttft and tpot")
    slo = planner.SLO(ttft=slo_ms.get("ttft", 0) / 1000 or None, tpot=slo_ms.get("tpot", 0) / 1000 or None,
                      attainment=ns.up_slo_attainment)
    hw = None
    if (ns.up_prefill_profile is None) != (ns.up_decode_profile is None):
        raise ValueError("--prefill-profile/--decode-profile: give both or neither")
    if ns.up_prefill_profile is not None:
        hw = planner.Hardware(profiles.load_profile(ns.up_prefill_profile, "prefill"),
                              profiles.load_profile(ns.up_decode_profile, "decode"))
    return ElasticConfig(slo, ns.elastic_interval, ns.elastic_patience,
                         quiet_s=ns.up_health_check_interval_secs + 1.0, hardware=hw)


def up_split(ns: argparse.Namespace) -> tuple[int, int]:
    """(prefill, decode) servers at the start: --num-prefill/--num-decode, or with --elastic
    --num-prefill of --num-servers prefill and the rest decode."""
    if not ns.elastic:
        return ns.num_prefill, ns.num_decode
    total = 2 if ns.num_servers is None else ns.num_servers
    if not 1 <= ns.num_prefill < total:
        raise ValueError(f"--num-servers: --elastic needs --num-prefill ({ns.num_prefill}) prefill servers and at "
                         f"least one decode, got {total} servers")
    return ns.num_prefill, total - ns.num_prefill


def server_flags_from_namespace(ns: argparse.Namespace, parser: argparse.ArgumentParser,
                                exclude: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The server flags given (those different from their defaults), as a command line again;
    ``exclude``: fields the caller sets per server."""
    out: list[str] = []
    for action in parser._actions:  # noqa: SLF001 - argparse keeps its actions here
        if action.dest not in _FIELDS or action.dest in ("host", "port", *exclude) or not action.option_strings:
            continue
        value = getattr(ns, action.dest)
        if value == action.default:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):  # --x / --no-x
            out.append(flag if value else action.option_strings[1])
            continue
        out += [flag] if isinstance(action, argparse._StoreTrueAction) else [flag, str(value)]  # noqa: SLF001
    return tuple(out)


def up_args_from_namespace(ns: argparse.Namespace, parser: argparse.ArgumentParser):
    """The deployment (an ``up.UpArgs``); raises ValueError (naming the flag) if it is invalid."""
    from pdserve.entrypoints.up import StorageTier, UpArgs

    server = server_args_from_namespace(ns)  # every server would refuse these: say so now
    server.replace(disaggregation_mode="prefill").disagg_config().check_servable()  # up runs P/D servers
    num_prefill, num_decode = up_split(ns)
    storage = StorageTier()  # the tier's flags mean nothing without the hierarchical cache: no master then
    if server.enable_hierarchical_cache:
        storage = StorageTier(server.hicache_storage_backend, server.hicache_storage_dir,
                              server.hicache_storage_backend_extra_config)
    flags = server_flags_from_namespace(ns, parser, exclude=UP_STORAGE_FIELDS + UP_SECRET_FIELDS)
    return UpArgs(num_prefill, num_decode, ns.host, ns.port, ns.up_bootstrap_port, flags, ns.up_policy,
                  _api_key(ns.up_api_key), ns.up_health_check_interval_secs, auth_token=_up_auth_token(server),
                  elastic=elastic_from_namespace(ns), storage=storage, admin_api_key=ns.up_admin_api_key,
                  allow_no_api_key=ns.up_allow_no_api_key, kv_hash_key=_up_kv_hash_key(ns))


def _up_auth_token(server) -> str:
    """The P/D token of up's servers and router: the operator's, else a new random one. Always one: its
    router signs the bootstrap fields it adds, which decode servers bound beyond the loopback (the
    image's --host 0.0.0.0) accept from nobody else."""
    return server.disaggregation_auth_token or secrets.token_hex(32)


def _up_kv_hash_key(ns: argparse.Namespace) -> str | None:
    """The block hash key ``up`` hands every server and its router (docs/security.md): the operator's
    (--kv-hash-key-file, which the router is given too, or $PDSERVE_KV_HASH_KEY), else a new random one."""
    if ns.kv_hash_key_file:
        return None
    return os.environ.get(KV_HASH_KEY_ENV, "").strip() or secrets.token_hex(32)


def cmd_up(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from pdserve.entrypoints.up import launch_up

    try:
        args = up_args_from_namespace(ns, parser)
    except (ValueError, TypeError) as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    refusal = unauthenticated_refusal(args.host, args.api_key, args.allow_no_api_key, "the deployment")
    if refusal:
        parser.exit(2, f"{parser.prog}: error: {refusal}\n")
    return launch_up(args)


# ------------------------------------------------------------------ bench
def _part_default(part, name: str):
    f = {f.name: f for f in dataclasses.fields(part)}[name]
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise ValueError(f"{name}: {part.__name__}.{name} has no default")


def _bflag(group, part, name: str, help: str, *aliases: str, **kw) -> None:
    """``--random-input-len`` -> ``part.random_input_len``, defaulting to the dataclass default."""
    dest = name.lstrip("-").replace("-", "_")
    if kw.get("action") != "store_true":
        default = _part_default(part, dest)
        kw.setdefault("default", ",".join(f"{x:g}" for x in default) if isinstance(default, tuple) else default)
        if kw["default"] is not None and kw["default"] != {}:
            help += " (default: %(default)s)"
    group.add_argument(name, *aliases, dest=dest, help=help, **kw)


def add_bench_server_args(parser: argparse.ArgumentParser) -> None:
    c = bench_config
    g = parser.add_argument_group("server")
    _bflag(g, c.EndpointConfig, "--backend", "API shape: pdserve/sglang = native /generate, openai = "
           "/v1/completions, openai-chat = /v1/chat/completions", choices=c.BACKENDS)
    _bflag(g, c.EndpointConfig, "--base-url", "server URL (default: http://HOST:PORT)")
    _bflag(g, c.EndpointConfig, "--host", "server host")
    _bflag(g, c.EndpointConfig, "--port", "server port", type=int)
    _bflag(g, c.EndpointConfig, "--model", "model name for request bodies (default: the server's /v1/models)")
    _bflag(g, c.EndpointConfig, "--tokenizer", "preset name or local tokenizer directory (default: the model's)")
    _bflag(g, c.EndpointConfig, "--api-key", "bearer token (default: $OPENAI_API_KEY)")
    _bflag(g, c.EndpointConfig, "--disable-ignore-eos", "let requests stop at EOS (lengths then vary)",
           action="store_true")
    _bflag(g, c.EndpointConfig, "--tokenize-prompt", "native backends: send input_ids instead of text",
           action="store_true")
    _bflag(g, c.EndpointConfig, "--extra-request-body", "JSON object merged into every request body",
           type=_json_object)
    _bflag(g, c.EndpointConfig, "--request-timeout", "seconds before one request is abandoned", type=float)


def add_bench_dataset_args(parser: argparse.ArgumentParser) -> None:
    c = bench_config
    d = parser.add_argument_group("dataset")
    _bflag(d, c.DatasetConfig, "--dataset-name", "workload", choices=c.DATASETS)
    _bflag(d, c.DatasetConfig, "--dataset-path", "local ShareGPT JSON file (sharegpt)")
    _bflag(d, c.DatasetConfig, "--random-input-len", "random: tokens per prompt (the longest, with a ratio < 1)",
           type=int)
    _bflag(d, c.DatasetConfig, "--random-output-len", "random: tokens per answer (the longest, with a ratio < 1)",
           type=int)
    _bflag(d, c.DatasetConfig, "--random-range-ratio", "random: lengths uniform in [ratio * len, len]; 1 = fixed",
           type=float)
    _bflag(d, c.DatasetConfig, "--sharegpt-output-len", "sharegpt: fixed answer length (default: the dataset's)",
           type=int)
    _bflag(d, c.DatasetConfig, "--sharegpt-context-len", "sharegpt: drop conversations whose prompt + answer is "
           "longer than this", type=int)
    _bflag(d, c.DatasetConfig, "--gsp-num-groups", "generated-shared-prefix: groups, each with its own system "
           "prompt", type=int)
    _bflag(d, c.DatasetConfig, "--gsp-prompts-per-group", "generated-shared-prefix: questions sharing one system "
           "prompt", type=int)
    _bflag(d, c.DatasetConfig, "--gsp-system-prompt-len", "generated-shared-prefix: tokens of the shared system "
           "prompt", type=int)
    _bflag(d, c.DatasetConfig, "--gsp-question-len", "generated-shared-prefix: tokens of each question after it",
           type=int)
    _bflag(d, c.DatasetConfig, "--gsp-output-len", "generated-shared-prefix: tokens per answer", type=int)
    _bflag(d, c.DatasetConfig, "--multi-turn-clients", "multi-turn: conversations running side by side", type=int)
    _bflag(d, c.DatasetConfig, "--multi-turn-rounds", "multi-turn: turns per conversation, each extending the "
           "last answer", type=int)
    _bflag(d, c.DatasetConfig, "--multi-turn-question-len", "multi-turn: tokens of each new user turn", type=int)
    _bflag(d, c.DatasetConfig, "--multi-turn-output-len", "multi-turn: tokens per answer", type=int)
    for stream in ("interactive", "background"):
        _bflag(d, c.DatasetConfig, f"--mixed-{stream}-input-len", f"mixed: tokens per prompt of the {stream} "
               "stream", type=int)
        _bflag(d, c.DatasetConfig, f"--mixed-{stream}-output-len", f"mixed: tokens per answer of the {stream} "
               "stream", type=int)
    _bflag(d, c.DatasetConfig, "--mixed-interactive-rate", "mixed: req/s of the interactive stream (default: "
           "--request-rate)", type=float)
    _bflag(d, c.DatasetConfig, "--mixed-background-rate", "mixed: req/s of the background stream (Poisson, its "
           "own clock)", type=float)


def add_bench_load_args(parser: argparse.ArgumentParser) -> None:
    c = bench_config
    ld = parser.add_argument_group("load")
    _bflag(ld, c.LoadConfig, "--num-prompts", "requests to send (mixed: both streams together)", type=int)
    _bflag(ld, c.LoadConfig, "--request-rate", "mean arrivals per second; inf sends all at once", type=float)
    _bflag(ld, c.LoadConfig, "--burstiness", "gamma shape of inter-arrivals: 1 = Poisson, <1 burstier",
           type=float)
    _bflag(ld, c.LoadConfig, "--max-concurrency", "most requests in flight from this client", type=int)
    _bflag(ld, c.LoadConfig, "--warmup-requests", "concurrent warm-up requests before the clock starts", type=int)
    _bflag(ld, c.LoadConfig, "--seed", "seed of prompts, lengths and arrivals", type=int)
    _bflag(ld, c.LoadConfig, "--flush-cache", "POST /flush_cache after warm-up (profiles flush before every "
           "measurement anyway)", action="store_true")
    _bflag(ld, c.LoadConfig, "--disable-tqdm", "no progress bar", action="store_true")


def add_bench_report_args(parser: argparse.ArgumentParser) -> None:
    c = bench_config
    r = parser.add_argument_group("report")
    _bflag(r, c.ReportConfig, "--output-file", "append the result as one JSON line to this file")
    _bflag(r, c.ReportConfig, "--output-details", "also keep generated texts in the JSON", action="store_true")
    _bflag(r, c.ReportConfig, "--metric-percentiles", "percentiles reported for every latency")
    _bflag(r, c.ReportConfig, "--slo", "goodput SLOs in ms, e.g. ttft:200,tpot:50 (metrics: ttft, tpot, e2e)",
           "--goodput", nargs="+")
    _bflag(r, c.ReportConfig, "--label", "free-form label stored with the result")
    _bflag(r, c.ReportConfig, "--kv-link-gbps", "the prefill->decode link's bandwidth in Gbit/s, against which the "
           "KV transfer rate is judged (default: measured when everything is on the loopback)", type=float)


def add_bench_profile_args(parser: argparse.ArgumentParser) -> None:
    c = bench_config
    p = parser.add_argument_group("planner profiles (pdserve plan)")
    _bflag(p, c.ProfileConfig, "--profile", "measure a prefill or decode profile instead of running a dataset",
           choices=c.PROFILE_KINDS)
    _bflag(p, c.ProfileConfig, "--profile-input-lens", "prefill: prompt lengths timed, each < the server's "
           "context length (longer ones are refused before the run)")
    _bflag(p, c.ProfileConfig, "--profile-batch-sizes", "decode: batch sizes timed")
    _bflag(p, c.ProfileConfig, "--profile-context-len", "decode: prompt length of each request", type=int)
    _bflag(p, c.ProfileConfig, "--profile-output-len", "decode: tokens per request", type=int)
    _bflag(p, c.ProfileConfig, "--profile-repeats", "measurements per point (the median is kept)", type=int)


BENCH_ARG_GROUPS = (add_bench_server_args, add_bench_dataset_args, add_bench_load_args, add_bench_report_args,
                    add_bench_profile_args)


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    for add in BENCH_ARG_GROUPS:
        add(parser)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def bench_config_from_namespace(ns: argparse.Namespace) -> bench_config.BenchConfig:
    """BenchConfig from parsed flags; raises ValueError naming the flag if they are invalid."""
    c = bench_config
    values = dict(vars(ns))
    values["metric_percentiles"] = c.parse_floats(ns.metric_percentiles, "--metric-percentiles")
    values["profile_input_lens"] = c.parse_ints(ns.profile_input_lens, "--profile-input-lens")
    values["profile_batch_sizes"] = c.parse_ints(ns.profile_batch_sizes, "--profile-batch-sizes")
    values["slo"] = c.parse_slo(" ".join(ns.slo)) if ns.slo else {}
    return c.BenchConfig.from_flat(values)


def cmd_bench(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        cfg = bench_config_from_namespace(ns)
    except (ValueError, TypeError) as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    from pdserve.bench.serving import main as bench_main

    try:
        return bench_main(cfg)
    except (ValueError, RuntimeError) as e:
        parser.exit(1, f"{parser.prog}: error: {e}\n")


# ------------------------------------------------------------------- plan
def add_plan_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("instances (from `pdserve bench --profile prefill|decode`)")
    g.add_argument("--prefill-profile", required=True, help="JSON (lines) file holding a prefill profile")
    g.add_argument("--decode-profile", required=True, help="JSON (lines) file holding a decode profile")
    g.add_argument("--transfer-us-per-token", type=float, default=0.0,
                   help="KV transfer time per prompt token not hidden behind prefill (default: %(default)s)")
    g.add_argument("--transfer-overhead-ms", type=float, default=0.0,
                   help="fixed cost per transferred request: handshake, completion (default: %(default)s)")
    g.add_argument("--max-running-requests", type=int, default=256,
                   help="largest decode batch per instance (default: %(default)s)")
    g.add_argument("--max-prefill-tokens", type=int, default=16384,
                   help="most prompt tokens in one prefill batch (default: %(default)s)")
    w = parser.add_argument_group("workload (a bench result, or lengths)")
    w.add_argument("--workload", help="a `pdserve bench` JSON-lines file: the last run's lengths and rate")
    w.add_argument("--isl", type=int, help="prompt length in tokens (without --workload)")
    w.add_argument("--osl", type=int, help="output length in tokens (without --workload)")
    w.add_argument("--range-ratio", type=float, default=1.0,
                   help="lengths uniform in [ratio*L, L] (default: %(default)s: fixed)")
    w.add_argument("--request-rate", type=float, help="req/s to plan for (default: the --workload run's)")
    w.add_argument("--burstiness", type=float, help="gamma shape of inter-arrivals (default: the run's, or 1)")
    o = parser.add_argument_group("objective and search")
    o.add_argument("--slo", required=True, nargs="+", help="per-request SLOs in ms, e.g. ttft:2000,tpot:100")
    o.add_argument("--slo-attainment", type=float, default=0.9,
                   help="fraction of requests that must meet every SLO (default: %(default)s)")
    o.add_argument("--max-instances", type=int, default=16, help="largest deployment tried (default: %(default)s)")
    o.add_argument("--num-requests", type=int, default=1000, help="simulated requests (default: %(default)s)")
    o.add_argument("--seed", type=int, default=0, help="seed of the simulated arrivals (default: %(default)s)")
    o.add_argument("--output-file", help="append the plan as one JSON line to this file")


def plan_inputs_from_namespace(ns: argparse.Namespace):
    """(Hardware, WorkloadModel, SLO) from parsed flags; raises ValueError naming the flag."""
    from pdserve.bench import planner, profiles
    from pdserve.bench.serving import read_jsonl

    hw = planner.Hardware(profiles.load_profile(ns.prefill_profile, "prefill"),
                          profiles.load_profile(ns.decode_profile, "decode"),
                          transfer_s_per_token=ns.transfer_us_per_token * 1e-6,
                          transfer_overhead_s=ns.transfer_overhead_ms / 1000.0,
                          max_running_requests=ns.max_running_requests, max_prefill_tokens=ns.max_prefill_tokens)
    if ns.workload:
        runs = [r for r in read_jsonl(ns.workload) if r.get("schema") == "pdserve.bench/v1"]
        if not runs:
            raise ValueError(f"--workload: {ns.workload} holds no `pdserve bench` result")
        wl = planner.workload_from_result(runs[-1], ns.request_rate, ns.burstiness)
    elif ns.isl and ns.osl and ns.request_rate:
        wl = planner.workload_from_lengths(ns.isl, ns.osl, ns.range_ratio, ns.request_rate, ns.burstiness or 1.0)
    else:
        raise ValueError("--workload: give a bench result, or --isl, --osl and --request-rate")
    slo_ms = bench_config.parse_slo(" ".join(ns.slo))
    if "e2e" in slo_ms:
        raise ValueError("--slo: the planner takes ttft and tpot")
    slo = planner.SLO(ttft=slo_ms.get("ttft", 0) / 1000 or None, tpot=slo_ms.get("tpot", 0) / 1000 or None,
                      attainment=ns.slo_attainment)
    return hw, wl, slo


def cmd_plan(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from pdserve.bench import planner
    from pdserve.bench.serving import append_jsonl

    try:
        hw, wl, slo = plan_inputs_from_namespace(ns)
        result = planner.plan(hw, wl, slo, ns.max_instances, ns.num_requests, ns.seed)
    except (ValueError, TypeError) as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    print(planner.format_plan(result))
    if ns.output_file:
        append_jsonl(ns.output_file, result.to_dict())
    return 0 if result.recommendation else 1


class OneLineErrors(argparse.ArgumentParser):
    """A bad flag is one line naming the subcommand and the flag (argparse prints the whole usage
    first: 70 lines, with the error last, where a reader misses it)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrors(prog="pdserve", description="pdserve: an SGLang-style LLM server "
                           "built around prefill/decode disaggregation.")
    parser.add_argument("--version", action="version", version=f"pdserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=OneLineErrors)
    commands = (
        ("serve", add_server_args, cmd_serve, "launch an HTTP server (frontend + scheduler process)",
         "Launch an HTTP server: OpenAI and SGLang-native APIs."),
        ("router", add_router_args, cmd_router, "launch a P/D router in front of prefill and decode servers",
         "Send each request to a prefill and a decode server at once (bootstrap_host/port/room added) and "
         "return the decode server's answer."),
        ("up", add_up_args, cmd_up, "launch a whole P/D deployment here: prefill + decode servers and a router",
         "Start prefill and decode servers (cores split between them) and a router in front; Ctrl-C stops "
         "everything."),
        ("bench", add_bench_args, cmd_bench, "benchmark a running server (TTFT, TPOT, ITL, throughput, goodput)",
         "Streaming serving benchmark for pdserve, SGLang and OpenAI-compatible servers; metrics as "
         "sglang.bench_serving and vllm bench serve compute them."),
        ("plan", add_plan_args, cmd_plan, "recommend prefill:decode instance counts by simulating a workload",
         "P:D ratio planner: simulates prefill queues, decode batches and KV transfer from measured profiles, "
         "and recommends the deployment with the most goodput per instance that meets the SLOs (or "
         "colocation)."),
    )
    for name, add_args, handler, help_text, description in commands:
        cmd = sub.add_parser(name, help=help_text, description=description)
        add_args(cmd)
        cmd.set_defaults(handler=handler, subparser=cmd)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return ns.handler(ns, ns.subparser) or 0
    except KeyboardInterrupt:
        # Ctrl-C before the command's own signal handling is armed (imports, model loading):
        # one line, not the traceback of whatever was being imported
        print(f"{ns.subparser.prog}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
