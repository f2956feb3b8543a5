"""The ``pdserve`` command line: ``pdserve serve ...``, ``pdserve router ...`` (``bench``, ``up`` plug in later).

Flag names are SGLang's. Each flag's ``dest`` is the ServerArgs field it sets,
so a flag added to a group below only needs a matching ServerArgs field.
Errors in the arguments (argparse's or ServerArgs validation) exit with code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from pdserve import __version__
from pdserve.config import DTYPES, LOAD_FORMATS, MOE_A2A_BACKENDS, SCHEDULE_POLICIES, ServerArgs
from pdserve.router.config import PrefillSpec, RouterArgs, normalize_url
from pdserve.router.policy import POLICIES

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_FIELDS = {f.name: f for f in dataclasses.fields(ServerArgs)}


def _default(name: str):
    return _FIELDS[name].default


def _flag(group, name: str, help: str, **kw) -> None:
    """``--page-size`` -> ServerArgs.page_size, defaulting to the dataclass default."""
    dest = name.lstrip("-").replace("-", "_")
    if kw.get("action") != "store_true":
        kw.setdefault("default", _default(dest))
        if kw["default"] is not None:
            help += " (default: %(default)s)"
    group.add_argument(name, dest=dest, help=help, **kw)


# ----------------------------------------------------------- flag groups
def add_model_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model")
    g.add_argument("--model-path", dest="model_path", required=True,
                   help="model directory (HF layout) or a built-in preset name, e.g. tiny-deepseek")
    _flag(g, "--tokenizer-path", "tokenizer directory (default: the model's)")
    _flag(g, "--load-format", "weight format; presets default to random 'dummy' weights",
          choices=LOAD_FORMATS)
    _flag(g, "--dtype", "weight and KV dtype", choices=DTYPES)
    _flag(g, "--context-length", "override the model's max_position_embeddings", type=int)
    _flag(g, "--served-model-name", "model name reported by the OpenAI API (default: --model-path)")
    _flag(g, "--skip-tokenizer-init", "serve input_ids only; no tokenizer is loaded", action="store_true")


def add_http_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("HTTP server")
    _flag(g, "--host", "interface to listen on")
    _flag(g, "--port", "port to listen on", type=int)
    _flag(g, "--api-key", "require 'Authorization: Bearer <key>' on every API call")
    _flag(g, "--max-request-bytes", "refuse larger request bodies with a 413, before parsing them", type=int)


def add_memory_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("memory and scheduling")
    _flag(g, "--page-size", "tokens per KV page", type=int)
    _flag(g, "--max-total-tokens", "KV pool size in tokens (default: derived from memory)", type=int)
    _flag(g, "--max-running-requests", "most requests in the running batch", type=int)
    _flag(g, "--chunked-prefill-size", "prefill tokens per step; <= 0 disables chunking", type=int)
    _flag(g, "--max-prefill-tokens", "most prompt tokens in one prefill batch", type=int)
    _flag(g, "--schedule-policy", "order in which waiting requests are admitted", choices=SCHEDULE_POLICIES)
    _flag(g, "--disable-radix-cache", "do not reuse KV of shared prefixes", action="store_true")


def add_runtime_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("runtime")
    _flag(g, "--random-seed", "seed for weights of dummy models and for sampling", type=int)
    _flag(g, "--num-threads", "torch threads of the scheduler process (default: all cores)", type=int)
    _flag(g, "--log-level", "logging level of every process", choices=LOG_LEVELS)
    _flag(g, "--stream-interval", "send streamed text every N tokens (first and last always)", type=int)


def add_parallel_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("parallelism (one scheduler process per rank)")
    _flag(g, "--tp-size", "tensor-parallel ranks (with --enable-dp-attention: every rank)", type=int)
    _flag(g, "--dp-size", "data-parallel replicas, or attention groups with --enable-dp-attention", type=int)
    _flag(g, "--enable-dp-attention", "attention in --dp-size groups owning whole requests; dense and MoE "
          "layers over all --tp-size ranks (MLA models)", action="store_true")
    _flag(g, "--ep-size", "expert-parallel ranks: 1, or --tp-size to place routed experts whole", type=int)
    _flag(g, "--moe-a2a-backend", "how EP moves tokens to experts: torch.distributed all-to-all, or DeepEP "
          "(CUDA only)", choices=MOE_A2A_BACKENDS)
    _flag(g, "--dist-init-addr", "host:port of node 0 for the ranks' rendezvous (needed with --nnodes > 1)")
    _flag(g, "--nnodes", "nodes the ranks are spread over", type=int)
    _flag(g, "--node-rank", "this node's index; nodes > 0 run their ranks only, node 0 the server too", type=int)


SERVER_ARG_GROUPS = (add_model_args, add_http_args, add_memory_args, add_parallel_args, add_runtime_args)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    for add in SERVER_ARG_GROUPS:
        add(parser)


def server_args_from_namespace(ns: argparse.Namespace) -> ServerArgs:
    """ServerArgs from parsed flags; raises ValueError (naming the field) if they are invalid."""
    from pdserve.layers.moe.dispatch import require_backend  # imports torch: only for serve

    kwargs = {k: v for k, v in vars(ns).items() if k in _FIELDS}
    args = ServerArgs(**kwargs)
    args.model_config()  # resolves the model path and architecture now, not after forking
    require_backend(args.moe_a2a_backend)  # and whether the EP backend can run on this host
    return args


# ------------------------------------------------------------- router
_ROUTER_FIELDS = {f.name: f for f in dataclasses.fields(RouterArgs)}


def _router_flag(group, name: str, help: str, **kw) -> None:
    """``--health-check-interval-secs`` -> RouterArgs.health_check_interval_secs (sglang-router's names)."""
    dest = name.lstrip("-").replace("-", "_")
    kw.setdefault("default", _ROUTER_FIELDS[dest].default)
    if kw["default"] is not None:
        help += " (default: %(default)s)"
    group.add_argument(name, dest=dest, help=help, **kw)


def add_router_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workers")
    g.add_argument("--prefill", nargs="+", action="append", required=True, metavar=("URL", "BOOTSTRAP_PORT"),
                   help="a prefill server and its bootstrap port (default: 8998); repeat for more")
    g.add_argument("--decode", action="append", required=True, metavar="URL",
                   help="a decode server; repeat for more")
    g = parser.add_argument_group("routing")
    _router_flag(g, "--host", "interface to listen on")
    _router_flag(g, "--port", "port to listen on", type=int)
    _router_flag(g, "--policy", "how a worker is picked, on both sides", choices=tuple(POLICIES))
    _router_flag(g, "--prefill-policy", "prefill side's policy (default: --policy)", choices=tuple(POLICIES))
    _router_flag(g, "--decode-policy", "decode side's policy (default: --policy)", choices=tuple(POLICIES))
    _router_flag(g, "--request-timeout-secs", "longest a request (a whole stream) may take", type=float)
    g = parser.add_argument_group("health")
    _router_flag(g, "--health-check-interval-secs", "seconds between GET /health of every worker", type=float)
    _router_flag(g, "--health-check-timeout-secs", "a health check slower than this fails", type=float)
    _router_flag(g, "--worker-startup-timeout-secs", "at start-up, how long to wait for a healthy prefill "
                 "and decode worker", type=float)
    _router_flag(g, "--worker-startup-check-interval", "seconds between checks at start-up", type=float)
    _router_flag(g, "--log-level", "logging level", choices=LOG_LEVELS)


def router_args_from_namespace(ns: argparse.Namespace) -> RouterArgs:
    """RouterArgs from parsed flags; raises ValueError (naming the field) if they are invalid."""
    kwargs = {k: v for k, v in vars(ns).items() if k in _ROUTER_FIELDS}
    kwargs["prefill"] = tuple(PrefillSpec.parse(values) for values in ns.prefill)
    kwargs["decode"] = tuple(normalize_url(url) for url in ns.decode)
    return RouterArgs(**kwargs)


# -------------------------------------------------------------- commands
def cmd_serve(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        args = server_args_from_namespace(ns)
    except (ValueError, TypeError) as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    if args.node_rank > 0:
        from pdserve.entrypoints.node_launcher import launch_ranks_only

        return launch_ranks_only(args)
    from pdserve.entrypoints.http_server import launch_server

    return launch_server(args)


def cmd_router(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        args = router_args_from_namespace(ns)
    except ValueError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    from pdserve.router.app import launch_router

    return launch_router(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="pdserve: an SGLang-style LLM server "
                                     "built around prefill/decode disaggregation.")
    parser.add_argument("--version", action="version", version=f"pdserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    serve = sub.add_parser("serve", help="launch an HTTP server (frontend + scheduler process)",
                           description="Launch an HTTP server: OpenAI and SGLang-native APIs.")
    add_server_args(serve)
    serve.set_defaults(handler=cmd_serve, subparser=serve)
    router = sub.add_parser("router", help="launch a P/D router in front of prefill and decode servers",
                            description="Send each request to a prefill and a decode server at once "
                            "(bootstrap_host/port/room added) and return the decode server's answer.")
    add_router_args(router)
    router.set_defaults(handler=cmd_router, subparser=router)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(sys.argv[1:] if argv is None else argv)
    return ns.handler(ns, ns.subparser) or 0


if __name__ == "__main__":
    sys.exit(main())
