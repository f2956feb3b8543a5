"""Lock step for the scheduler ranks of one engine (one process per DP x TP rank).

Who decides: every rank runs the same ``Scheduler`` code on the same inputs, so its
decisions are replayed, not sent. Each loop iteration:

1. **Exchange** (every rank): rank 0 alone reads the frontend's socket (and a
   disaggregation mode's sockets); the raw messages it drained, its clock, and each
   rank's state (has work, requests held, runnable, ...) are shared with every rank
   (``ControlPlane.exchange``). Every rank then handles the same messages in the same
   order: a generate request is kept only by the attention group it is assigned to
   (``pick_dp_rank``, least loaded, computed identically everywhere), aborts and
   control requests go to all. Rank 0 waits for messages before an exchange only when
   no rank has a forward to run (then as long as the modes' poll interval says).
2. **Step** (every rank, when any rank has work): ``Scheduler.step()``. Before its
   forward a rank agrees with all others on the step (``StepSync``: its token count,
   which attention groups with no tokens need, and a fingerprint of its batch that must
   equal its attention group leader's, so a rank that diverged fails loudly instead of
   deadlocking). A rank without a forward agrees with 0 tokens and, under DP attention,
   runs an idle forward so the shared layers' collectives line up.
   With the hierarchical cache, ranks also agree on each waiting request's cache hit before
   any of them loads it from host memory or storage (``agree_hits``): every rank loads the
   minimum over ranks and computes the rest.
3. **Sampling**: the attention group's leader samples and broadcasts the tokens
   (``BroadcastSampler``); floating-point equality across ranks is never trusted.
4. **Outputs**: only each attention group's leader sends its outputs to the frontend;
   only rank 0 answers control requests (after gathering every rank's part).

Legend: W ranks, D attention groups (DP), T tokens.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import zmq

from pdserve.distributed.groups import RankGroups
from pdserve.distributed.rank_layout import RankLayout
from pdserve.engine import io_struct as io
from pdserve.engine.codec import Codec, CodecError, DropCounter, Values
from pdserve.engine.model_runner import ModelRunner, ScheduledBatch, build_model_runner
from pdserve.engine.rank_io import CheckMemoryReq, CheckMemoryResp, RankMemory
from pdserve.engine.sampler import Sampler, SampleResult
from pdserve.engine.scheduler_loop import FRONTEND_CODEC, send_message
from pdserve.layers.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from pdserve.mem.cache_manager import KVCacheManager

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 200  # an idle leader wakes every rank this often (liveness, parent check)


class LockStepError(RuntimeError):
    """A rank's batch differs from its attention group leader's: their states diverged."""


# ------------------------------------------------------------------ policy
def pick_dp_rank(loads: list[int]) -> int:
    """The attention group a new request goes to: fewest requests held, lowest index on a tie."""
    return min(range(len(loads)), key=lambda d: (loads[d], d))


def batch_fingerprint(batch: ScheduledBatch) -> int:
    """A hash of what a step runs, equal on ranks that scheduled the same batch (tuples of ints
    hash the same in every process, unlike str)."""
    key = (batch.mode is ForwardMode.DECODE, tuple(batch.input_ids), tuple(batch.positions),
           tuple(batch.out_cache_loc), tuple(batch.extend_lens), tuple(batch.rows))
    return hash(key) & ((1 << 62) - 1)


def merge_stats(per_dp: list[dict]) -> dict:
    """One server's stats from each attention group's: counts add up, ``dp_ranks`` keeps each."""
    if len(per_dp) == 1:
        return per_dp[0]
    summed = ("num_running_reqs", "num_waiting_reqs", "total_pages", "free_pages", "cached_pages",
              "num_retractions")
    out = {k: sum(s[k] for s in per_dp) for k in summed}
    out["page_size"] = per_dp[0]["page_size"]
    out["forward_steps"] = max(s["forward_steps"] for s in per_dp)
    out["token_usage"] = sum(s["token_usage"] * s["total_pages"] for s in per_dp) / out["total_pages"]
    # The KV cache's per-tier counters (cache_hit_tokens_*, host_*, storage_*) add up too.
    tiers = ("cache_hit_tokens_", "host_", "storage_", "device_demoted_")
    out.update({k: sum(s.get(k, 0) for s in per_dp) for k in per_dp[0] if k.startswith(tiers)})
    if "kv_pool" in per_dp[0]:  # every group's pool is sized alike
        out["kv_pool"] = per_dp[0]["kv_pool"]
    out["dp_ranks"] = per_dp
    return out


# ----------------------------------------------------------- control plane
@dataclass
class Inbound:
    """What one exchange gave every rank: the leader's messages and clock, each rank's state."""

    messages: list
    has_work: list[bool]  # [W]
    loads: list[int]  # [W] requests each rank holds
    runnable: list[bool]  # [W] a forward (or an output) is due on the rank
    poll_ms: list[int | None]  # [W] how soon its mode wants the next step when nothing is runnable
    agreement_due: bool  # some rank's mode asked for an agreement round in this iteration's step
    now: float  # rank 0's monotonic clock at the exchange: the time every rank uses


class ControlPlane:
    """Collectives over the gloo group spanning every rank (CPU tensors; values and messages as
    ``engine/codec.py`` bytes, never pickle). ``codec``: the messages ``exchange`` carries."""

    def __init__(self, layout: RankLayout, group, codec: Codec = FRONTEND_CODEC):
        self.layout = layout
        self.group = group
        self.codec = codec
        self.values = Values()
        self.drops = DropCounter(f"scheduler rank {layout.rank}")

    def exchange(self, frames: list[bytes], has_work: bool, load: int, runnable: bool = True,
                 poll_ms: int | None = None, agreement: bool = False) -> Inbound:
        """Every rank calls this once per iteration; ``frames`` (``codec`` messages) count only on
        rank 0. One all-gather, plus a broadcast when rank 0 has messages."""
        payload = self.values.encode(frames) if frames else b""
        now_us = int(time.monotonic() * 1e6)
        mine = torch.tensor([int(has_work), load, len(payload), int(runnable), -1 if poll_ms is None else poll_ms,
                             int(agreement), now_us], dtype=torch.int64)
        table = self.all_gather_row(mine)  # [W, 7]
        n = int(table[0, 2])
        if n:
            buf = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if self.layout.is_leader
                   else torch.empty(n, dtype=torch.uint8))
            dist.broadcast(buf, src=0, group=self.group)
            frames = self.values.decode(buf.numpy().tobytes(), list[bytes])
        messages = self._decode(frames) if n else []
        polls = [None if p < 0 else p for p in table[:, 4].tolist()]
        return Inbound(messages, table[:, 0].bool().tolist(), table[:, 1].tolist(), table[:, 3].bool().tolist(),
                       polls, bool(table[:, 5].any()), int(table[0, 6]) / 1e6)

    def _decode(self, frames: list[bytes]) -> list:
        """Every rank decodes the same frames with the same codec, so a refused one is dropped
        everywhere alike (rank 0 already dropped what it could not decode: see ``_drain``)."""
        out = []
        for frame in frames:
            try:
                out.append(self.codec.decode(frame))
            except CodecError as e:
                self.drops.record(e)
        return out

    def gather(self, obj, as_type: Any = Any) -> list:
        """Every rank's ``obj``, in rank order (all ranks call it), decoded as ``as_type`` (Any:
        plain values: tuples come back as lists). Lengths first, then the bytes, padded."""
        data = self.values.encode(obj)
        sizes = self.all_gather_row(torch.tensor([len(data)], dtype=torch.int64))[:, 0].tolist()  # [W]
        mine = torch.zeros(max(sizes), dtype=torch.uint8)
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        every = [torch.empty_like(mine) for _ in range(self.layout.world_size)]
        dist.all_gather(every, mine, group=self.group)
        return [self.values.decode(t[:n].numpy().tobytes(), as_type) for t, n in zip(every, sizes)]

    def all_gather_row(self, row: torch.Tensor) -> torch.Tensor:
        """Every rank's ``row`` [N] stacked in rank order: [W, N]."""
        rows = [torch.empty_like(row) for _ in range(self.layout.world_size)]
        dist.all_gather(rows, row, group=self.group)
        return torch.stack(rows)


class StepSync:
    """Once per scheduler step on every rank: agree on every attention group's token count,
    and check each rank runs its attention group leader's batch."""

    def __init__(self, control: ControlPlane):
        self.control = control

    def agree(self, num_tokens: int, fingerprint: int) -> list[int]:
        """Returns the tokens of each attention group this step ([D]); raises LockStepError."""
        lay = self.control.layout
        table = self.control.all_gather_row(torch.tensor([num_tokens, fingerprint], dtype=torch.int64))  # [W, 2]
        leaders = [lay.leader_of(r) for r in range(lay.world_size)]
        diverged = (table != table[leaders]).any(dim=1).nonzero().flatten().tolist()
        if diverged:
            r = diverged[0]
            raise LockStepError(f"rank {r} scheduled a different batch from its attention group leader "
                                f"(rank {leaders[r]}): (tokens, fingerprint) {table[r].tolist()} vs "
                                f"{table[leaders[r]].tolist()}")
        return [int(table[lay.dp_leader_rank(d), 0]) for d in range(lay.dp_size)]


# ------------------------------------------------------------ model runner
class RankModelRunner(ModelRunner):
    """A ModelRunner that agrees on each step with the other ranks (``StepSync``).

    Contract with the loop: ``end_step()`` after every ``Scheduler.step()``; the scheduler
    runs at most one forward per step, so every rank agrees exactly once per step.
    """

    def __init__(self, *args, sync: StepSync, **kwargs):
        super().__init__(*args, **kwargs)
        self.sync = sync
        self._agreed = False

    def build_forward_batch(self, batch: ScheduledBatch, req_to_token: torch.Tensor) -> ForwardBatch:
        fb = super().build_forward_batch(batch, req_to_token)
        fb.dp_num_tokens = self.sync.agree(fb.num_tokens, batch_fingerprint(batch))
        self._agreed = True
        return fb

    @torch.inference_mode()
    def end_step(self) -> None:
        """A rank that ran no forward this step agrees with no tokens, and under DP attention
        takes part in the shared layers while another attention group runs tokens."""
        if self._agreed:
            self._agreed = False
            return
        counts = self.sync.agree(0, 0)
        if self.parallel.dp_attention and any(counts):
            self.model(ForwardBatch.idle(self.pool, self.backend, counts))


# ---------------------------------------------------------------- sampling
class BroadcastSampler:
    """Samples on the attention group's leader and hands the result to the other ranks of
    the group, so every scheduler appends the same tokens."""

    def __init__(self, inner: Sampler, group, leader_rank: int, is_leader: bool):
        self.inner = inner
        self.group = group
        self.leader_rank = leader_rank
        self.is_leader = is_leader
        self.values = Values()

    def __call__(self, logits: torch.Tensor, params, generators, outputs, want_logprobs: bool = False,
                 top_logprobs_nums: list[int] | None = None) -> SampleResult:
        res = None
        if self.is_leader:
            res = self.inner(logits, params, generators, outputs, want_logprobs, top_logprobs_nums)
        if self.group is None:
            if res is None:
                raise RuntimeError("BroadcastSampler: a rank without a group must be its leader")
            return res
        if want_logprobs:  # logprobs too: the whole result as codec bytes
            return self._broadcast_result(res)
        toks = torch.tensor(res.tokens, dtype=torch.int64) if res is not None else torch.empty(len(params),
                                                                                               dtype=torch.int64)
        dist.broadcast(toks, src=self.leader_rank, group=self.group)
        return SampleResult(toks.tolist(), None)

    def _broadcast_result(self, res: SampleResult | None) -> SampleResult:
        """The leader's ``res`` on every rank of the group: its length, then its bytes (on the
        device the group's backend needs: NCCL takes CUDA tensors only)."""
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(self.group) == "nccl" else None
        data = self.values.encode(res) if res is not None else b""
        size = torch.tensor([len(data)], dtype=torch.int64, device=device)
        dist.broadcast(size, src=self.leader_rank, group=self.group)
        if res is not None:
            dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device), src=self.leader_rank,
                           group=self.group)
            return res
        if not int(size):
            raise RuntimeError(f"BroadcastSampler: leader rank {self.leader_rank} broadcast no result")
        buf = torch.empty(int(size), dtype=torch.uint8, device=device)
        dist.broadcast(buf, src=self.leader_rank, group=self.group)
        return self.values.decode(buf.cpu().numpy().tobytes(), SampleResult)


# -------------------------------------------------------------------- loop
class RankSchedulerLoop:
    """The loop of one rank (module docstring). ``inbox``: the frontend's socket (rank 0
    only, else None); ``outbox``: the socket to the frontend (used by attention group
    leaders). ``run`` returns after a ShutdownReq reached every rank, or once rank 0's
    parent is gone; an exception (a peer died mid-collective, a lock-step error) propagates.

    Extension points (a disaggregation mode's I/O uses them, ``disagg/mode_io.py``):
    ``add_inbox(sock, decode)`` (rank 0) reads another socket the same way;
    ``on(msg_type, handler, wakes)`` registers a handler for another message type. Every rank
    calls the handler with the same message at the same point of its loop, so anything that
    changes scheduler state must arrive this way (or be agreed on with ``self.control.gather``),
    never be applied by one rank alone. ``inbound``: the latest exchange (its clock, ...).
    """

    def __init__(self, scheduler, groups: RankGroups, inbox: zmq.Socket | None, outbox: zmq.Socket,
                 parent_pid: int | None = None, idle_poll_ms: int = IDLE_POLL_MS):
        self.scheduler = scheduler
        self.layout = groups.layout
        self.control = ControlPlane(groups.layout, groups.cpu, FRONTEND_CODEC)
        self.inboxes: list[tuple[zmq.Socket, Callable | None]] = []
        self.poller = zmq.Poller()
        if inbox is not None:
            self.add_inbox(inbox)
        self.outbox = outbox
        self.parent_pid = parent_pid
        self.idle_poll_ms = idle_poll_ms
        self.stopped = False
        self.busy = False  # did any rank have work at the last exchange (or get a waking message)
        self.woke = False  # did the last exchange bring a waking message
        self.inbound: Inbound | None = None
        self.dp_loads: list[int] = [0] * self.layout.dp_size
        self.handlers: dict[type, Callable] = {
            io.TokenizedGenerateReq: self._add, io.AbortReq: self._abort, io.GetStatsReq: self._stats,
            io.FlushCacheReq: self._flush, CheckMemoryReq: self._check_memory, io.ShutdownReq: self._stop,
            io.KVEventsSnapshotReq: self._kv_snapshot}
        self.waking: set[type] = {io.TokenizedGenerateReq}

    def on(self, msg_type: type, handler: Callable, wakes: bool = False) -> None:
        """``wakes``: a message of this type makes every rank step in the iteration it arrives."""
        self.handlers[msg_type] = handler
        if msg_type.__name__ not in self.control.codec.types:  # every rank shares it through the exchange
            self.control.codec = self.control.codec.with_types([msg_type])
        if wakes:
            self.waking.add(msg_type)

    def add_inbox(self, sock: zmq.Socket, decode: Callable | None = None) -> None:
        """Rank 0: also read ``sock``. Its frames are ``FRONTEND_CODEC`` messages, or, with ``decode``,
        whatever ``decode(frame)`` makes of each ``zmq.Frame`` (None: a frame to drop; a message
        type registered with ``on``)."""
        self.inboxes.append((sock, decode))
        self.poller.register(sock, zmq.POLLIN)

    def run(self) -> None:
        mode = self.scheduler.mode
        while not self.stopped:
            s = self.scheduler
            self.inbound = inbound = self.control.exchange(self._drain(), s.has_work(), len(s.reqs), s.runnable(),
                                                           mode.poll_interval_ms(), mode.wants_agreement())
            self.dp_loads = [inbound.loads[self.layout.dp_leader_rank(d)] for d in range(self.layout.dp_size)]
            self.woke = any(type(m) in self.waking for m in inbound.messages)
            self.busy = any(inbound.has_work) or self.woke
            for msg in inbound.messages:
                self.handle(msg)
            if self.stopped:
                break
            if self.busy:
                self.run_step()

    def run_step(self) -> None:
        outputs = self.scheduler.step()
        self.scheduler.runner.end_step()
        if outputs and self.layout.is_dp_leader:
            send_message(self.outbox, io.BatchTokenOutput(outputs, time.monotonic(), self.scheduler.outputs_sampled_at))

    def handle(self, msg) -> None:
        handler = self.handlers.get(type(msg))
        if handler is None:
            logger.error("scheduler rank %d: ignoring unknown message %r", self.layout.rank, type(msg).__name__)
            return
        handler(msg)

    # ------------------------------------------------------------ inbox
    def _drain(self) -> list[bytes]:
        """Rank 0: every queued frame, after waiting up to ``_wait_ms`` for the first."""
        if not self.inboxes:
            return []
        wait = self._wait_ms()
        if wait and not self.poller.poll(wait):
            return [self.control.codec.encode(io.ShutdownReq())] if self._parent_gone() else []
        frames = []
        for sock, decode in self.inboxes:
            while True:
                try:  # a decoded inbox gets the zmq.Frame: its peer address is part of the input
                    raw = sock.recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                if decode is None:
                    if self._valid(data := raw.bytes):
                        frames.append(data)
                elif (msg := decode(raw)) is not None:
                    frames.append(self.control.codec.encode(msg))
        return frames

    def _valid(self, frame: bytes) -> bool:
        """Rank 0 drops a frame that is none of our messages before any rank sees it."""
        try:
            self.control.codec.decode(frame)
        except CodecError as e:
            self.control.drops.record(e)
            return False
        return True

    def _wait_ms(self) -> int:
        """How long rank 0 waits for a message before the next exchange: the idle poll when no
        rank had work; not at all when a rank had a forward to run or the last exchange brought
        news (state may have changed since); otherwise (the modes wait on the network) the
        shortest poll interval they asked for."""
        if not self.busy:
            return self.idle_poll_ms
        inb = self.inbound
        if inb is None or self.woke or any(inb.runnable) or self.scheduler.runnable():
            return 0
        return min([p for p in inb.poll_ms if p is not None] + [self.idle_poll_ms])

    def _parent_gone(self) -> bool:
        gone = self.parent_pid is not None and os.getppid() != self.parent_pid
        if gone:
            logger.warning("parent process is gone; every scheduler rank exits")
        return gone

    # --------------------------------------------------------- handlers
    def _add(self, msg: io.TokenizedGenerateReq) -> None:
        owner = pick_dp_rank(self.dp_loads)
        self.dp_loads[owner] += 1
        if owner != self.layout.dp_rank:
            return
        try:
            self.scheduler.add_request(msg.rid, msg.input_ids, msg.sampling, msg.return_logprob,
                                       msg.logprob_start_len, msg.top_logprobs_num, bootstrap=msg.bootstrap,
                                       group=msg.group, cache_salt=msg.cache_salt)
        except ValueError as e:
            if self.layout.is_dp_leader:
                send_message(self.outbox, io.RejectedReq(msg.rid, str(e)))

    def _abort(self, msg: io.AbortReq) -> None:
        if msg.refused is not None:
            self.scheduler.mode.refused(msg.refused, msg.message)
            return
        for rid in list(self.scheduler.reqs) if msg.abort_all else [msg.rid]:
            self.scheduler.abort(rid)

    def _stats(self, _msg: io.GetStatsReq) -> None:
        every = self.control.gather(self.scheduler.stats())
        self._reply(lambda: io.StatsResp(self._merged_stats(every)))

    def _merged_stats(self, every: list[dict]) -> dict:
        """One server's stats: each attention group's leader speaks for its group, except for the
        mode's per-rank counters (a rank's own KV writes), which add up over the group."""
        mode, a = self.scheduler.mode, self.layout.attn_tp_size
        per_dp = []
        for d in range(self.layout.dp_size):
            group = every[d * a:(d + 1) * a]
            s = dict(group[0])
            for key in mode.rank_counters:
                s[f"{key}_by_rank"] = [g[key] for g in group]
                s[key] = sum(s[f"{key}_by_rank"])
            per_dp.append(s)
        merged = merge_stats(per_dp)
        if len(per_dp) > 1:
            merged.update(mode.merge_stats(per_dp))
        merged["rank_pages"] = [{k: s[k] for k in ("total_pages", "free_pages", "cached_pages")} for s in every]
        return merged

    def _kv_snapshot(self, _msg: io.KVEventsSnapshotReq) -> None:
        # rank 0 alone publishes KV events (its attention group's cache is the server's)
        if self.layout.is_leader:
            self._reply(lambda: io.KVEventsSnapshotResp(self.scheduler.kv_events_snapshot()))

    def _flush(self, _msg: io.FlushCacheReq) -> None:
        every = self.control.gather(bool(self.scheduler.flush_cache()))
        self._reply(lambda: io.FlushCacheResp(all(every)))

    def _check_memory(self, _msg: CheckMemoryReq) -> None:
        s = self.scheduler
        try:
            s.check_memory()
            error = None
        except Exception as e:  # noqa: BLE001 - reported to the caller, who decides
            error = f"{type(e).__name__}: {e}"
        mine = RankMemory(self.layout.rank, self.layout.dp_rank, s.allocator.num_pages, s.allocator.num_free,
                          s.cache.num_cached_pages, s.has_work(), error)
        every = self.control.gather(mine, RankMemory)
        self._reply(lambda: CheckMemoryResp(every))

    def _stop(self, _msg: io.ShutdownReq) -> None:
        self.stopped = True

    def _reply(self, make) -> None:
        if self.layout.is_leader:
            send_message(self.outbox, make())


# ----------------------------------------------------------------- builder
def agree_hits(kv_manager: KVCacheManager, control: ControlPlane) -> None:
    """Ranks agree on each request's cache hit before any of them loads from host memory or
    storage (``KVCacheManager.prepare``): each rank's lower tiers hold what they hold, and a rank
    that admitted a longer prefix than the others would run a different batch. The round spans
    every rank, so it needs one attention group (config refuses the cache with dp_size > 1)."""
    if control.layout.dp_size > 1 and kv_manager.hicache is not None:
        raise ValueError("enable_hierarchical_cache: ranks agree on hit lengths within one attention group; "
                         f"got dp_size {control.layout.dp_size}")

    def gather(row: list[int]) -> list[list[int]]:
        return control.all_gather_row(torch.tensor(row, dtype=torch.int64)).tolist()

    kv_manager.agree_hits_with(gather)


def build_rank_scheduler(args, groups: RankGroups, model_config, tokenizer, device: str = "cpu",
                         make_mode: Callable | None = None, **scheduler_kwargs):
    """This rank's Scheduler: a RankModelRunner over its split of the model and KV pool, and a
    sampler that broadcasts from the attention group's leader. ``make_mode(runner)``: this
    rank's disaggregation mode over its pool (every rank calls it at the same point, so it may
    use collectives); ``scheduler_kwargs`` go to the Scheduler."""
    from pdserve.engine.scheduler import Scheduler

    lay = groups.layout
    # Ranks step in lock step with collectives (agreement, broadcast sampling) on this thread:
    # no forward runs ahead on a worker thread (engine/overlap.py).
    cache, sched = args.cache_config(), dataclasses.replace(args.scheduler_config(), disable_overlap_schedule=True)
    control = ControlPlane(lay, groups.cpu)
    runner = build_model_runner(args, model_config, groups.parallel, RankModelRunner, device=device,
                                sync=StepSync(control))
    if make_mode is not None:
        scheduler_kwargs["mode"] = make_mode(runner)
    scheduler = Scheduler(model_config, cache, sched, tokenizer, groups.parallel, runner,
                          grammar=args.grammar_config(), **scheduler_kwargs)
    # ranks must admit the same requests in the same step: compiles finish where they start
    scheduler.grammar.lockstep = lay.world_size > 1
    if lay.world_size > 1:
        agree_hits(scheduler.kv_manager, control)
    # Attention groups other than the first draw other random streams for unseeded sampling.
    inner = Sampler(sched.random_seed + lay.dp_rank)
    scheduler.sampler = BroadcastSampler(inner, groups.attn_tp, lay.dp_leader_rank(), lay.is_dp_leader)
    return scheduler
