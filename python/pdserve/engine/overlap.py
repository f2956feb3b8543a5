"""Overlap scheduling: decode forwards and their sampling run on a worker thread, one step ahead.

SGLang's zero-overhead scheduler, on the host: while the worker runs step N's forward and
samples it, the scheduler thread processes step N-1's tokens (stop checks, outputs, the frontend
message) and builds step N+1. Torch ops release the GIL, so on CPU the forward's threads and the
scheduler's Python share the cores instead of taking turns; on a GPU the worker's launches and
its one host sync (the logits) leave the scheduler thread free.

Step N is built before step N-1's tokens are known: a request in both carries a placeholder as
its input token, which the worker fills from step N-1's sampled tokens before the forward
(``prev_rows``). The scheduler owns every request's state; the worker only reads the tensors it
was handed, the requests' sampling parameters and seeded generators (no one else touches them
while a step is in flight: a step that must sample on the scheduler thread waits for the worker
first, ``Scheduler.sync``).

Legend: B requests, V vocabulary.
"""

from __future__ import annotations

import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

# How long a thread holding the GIL keeps it while another waits. Python's 5 ms default lets the
# scheduler thread's bookkeeping hold up the worker for that long between two torch ops (each op
# releases the GIL while it computes): the forward would then wait out the bookkeeping instead of
# running beside it.
GIL_SWITCH_INTERVAL_S = 1e-4

if TYPE_CHECKING:
    from pdserve.engine.model_runner import ModelRunner
    from pdserve.engine.request import Req, SamplingParams
    from pdserve.engine.sampler import SampleFn, SampleResult
    from pdserve.engine.thread_tuner import ForwardThreads
    from pdserve.layers.forward_batch import ForwardBatch


@dataclass
class LaunchedDecode:
    """A decode step handed to the worker; the scheduler appends its tokens one step later.
    ``top_ks``: each row's top-logprob count when any row wants logprobs (else None)."""

    reqs: list[Req]  # [B] in row order, as they were when the step was built
    result: Future[SampleResult]
    top_ks: list[int] | None

    def __post_init__(self):
        self.rows = {id(r): b for b, r in enumerate(self.reqs)}  # a request's row in this step
        # Requests of this step that ended before it landed: their pages are released once it has
        # (its write to them must not land after a new owner's: a transfer, a load-back).
        self.ended: list[Req] = []

    def row_of(self, req: Req) -> int:
        """``req``'s row in this step, -1 if it is not in it."""
        return self.rows.get(id(req), -1)


class ForwardWorker:
    """One thread that runs decode forwards and samples them, in submission order.

    Contract: ``submit`` is called from the scheduler thread only; jobs run one at a time, in
    order, so a job's KV writes land before any later job (or any forward the scheduler runs
    itself after ``LaunchedDecode.result`` returned) reads the pool. ``prev_rows[b]`` >= 0: row b's
    input token is row ``prev_rows[b]`` of the previous job's sampled tokens.
    """

    def __init__(self, runner: ModelRunner, sampler: SampleFn, threads: ForwardThreads):
        self.runner = runner
        self.sampler = sampler
        # the forward's torch threads: set on this worker's own thread (a new thread's OpenMP team
        # would start at the default), chosen per step when tuned; the scheduler may replace it
        # before the first job
        self.threads = threads
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pdserve-forward")
        self._last_tokens = torch.zeros(0, dtype=torch.int64)  # [B_prev] the previous job's tokens
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))  # process-wide, as threads are

    def submit(self, fb: ForwardBatch, prev_rows: list[int], params: list[SamplingParams], generators: list,
               outputs: list[list[int]], want_logprobs: bool, top_ks: list[int] | None) -> Future[SampleResult]:
        return self._pool.submit(self._run, fb, prev_rows, params, generators, outputs, want_logprobs, top_ks)

    def _run(self, fb: ForwardBatch, prev_rows: list[int], params: list[SamplingParams], generators: list,
             outputs: list[list[int]], want_logprobs: bool, top_ks: list[int] | None) -> SampleResult:
        rows = [b for b, p in enumerate(prev_rows) if p >= 0]
        if prev_rows == rows and len(rows) == len(self._last_tokens):
            fb.input_ids.copy_(self._last_tokens)  # the previous job's batch, row for row (most steps)
        elif rows:  # the placeholders: tokens the previous job sampled
            fb.input_ids[torch.tensor(rows)] = self._last_tokens[torch.tensor([prev_rows[b] for b in rows])].to(
                fb.input_ids.device)
        with self.threads.step(len(params)):  # sampling reads the logits back: the forward has run
            logits = self.runner.run(fb)  # [B, V]
            res = self.sampler(logits, params, generators, outputs, want_logprobs, top_ks)
        self._last_tokens = torch.tensor(res.tokens, dtype=torch.int64)  # [B]
        return res

    def close(self) -> None:
        self._pool.shutdown(wait=True)
