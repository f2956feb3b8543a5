"""Planner profiles: how long one instance takes to prefill and to decode, measured on a real server.

A profile is one JSON object (schema ``pdserve.profile/v1``)::

    {"schema": "pdserve.profile/v1", "kind": "prefill", "model": ..., "base_url": ..., "date": ...,
     "points": [{"input_len": 512, "seconds": 0.081}, ...]}          # one prompt alone, prefill time
    {"schema": "pdserve.profile/v1", "kind": "decode", "model": ..., "context_len": 128, ...,
     "points": [{"batch_size": 8, "step_seconds": 0.012}, ...]}      # one decode step of a batch

``pdserve bench --profile prefill`` times ``--profile-input-lens`` prompts one at
a time with one output token (TTFT, median of ``--profile-repeats``; distinct
prompts, so no prefix-cache hit); ``--profile decode`` sends
``--profile-batch-sizes`` requests at once and keeps the median inter-token
latency (one decode step of that batch). Point it at a server started as the
instance will run (same flags, cores, parallelism). Between points the planner
interpolates linearly; beyond the last point it extends the last segment, below
the first it keeps the first value.
"""

from __future__ import annotations

import asyncio
import bisect
import datetime
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from pdserve.bench.backends import new_session, send
from pdserve.bench.config import BenchConfig, DatasetConfig, LoadConfig
from pdserve.bench.datasets import build_workload

PROFILE_SCHEMA = "pdserve.profile/v1"
_FIELDS = {"prefill": ("input_len", "seconds"), "decode": ("batch_size", "step_seconds")}


@dataclass(frozen=True)
class Curve:
    """A piecewise-linear y(x) through measured points (x strictly increasing, y >= 0)."""

    xs: tuple[float, ...]
    ys: tuple[float, ...]

    def __post_init__(self):
        if not self.xs or len(self.xs) != len(self.ys):
            raise ValueError("points: need one or more (x, y) pairs")
        if any(b <= a for a, b in zip(self.xs, self.xs[1:])):
            raise ValueError(f"points: x values must be strictly increasing, got {list(self.xs)}")
        if min(self.ys) <= 0:
            raise ValueError(f"points: times must be > 0, got {list(self.ys)}")

    def __call__(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        if x <= xs[0]:
            return ys[0]
        if len(xs) == 1:
            return ys[0] * x / xs[0]  # one point: proportional beyond it
        i = min(bisect.bisect_left(xs, x), len(xs) - 1)  # xs[i-1] < x <= xs[i], or extend the last segment
        slope = (ys[i] - ys[i - 1]) / (xs[i] - xs[i - 1])
        return max(ys[i - 1] + slope * (x - xs[i - 1]), min(ys))


@dataclass(frozen=True)
class PrefillProfile:
    """Seconds to prefill ``tokens`` prompt tokens in one batch on one prefill instance."""

    curve: Curve

    def time(self, tokens: int) -> float:
        return self.curve(tokens)


@dataclass(frozen=True)
class DecodeProfile:
    """Seconds of one decode step of a batch of ``batch`` requests on one decode instance."""

    curve: Curve

    def step(self, batch: int) -> float:
        return self.curve(batch)


def profile_from_dict(obj: dict, source: str = "profile"):
    """PrefillProfile or DecodeProfile from a profile object; errors name the source and field."""
    if not isinstance(obj, dict) or obj.get("schema") != PROFILE_SCHEMA:
        raise ValueError(f"{source}: not a {PROFILE_SCHEMA} object")
    kind = obj.get("kind")
    if kind not in _FIELDS:
        raise ValueError(f"{source}: kind must be 'prefill' or 'decode', got {kind!r}")
    xkey, ykey = _FIELDS[kind]
    try:
        pts = sorted((float(p[xkey]), float(p[ykey])) for p in obj["points"])
        curve = Curve(tuple(x for x, _ in pts), tuple(y for _, y in pts))
    except (KeyError, TypeError) as e:
        raise ValueError(f"{source}: each point needs {xkey!r} and {ykey!r} ({e})") from None
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    return PrefillProfile(curve) if kind == "prefill" else DecodeProfile(curve)


def load_profile(path: str, kind: str):
    """The last ``kind`` profile in a JSON or JSON-lines file."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"--{kind}-profile {path}: cannot read it: {e.strerror}") from None
    objs = []
    for line in text.splitlines() if "\n" in text.strip() else [text]:
        if line.strip():
            try:
                objs.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"--{kind}-profile {path}: not JSON: {e}") from None
    matching = [o for o in objs if isinstance(o, dict) and o.get("kind") == kind]
    if not matching:
        raise ValueError(f"--{kind}-profile {path}: holds no {kind!r} profile (make one with "
                         f"`pdserve bench --profile {kind}`)")
    return profile_from_dict(matching[-1], f"--{kind}-profile {path}")


# ---------------------------------------------------------------- measuring
async def run_profile(cfg: BenchConfig) -> dict:
    """Measure the profile ``cfg.profile.profile`` against the server; appends it to --output-file."""
    from pdserve.bench.serving import append_jsonl, resolve_model

    async with new_session(cfg.endpoint) as session:
        model, _, tokenizer = await resolve_model(session, cfg.endpoint)
        measure = _prefill_points if cfg.profile.profile == "prefill" else _decode_points
        points = await measure(session, cfg, tokenizer, model)
    prof = {"schema": PROFILE_SCHEMA, "kind": cfg.profile.profile, "model": model, "base_url": cfg.endpoint.url,
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "points": points}
    if cfg.profile.profile == "decode":
        prof["context_len"] = cfg.profile.profile_context_len
    if cfg.report.output_file:
        append_jsonl(cfg.report.output_file, prof)
    return prof


def _prompts(cfg: BenchConfig, tokenizer, n: int, input_len: int, output_len: int, seed: int):
    ds = DatasetConfig(random_input_len=input_len, random_output_len=output_len, random_range_ratio=1.0)
    return [c.first() for c in build_workload(ds, LoadConfig(num_prompts=n, seed=seed), tokenizer).conversations]


async def _prefill_points(session, cfg: BenchConfig, tokenizer, model: str) -> list[dict]:
    p = cfg.profile
    await send(session, cfg.endpoint, _prompts(cfg, tokenizer, 1, 16, 1, cfg.load.seed + 10**6)[0], model)  # warm-up
    points = []
    for i, n in enumerate(sorted(p.profile_input_lens)):
        times = []
        for req in _prompts(cfg, tokenizer, p.profile_repeats, n, 1, cfg.load.seed + i):
            out = await send(session, cfg.endpoint, req, model)
            if not out.success:
                raise RuntimeError(f"--profile prefill: a {n}-token request failed: {out.error}")
            times.append(out.ttft)
        points.append({"input_len": n, "seconds": statistics.median(times)})
    return points


async def _decode_points(session, cfg: BenchConfig, tokenizer, model: str) -> list[dict]:
    p = cfg.profile
    points = []
    for i, b in enumerate(sorted(p.profile_batch_sizes)):
        steps = []
        for r in range(p.profile_repeats):
            reqs = _prompts(cfg, tokenizer, b, p.profile_context_len, p.profile_output_len,
                            cfg.load.seed + 1000 * i + r)
            outs = await asyncio.gather(*(send(session, cfg.endpoint, q, model) for q in reqs))
            bad = [o for o in outs if not o.success]
            if bad:
                raise RuntimeError(f"--profile decode: a request at batch {b} failed: {bad[0].error}")
            steps.append(statistics.median([x for o in outs for x in o.itl]))
        points.append({"batch_size": b, "step_seconds": statistics.median(steps)})
    return points
