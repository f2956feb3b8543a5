"""The lock-step primitives over two real processes (gloo on loopback): the per-iteration
exchange, the step agreement (which catches ranks whose batches diverged) and sampling
broadcast from the attention group's leader."""

from __future__ import annotations

import os
import pickle
import time

import pytest
import torch
import torch.multiprocessing as mp

from pdserve.config import ParallelConfig
from pdserve.distributed.groups import init_method, init_rank_groups
from pdserve.distributed.rank_layout import RankLayout
from pdserve.engine.io_struct import AbortReq, ShutdownReq
from pdserve.engine.rank_group import BroadcastSampler, ControlPlane, LockStepError, StepSync
from pdserve.engine.request import SamplingParams
from pdserve.engine.sampler import Sampler
from pdserve.engine.scheduler_loop import FRONTEND_CODEC


def _exchange(control: ControlPlane, rank: int) -> dict:
    leader = [FRONTEND_CODEC.encode(AbortReq("r1")), FRONTEND_CODEC.encode(ShutdownReq())]
    frames = leader if rank == 0 else [b"ignored"]
    before = time.monotonic()
    busy = control.exchange(frames, has_work=rank == 1, load=3 + 2 * rank, runnable=rank == 0,
                            poll_ms=20 if rank else None, agreement=rank == 1)
    quiet = control.exchange([], has_work=False, load=0)
    return {"busy": (busy.messages, busy.has_work, busy.loads), "quiet": quiet.messages,
            "state": (busy.runnable, busy.poll_ms, busy.agreement_due, quiet.agreement_due),
            "clock": (before, busy.now, time.monotonic())}


def _agree(sync: StepSync, rank: int) -> dict:
    out = {"same": sync.agree(5, 1234)}
    try:
        sync.agree(5, 1234 + rank)  # rank 1 diverged
        out["diverged"] = None
    except LockStepError as e:
        out["diverged"] = str(e)
    return out


def _sample(groups, rank: int) -> dict:
    lay = groups.layout
    sampler = BroadcastSampler(Sampler(0), groups.attn_tp, lay.dp_leader_rank(), lay.is_dp_leader)
    logits = torch.zeros(2, 10)
    logits[0, 3 if rank == 0 else 7] = 5.0  # the ranks disagree; the leader's choice must win
    logits[1, 4] = 5.0
    greedy = [SamplingParams(temperature=0.0)] * 2
    plain = sampler(logits, greedy, [None, None], [[], []])
    with_lp = sampler(logits, greedy, [None, None], [[], []], want_logprobs=True, top_logprobs_nums=[2, 0])
    return {"tokens": plain.tokens, "logprobs": with_lp.logprobs, "top": with_lp.top_logprobs}


def _dp_counts(sync: StepSync, rank: int) -> dict:
    return {"counts": sync.agree(4 if rank == 0 else 0, 99 if rank == 0 else 0)}


def _worker(rank: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    results = {}
    for i, (kw, checks) in enumerate([(dict(tp_size=2), ("exchange", "agree", "sample")),
                                      (dict(tp_size=2, dp_size=2, enable_dp_attention=True), ("dp",))]):
        groups = init_rank_groups(RankLayout(ParallelConfig(**kw), rank), init_method(out_dir, None, f"s{i}"))
        control = ControlPlane(groups.layout, groups.cpu)
        try:
            for check in checks:
                if check == "exchange":
                    results[check] = _exchange(control, rank)
                elif check == "agree":
                    results[check] = _agree(StepSync(control), rank)
                elif check == "sample":
                    results[check] = _sample(groups, rank)
                else:
                    results[check] = _dp_counts(StepSync(control), rank)
        finally:
            groups.destroy()
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(results, f)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("control")
    mp.start_processes(_worker, args=(str(root),), nprocs=2, join=True, start_method="spawn")
    return [pickle.loads((root / f"rank{r}.pkl").read_bytes()) for r in range(2)]


def test_exchange_gives_every_rank_the_leaders_messages_clock_and_everyones_state(results):
    for r in results:
        messages, has_work, loads = r["exchange"]["busy"]
        assert messages == [AbortReq("r1"), ShutdownReq()]  # rank 1's frames are not read
        assert has_work == [False, True] and loads == [3, 5]
        assert r["exchange"]["quiet"] == []
        assert r["exchange"]["state"] == ([True, False], [None, 20], True, False)
    # One clock for every rank: rank 0's, read during the exchange.
    assert results[0]["exchange"]["clock"][1] == results[1]["exchange"]["clock"][1]
    before, now, after = results[0]["exchange"]["clock"]
    assert before - 1e-6 <= now <= after  # (shared in whole microseconds)


def test_step_agreement_catches_a_diverged_rank_on_every_rank(results):
    for r in results:
        assert r["agree"]["same"] == [5]
        assert r["agree"]["diverged"] is not None
        assert "rank 1 scheduled a different batch from its attention group leader (rank 0)" in r["agree"]["diverged"]


def test_followers_take_the_leaders_samples(results):
    for r in results:
        assert r["sample"]["tokens"] == [3, 4]
    assert results[0]["sample"] == results[1]["sample"]
    assert results[0]["sample"]["top"][0][0][1] == 3 and results[0]["sample"]["top"][1] == []


def test_dp_attention_agreement_reports_each_groups_tokens(results):
    """Rank 1 (attention group 1) has nothing to run: it learns group 0 runs 4 tokens."""
    assert results[0]["dp"]["counts"] == results[1]["dp"]["counts"] == [4, 0]
