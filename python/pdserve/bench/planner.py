"""``pdserve plan``: how many prefill and decode instances a workload needs, by simulation.

A discrete-event simulation of one deployment, driven by measured profiles
(``profiles.py``) and a workload (ISL/OSL samples, Poisson/gamma arrivals):

- **router**: at arrival a request gets the decode instance with the fewest
  unfinished requests and (if it is disaggregated) the prefill instance with the
  fewest queued prompt tokens, as a least-load router does.
- **prefill instance**: a FIFO queue; a batch takes queued prompts up to
  ``max_prefill_tokens`` and lasts ``prefill.time(sum of tokens)``; prefill never
  samples. The KV then arrives on decode after ``transfer_overhead_s +
  tokens * transfer_s_per_token`` (what is *not* hidden behind prefill compute).
- **decode instance**: steps back to back while it has work; a step of a batch
  of B lasts ``decode.step(B)`` and gives every running request one token.
  Arrived KV joins at the next step boundary (at most ``max_running_requests``
  run). A disaggregated request's first token comes from its first decode step.
  Prompts prefilled *on* decode (colocated, or shorter than
  ``--disaggregation-min-prefill-tokens``) run as a prefill step that stalls the
  batch (SGLang's default prefill priority: the head-of-line blocking that
  disaggregation removes) and give the first token.
- **colocated instance**: a decode instance that prefills everything itself.

A request meets the SLOs if its TTFT and TPOT ((finish - first token) / (OSL - 1))
are within them; attainment is the fraction that do. A deployment is feasible
when attainment >= the target; goodput per instance = rate * attainment /
instances. The search keeps, for each kind (disaggregated P x D, colocated C),
the feasible deployment with the highest goodput per instance (ties: fewer
instances), recommends colocation when it is at least as good, and searches
the disaggregated deployments once per candidate
``--disaggregation-min-prefill-tokens`` (0 and thresholds splitting the ISL samples).
Every configuration is simulated on the same seeded requests, so comparisons
are not noise. Not modelled: KV memory limits, chunked prefill interleaving,
prefix-cache hits, network contention.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from pdserve.bench.arrivals import arrival_offsets
from pdserve.bench.profiles import DecodeProfile, PrefillProfile

THRESHOLD_QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)
# A lead in goodput per instance under this is within what profiles measured on a shared host
# move by: the plan says it is a close call instead of recommending.
MARGIN_WARNING = 0.05


# ------------------------------------------------------------------- inputs
@dataclass(frozen=True)
class Hardware:
    """One instance's speed (profiles) and the exposed KV transfer cost."""

    prefill: PrefillProfile
    decode: DecodeProfile
    transfer_s_per_token: float = 0.0
    transfer_overhead_s: float = 0.0
    max_running_requests: int = 256
    max_prefill_tokens: int = 16384

    def __post_init__(self):
        if self.transfer_s_per_token < 0 or self.transfer_overhead_s < 0:
            raise ValueError("--transfer-us-per-token/--transfer-overhead-ms: must be >= 0")
        if self.max_running_requests < 1:
            raise ValueError(f"--max-running-requests: must be >= 1, got {self.max_running_requests}")
        if self.max_prefill_tokens < 1:
            raise ValueError(f"--max-prefill-tokens: must be >= 1, got {self.max_prefill_tokens}")

    def transfer(self, tokens: int) -> float:
        return self.transfer_overhead_s + tokens * self.transfer_s_per_token


@dataclass(frozen=True)
class WorkloadModel:
    """Lengths are drawn (with replacement) from the given samples; arrivals at ``rate`` req/s."""

    input_lens: tuple[int, ...]
    output_lens: tuple[int, ...]
    rate: float
    burstiness: float = 1.0

    def __post_init__(self):
        if not self.input_lens or not self.output_lens:
            raise ValueError("workload: needs input and output lengths")
        if min(self.input_lens) < 1 or min(self.output_lens) < 1:
            raise ValueError("workload: lengths must be >= 1")
        if not 0 < self.burstiness:
            raise ValueError(f"--burstiness: must be > 0, got {self.burstiness}")
        if not 0 < self.rate < math.inf:
            raise ValueError(f"--request-rate: the planner needs a finite rate > 0, got {self.rate}")

    def requests(self, n: int, seed: int) -> list[SimRequest]:
        rng = np.random.default_rng(seed)
        times = arrival_offsets(n, self.rate, self.burstiness, rng)
        isl = rng.choice(np.asarray(self.input_lens), size=n)
        osl = rng.choice(np.asarray(self.output_lens), size=n)
        return [SimRequest(t, int(i), int(o)) for t, i, o in zip(times, isl, osl)]


@dataclass(frozen=True)
class SLO:
    """Per-request limits in seconds (None: not constrained) and the attainment target."""

    ttft: float | None = None
    tpot: float | None = None
    attainment: float = 0.9

    def __post_init__(self):
        if self.ttft is None and self.tpot is None:
            raise ValueError("--slo: give at least one of ttft, tpot")
        if not 0 < self.attainment <= 1:
            raise ValueError(f"--slo-attainment: must be in (0, 1], got {self.attainment}")


@dataclass(frozen=True)
class Deployment:
    """``prefill`` x ``decode`` instances (disaggregated) or ``colocated`` instances."""

    prefill: int = 0
    decode: int = 0
    colocated: int = 0
    min_prefill_tokens: int = 0

    def __post_init__(self):
        if (self.colocated > 0) == (self.prefill > 0 or self.decode > 0):
            raise ValueError("deployment: either colocated > 0, or prefill > 0 and decode > 0")
        if self.colocated == 0 and (self.prefill < 1 or self.decode < 1):
            raise ValueError("deployment: a disaggregated deployment needs prefill >= 1 and decode >= 1")

    @property
    def instances(self) -> int:
        return self.colocated or self.prefill + self.decode

    def __str__(self) -> str:
        if self.colocated:
            return f"{self.colocated} colocated"
        extra = f" (min-prefill-tokens {self.min_prefill_tokens})" if self.min_prefill_tokens else ""
        return f"{self.prefill}P{self.decode}D{extra}"


# --------------------------------------------------------------- simulation
@dataclass(eq=False)
class SimRequest:
    arrival: float
    isl: int
    osl: int
    first_token: float | None = None
    finish: float | None = None
    decode: DecodeInbox | None = None  # chosen on arrival
    finish_step: int = 0  # the decode worker's step count at which its last token comes out

    # What a finished simulation has set on every request (``simulate``'s contract).
    @property
    def ttft(self) -> float:
        if self.first_token is None:
            raise RuntimeError(f"simulated request arriving at {self.arrival} has no first token yet")
        return self.first_token - self.arrival

    @property
    def decode_time(self) -> float:
        """From the first token to the last."""
        if self.first_token is None or self.finish is None:
            raise RuntimeError(f"simulated request arriving at {self.arrival} has not finished")
        return self.finish - self.first_token

    @property
    def decoder(self) -> DecodeInbox:
        if self.decode is None:
            raise RuntimeError(f"simulated request arriving at {self.arrival} has no decode worker yet")
        return self.decode


class EventLoop:
    """Time-ordered callbacks (ties in scheduling order)."""

    def __init__(self):
        self.now = 0.0
        self._heap: list = []
        self._seq = 0

    def at(self, t: float, fn, *args) -> None:
        heapq.heappush(self._heap, (t, self._seq, fn, args))
        self._seq += 1

    def run(self) -> None:
        while self._heap:
            self.now, _, fn, args = heapq.heappop(self._heap)
            fn(*args)


class PrefillWorker:
    """FIFO batches of whole prompts; calls ``done(request)`` when its KV is computed."""

    def __init__(self, loop: EventLoop, hw: Hardware, done):
        self.loop, self.hw, self.done = loop, hw, done
        self.queue: deque[SimRequest] = deque()
        self.backlog = 0  # tokens queued or in the running batch
        self.busy = False

    def submit(self, r: SimRequest) -> None:
        self.queue.append(r)
        self.backlog += r.isl
        if not self.busy:
            self._start()

    def _start(self) -> None:
        batch = take_batch(self.queue, self.hw.max_prefill_tokens, len(self.queue))
        tokens = sum(r.isl for r in batch)
        self.busy = True
        self.loop.at(self.loop.now + self.hw.prefill.time(tokens), self._finished, batch, tokens)

    def _finished(self, batch: list[SimRequest], tokens: int) -> None:
        self.backlog -= tokens
        self.busy = False
        for r in batch:
            self.done(r)
        if self.queue:
            self._start()


class DecodeInbox:
    """How work reaches a simulated decode instance: prompts to prefill locally (conditional
    disaggregation) and requests whose KV arrived. Subclasses say what a kick does."""

    def __init__(self, loop: EventLoop, hw: Hardware):
        self.loop, self.hw = loop, hw
        self.local: deque[SimRequest] = deque()  # prompts to prefill here
        self.joining: deque[SimRequest] = deque()  # KV arrived, waiting for a step boundary
        self.assigned = 0  # unfinished requests routed here (the router's load)
        self.busy = False

    def add_local(self, r: SimRequest) -> None:
        self.local.append(r)
        self._kick()

    def add_kv(self, r: SimRequest) -> None:
        self.joining.append(r)
        self._kick()

    def _kick(self) -> None:
        raise NotImplementedError


class DecodeWorker(DecodeInbox):
    """A running batch stepping back to back; local prefills (prefill priority) stall it.

    Steps are simulated in runs: while the batch does not change, the steps up to
    the next finish are one event, cut short at the next step boundary when new
    work arrives (so the cost is per join and finish, not per token).
    Invariant: ``running`` = requests decoding here; ``finishing`` is a heap of
    their (finish_step, seq, request); ``fresh`` = those whose first token is the
    first step of the current run.
    """

    def __init__(self, loop: EventLoop, hw: Hardware):
        super().__init__(loop, hw)
        self.running: set[SimRequest] = set()
        self.finishing: list = []
        self.fresh: list[SimRequest] = []
        self.steps = 0  # decode steps done
        self.run: tuple[float, float, int, int] | None = None  # (start, step time, steps, steps before)
        self.version = 0  # bumps when the scheduled end of a run changes

    def _kick(self) -> None:
        if not self.busy:
            self._next()
        elif self.run is not None:
            self._cut_run()

    def _cut_run(self) -> None:
        """New work joins at the next step boundary: end the run there."""
        assert self.run is not None  # only called with a run in progress
        start, dt, n, base = self.run
        done = int((self.loop.now - start) // dt) + 1
        if done < n:
            self.run = (start, dt, done, base)
            self._schedule(start + done * dt)

    def _schedule(self, t: float) -> None:
        self.version += 1
        self.loop.at(t, self._run_done, self.version)

    def _next(self) -> None:
        room = self.hw.max_running_requests - len(self.running)
        if self.local and room > 0:
            batch = take_batch(self.local, self.hw.max_prefill_tokens, room)
            self.busy, self.run = True, None
            self.loop.at(self.loop.now + self.hw.prefill.time(sum(r.isl for r in batch)), self._prefilled, batch)
            return
        while self.joining and len(self.running) < self.hw.max_running_requests:
            r = self.joining.popleft()
            self._join(r, r.osl)  # its first token is the first step's: prefill does not sample
            self.fresh.append(r)
        if not self.running:
            self.busy = False
            return
        dt = self.hw.decode.step(len(self.running))
        n = self.finishing[0][0] - self.steps
        self.busy, self.run = True, (self.loop.now, dt, n, self.steps)
        self._schedule(self.loop.now + n * dt)

    def _join(self, r: SimRequest, tokens: int) -> None:
        r.finish_step = self.steps + tokens
        heapq.heappush(self.finishing, (r.finish_step, id(r), r))
        self.running.add(r)

    def _prefilled(self, batch: list[SimRequest]) -> None:
        for r in batch:
            r.first_token = self.loop.now
            if r.osl == 1:
                self._finish(r, self.loop.now)
            else:
                self._join(r, r.osl - 1)
        self._next()

    def _run_done(self, version: int) -> None:
        if version != self.version:
            return  # superseded by a cut
        assert self.run is not None  # a current (not superseded) run-done event has its run
        start, dt, n, base = self.run
        self.steps = base + n
        for r in self.fresh:
            r.first_token = start + dt
        self.fresh = []
        while self.finishing and self.finishing[0][0] <= self.steps:
            step, _, r = heapq.heappop(self.finishing)
            self.running.discard(r)
            self._finish(r, start + (step - base) * dt)
        self.run = None
        self._next()

    def _finish(self, r: SimRequest, t: float) -> None:
        r.finish = t
        self.assigned -= 1


class StepDecodeWorker(DecodeInbox):
    """The slow twin of DecodeWorker: one event per step, every request counted per token.
    Same contract and same results (tests compare them); kept because it is obviously right."""

    def __init__(self, loop: EventLoop, hw: Hardware):
        super().__init__(loop, hw)
        self.running: list[SimRequest] = []
        self.left: dict[SimRequest, int] = {}  # tokens still to come

    def _kick(self) -> None:
        if not self.busy:
            self._step()

    def _step(self) -> None:
        room = self.hw.max_running_requests - len(self.running)
        self.busy = True
        if self.local and room > 0:
            batch = take_batch(self.local, self.hw.max_prefill_tokens, room)
            self.loop.at(self.loop.now + self.hw.prefill.time(sum(r.isl for r in batch)), self._emit, batch, True)
            return
        while self.joining and len(self.running) < self.hw.max_running_requests:
            self.running.append(self.joining.popleft())
        if not self.running:
            self.busy = False
            return
        self.loop.at(self.loop.now + self.hw.decode.step(len(self.running)), self._emit, list(self.running), False)

    def _emit(self, reqs: list[SimRequest], prefilled: bool) -> None:
        now = self.loop.now
        for r in reqs:
            if r.first_token is None:
                r.first_token = now
            self.left[r] = self.left.get(r, r.osl) - 1
            if self.left[r] == 0:
                r.finish = now
                self.assigned -= 1
                if not prefilled:
                    self.running.remove(r)
            elif prefilled:
                self.running.append(r)
        self._step()


def take_batch(queue: deque, token_budget: int, max_requests: int) -> list:
    """FIFO prompts up to ``token_budget`` tokens (always at least one) and ``max_requests``."""
    batch: list = []
    tokens = 0
    while queue and len(batch) < max_requests and (not batch or tokens + queue[0].isl <= token_budget):
        r = queue.popleft()
        batch.append(r)
        tokens += r.isl
    return batch


def simulate(dep: Deployment, hw: Hardware, requests: list[SimRequest], stepwise: bool = False) -> list[SimRequest]:
    """Run ``requests`` (fresh copies) through ``dep``; returns them with first_token/finish set.
    ``stepwise`` uses the per-step slow twin of the decode worker."""
    loop = EventLoop()
    reqs = [SimRequest(r.arrival, r.isl, r.osl) for r in requests]
    worker: type[DecodeInbox] = StepDecodeWorker if stepwise else DecodeWorker
    decoders = [worker(loop, hw) for _ in range(dep.decode or dep.colocated)]

    def kv_computed(r: SimRequest) -> None:
        loop.at(loop.now + hw.transfer(r.isl), r.decoder.add_kv, r)

    prefills = [PrefillWorker(loop, hw, kv_computed) for _ in range(dep.prefill)]

    def arrive(r: SimRequest) -> None:
        decoder = r.decode = min(decoders, key=lambda w: w.assigned)
        decoder.assigned += 1
        if dep.colocated or r.isl < dep.min_prefill_tokens:
            decoder.add_local(r)
        else:
            min(prefills, key=lambda w: w.backlog).submit(r)

    for r in reqs:
        loop.at(r.arrival, arrive, r)
    loop.run()
    return reqs


# ---------------------------------------------------------------- evaluation
@dataclass
class Evaluation:
    deployment: Deployment
    feasible: bool
    attainment: float = 0.0
    goodput_per_instance: float = 0.0
    stats: dict = field(default_factory=dict)
    reason: str = ""

    def to_dict(self) -> dict:
        d = self.deployment
        return {"deployment": str(d), "prefill": d.prefill, "decode": d.decode, "colocated": d.colocated,
                "min_prefill_tokens": d.min_prefill_tokens, "instances": d.instances, "feasible": self.feasible,
                "attainment": self.attainment, "goodput_per_instance": self.goodput_per_instance,
                "stats": self.stats, "reason": self.reason}


def request_tpot(r: SimRequest) -> float | None:
    return None if r.osl < 2 else r.decode_time / (r.osl - 1)


def meets(r: SimRequest, slo: SLO) -> bool:
    tpot = request_tpot(r)
    return ((slo.ttft is None or r.ttft <= slo.ttft)
            and (slo.tpot is None or tpot is None or tpot <= slo.tpot))


def evaluate(dep: Deployment, hw: Hardware, wl: WorkloadModel, slo: SLO, requests: list[SimRequest]) -> Evaluation:
    """Simulate ``dep`` (unless it is overloaded on average) and score it against ``slo``."""
    reason = overload(dep, hw, wl)
    if reason:
        return Evaluation(dep, False, reason=reason)
    done = simulate(dep, hw, requests)
    attainment = sum(meets(r, slo) for r in done) / len(done)
    feasible = attainment >= slo.attainment
    return Evaluation(dep, feasible, attainment, wl.rate * attainment / dep.instances, sim_stats(done),
                      "" if feasible else f"attainment {attainment:.1%} < {slo.attainment:.0%}")


def sim_stats(done: list[SimRequest]) -> dict:
    ttft = np.asarray([r.ttft for r in done]) * 1000
    tpot = np.asarray([t for t in map(request_tpot, done) if t is not None] or [0.0]) * 1000
    return {"mean_ttft_ms": float(ttft.mean()), "p90_ttft_ms": float(np.percentile(ttft, 90)),
            "p99_ttft_ms": float(np.percentile(ttft, 99)), "mean_tpot_ms": float(tpot.mean()),
            "p90_tpot_ms": float(np.percentile(tpot, 90)), "p99_tpot_ms": float(np.percentile(tpot, 99))}


def overload(dep: Deployment, hw: Hardware, wl: WorkloadModel) -> str:
    """Why ``dep`` cannot keep up on average ('' if it might), from lower bounds of the busy fraction
    of each instance kind: decode steps at the best token rate of any batch size, plus prompts
    prefilled on decode (colocated, or under the threshold) and on prefill at the cheapest token cost."""
    isl, osl = np.asarray(wl.input_lens), np.asarray(wl.output_lens)
    local = isl if dep.colocated else isl[isl < dep.min_prefill_tokens]
    remote = isl[:0] if dep.colocated else isl[isl >= dep.min_prefill_tokens]
    cost = min_prefill_cost(hw)
    decode_tput = max(b / hw.decode.step(b) for b in range(1, hw.max_running_requests + 1))
    decode_busy = wl.rate * (osl.mean() / decode_tput + local.sum() / len(isl) * cost) / (dep.decode or dep.colocated)
    if decode_busy >= 1:
        return f"decode overloaded (busy >= {decode_busy:.2f}x its time)"
    prefill_busy = wl.rate * remote.sum() / len(isl) * cost / dep.prefill if dep.prefill else 0.0
    if prefill_busy >= 1:
        return f"prefill overloaded (busy >= {prefill_busy:.2f}x its time)"
    return ""


def min_prefill_cost(hw: Hardware) -> float:
    """A lower bound of prefill seconds per token over any batch size the curve describes."""
    xs, ys = hw.prefill.curve.xs, hw.prefill.curve.ys
    costs = [y / x for x, y in zip(xs, ys)]
    if len(xs) > 1 and ys[-1] > ys[-2]:
        costs.append((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))
    return min(costs)


# -------------------------------------------------------------------- search
@dataclass
class Plan:
    recommendation: Evaluation | None
    best_disaggregated: Evaluation | None
    best_colocated: Evaluation | None
    thresholds: list[Evaluation]  # the best disaggregated deployment found for each threshold tried
    evaluations: list[Evaluation]
    verdict: str
    runner_up: Evaluation | None = None  # the best feasible deployment of another shape
    margin: float | None = None  # the recommendation's lead in goodput per instance over runner_up

    @property
    def close_call(self) -> bool:
        """The recommendation's lead is within noise: a warning, not a recommendation."""
        return self.margin is not None and self.margin < MARGIN_WARNING

    def to_dict(self) -> dict:
        pick = lambda e: e.to_dict() if e else None  # noqa: E731
        return {"schema": "pdserve.plan/v1", "verdict": self.verdict, "recommendation": pick(self.recommendation),
                "margin": self.margin, "close_call": self.close_call, "runner_up": pick(self.runner_up),
                "best_disaggregated": pick(self.best_disaggregated), "best_colocated": pick(self.best_colocated),
                "min_prefill_tokens_tried": [e.to_dict() for e in self.thresholds],
                "evaluations": [e.to_dict() for e in self.evaluations]}


def better(a: Evaluation | None, b: Evaluation) -> bool:
    """Is ``b`` a better feasible pick than ``a``: more goodput per instance, then fewer instances,
    higher attainment, lower mean TTFT."""
    if not b.feasible:
        return False
    if a is None:
        return True
    return _rank(b) > _rank(a)


def _rank(e: Evaluation) -> tuple:
    return (e.goodput_per_instance, -e.deployment.instances, e.attainment, -e.stats.get("mean_ttft_ms", math.inf))


def plan(hw: Hardware, wl: WorkloadModel, slo: SLO, max_instances: int = 16, num_requests: int = 1000,
         seed: int = 0) -> Plan:
    """Search deployments of up to ``max_instances`` instances (see the module docstring)."""
    if max_instances < 1:
        raise ValueError(f"--max-instances: must be >= 1, got {max_instances}")
    if num_requests < 1:
        raise ValueError(f"--num-requests: must be >= 1, got {num_requests}")
    reqs = wl.requests(num_requests, seed)
    evals: list[Evaluation] = []
    coloc = _search_colocated(hw, wl, slo, reqs, max_instances, evals)
    per_threshold = [e for t in threshold_candidates(wl.input_lens)
                     if (e := _search_disaggregated(hw, wl, slo, reqs, max_instances, evals, t)) is not None]
    disagg = None
    for e in per_threshold:
        if better(disagg, e):
            disagg = e
    if coloc is None and disagg is None:
        return Plan(None, None, None, per_threshold, evals,
                    f"no deployment of up to {max_instances} instances meets the SLOs at {wl.rate:g} req/s")
    if disagg is None or (coloc is not None and coloc.goodput_per_instance >= disagg.goodput_per_instance):
        assert coloc is not None  # both None returned above
        why = "only colocation meets the SLOs" if disagg is None else \
            f"colocation gives {coloc.goodput_per_instance:.3g} req/s per instance vs " \
            f"{disagg.goodput_per_instance:.3g} for {disagg.deployment}"
        return with_margin(Plan(coloc, disagg, coloc, per_threshold, evals, f"colocate: {coloc.deployment} ({why})"))
    verdict = f"disaggregate: {disagg.deployment}"
    if coloc is not None:
        verdict += (f" ({disagg.goodput_per_instance:.3g} req/s per instance vs {coloc.goodput_per_instance:.3g} "
                    f"colocated with {coloc.deployment})")
    return with_margin(Plan(disagg, disagg, coloc, per_threshold, evals, verdict))


def with_margin(p: Plan) -> Plan:
    """``p`` with its runner-up and margin: the best feasible deployment of another shape (other
    P, D or C; a threshold alone is no other shape) among those simulated, and the recommendation's
    relative lead over it in goodput per instance (None when nothing else meets the SLOs)."""
    rec = p.recommendation
    if rec is None:
        return p
    shape = _shape(rec.deployment)
    for e in p.evaluations:
        if _shape(e.deployment) != shape and better(p.runner_up, e):
            p.runner_up = e
    if p.runner_up is not None and p.runner_up.goodput_per_instance > 0:
        p.margin = rec.goodput_per_instance / p.runner_up.goodput_per_instance - 1
    return p


def _shape(d: Deployment) -> tuple[int, int, int]:
    return d.prefill, d.decode, d.colocated


def _search_colocated(hw, wl, slo, reqs, max_instances, evals) -> Evaluation | None:
    best = None
    for c in range(1, max_instances + 1):
        if best and wl.rate / c <= best.goodput_per_instance:
            break  # goodput per instance <= rate / instances: nothing larger can win
        e = evaluate(Deployment(colocated=c), hw, wl, slo, reqs)
        evals.append(e)
        if better(best, e):
            best = e
    return best


def _search_disaggregated(hw, wl, slo, reqs, max_instances, evals, threshold: int) -> Evaluation | None:
    best = None
    for p in range(1, max_instances):
        if best and wl.rate / (p + 1) <= best.goodput_per_instance:
            break
        for d in range(1, max_instances - p + 1):
            if best and wl.rate / (p + d) <= best.goodput_per_instance:
                break
            e = evaluate(Deployment(prefill=p, decode=d, min_prefill_tokens=threshold), hw, wl, slo, reqs)
            evals.append(e)
            if better(best, e):
                best = e
            if e.feasible:
                break  # more decode instances only add to the denominator past the first feasible one
    return best


def threshold_candidates(input_lens) -> list[int]:
    """0 (always transfer) plus thresholds that split the ISL samples at their quantiles and powers of 2."""
    isl = np.asarray(input_lens)
    cands = {int(np.quantile(isl, q)) + 1 for q in THRESHOLD_QUANTILES}
    cands |= {2 ** k for k in range(4, 20) if isl.min() < 2 ** k <= isl.max()}
    return [0, *sorted(c for c in cands if isl.min() < c <= isl.max())]


# ------------------------------------------------------------------- report
def format_plan(p: Plan) -> str:
    rows = ["{s:{c}^{n}}".format(s=" P:D plan ", n=78, c="="),
            f"{'deployment':<36}{'feasible':>9}{'attain':>8}{'gp/inst':>9}{'p99 TTFT':>9}{'p99 TPOT':>9}"]
    for e in p.evaluations:
        s = e.stats
        rows.append(f"{str(e.deployment):<36}{'yes' if e.feasible else 'no':>9}{e.attainment:>8.1%}"
                    f"{e.goodput_per_instance:>9.3g}{s.get('p99_ttft_ms', math.nan):>9.0f}"
                    f"{s.get('p99_tpot_ms', math.nan):>9.1f}" + (f"  {e.reason}" if e.reason and not s else ""))
    rows.append("-" * 78)
    rows += margin_lines(p)
    r = p.recommendation
    if r is not None and r.deployment.colocated == 0:
        rows.append(f"--disaggregation-min-prefill-tokens {r.deployment.min_prefill_tokens}"
                    + ("  (always transfer)" if r.deployment.min_prefill_tokens == 0 else
                       "  (shorter prompts are prefilled on decode)"))
    rows.append("=" * 78)
    return "\n".join(rows)


def margin_lines(p: Plan) -> list[str]:
    """The verdict with its margin; a lead under MARGIN_WARNING is printed as a warning instead."""
    r, u = p.recommendation, p.runner_up
    if r is None:
        return ["Recommendation: " + p.verdict]
    if u is None or p.margin is None:
        return ["Recommendation: " + p.verdict,
                "Margin: no other deployment simulated meets the SLOs"]
    rates = f"({r.goodput_per_instance:.3g} vs {u.goodput_per_instance:.3g} req/s)"
    if p.close_call:
        return [f"WARNING: no clear winner: {r.deployment} leads {u.deployment} by only {p.margin:.1%} in goodput "
                f"per instance {rates}; a lead under {MARGIN_WARNING:.0%} is within profiling noise, so benchmark "
                "both before choosing", "Closest call: " + p.verdict]
    return ["Recommendation: " + p.verdict,
            f"Margin: {p.margin:.1%} more goodput per instance than {u.deployment} {rates}"]


# ------------------------------------------------------------------- inputs
def workload_from_result(result: dict, rate: float | None = None, burstiness: float | None = None) -> WorkloadModel:
    """ISL/OSL samples of a ``pdserve bench`` result's successful requests; its offered rate unless given."""
    d = result.get("details") or {}
    ok = [i for i, s in enumerate(d.get("success", [])) if s]
    if not ok:
        raise ValueError("--workload: the result has no successful request to take lengths from")
    isl = tuple(int(d["input_lens"][i]) for i in ok)
    osl = tuple(int(d["output_lens"][i]) for i in ok)
    if rate is None:
        rate = offered_rate(result.get("args") or {})
    if rate is None:
        raise ValueError("--request-rate: the --workload run sent everything at once (rate inf); give the rate "
                         "to plan for")
    b = burstiness if burstiness is not None else float((result.get("args") or {}).get("burstiness", 1.0))
    return WorkloadModel(isl, osl, rate, b)


def offered_rate(args: dict) -> float | None:
    """The req/s a bench run offered (both streams of ``mixed``), None if unbounded."""
    def num(x):
        return None if x in (None, "inf") or (isinstance(x, float) and math.isinf(x)) else float(x)

    base = num(args.get("request_rate"))
    if args.get("dataset_name") == "mixed":
        inter = num(args.get("mixed_interactive_rate")) or base
        back = num(args.get("mixed_background_rate"))
        return None if inter is None or back is None else inter + back
    return base


def workload_from_lengths(isl: int, osl: int, range_ratio: float, rate: float, burstiness: float = 1.0,
                          samples: int = 4096, seed: int = 0) -> WorkloadModel:
    """Uniform lengths in [ratio * L, L] (the random dataset's rule)."""
    if not 0 <= range_ratio <= 1:
        raise ValueError(f"--range-ratio: must be in [0, 1], got {range_ratio}")
    rng = np.random.default_rng(seed)
    ins = rng.integers(max(int(isl * range_ratio), 1), isl + 1, size=samples)
    outs = rng.integers(max(int(osl * range_ratio), 1), osl + 1, size=samples)
    return WorkloadModel(tuple(int(x) for x in ins), tuple(int(x) for x in outs), rate, burstiness)
