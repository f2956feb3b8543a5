"""Planner profiles: how long one instance takes to prefill and to decode, measured on a real server.

A profile is one JSON object (schema ``pdserve.profile/v1``)::

    {"schema": "pdserve.profile/v1", "kind": "prefill", "model": ..., "base_url": ..., "date": ...,
     "points": [{"input_len": 512, "seconds": 0.081}, ...]}          # one prompt alone, prefill time
    {"schema": "pdserve.profile/v1", "kind": "decode", "model": ..., "context_len": 128, ...,
     "points": [{"batch_size": 8, "step_seconds": 0.012}, ...]}      # one decode step of a batch

``pdserve bench --profile prefill`` times ``--profile-input-lens`` prompts one at
a time with one output token (TTFT, median of ``--profile-repeats``; fresh random
prompts on a flushed prefix cache, checked by the ``cached_tokens`` the server
reports; lengths past the server's context are refused); ``--profile decode`` sends
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
import secrets
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from pdserve.bench.backends import RequestOutput, new_session, send
from pdserve.bench.config import BenchConfig, DatasetConfig, EndpointConfig, LoadConfig, ProfileConfig
from pdserve.bench.datasets import BenchRequest, build_workload

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
@dataclass
class CacheAudit:
    """Whether a profile timed cold prompts: the prefix cache was flushed before every measurement
    (``flushed``), and what ``cached_tokens`` the server reported for each timed request (None where
    it did not say). A prefix-cache hit makes a 2048-token prefill look 20x faster than it is."""

    flushed: bool = True
    cached: list[int | None] = field(default_factory=list)

    def record(self, outs: list[RequestOutput]) -> None:
        self.cached += [o.cached_tokens for o in outs]

    def to_dict(self) -> dict:
        known = [c for c in self.cached if c is not None]
        return {"flushed_before_each": self.flushed, "max_cached_tokens": max(known) if known else None,
                "requests_with_cache_hits": sum(c > 0 for c in known), "requests": len(self.cached)}

    def warning(self) -> str:
        """'' when the points are known to be cold; else what is wrong, for a person."""
        hits = [c for c in self.cached if c]
        if hits:
            return (f"{len(hits)} of {len(self.cached)} timed requests reused up to {max(hits)} cached prompt "
                    "tokens: those points time prefix-cache hits, not prefill (is another client sending the "
                    "same prompts?)")
        if not self.flushed and all(c is None for c in self.cached):
            return ("the server neither flushes its cache (POST /flush_cache) nor reports cached_tokens: the "
                    "prompts are fresh random text, but prefix-cache hits cannot be ruled out")
        return ""


async def run_profile(cfg: BenchConfig) -> dict:
    """Measure the profile ``cfg.profile.profile`` against the server; appends it to --output-file.

    Every measurement times cold prompts: fresh random prompts each run (a re-run must not hit the
    radix cache the last run filled), the server's prefix cache flushed before each one, and the
    ``cached_tokens`` it reports checked (a warning on stderr and in the profile if any is not 0)."""
    from pdserve.bench.serving import append_jsonl, resolve_model

    async with new_session(cfg.endpoint) as session:
        model, _, tokenizer = await resolve_model(session, cfg.endpoint)
        context_len = await server_context_len(session, cfg.endpoint)
        if context_len is not None:
            check_context_room(cfg.profile, context_len)
        run = _Run(session, cfg, tokenizer, model, cfg.load.seed + secrets.randbits(48), CacheAudit())
        points = await (run.prefill_points() if cfg.profile.profile == "prefill" else run.decode_points())
    prof = {"schema": PROFILE_SCHEMA, "kind": cfg.profile.profile, "model": model, "base_url": cfg.endpoint.url,
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "points": points,
            "cache": run.audit.to_dict()}
    if cfg.profile.profile == "decode":
        prof["context_len"] = cfg.profile.profile_context_len
    warning = run.audit.warning()
    if warning:
        prof["warning"] = warning
        print(f"WARNING: --profile {cfg.profile.profile}: {warning}", file=sys.stderr)
    if cfg.report.output_file:
        append_jsonl(cfg.report.output_file, prof)
    return prof


def check_context_room(p: ProfileConfig, context_len: int) -> None:
    """Refuse, naming the flag, profile lengths the server would reject: every prompt needs room for
    its output tokens in the context (a refusal before the run beats a failure half-way)."""
    if p.profile == "prefill":
        too_long = [n for n in p.profile_input_lens if n + 1 > context_len]
        if too_long:
            verb = "leaves" if len(too_long) == 1 else "leave"
            raise ValueError(f"--profile-input-lens: {', '.join(map(str, too_long))} {verb} no room for the output "
                             f"token in the server's context length of {context_len} tokens; use lengths up to "
                             f"{context_len - 1}")
    elif p.profile_context_len + p.profile_output_len > context_len:
        raise ValueError(f"--profile-context-len: {p.profile_context_len} prompt + {p.profile_output_len} output "
                         f"tokens (--profile-output-len) exceed the server's context length of {context_len} tokens")


async def server_context_len(session: aiohttp.ClientSession, ep: EndpointConfig) -> int | None:
    """The server's context length (``max_model_len`` of ``/v1/models``), None if it does not say."""
    try:
        async with session.get(ep.url + "/v1/models", headers=ep.headers()) as r:
            if r.status != 200:
                return None
            first = (await r.json())["data"][0]
    except (aiohttp.ClientError, KeyError, IndexError, TypeError, ValueError):
        return None
    value = first.get("max_model_len") if isinstance(first, dict) else None
    return value if isinstance(value, int) and value > 0 else None


async def flush_prefix_cache(session: aiohttp.ClientSession, ep: EndpointConfig) -> bool:
    """POST /flush_cache; whether the server did it (an OpenAI-only server has no such route)."""
    try:
        async with session.post(ep.url + "/flush_cache", headers=ep.admin_headers()) as r:
            return r.status == 200
    except aiohttp.ClientError:
        return False


@dataclass
class _Run:
    """One profile run: its session, prompts (seeded by ``seed``, fresh per run) and cache audit."""

    session: aiohttp.ClientSession
    cfg: BenchConfig
    tokenizer: object
    model: str
    seed: int
    audit: CacheAudit

    def prompts(self, n: int, input_len: int, output_len: int, offset: int) -> list[BenchRequest]:
        ds = DatasetConfig(random_input_len=input_len, random_output_len=output_len, random_range_ratio=1.0)
        load = LoadConfig(num_prompts=n, seed=self.seed + offset)
        return [c.first() for c in build_workload(ds, load, self.tokenizer).conversations]

    async def cold(self, reqs: list[BenchRequest]) -> list[RequestOutput]:
        """``reqs`` sent at once, on an empty prefix cache."""
        if not await flush_prefix_cache(self.session, self.cfg.endpoint):
            self.audit.flushed = False
        outs = list(await asyncio.gather(*(send(self.session, self.cfg.endpoint, q, self.model) for q in reqs)))
        self.audit.record(outs)
        return outs

    async def prefill_points(self) -> list[dict]:
        p = self.cfg.profile
        await send(self.session, self.cfg.endpoint, self.prompts(1, 16, 1, 10**6)[0], self.model)  # warm-up
        points = []
        for i, n in enumerate(sorted(p.profile_input_lens)):
            times = []
            for req in self.prompts(p.profile_repeats, n, 1, i):
                out = (await self.cold([req]))[0]
                if not out.success:
                    raise RuntimeError(f"--profile prefill: a {n}-token request failed: {out.error}")
                times.append(out.ttft)
            points.append({"input_len": n, "seconds": statistics.median(times)})
        return points

    async def decode_points(self) -> list[dict]:
        p = self.cfg.profile
        points = []
        for i, b in enumerate(sorted(p.profile_batch_sizes)):
            steps = []
            for r in range(p.profile_repeats):
                outs = await self.cold(self.prompts(b, p.profile_context_len, p.profile_output_len, 1000 * i + r))
                bad = [o for o in outs if not o.success]
                if bad:
                    raise RuntimeError(f"--profile decode: a request at batch {b} failed: {bad[0].error}")
                steps.append(statistics.median([x for o in outs for x in o.itl]))
            points.append({"batch_size": b, "step_seconds": statistics.median(steps)})
        return points
