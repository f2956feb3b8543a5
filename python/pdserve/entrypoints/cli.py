"""The ``pdserve`` command line: ``pdserve serve ...`` (``router``, ``bench``, ``up`` plug in later).

Flag names are SGLang's. Each flag's ``dest`` is the ServerArgs field it sets,
so a flag added to a group below only needs a matching ServerArgs field.
Errors in the arguments (argparse's or ServerArgs validation) exit with code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from pdserve import __version__
from pdserve.config import DTYPES, LOAD_FORMATS, SCHEDULE_POLICIES, ServerArgs

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


SERVER_ARG_GROUPS = (add_model_args, add_http_args, add_memory_args, add_runtime_args)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    for add in SERVER_ARG_GROUPS:
        add(parser)


def server_args_from_namespace(ns: argparse.Namespace) -> ServerArgs:
    """ServerArgs from parsed flags; raises ValueError (naming the field) if they are invalid."""
    kwargs = {k: v for k, v in vars(ns).items() if k in _FIELDS}
    args = ServerArgs(**kwargs)
    args.model_config()  # resolves the model path and architecture now, not after forking
    return args


# -------------------------------------------------------------- commands
def cmd_serve(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        args = server_args_from_namespace(ns)
    except (ValueError, TypeError) as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    from pdserve.entrypoints.http_server import launch_server

    return launch_server(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="pdserve: an SGLang-style LLM server "
                                     "built around prefill/decode disaggregation.")
    parser.add_argument("--version", action="version", version=f"pdserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    serve = sub.add_parser("serve", help="launch an HTTP server (frontend + scheduler process)",
                           description="Launch an HTTP server: OpenAI and SGLang-native APIs.")
    add_server_args(serve)
    serve.set_defaults(handler=cmd_serve, subparser=serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(sys.argv[1:] if argv is None else argv)
    return ns.handler(ns, ns.subparser) or 0


if __name__ == "__main__":
    sys.exit(main())
