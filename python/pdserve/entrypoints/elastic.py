"""``pdserve up --elastic``: a controller that moves servers between prefill and decode as the
traffic mix changes.

Every ``interval_s`` it reads the router's worker lists and each server's ``/metrics``, turns the
interval's counters into a workload (request rate, mean prompt and output length, measured on the
decode servers, which see every request whole) and a hardware estimate (unless profiles are
given: seconds of prefill forward passes per prompt token, from the decode servers' TTFT
breakdown, which the prefill side reports per request; the decode step time at the observed
batch from the inter-token gaps), asks
the planner (``bench/planner.py``) which P:D split of the same servers meets ``--slo`` best, and
switches one server at a time (``POST /pd_role_switch``) with hysteresis:

- the planner must want the same direction for ``patience`` intervals in a row;
- at most one switch per interval, and the streak starts again after each;
- never fewer than one server of each role;
- an interval with fewer than ``min_requests`` finished requests decides nothing (it grows until
  it has them), and neither does the one a switch happened in (it mixes two splits and the drain).

``decide`` and ``plan_split`` are pure (tested alone); ``Controller`` does the I/O.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from pdserve.bench import planner
from pdserve.bench.profiles import Curve, DecodeProfile, PrefillProfile

logger = logging.getLogger(__name__)

SIM_REQUESTS = 200  # requests the planner simulates per split: enough to rank a handful of splits
SWITCH_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class ElasticConfig:
    slo: planner.SLO
    interval_s: float = 5.0
    patience: int = 2
    min_requests: int = 4
    quiet_s: float = 1.5  # /pd_role_switch's quiet_secs: above the router's health-check interval
    hardware: planner.Hardware | None = None  # from --prefill-profile/--decode-profile; None: estimated

    def __post_init__(self):
        if not self.interval_s > 0:
            raise ValueError(f"--elastic-interval: must be > 0, got {self.interval_s}")
        if self.patience < 1:
            raise ValueError(f"--elastic-patience: must be >= 1, got {self.patience}")


# ------------------------------------------------------------------ pure parts
@dataclass(frozen=True)
class Hysteresis:
    """How many intervals in a row the planner wanted more prefill (> 0) or more decode (< 0)."""

    streak: int = 0


def decide(state: Hysteresis, prefill: int, total: int, wanted: int, patience: int) -> tuple[Hysteresis, int]:
    """The next state and the switch to make now: +1 (a decode becomes prefill), -1 (a prefill
    becomes decode) or 0. ``wanted`` is clamped so both roles keep at least one server."""
    wanted = min(max(wanted, 1), total - 1)
    direction = (wanted > prefill) - (wanted < prefill)
    if direction == 0:
        return Hysteresis(0), 0
    streak = state.streak + direction if state.streak * direction > 0 else direction
    if abs(streak) < patience:
        return Hysteresis(streak), 0
    return Hysteresis(0), direction


@dataclass(frozen=True)
class Interval:
    """One interval's observations (deltas of the servers' counters)."""

    seconds: float
    requests: float  # finished on decode servers
    prompt_tokens: float
    output_tokens: float
    prefill_seconds: float = 0.0  # prefill forward passes (the TTFT breakdown's "prefill" stage)
    prefill_tokens: float = 0.0  # ... of these prompt tokens
    itl_seconds: float = 0.0
    itl_count: float = 0.0
    decode_batch: float = 1.0  # running requests per decode server, now

    def workload(self) -> planner.WorkloadModel:
        n = max(self.requests, 1.0)
        isl = max(1, round(self.prompt_tokens / n))
        osl = max(1, round(self.output_tokens / n))
        return planner.WorkloadModel((isl,), (osl,), max(self.requests / self.seconds, 1e-3))

    def hardware(self) -> planner.Hardware | None:
        """One-point profiles from what was measured, or None when a side saw nothing."""
        if self.prefill_tokens <= 0 or self.itl_count <= 0 or self.prefill_seconds <= 0:
            return None
        per_token = self.prefill_seconds / self.prefill_tokens
        step = self.itl_seconds / self.itl_count
        batch = max(1.0, self.decode_batch)
        return planner.Hardware(PrefillProfile(Curve((1024.0,), (1024.0 * per_token,))),
                                DecodeProfile(Curve((batch,), (step,))))


def plan_split(wl: planner.WorkloadModel, hw: planner.Hardware, slo: planner.SLO, total: int,
               seed: int = 0) -> tuple[int, list[planner.Evaluation]]:
    """The number of prefill servers (1 .. total-1) the planner rates best for ``wl``: feasible
    first, then the highest SLO attainment, then the lowest busy fraction of the busier side (so
    an overloaded deployment still leans the right way), then the fewest prefill servers."""
    reqs = wl.requests(SIM_REQUESTS, seed)
    evals = [planner.evaluate(planner.Deployment(p, total - p), hw, wl, slo, reqs) for p in range(1, total)]
    keys = [(e.feasible, e.attainment, -busiest(e.deployment, hw, wl), -e.deployment.prefill) for e in evals]
    best = max(range(len(evals)), key=lambda i: keys[i])
    return evals[best].deployment.prefill, evals


def busiest(dep: planner.Deployment, hw: planner.Hardware, wl: planner.WorkloadModel) -> float:
    """The busy fraction of the busier side at ``wl``'s mean lengths (the planner's overload bounds)."""
    isl = sum(wl.input_lens) / len(wl.input_lens)
    osl = sum(wl.output_lens) / len(wl.output_lens)
    decode_tput = max(b / hw.decode.step(b) for b in range(1, hw.max_running_requests + 1))
    prefill = wl.rate * isl * planner.min_prefill_cost(hw) / dep.prefill
    decode = wl.rate * osl / decode_tput / dep.decode
    return max(prefill, decode)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> sample name -> value summed over labels (one server, one model)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith("_bucket") or s.name.endswith("_created"):
                continue
            key = s.name if "stage" not in s.labels else f"{s.name}:{s.labels['stage']}"
            out[key] = out.get(key, 0.0) + s.value
    return out


def interval_from(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]],
                  roles: dict[str, str], seconds: float) -> Interval:
    """The interval between two scrapes (url -> metrics) of servers with ``roles`` (url -> role)."""
    def delta(url: str, name: str) -> float:
        return max(0.0, after[url].get(name, 0.0) - before.get(url, {}).get(name, 0.0))

    dec = [u for u, r in roles.items() if r == "decode" and u in after]
    prompt_tokens = sum(delta(u, "pdserve:prompt_tokens_total") for u in dec)
    return Interval(
        seconds=seconds,
        requests=sum(delta(u, "pdserve:num_requests_total") for u in dec),
        prompt_tokens=prompt_tokens,
        output_tokens=sum(delta(u, "pdserve:generation_tokens_total") for u in dec),
        prefill_seconds=sum(delta(u, "pdserve:ttft_stage_seconds_sum:prefill") for u in dec),
        prefill_tokens=prompt_tokens,
        itl_seconds=sum(delta(u, "pdserve:inter_token_latency_seconds_sum") for u in dec),
        itl_count=sum(delta(u, "pdserve:inter_token_latency_seconds_count") for u in dec),
        decode_batch=sum(after[u].get("pdserve:num_running_reqs", 0.0) for u in dec) / max(1, len(dec)))


# ------------------------------------------------------------------ the loop
@dataclass
class Controller:
    """Runs ``step`` every interval on a thread until ``stop``; ``switches`` lists what it did."""

    router_url: str
    config: ElasticConfig
    api_key: str | None = None
    admin_api_key: str | None = None  # POST /pd_role_switch needs it when the servers have one
    switches: list[dict] = field(default_factory=list)
    state: Hysteresis = field(default_factory=Hysteresis)
    _scrape: dict[str, dict[str, float]] = field(default_factory=dict)
    _at: float = 0.0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Controller:
        self._thread = threading.Thread(target=self._run, name="pdserve-elastic", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(SWITCH_TIMEOUT_S + 5)

    def _run(self) -> None:
        while not self._stop.wait(self.config.interval_s):
            try:
                self.step()
            except (OSError, ValueError, KeyError) as e:  # a server restarting, a scrape cut off
                logger.warning("elastic: this interval decided nothing: %s: %s", type(e).__name__, e)

    def step(self) -> int:
        """One interval: observe, plan, maybe switch one server; returns the switch made (+1/-1/0)."""
        workers = self._workers()
        roles = {w["url"]: role for role, ws in workers.items() for w in ws}
        now, scrape = time.monotonic(), {url: parse_metrics(self._get(url + "/metrics")) for url in roles}
        if not self._scrape:
            self._scrape, self._at = scrape, now
            return 0
        iv = interval_from(self._scrape, scrape, roles, now - self._at)
        hw = self.config.hardware or iv.hardware()
        if iv.requests < self.config.min_requests or hw is None:
            return 0  # the interval grows until it saw enough
        self._scrape, self._at = scrape, now
        prefill, total = len(workers["prefill"]), len(roles)
        wanted, _ = plan_split(iv.workload(), hw, self.config.slo, total)
        self.state, move = decide(self.state, prefill, total, wanted, self.config.patience)
        logger.info("elastic: %dP%dD, planner wants %dP%dD (mean ISL %.0f, OSL %.0f, %.2f req/s)%s", prefill,
                    total - prefill, wanted, total - wanted, iv.prompt_tokens / iv.requests,
                    iv.output_tokens / iv.requests, iv.requests / iv.seconds,
                    f": switching one {'decode to prefill' if move > 0 else 'prefill to decode'}" if move else "")
        if move:
            self._switch(workers["decode" if move > 0 else "prefill"], "prefill" if move > 0 else "decode")
            self._scrape = {}  # the next interval starts after the switch: one spanning it mixes two splits
        return move

    def _switch(self, candidates: list[dict], target: str) -> None:
        worker = min(candidates, key=lambda w: w["in_flight"])  # the least loaded drains soonest
        body = {"target_role": target, "quiet_secs": self.config.quiet_s, "timeout_secs": SWITCH_TIMEOUT_S}
        started = time.time()
        try:
            reply = self._post(worker["url"] + "/pd_role_switch", body)
        except urllib.error.HTTPError as e:
            logger.warning("elastic: %s refused the switch to %s: %s", worker["url"], target, e.read()[:300])
            return
        self.switches.append({"at": started, "url": worker["url"], "role": target, "seconds": reply.get("seconds")})
        logger.info("elastic: %s is %s now (drained and switched in %s s)", worker["url"], target,
                    reply.get("seconds"))

    def _workers(self) -> dict[str, list[dict]]:
        info = json.loads(self._get(self.router_url + "/get_server_info"))
        return {"prefill": info["prefill"], "decode": info["decode"]}

    def _headers(self, admin: bool = False) -> dict[str, str]:
        key = self.admin_api_key if admin and self.admin_api_key else self.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _get(self, url: str) -> str:
        req = urllib.request.Request(url, headers=self._headers())
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.read().decode()

    def _post(self, url: str, body: dict) -> dict:
        req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={**self._headers(admin=True), "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=SWITCH_TIMEOUT_S + 10) as resp:
            return json.loads(resp.read())
