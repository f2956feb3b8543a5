"""The forward's torch threads, chosen at run time from measured step times (``ThreadTuner``).

How many intra-op threads a CPU forward should use depends on what else runs on the cores, which
start-up cannot know: on a quiet 2-core machine the second core sits idle beside a one-thread
forward, while on a loaded one a two-thread OpenMP team collapses (a descheduled thread stalls
every barrier, up to 3x the CPU time). So the forward runs mostly at the count that has measured
fastest and, now and then, probes the other one for a few steps; it switches when the other is
clearly faster (``TunerSettings.margin``) than the current count both just before the probe and
just after it, so that a burst of load from elsewhere during either window does not flap it.

Steps are compared per token, and only steps of like size: each power-of-two bucket of tokens in
the step (a decode of 32 requests, a 2,048-token prefill chunk) keeps its own choice, because a
big prefill may gain from a second thread where a one-request decode only pays the barriers. A
probe is compared with the steps run around it, so slow drift (longer contexts, a changing load)
hits both alike. A probe that loses waits twice as long before the next one (up to
``max_backoff``), so a machine where the other count never wins pays for probing rarely; a step
time that grows well past what the last decision saw (``drift``) probes as soon as ``probe_every``
steps have passed. A probe step far slower than the current count (``give_up``: a collapsing
OpenMP team on a loaded machine can be 10x slower) ends the probe at once, as lost.

Wide steps (``wide_tokens`` and more: prefill chunks) are few and long, and GEMM-bound: they start at
the larger count and compare one step at a time, so a burst of prompts is decided within its first
three chunks (online on a quiet 2-core machine, a short run of 64 prompts saw ~5 prefill chunks per
step size, and a four-step window never decided them while two threads cut TTFT by a third). On a
loaded machine the first wide step may collapse; the probe of the smaller count right after it
takes the bucket back. Wide starts at 128 tokens: a wave's first chunk is often one or two prompts
(the scheduler starts on the first arrival), one step per wave in its bucket, so a four-step window
would leave it at one thread for a dozen waves; offline on 2 cores, a 128-256-token prefill took
0.74-0.79x the time on two threads (64 tokens: 0.98x, left narrow).

``ThreadTuner`` is the policy alone (no torch, no clock: tests feed it step times);
``ForwardThreads`` applies it on the thread that runs a forward.
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.config import ThreadLayout


@dataclass(frozen=True)
class TunerSettings:
    """``probe_steps``: steps one probe runs at the other count (and steps of the current count it
    is compared with); ``probe_every``: steps at the current count between probes; ``margin``: how
    much faster per token the other count must be to switch; ``max_backoff``: the most a losing
    probe multiplies ``probe_every`` by; ``drift``: how much slower the current count may grow
    since the last decision before a probe runs early; ``give_up``: a probe step this many times
    slower per token than the current count ends its probe, lost; ``wide_tokens``: steps of at
    least this many tokens start at the larger count, with windows of one step."""

    probe_steps: int = 4
    probe_every: int = 64
    margin: float = 0.1
    max_backoff: int = 8
    drift: float = 0.25
    give_up: float = 2.0
    wide_tokens: int = 128

    def __post_init__(self):
        for name in ("probe_steps", "probe_every", "max_backoff", "wide_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be at least 1, got {getattr(self, name)}")
        if not 0 <= self.margin < 1:
            raise ValueError(f"margin: must be in [0, 1), got {self.margin}")
        if self.drift <= 0:
            raise ValueError(f"drift: must be positive, got {self.drift}")
        if self.give_up <= 1:
            raise ValueError(f"give_up: must be above 1, got {self.give_up}")


@dataclass
class _Bucket:
    """One step size's choice. ``times[c]``: the latest per-token seconds at count ``c``; ``probing``:
    probe steps still to run; ``after``: steps at ``current`` still to run after a probe before the
    decision (``before``: the current count's median just before the probe); ``since``: steps at
    ``current`` since the last decision, ``interval``: how many of them the next probe waits for;
    ``ref``: the current count's per-token time when it was last chosen or kept; ``window``: steps
    in a probe and in each window compared with it."""

    current: int
    interval: int
    window: int
    times: dict[int, deque[float]]
    probing: int = 0
    since: int = 0
    after: int = 0
    before: float = 0.0
    backoff: int = 1
    ref: float = 0.0
    switches: int = 0
    probes: int = 0
    last: dict[int, float] = field(default_factory=dict)  # per-token seconds each count had at the last decision


class ThreadTuner:
    """Chooses between two thread counts per step size. Not thread-safe (``ForwardThreads`` locks).

    ``counts``: (the count to start at, the other); ``count_for(tokens)`` is the count the next step
    of ``tokens`` tokens should run at; ``observe`` records a step that ran (at whatever count).
    """

    def __init__(self, counts: tuple[int, int], settings: TunerSettings = TunerSettings()):
        if counts[0] == counts[1] or min(counts) < 1:
            raise ValueError(f"counts: two different positive thread counts, got {counts}")
        self.counts = counts
        self.settings = settings
        self.buckets: dict[int, _Bucket] = {}

    @staticmethod
    def bucket_of(tokens: int) -> int:
        """Steps of 2^k .. 2^(k+1)-1 tokens compare with each other."""
        return max(1, tokens).bit_length() - 1

    def other(self, count: int) -> int:
        return self.counts[1] if count == self.counts[0] else self.counts[0]

    def count_for(self, tokens: int) -> int:
        b = self._bucket(tokens)
        return self.other(b.current) if b.probing else b.current

    def observe(self, tokens: int, count: int, seconds: float) -> None:
        b = self._bucket(tokens)
        b.times[count].append(seconds / max(1, tokens))
        if count != b.current:
            if b.probing and seconds / max(1, tokens) > self.settings.give_up * b.before:
                b.probing = 0
                self._decide(b, lost=True)
            elif b.probing:
                b.probing -= 1
                if not b.probing:  # the current count's window after the probe starts afresh
                    b.times[b.current].clear()
                    b.after = b.window
            return
        if b.after:
            b.after -= 1
            if not b.after:
                self._decide(b)
            return
        b.since += 1
        due = b.since >= b.interval or (b.since >= self.settings.probe_every and self._drifted(b))
        if len(b.times[count]) >= b.window and due:
            self._start_probe(b)

    def _bucket(self, tokens: int) -> _Bucket:
        k = self.bucket_of(tokens)
        if k not in self.buckets:
            wide = (1 << k) >= self.settings.wide_tokens
            n = 1 if wide else self.settings.probe_steps
            start = max(self.counts) if wide else self.counts[0]
            # the first probe comes as soon as the start count has a window to compare with
            self.buckets[k] = _Bucket(start, n, n, {c: deque(maxlen=n) for c in self.counts})
        return self.buckets[k]

    def _drifted(self, b: _Bucket) -> bool:
        return b.ref > 0 and statistics.median(b.times[b.current]) > b.ref * (1 + self.settings.drift)

    def _start_probe(self, b: _Bucket) -> None:
        b.before = statistics.median(b.times[b.current])
        b.times[self.other(b.current)].clear()  # only this probe's steps count
        b.probing = b.window
        b.probes += 1

    def _decide(self, b: _Bucket, lost: bool = False) -> None:
        """A probe and the window after it have run (or the probe gave up, ``lost``): switch if the
        other count ran clearly faster than the current one did both before and after it."""
        other = self.other(b.current)
        mine = b.before if lost else min(b.before, statistics.median(b.times[b.current]))
        theirs = statistics.median(b.times[other])
        b.last = {b.current: mine, other: theirs}
        if not lost and theirs < mine * (1 - self.settings.margin):
            b.current, b.ref, b.backoff = other, theirs, 1
            b.switches += 1
            b.times[other].clear()  # the new current's window fills afresh
        else:
            b.ref = mine
            b.backoff = min(2 * b.backoff, self.settings.max_backoff)
        b.since, b.interval = 0, self.settings.probe_every * b.backoff

    def to_dict(self) -> dict:
        """What ``/get_server_info`` shows: per step-size bucket (its smallest token count), the count
        in use, each count's per-token milliseconds at the last probe, probes and switches."""
        return {
            "counts": list(self.counts),
            "buckets": {str(1 << k): {"threads": b.current, "switches": b.switches, "probes": b.probes,
                                      "ms_per_token": {str(c): round(t * 1e3, 4) for c, t in b.last.items()}}
                        for k, b in sorted(self.buckets.items())},
        }


class ForwardThreads:
    """Sets the torch threads of whichever thread runs a forward, and times the step.

    ``pinned``: the one count (``--num-threads``, ``OMP_NUM_THREADS``, the tuner off); else
    ``tuner`` chooses per step. OpenMP's thread count is per calling thread, so each thread that
    runs forwards (the scheduler's, the overlap worker) sets its own, and only when it changes.
    Contract: one forward at a time (the scheduler waits for the worker before it runs one itself),
    so steps never overlap; the lock only guards ``to_dict`` against a step's update.
    """

    def __init__(self, pinned: int | None = None, tuner: ThreadTuner | None = None, reason: str = ""):
        if (pinned is None) == (tuner is None):
            raise ValueError("ForwardThreads: exactly one of pinned and tuner")
        self.pinned = pinned
        self.tuner = tuner
        self.reason = reason
        self._lock = threading.Lock()
        self._local = threading.local()

    @property
    def most(self) -> int:
        """The largest count a forward may run at (the pinned one, or the tuner's larger choice)."""
        if self.tuner is None:
            assert self.pinned is not None  # exactly one of the two (__init__)
            return self.pinned
        return max(self.tuner.counts)

    @contextmanager
    def step(self, tokens: int) -> Iterator[int]:
        """Run one forward of ``tokens`` tokens inside: at the chosen count, timed when tuning (the
        body must have finished its compute on exit: on CPU a forward is synchronous)."""
        with self._lock:
            count = self.pinned if self.tuner is None else self.tuner.count_for(tokens)
        assert count is not None
        self._apply(count)
        t0 = time.perf_counter()
        yield count
        if self.tuner is not None:
            seconds = time.perf_counter() - t0
            with self._lock:
                self.tuner.observe(tokens, count, seconds)

    def _apply(self, count: int) -> None:
        if getattr(self._local, "count", None) != count:
            import torch

            torch.set_num_threads(count)
            self._local.count = count

    def to_dict(self) -> dict:
        with self._lock:
            state = {"enabled": False, "threads": self.pinned} if self.tuner is None else \
                {"enabled": True, **self.tuner.to_dict()}
        return {**state, "reason": self.reason, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "")}


def forward_threads(layout: ThreadLayout, tune: bool, device_type: str) -> ForwardThreads:
    """The forward's threads for a process laid out as ``layout``: tuned between the layout's count
    (where it starts: what start-up leaves room for) and every usable core, unless the operator set
    the count, turned tuning off, the forward runs on an accelerator, or one core leaves no choice."""
    why_pinned = (f"{layout.source} sets the torch threads" if layout.source != "cores" else
                  "--disable-thread-tuning" if not tune else
                  f"the forward runs on {device_type}" if device_type != "cpu" else
                  "one usable core" if layout.cores < 2 else "")
    if why_pinned:
        return ForwardThreads(pinned=layout.torch_threads, reason=why_pinned)
    other = layout.cores if layout.torch_threads != layout.cores else 1
    return ForwardThreads(tuner=ThreadTuner((layout.torch_threads, other)),
                          reason=f"chosen per step from measured step times: {layout.torch_threads} (the layout's) "
                                 f"or {other}")


def tuned_process_env(tune: bool, environ: dict[str, str] | os._Environ[str]) -> dict[str, str]:
    """What a compute process whose forward may change its thread count per step (``tune``) is
    started with: OpenMP threads that sleep as soon as a parallel region ends (OMP_WAIT_POLICY=passive),
    unless the operator chose a wait policy (or GOMP_SPINCOUNT).

    Why: GNU OpenMP's threads spin after each region, for long when the process's OpenMP threads fit
    the cores. With the second core also running the HTTP frontend, the scheduler thread and other
    processes, a spinning team member uses up its time slice and is then descheduled at the next
    barrier: measured on the shared 2-core machine, a two-thread decode step of tiny-llama took 0.2-1 s
    against 9-10 ms with passive waiting (one thread: 20-35 ms), so the tuner's probes of two threads
    were all lost. A one-thread forward has no team, so passive waiting cannot slow it. Read before
    torch loads OpenMP: the caller sets it in a child's environment.
    """
    if not tune or "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ:
        return {}
    return {"OMP_WAIT_POLICY": "passive"}


def passive_waits_before_torch(environ: os._Environ[str] | dict[str, str] = os.environ) -> bool:
    """For the in-process ``Engine`` (``pdserve.Engine``): when torch is not loaded yet, the tuner
    could run (no OMP_NUM_THREADS pins the count) and the operator chose no wait policy, set
    ``tuned_process_env``'s passive waits in this process's environment, where OpenMP reads them when
    torch loads it. Returns whether it did. With torch already loaded it is too late: the tuner then
    runs with spinning waits, whose probes of a larger count mostly lose (docs/overlap.md)."""
    if "torch" in sys.modules or environ.get("OMP_NUM_THREADS", "").strip():
        return False
    extra = tuned_process_env(True, environ)
    environ.update(extra)
    return bool(extra)

