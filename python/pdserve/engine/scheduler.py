"""The scheduler loop: admission, chunked prefill, continuous decode batching, retraction.

One ``step()`` runs at most one forward pass: an extend batch when any request
can be admitted (or a chunked prefill is in progress), otherwise a decode step
over every running request.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pdserve.config import CacheConfig, GrammarConfig, ModelConfig, SchedulerConfig, ThreadLayout
from pdserve.distributed.parallel_state import SINGLE, ParallelState
from pdserve.engine import policy
from pdserve.engine.grammar import ReqGrammars, StepMask
from pdserve.engine.io_struct import BootstrapRef, TokenOutput
from pdserve.engine.logprobs import PromptLogitPlan, ReqLogprobs, check_logprob_params
from pdserve.engine.model_runner import ModelRunner, ScheduledBatch
from pdserve.engine.modes import SchedulerMode
from pdserve.engine.overlap import ForwardWorker, LaunchedDecode
from pdserve.engine.request import (
    Req,
    ReqState,
    RequestLimits,
    SamplingParams,
    check_scheduler_request,
    finish_abort,
    finish_length,
    finish_stop,
    grammar_refused,
)
from pdserve.engine.sampler import SampleFn, Sampler, SampleResult
from pdserve.engine.speculative import DecodeStep, SpecStats, make_decode_step
from pdserve.engine.stop import StopStringMatcher
from pdserve.engine.thread_tuner import ForwardThreads, forward_threads
from pdserve.layers import cpu_gemm
from pdserve.layers.forward_batch import ForwardMode
from pdserve.mem.allocator import PageAllocator
from pdserve.mem.cache_manager import KVCacheManager
from pdserve.mem.page_table import ReqToTokenTable
from pdserve.mem.radix_cache import RadixCache, key_check
from pdserve.obs.timeline import StageClock

if TYPE_CHECKING:
    from pdserve.obs.kv_event_publisher import KVEventPublisher

logger = logging.getLogger(__name__)

GRAMMAR_IDLE_WAIT_S = 0.01  # with nothing else to run, a step waits this long for a compile to finish


class Scheduler:
    """Owns every request's lifecycle and memory.

    Callers (the offline Engine or the scheduler process) call ``add_request``,
    ``abort``, then ``step()`` repeatedly; ``step`` returns the tokens produced.
    KV memory (pages, table rows, prefix locks) belongs to ``kv_manager``
    (``mem.cache_manager.KVCacheManager``): the loop and the modes ask it, never
    the allocator, the table or the radix cache. A mode hands requests to the loop
    only through ``enqueue`` (to be prefilled here) and ``activate`` (KV complete:
    decode from now on).
    """

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, config: SchedulerConfig,
                 tokenizer=None, parallel: ParallelState = SINGLE, runner: ModelRunner | None = None,
                 mode: SchedulerMode | None = None, grammar: GrammarConfig | None = None):
        """``runner``: one built by the caller (it must match model_config and cache_config);
        by default the scheduler builds its own. ``mode``: a disaggregation mode (default:
        colocated), attached last, once the pool and the queues exist. ``grammar``: how
        json_schema / regex / ebnf requests are constrained (engine/grammar.py)."""
        self.model_config = model_config
        self.cache_config = cache_config
        self.config = config
        self.tokenizer = tokenizer
        self.page_size = cache_config.page_size
        self.runner = runner or ModelRunner(model_config, cache_config, parallel, seed=config.random_seed)
        pool = self.runner.pool
        self.context_len = model_config.context_length
        self.kv_manager = KVCacheManager(pool.num_pages, self.page_size, config.max_running_requests,
                                         self.context_len, disable_radix_cache=cache_config.disable_radix_cache,
                                         hicache=cache_config.hicache, pool=pool,
                                         storage_compat=self._storage_compat(parallel, cache_config),
                                         hash_key=cache_config.hash_key)
        self.sampler: SampleFn = Sampler(config.random_seed)
        self.eos_ids = set(self.model_config.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_ids.add(tokenizer.eos_token_id)
        # Constrained decoding: compiles off this thread, masks per step (nothing without grammars).
        self.grammar = ReqGrammars(grammar or GrammarConfig(), tokenizer, model_config.vocab_size,
                                   sorted(self.eos_ids))
        self.grammar.overlap = self.runner.device.type != "cpu"  # masks fill while the GPU runs the forward
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        # KV complete (a disaggregated decode's transfer landed) but the grammar still compiling:
        # RUNNING, holding pages, joins ``running`` once it can sample
        self.parked: list[Req] = []
        self.chunked: Req | None = None  # the request whose prefill is split over steps
        self.reqs: dict[str, Req] = {}
        self._pending: list[TokenOutput] = []
        # time.monotonic() when the oldest sampled token in ``_pending`` was appended (0.0: none),
        # and that stamp of the outputs ``step`` returned last (the frontend's handoff profile)
        self._sampled_at = 0.0
        self.outputs_sampled_at = 0.0
        # Set by whoever sends the outputs (the scheduler process's loop): a step about to run an
        # extend forward hands it the outputs already due, so a decode token sampled before a long
        # prefill reaches its client before that prefill runs, not after.
        self.emit: Callable[[list[TokenOutput], float], None] | None = None
        # Set by the same loop during a step: a request that finishes decoding hands its pages to the
        # radix cache after the step's outputs have left (``release_finished``), not before: the insert
        # (a node and a hash per page, ~0.8 ms for 224 tokens at page size 1) delayed that step's tokens
        # for every stream, and at a wave's end 32 of them held the last tokens back ~25 ms.
        self.defer_release = False
        self._finished_unreleased: list[Req] = []
        self._arrivals = itertools.count()
        self._uids = itertools.count()  # Req.uid: never reused, unlike a client's rid
        self.num_retractions = 0
        self.forward_steps = 0
        self.new_token_ratio = policy.NewTokenRatio()  # KV admission keeps free for decode growth
        self.kv_events: KVEventPublisher | None = None
        # How a decode step runs: plain, or speculative when the runner has a draft (chosen once).
        self.decode_step: DecodeStep = make_decode_step(self)
        # Overlap scheduling (engine/overlap.py): plain decode steps run one step ahead on a worker
        # thread. Not with speculation (a verify step's accepted length decides the next step's
        # input) nor several ranks (their collectives and shared sampling stay on this thread).
        self.overlap = (not config.disable_overlap_schedule and type(self.decode_step) is DecodeStep
                        and parallel.is_single)
        # The forward's torch threads: the caller's count until ``use_threads`` (engine/thread_tuner.py)
        self.threads = ForwardThreads(pinned=torch.get_num_threads(), reason="the caller's torch threads")
        self._worker = ForwardWorker(self.runner, self.sampler, self.threads) if self.overlap else None
        self._inflight: LaunchedDecode | None = None  # the decode step the worker is running
        self.thread_layout: ThreadLayout | None = None  # set by whoever chose the threads (stats show it)
        self.mode = mode or SchedulerMode()
        self.mode.attach(self)

    def use_threads(self, layout: ThreadLayout, tune: bool = True) -> None:
        """Run forwards in the threads ``layout`` chose, tuned per step unless ``tune`` is off
        (``forward_threads`` says when it stays pinned). Before the first step."""
        self.thread_layout = layout
        self.threads = forward_threads(layout, tune, self.runner.device.type)
        if self._worker is not None:
            self._worker.threads = self.threads
        # The CPU decode attention kernel shares a step's requests with its own helper threads, up to
        # the cores the forward may use: attention reads KV from memory, so it gains from a second
        # core where torch's small ops lose to their barriers (docs/cpu.md).
        if hasattr(self.runner.backend, "decode_threads"):
            self.runner.backend.decode_threads = self.threads.most
        cpu_gemm.set_small_m_threads(self.threads.most)  # the C decode GEMM's helpers, the same way

    def attach_kv_events(self, publisher: KVEventPublisher) -> None:
        """Publish the KV cache's events: one batch per step (and per flush), sent off this thread."""
        self.kv_events = publisher
        self.kv_manager.set_event_sink(publisher)

    def kv_events_snapshot(self) -> dict | None:
        """Every cached block and the event batch it is current to; None when events are off."""
        if self.kv_events is None:
            return None
        return self.kv_events.snapshot(self.kv_manager.cached_blocks(), self.page_size)

    def _storage_compat(self, parallel: ParallelState, cache_config: CacheConfig) -> dict[str, object] | None:
        """What makes stored KV pages interchangeable: other weights (whatever their path: the
        content fingerprint reads every byte), dtype, page shape, layout or TP shard must never
        read them (storage keys are scoped by this record). None without a storage tier, which
        spares the checkpoint read."""
        if not cache_config.hicache.storage_backend:
            return None
        from pdserve.models.fingerprint import content_fingerprint

        pool = self.runner.pool
        return {"weights": content_fingerprint(self.model_config, self.config.random_seed),
                "architecture": self.model_config.architecture, "dtype": str(pool.dtype),
                "page_size": self.page_size, "layout": "page_first", "num_layers": pool.num_layers,
                "buffers": [[name, str(buf.dtype), *buf.shape[2:]] for name, buf in pool.page_buffers()],
                "tp_rank": parallel.tp_rank, "tp_size": parallel.tp_size,
                # where a page's tail rows sit depends on the boundaries' spacing (V4's bounded layout)
                **({"reuse_tokens": pool.reuse_tokens} if pool.reuse_tokens != self.page_size else {})}

    def close(self) -> None:
        """Stop the KV cache's, the grammars' and the forward worker's threads (the process or Engine
        is ending)."""
        if self._worker is not None:
            self._inflight = None  # its tokens go nowhere now
            self._worker.close()
        self.kv_manager.close()
        self.grammar.close()

    # ---------------------------------------------------------- memory views
    # Inspection only (stats, tests, the rank group's memory report): changes go through kv_manager.
    @property
    def allocator(self) -> PageAllocator:
        return self.kv_manager.allocator

    @property
    def cache(self) -> RadixCache:
        return self.kv_manager.cache

    @property
    def table(self) -> ReqToTokenTable:
        return self.kv_manager.table

    # ---------------------------------------------------------------- intake
    @property
    def limits(self) -> RequestLimits:
        return RequestLimits(self.context_len, self.model_config.vocab_size,
                             self.kv_manager.num_pages * self.page_size)

    def validate(self, input_ids: list[int], sampling: SamplingParams) -> None:
        """Raise ValueError naming the field if this request can never be served."""
        check_scheduler_request(input_ids, sampling, self.limits)
        if self.mode.samples:  # a server that never samples never needs the grammar
            self.grammar.check(sampling)

    def add_request(self, rid: str, input_ids: list[int], sampling: SamplingParams,
                    return_logprob: bool = False, logprob_start_len: int = -1, top_logprobs_num: int = 0,
                    bootstrap: BootstrapRef | None = None, group: str | None = None, cache_salt: str = "") -> Req:
        """Queue a request. ``max_new_tokens`` 0 still prefills the prompt (its KV lands in the
        radix cache, its input logprobs are computed) and finishes without sampling.
        ``bootstrap`` (an ``io_struct.BootstrapRef``): the request's disaggregated other half.
        ``group``: the API call it belongs to; admission lets groups take turns. ``cache_salt``: its
        prefix cache tree (requests with different salts share no page; mem/radix_cache.py)."""
        if rid in self.reqs:
            raise ValueError(f"rid: {rid!r} is already in use")
        self.validate(input_ids, sampling)
        req = Req(rid, input_ids, sampling, return_logprob, arrival=next(self._arrivals), uid=next(self._uids),
                  group=group, cache_salt=cache_salt)
        if return_logprob:
            check_logprob_params(len(input_ids), logprob_start_len, top_logprobs_num, self.model_config.vocab_size)
            req.logprob = ReqLogprobs.create(len(input_ids), logprob_start_len, top_logprobs_num)
        if sampling.seed is not None:
            req.generator = torch.Generator().manual_seed(sampling.seed)
        if sampling.stop and self.tokenizer is not None:
            req.stop_matcher = StopStringMatcher(self.tokenizer, sampling.stop, sampling.skip_special_tokens)
        req.clock = StageClock()
        if getattr(self.runner, "draft", None) is not None:
            req.spec_stats = SpecStats()
        if self.mode.samples:
            self.grammar.submit(req)
            if req.grammar_error is not None:  # several ranks compile at once: it failed on every one
                raise ValueError(req.grammar_error)
        self.reqs[rid] = req
        if not self.mode.take(req, bootstrap):
            self.enqueue(req)
        return req

    def enqueue(self, req: Req, front: bool = False) -> None:
        """Queue ``req`` for admission (a prefill here, from its cached prefix); ``front``: ahead
        of every waiting request (retracted or fallen back: it already waited). It must hold no
        KV memory."""
        req.state = ReqState.WAITING
        if front:
            self.waiting.insert(0, req)
        else:
            self.waiting.append(req)
        self._start_prefetch(req)

    def _start_prefetch(self, req: Req) -> None:
        """Start reading ``req``'s stored prefix now (on the storage thread), so it lands while
        the request queues; admission (``prepare``) takes what the prefetch policy allows."""
        hi = self.kv_manager.hicache
        if hi is not None and hi.storage is not None:
            tokens = self._matchable(req)
            hi.start_prefetch(req.uid, tokens, hi.match_tiers(tokens, req.cache_salt), req.cache_salt)

    def activate(self, req: Req) -> None:
        """``req``'s KV for ``fill_ids[:-1]`` is in its pages: it joins the decode batch (once its
        grammar, if any, has compiled)."""
        req.state = ReqState.RUNNING
        if self.grammar.waiting_for(req):
            self.parked.append(req)
            return
        self.running.append(req)

    def abort(self, rid: str, message: str = "aborted by client") -> bool:
        req = self.reqs.get(rid)
        if req is None or req.finished:
            return False
        if self.mode.abort(req, message):
            return True
        if req in self.waiting:
            self.waiting.remove(req)
        self._finish(req, finish_abort(message))
        return True

    # ------------------------------------------------------------------ step
    def has_work(self) -> bool:
        return self.runnable() or self.mode.has_work()

    def runnable(self) -> bool:
        """A forward pass (or an output) is due now; otherwise only the mode waits on something."""
        return bool(self.waiting or self.running or self.chunked or self._pending or self.parked
                    or self._inflight is not None)

    def step(self) -> list[TokenOutput]:
        self.release_finished()
        self.mode.poll()
        self._poll_grammars()
        if not self.running and self.chunked is None:
            self.new_token_ratio.on_idle()
        batch = self._schedule_extend()
        if batch is not None:
            self.sync()  # an extend samples on this thread, after the step in flight
            self._emit_due()
            self._run_extend(*batch)
        elif self.running:
            self.decode_step.run()
        else:
            self.sync()
            if self.grammar.pending and (self.waiting or self.parked) and not self._pending:
                self.grammar.wait(GRAMMAR_IDLE_WAIT_S)  # only compiles are left to run: wait for one, do not spin
        out, self.outputs_sampled_at = self._take_outputs()
        if self.kv_events is not None:
            self.kv_events.flush()
        return out

    def _take_outputs(self) -> tuple[list[TokenOutput], float]:
        out, at = self._pending, self._sampled_at
        self._pending, self._sampled_at = [], 0.0
        return out, at

    def _emit_due(self) -> None:
        if self.emit is not None and self._pending:
            self.emit(*self._take_outputs())

    def _poll_grammars(self) -> None:
        """Compiles that finished: failed ones end their request (a 400 naming the field), parked
        requests whose grammar is ready join the decode batch."""
        for req in self.grammar.poll():
            self.abort(req.rid, req.grammar_error or "grammar failed")
        if self.parked:
            ready = [r for r in self.parked if not self.grammar.waiting_for(r)]
            self.parked = [r for r in self.parked if self.grammar.waiting_for(r)]
            self.running += ready

    # ------------------------------------------------------------- admission
    def _match_len(self, req: Req) -> int:
        return self.kv_manager.match_len(self._matchable(req), req.cache_salt)

    @staticmethod
    def _matchable(req: Req) -> list[int]:
        """The tokens a cache hit may cover: never the last (it must run to produce logits),
        nor a position whose logits an input logprob needs."""
        limit = req.logprob.max_prefix_len() if req.logprob is not None else None
        return req.fill_ids[:-1] if limit is None else req.fill_ids[:min(limit, len(req.fill_ids) - 1)]

    def _admitted_per_group(self) -> Counter[str]:
        """Sequences of each group past admission (running, prefilling or held by the mode)."""
        if not self.waiting:
            return Counter()
        return Counter(r.group for r in self.reqs.values() if r.group is not None and r.state is not ReqState.WAITING)

    def _admit(self, req: Req, admitted_now: int) -> bool:
        """Give a waiting request a table row and its cached prefix (locked)."""
        if len(self.running) + admitted_now >= self.config.max_running_requests:
            return False
        if not self.kv_manager.admit(req, self._matchable(req)):
            return False
        if req.num_retractions == 0 and not req.output_ids:  # not back from a retraction or a jump-forward
            req.cached_tokens_reported = req.cached_len
            req.cached_by_tier_reported = dict(req.cached_by_tier)
            self.kv_manager.count_hit(req.cached_by_tier)
        return True

    def _schedule_extend(self):
        if not self.waiting and self.chunked is None:
            return None  # a decode step: nothing to admit, nor the running requests' growth to weigh
        budget = self.config.chunked_prefill_size
        budget = min(budget if budget > 0 else self.config.max_prefill_tokens, self.config.max_prefill_tokens)
        candidates = [self.chunked] if self.chunked else []
        candidates += policy.order_waiting(self.waiting, self.config.schedule_policy, self._match_len,
                                           self._admitted_per_group())
        reqs: list[Req] = []
        lens: list[int] = []
        self.chunked = None
        running_growth: list[policy.Growth] | None = None  # the same for every candidate: built once needed
        for req in candidates:
            fresh = req.state is ReqState.WAITING
            if fresh and self.grammar.waiting_for(req):
                continue  # it samples once its grammar has compiled; the others go on
            if fresh and not self.kv_manager.prepare(req, self._matchable(req)):
                continue  # its cached prefix is still being loaded back from host memory
            if fresh and not self._admit(req, len(reqs)):
                break
            remaining = len(req.fill_ids) - req.kv_len
            n = policy.chunk_len(remaining, budget, req.kv_len, self.page_size)
            headroom = 0
            if n:
                if running_growth is None:
                    running_growth = [self._growth(r) for r in self.running]
                headroom = self._headroom(running_growth, req, n, fresh, reqs, lens)
            if not n or not self.kv_manager.grow(req, req.kv_len + n, headroom=headroom):
                if fresh:
                    self.kv_manager.unadmit(req)
                else:  # an in-flight chunk always continues later
                    self.chunked = req
                break
            if fresh:
                self.waiting.remove(req)
                req.state = ReqState.PREFILLING
            reqs.append(req)
            lens.append(n)
            budget -= n
            if n < remaining:
                self.chunked = req
                break
            if budget <= 0:
                break
        return (reqs, lens) if reqs else None

    def _headroom(self, running_growth: list[policy.Growth], req: Req, n: int, fresh: bool, batch: list[Req],
                  lens: list[int]) -> int:
        """Pages to keep free besides ``req``'s next ``n`` prompt tokens: the expected decode growth
        of the running requests (``running_growth``) and, when admitting ``req``, of this batch and
        of ``req`` itself. A lone request is admitted on its prompt alone (else one too long could
        never start)."""
        growth = list(running_growth)
        if fresh and (self.running or batch):
            growth += [self._growth(r, m) for r, m in zip(batch, lens)] + [self._growth(req, n)]
        return policy.reserved_pages(growth, self.new_token_ratio.value, self.page_size)

    def _growth(self, req: Req, prefill: int = 0) -> policy.Growth:
        """What ``req`` may still write to the pool: a running request its decode; one being
        prefilled (``prefill`` tokens this step) the rest of its prompt, then its decode."""
        if req.state is ReqState.RUNNING:
            return policy.Growth(req.kv_len, len(req.pages), req.sampling.max_new_tokens - len(req.output_ids))
        pages = max(len(req.pages), -(-(req.kv_len + prefill) // self.page_size))
        return policy.Growth(len(req.fill_ids), pages, req.sampling.max_new_tokens - len(req.output_ids) - 1)

    # ------------------------------------------------------------------ runs
    def _observe_prefill(self, tokens: int, seconds: float) -> None:
        """The hierarchical cache compares load time with this (recompute) speed."""
        hi = self.kv_manager.hicache
        if hi is not None:
            hi.costs.observe_prefill(tokens, seconds)

    def _run_extend(self, reqs: list[Req], lens: list[int]) -> None:
        ids: list[int] = []
        pos: list[int] = []
        loc: list[int] = []
        for req, n in zip(reqs, lens):
            ids += req.fill_ids[req.kv_len:req.kv_len + n]
            pos += range(req.kv_len, req.kv_len + n)
            loc += self.kv_manager.slots(req, req.kv_len, req.kv_len + n)
        for req in reqs:
            req.stage_clock.start_prefill()
        self.mode.before_extend(reqs, lens)
        plan = PromptLogitPlan.build(reqs, lens)
        batch = ScheduledBatch(ForwardMode.EXTEND, ids, pos, loc, [r.kv_len for r in reqs], lens,
                               [r.table_row for r in reqs], prompt_logit_index=plan.index)
        t0 = time.perf_counter()
        with self.threads.step(len(ids)):
            logits = self.runner.forward(batch, self.kv_manager.req_to_token)
        self.forward_steps += 1
        plan.record(reqs, logits[len(reqs):])
        logits = logits[:len(reqs)]
        done = []
        for i, (req, n) in enumerate(zip(reqs, lens)):
            req.kv_len += n
            if req.kv_len == len(req.fill_ids):
                req.stage_clock.end_prefill()
                done.append(i)
        hidden = getattr(self.runner, "step_hidden", None)  # [T, H] with speculation, else None
        self.decode_step.after_forward(reqs, lens, hidden)
        done = self._finish_prefill_only(reqs, self.mode.after_prefill(reqs, done))
        if done:
            finished_prefill = [reqs[i] for i in done]
            for req in finished_prefill:
                self.activate(req)
            self._sample_and_append(finished_prefill, logits[torch.tensor(done)])
            # Sampling read the tokens back, so the forward has really finished by now.
            self._observe_prefill(sum(lens), time.perf_counter() - t0)
        self.decode_step.after_sample(reqs, lens, hidden)

    def _finish_prefill_only(self, reqs: list[Req], done: list[int]) -> list[int]:
        """Finish the requests that asked for no new tokens; the rest of ``done`` samples."""
        for i in done:
            if reqs[i].sampling.max_new_tokens == 0:
                self._finish(reqs[i], finish_length(0))
        return [i for i in done if not reqs[i].finished]

    def _run_decode(self) -> None:
        if self._can_overlap():
            self._launch_decode()
            return
        self.sync()
        self._ensure_decode_pages()
        reqs = list(self.running)
        if not reqs:
            return
        pos = [r.kv_len for r in reqs]
        loc = self.kv_manager.write_next_slots(reqs)
        rows = [r.table_row for r in reqs]
        batch = ScheduledBatch(ForwardMode.DECODE, [r.fill_ids[-1] for r in reqs], pos, loc, pos,
                               [1] * len(reqs), rows, tuple(r.engine_uid for r in reqs))
        # the grammars' masks fill on their thread while the forward runs
        mask = self.grammar.start_mask(reqs) if self.grammar.live else None
        with self.threads.step(len(reqs)):
            logits = self.runner.forward(batch, self.kv_manager.req_to_token)
        self.forward_steps += 1
        self.new_token_ratio.decay()
        for r in reqs:
            r.kv_len += 1
        self._sample_and_append(reqs, logits, mask)

    # ------------------------------------------------------------- overlap
    def _can_overlap(self) -> bool:
        """This decode step may run one step ahead: nothing in it needs the previous step's tokens
        on this thread before the forward (a grammar's mask does, penalties count the outputs)."""
        return (self._worker is not None and not self.grammar.live
                and not any(r.sampling.frequency_penalty or r.sampling.presence_penalty for r in self.running))

    def _row_in_flight(self, req: Req) -> int:
        """``req``'s row in the decode step in flight (-1: not in it, or none in flight)."""
        return self._inflight.row_of(req) if self._inflight is not None else -1

    @staticmethod
    def _next_pos(req: Req, row: int) -> int:
        """The position ``req``'s next decode step writes, ``row`` its row in the step in flight: one
        past that step, if it is in it."""
        return req.kv_len + (row >= 0)

    def _launch_decode(self) -> None:
        """Hand this step's decode to the worker, then append the previous step's tokens (those of
        requests that finished or were aborted meanwhile are dropped: their stream has ended)."""
        self._ensure_decode_pages()
        prev = self._inflight
        reqs: list[Req] = []
        prev_rows: list[int] = []  # each request's row in the step in flight (-1: not in it)
        pos: list[int] = []
        for r in self.running:  # one pass: this runs every step, for every running request
            row = self._row_in_flight(r)
            if row >= 0 and len(r.output_ids) + 1 >= r.sampling.max_new_tokens:
                continue  # its token in flight is its last (max_new_tokens): no next step
            reqs.append(r)
            prev_rows.append(row)
            pos.append(self._next_pos(r, row))
        if not reqs:
            self.sync()
            return
        loc = self.kv_manager.write_next_slots(reqs, pos)
        batch = ScheduledBatch(ForwardMode.DECODE, [r.fill_ids[-1] for r in reqs], pos, loc, pos,
                               [1] * len(reqs), [r.table_row for r in reqs], tuple(r.engine_uid for r in reqs))
        fb = self.runner.build_forward_batch(batch, self.kv_manager.req_to_token)
        top_ks = [r.logprob.top_k if r.logprob else 0 for r in reqs] if any(r.return_logprob for r in reqs) else None
        assert self._worker is not None
        future = self._worker.submit(fb, prev_rows, [r.sampling for r in reqs], [r.generator for r in reqs],
                                     [r.output_ids for r in reqs], top_ks is not None, top_ks)
        self._inflight = LaunchedDecode(reqs, future, top_ks)
        self.forward_steps += 1
        self.new_token_ratio.decay()
        if prev is not None:
            self._collect(prev)
        if all(r.finished for r in reqs):  # all ended at the previous step: nothing waits on this one
            self.sync()

    def sync(self) -> None:
        """Wait for the decode step in flight, if any, and append its tokens: afterwards every
        request's state is what the plain loop would have (the next forward may run here)."""
        prev, self._inflight = self._inflight, None
        if prev is not None:
            self._collect(prev)

    def _collect(self, launched: LaunchedDecode) -> None:
        res = launched.result.result()
        for req in launched.ended:  # the step has landed: nothing writes their pages any more
            self.kv_manager.release(req, req.kv_len)
        launched.ended.clear()
        reqs, top_ks = launched.reqs, launched.top_ks
        live = [i for i, r in enumerate(reqs) if not r.finished]
        if len(live) < len(reqs):  # most steps end none before they land: no row to drop then
            reqs = [reqs[i] for i in live]
            top = res.top_logprobs
            res = SampleResult([res.tokens[i] for i in live],
                               None if res.logprobs is None else [res.logprobs[i] for i in live],
                               None if top is None else [top[i] for i in live])
            top_ks = None if top_ks is None else [top_ks[i] for i in live]
        for r in reqs:
            r.kv_len += 1
        self._append_sampled(reqs, res, top_ks, None)

    def _ensure_decode_pages(self) -> None:
        """Every running request needs a slot for its next token; retract until they all fit
        (after the step in flight has landed: it may end requests, and retraction re-queues)."""
        while True:
            needy = [r for r in self.running
                     if self._next_pos(r, self._row_in_flight(r)) == len(r.pages) * self.page_size]
            if not needy or self.kv_manager.grow_each(needy):
                return
            if self._finished_unreleased:  # pages that finished requests give back come first
                self.release_finished()
                continue
            if self._inflight is not None:
                self.sync()
                continue
            if len(self.running) == 1:
                self._finish(self.running[0], finish_abort("KV cache exhausted: the request does not fit "
                                                           "in the pool even alone"))
                return
            self._retract(policy.pick_retraction(self.running))

    def _retract(self, req: Req) -> None:
        """Give a running request's pages back and re-queue it; its output so far is kept
        and its KV recomputed (or re-matched from the cache) on re-admission."""
        logger.info("retracting %s to free KV pages", req.rid)
        self.running.remove(req)
        self._release(req)
        req.num_retractions += 1
        self.num_retractions += 1
        self.new_token_ratio.on_retract()
        self.enqueue(req, front=True)

    def _sample_and_append(self, reqs: list[Req], logits: torch.Tensor, mask: StepMask | None = None) -> None:
        """Sample one token per request from ``logits`` [B, V] (masked first where a request has a
        grammar: every sampling mode and the logprobs see the mask, as in SGLang), append it."""
        if self.grammar.live:
            self.grammar.apply(logits, reqs, mask)
        want_lp = any(r.return_logprob for r in reqs)
        top_ks = [r.logprob.top_k if r.logprob else 0 for r in reqs] if want_lp else None
        res = self.sampler(logits, [r.sampling for r in reqs], [r.generator for r in reqs],
                           [r.output_ids for r in reqs], want_lp, top_ks)
        # each grammar moves past its request's token (one batched call; None: no grammars)
        advanced = self.grammar.advance_all(reqs, res.tokens) if self.grammar.live else None
        self._append_sampled(reqs, res, top_ks, advanced)

    def _append_sampled(self, reqs: list[Req], res: SampleResult, top_ks: list[int] | None,
                        advanced: list[bool] | None) -> None:
        """Append each request's sampled token, end the requests it finishes, queue the outputs."""
        if not self._sampled_at:
            self._sampled_at = time.monotonic()
        for i, (req, tok) in enumerate(zip(reqs, res.tokens)):
            req.append_output(tok)
            lp = top = None
            if req.return_logprob:
                if res.logprobs is None or top_ks is None:
                    raise RuntimeError(f"sampler returned no logprobs for {req!r}, which asked for them")
                lp = [res.logprobs[i]]
                req.output_logprobs.append(res.logprobs[i])
                top = [res.top_logprobs[i]] if res.top_logprobs is not None and top_ks[i] else None
            reason = self._check_finish(req, tok) if advanced is None or advanced[i] else grammar_refused(tok)
            if reason is not None:
                self._finish(req, reason, emit=False)
            out = self._output(req, [tok], lp, top)
            if len(req.output_ids) == 1:
                out.timeline = req.stage_clock.breakdown()
            self._pending.append(out)
        if self.grammar.live and self.grammar.config.jump_forward:
            self._jump_forward(reqs)

    def _jump_forward(self, reqs: list[Req]) -> None:
        """Jump-forward (--grammar-jump-forward, engine/grammar.py): a running request whose grammar
        now allows one continuation only gets its tokens appended unsampled, then goes back to the
        front of the queue to prefill them in one extend (its KV so far stays in the radix cache), as
        SGLang did. Not with logprobs (the tokens were never sampled) nor speculation."""
        for req in reqs:
            if req.finished or req.return_logprob or req.spec_stats is not None or req not in self.running:
                continue
            tokens = self.grammar.jump(req, req.sampling.max_new_tokens - len(req.output_ids))
            reason = None
            for n, tok in enumerate(tokens, 1):
                req.append_output(tok)
                reason = self._check_finish(req, tok)
                if reason is not None:
                    tokens = tokens[:n]
                    break
            if not tokens:
                continue
            if reason is not None:
                self._finish(req, reason, emit=False)
            else:
                self.running.remove(req)
                self._release(req)
                self.enqueue(req, front=True)
            self._pending.append(self._output(req, tokens, None))

    def _check_finish(self, req: Req, tok: int) -> dict | None:
        sp = req.sampling
        if tok in sp.stop_token_ids or (not sp.ignore_eos and tok in self.eos_ids):
            return finish_stop(tok)
        if req.stop_matcher is not None:
            matched = req.stop_matcher.check(req.output_ids)
            if matched is not None:
                return finish_stop(matched)
        if self.grammar.terminated(req):  # the grammar is complete (it accepted its end)
            return finish_stop(tok if tok in self.eos_ids else None)
        if len(req.output_ids) >= sp.max_new_tokens:
            return finish_length(sp.max_new_tokens)
        return None

    # --------------------------------------------------------------- release
    def finish_request(self, req: Req, reason: dict) -> None:
        """End ``req`` now (a mode's decision), releasing what it holds and telling the frontend."""
        if req in self.waiting:
            self.waiting.remove(req)
        self._finish(req, reason)

    def _finish(self, req: Req, reason: dict, emit: bool = True) -> None:
        self.mode.on_finish(req)
        self.kv_manager.forget(req)  # a load-back it waited for, if any
        self.grammar.release(req)
        if req.grammar_error is not None and reason["type"] == "abort":
            reason = {**reason, "status_code": 400}  # the request's constraint was bad: the client's error
        if req.state in (ReqState.RUNNING, ReqState.PREFILLING, ReqState.TRANSFERRING):
            if req in self.running:
                self.running.remove(req)
            if req in self.parked:
                self.parked.remove(req)
            if self.chunked is req:
                self.chunked = None
            if self.defer_release and req.state is ReqState.RUNNING:
                self._finished_unreleased.append(req)  # after this step's outputs are out
            else:
                self._release(req)
        req.state = ReqState.FINISHED
        req.finish_reason = reason
        self.reqs.pop(req.rid, None)
        if emit:
            self._pending.append(self._output(req, [], None))

    def release_finished(self) -> None:
        """Release the requests that finished decoding since the last call (``defer_release``): the
        loop calls it once the step's outputs are sent, ``step`` and a decode short of pages before
        they look at the pool."""
        done, self._finished_unreleased = self._finished_unreleased, []
        for req in done:
            self._release(req)

    def _release(self, req: Req) -> None:
        """Hand computed full pages to the radix cache (which frees duplicates) and free the rest;
        after the step in flight, if it holds ``req`` (it still writes ``req``'s next position)."""
        if self._inflight is not None and self._inflight.row_of(req) >= 0:
            self._inflight.ended.append(req)
            return
        self.kv_manager.release(req, req.kv_len)

    def _output(self, req: Req, new_ids: list[int], logprobs, top_logprobs=None) -> TokenOutput:
        by_tier = req.cached_by_tier_reported or {"device": req.cached_tokens_reported, "host": 0, "storage": 0}
        out = TokenOutput(req.rid, new_ids, logprobs, req.finished, req.finish_reason, req.prompt_len,
                          len(req.output_ids), req.cached_tokens_reported, top_logprobs,
                          cached_tokens_by_tier=by_tier, decode_cached_tokens=req.decode_cached_tokens)
        if req.spec_stats is not None:
            st = req.spec_stats
            out.spec_verify_ct, out.spec_draft_token_num = st.verify_ct, st.draft_tokens
            out.spec_accept_token_num = st.accepted_tokens
        taken = req.logprob.take_input() if req.logprob is not None else None
        if taken is not None:
            out.input_token_logprobs, out.input_top_logprobs = taken
        return out

    # ----------------------------------------------------------- inspection
    def flush_cache(self) -> bool:
        if self.has_work():
            return False
        flushed = self.kv_manager.flush()
        if self.kv_events is not None:
            self.kv_events.flush()
        return flushed

    def _live_reqs(self) -> list[Req]:
        """Requests holding pages: the scheduler's own, then the mode's."""
        ended = self._inflight.ended if self._inflight is not None else []  # released once their step lands
        return (self.running + self.parked + ([self.chunked] if self.chunked else []) + self.mode.held_reqs()
                + ended + self._finished_unreleased)

    def pages_held_by_requests(self) -> int:
        """Pages outside the allocator and the cache: live requests' own and quarantined ones."""
        return self.kv_manager.pages_held(self._live_reqs())

    def check_memory(self) -> None:
        """free + cached + request-owned + quarantined pages == total, rows, the mode's books,
        and every live request's own invariants; raises on a leak, a double count or a broken
        request."""
        live = self._live_reqs()
        for req in live:
            req.check(self.page_size)
        self.kv_manager.check(live)
        if self.mode.quarantined_pages() != self.kv_manager.num_quarantined_pages:
            raise RuntimeError(f"quarantine accounting broken: the mode holds {self.mode.quarantined_pages()} "
                               f"pages, the KV cache manager {self.kv_manager.num_quarantined_pages}")
        self.mode.check_resources(idle=not self.has_work() and not self.reqs)

    def _kv_pool_info(self) -> dict:
        """The pool's size and budget (mem/kv_budget.py), when the runner measured one (fakes do not)."""
        budget = getattr(self.runner, "kv_budget", None)
        backend = getattr(self.runner, "backend", None)  # what attention (and the V3.2 indexer's top-k) runs
        return {**({} if budget is None else {"kv_pool": budget.to_dict()}),
                **({} if backend is None else {"attention": backend.describe()})}

    def stats(self) -> dict:
        total = self.kv_manager.num_pages
        free = self.kv_manager.num_free_pages
        return {
            "num_running_reqs": len(self.running) + (self.chunked is not None),
            "num_waiting_reqs": len(self.waiting),
            "total_pages": total,
            "free_pages": free,
            "cached_pages": self.kv_manager.num_cached_pages,
            "page_size": self.page_size,
            "token_usage": (total - free - self.kv_manager.num_evictable_pages) / total,
            "num_retractions": self.num_retractions,
            "forward_steps": self.forward_steps,
            **self._kv_pool_info(),
            "overlap_schedule": self.overlap,
            **({"thread_layout": self.thread_layout.to_dict()} if self.thread_layout is not None else {}),
            "thread_tuning": self.threads.to_dict(),
            **(self.kv_events.stats() if self.kv_events is not None else {}),
            **({"kv_hash_key_check": key_check(self.kv_manager.hash_key)} if self.kv_events is not None else {}),
            **self.kv_manager.stats(),
            **self.mode.stats(),
            **self.decode_step.stats(),
            **self.grammar.stats_dict(),
        }
