"""benchmark/frontend_profile.py: a cProfile dump grouped by the frontend's parts."""

from __future__ import annotations

import cProfile
import sys
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))

from frontend_profile import part_times, table  # noqa: E402

# Functions whose code says it lives in the frontend's files (the parts are found by file name).
FAKE = {
    "pdserve/entrypoints/tokenizer_manager.py": "def route(n):\n    return sum(i * i for i in range(n))\n",
    "pdserve/entrypoints/native_api.py": "def body(n, dumps):\n    return [dumps({'i': i}) for i in range(n)]\n",
}


def _load(path: str, src: str) -> dict:
    scope: dict = {}
    exec(compile(src, f"/somewhere/{path}", "exec"), scope)  # noqa: S102 - our own two-line sources
    return scope


def test_time_goes_to_the_part_of_the_file_and_builtins_to_their_callers(tmp_path):
    route = _load(*next(iter(FAKE.items())))["route"]
    body = _load("pdserve/entrypoints/native_api.py", FAKE["pdserve/entrypoints/native_api.py"])["body"]
    prof = cProfile.Profile()
    prof.enable()
    route(200_000)
    body(20_000, orjson.dumps)
    prof.disable()
    dump = tmp_path / "frontend.prof"
    prof.dump_stats(dump)
    parts = part_times(str(dump))
    # sum() is a built-in of no part: its time counts for its caller's (route), not for "the rest"
    assert parts["request table, metrics (tokenizer_manager, obs)"] > 0
    assert parts.get("start-up and the rest (imports, model config, GC)", 0.0) < 0.1 * parts[
        "request table, metrics (tokenizer_manager, obs)"]
    # orjson.dumps names its part itself; the list it is called in is the API body's
    assert parts["JSON (orjson, pydantic parse)"] > 0
    assert parts["API bodies, validation (native_api, streaming, api_key)"] > 0
    text = table(parts)
    assert text.splitlines()[0] == "| part | own time (s) | share of serving time |"
    assert text.splitlines()[-1].startswith("| serving (all but idle and start-up) |")
