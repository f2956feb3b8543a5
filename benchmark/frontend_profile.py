"""Where the HTTP frontend's time goes: a cProfile dump of the frontend (``bench_server.py
--profile-frontend FILE``) grouped by part, as a Markdown table (docs/benchmarking.md).

    python benchmark/frontend_profile.py FILE

Each function's own time (tottime) goes to the first part whose pattern its ``file:function``
contains; a built-in's (a socket call, ``str.startswith``) is split among its callers' parts by
their time in it. Shares are of the serving time: all but the idle wait and the start-up.
"""

from __future__ import annotations

import pstats
import sys

RULES = [  # (category, substrings of "file:function"), first match wins
    ("idle (epoll wait)", ["select.epoll"]),
    ("socket writes (send syscall)", ["'send' of '_socket.socket'"]),
    ("HTTP framing (uvicorn, h11, starlette)", ["uvicorn/", "h11/", "starlette/", "fastapi/", "anyio/"]),
    ("ZMQ receive + codec decode", ["zmq/", "engine/codec.py", "msgspec", "scheduler_process.py",
                                    "scheduler_loop.py"]),
    ("detokenizer", ["engine/tokenizer.py", "tokenizers.Tokenizer", "tokenization_utils"]),
    ("JSON (orjson, pydantic parse)", ["orjson", "pydantic", "web/errors.py", "protocol.py"]),
    ("request table, metrics (tokenizer_manager, obs)", ["tokenizer_manager.py", "obs/", "prometheus_client"]),
    ("API bodies, validation (native_api, streaming, api_key)", [
        "native_api.py", "openai_api.py", "web/streaming.py", "parallel_sampling.py", "logprobs.py",
        "web/api_key.py", "http_server.py", "engine/request.py", "hashlib", "uuid"]),
    ("asyncio event loop", ["asyncio/", "_asyncio", "contextvars", "selectors.py"]),
    ("logging", ["logging/"]),
]


def category(key: str) -> str | None:
    return next((c for c, subs in RULES if any(s in key for s in subs)), None)


REST = "start-up and the rest (imports, model config, GC)"


def part_times(path: str) -> dict[str, float]:
    """Seconds of own time per part in the cProfile dump at ``path``."""
    stats = pstats.Stats(path).stats  # type: ignore[attr-defined]  # pstats keeps its table untyped
    totals: dict[str, float] = {}
    for (file, _line, fn), (_cc, _nc, own, _cum, callers) in stats.items():
        part = category(f"{file}:{fn}")
        if part is not None or file != "~" or not callers:
            totals[part or REST] = totals.get(part or REST, 0.0) + own
            continue
        weight = sum(v[3] for v in callers.values()) or 1.0  # a built-in: split by its callers' time in it
        for (cfile, _, cfn), v in callers.items():
            caller_part = category(f"{cfile}:{cfn}") or REST
            totals[caller_part] = totals.get(caller_part, 0.0) + own * v[3] / weight
    return totals


def table(totals: dict[str, float]) -> str:
    busy = sum(v for k, v in totals.items() if not k.startswith(("idle", "start-up")))
    rows = ["| part | own time (s) | share of serving time |", "|---|---|---|"]
    for k, v in sorted(totals.items(), key=lambda kv: -kv[1]):
        share = "" if k.startswith(("idle", "start-up")) else f"{v / busy:.0%}"
        rows.append(f"| {k} | {v:.2f} | {share} |")
    rows.append(f"| serving (all but idle and start-up) | {busy:.2f} | 100% |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table(part_times(sys.argv[1])))
