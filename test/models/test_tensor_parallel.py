"""TP / EP over real processes (gloo on loopback): two ranks' logits equal the single-rank run.

Each rank loads the same checkpoint with its ParallelState and runs the same steps; rank 0
writes its logits for the parent to compare.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fixtures.paged_batches import PagedRequests, make_pool
from fixtures.tiny_models import make_tiny_hf_model
from pdserve.config import ModelConfig
from pdserve.distributed.parallel_state import SINGLE, ParallelState
from pdserve.models.loader import load_model

SEQS = [[5, 9, 200, 31, 7, 88, 41], [17, 3, 64]]


def _run(model, tp_size: int) -> torch.Tensor:
    """Prefill both sequences, then two decode steps; all logits, concatenated."""
    paged = PagedRequests(make_pool(model.config, 4, tp_size=tp_size))
    out = []
    with torch.no_grad():
        out.append(model.compute_logits(model(paged.batch(list(enumerate(SEQS))))))
        for tok in (11, 12):
            out.append(model.compute_logits(model(paged.batch([(0, [tok]), (1, [tok])], decode=True))))
    return torch.cat(out)


def _worker(rank: int, world: int, store: str, cases: list[tuple[str, str]], out_dir: str) -> None:
    """cases: (checkpoint path, "tp" | "ep"); rank 0 saves case i's logits as ``{out_dir}/{i}.pt``."""
    # Read the configs before the process group exists. The first config lookup makes
    # transformers import torch.distributed.nn.functional, whose functions take
    # `group=group.WORLD` as default arguments evaluated at import time: imported after
    # init_process_group, they hold the world group for the life of the process, so
    # destroy_process_group cannot free it and gloo's threads outlive main() (see _check_torn_down).
    configs = [ModelConfig.from_path(path) for path, _ in cases]
    # A file store, not a TCP port picked in the parent and bound later by rank 0 (racy).
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        _run_cases(rank, world, configs, [axis for _, axis in cases], out_dir)
    finally:
        dist.destroy_process_group()
    _check_torn_down()


def _run_cases(rank: int, world: int, configs: list[ModelConfig], axes: list[str], out_dir: str) -> None:
    """Every reference to the process group lives in this frame, gone when it returns."""
    group = dist.group.WORLD
    for i, (config, axis) in enumerate(zip(configs, axes)):
        parallel = (ParallelState(tp_rank=rank, tp_size=world, tp_group=group) if axis == "tp"
                    else ParallelState(ep_rank=rank, ep_size=world, ep_group=group))
        logits = _run(load_model(config, parallel), parallel.tp_size)
        if rank == 0:
            torch.save(logits, os.path.join(out_dir, f"{i}.pt"))


def _check_torn_down() -> None:
    """Fail loudly if gloo's threads survived destroy_process_group.

    A surviving thread that drops the last reference to a Python-owned tensor (the end of a
    collective) while the interpreter finalizes must take the GIL, which CPython refuses by
    exiting the thread inside C++: std::terminate, "terminate called without an active
    exception", SIGABRT, at random. Better a clear error every time.
    """
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return
    names = [(t / "comm").read_text().strip() for t in tasks.iterdir()]
    alive = [n for n in names if "gloo" in n]
    if alive:
        raise RuntimeError(f"process group still alive after destroy_process_group (threads {alive}): "
                           "something holds a reference to it")


CASES = {
    "llama-tp": ("LlamaForCausalLM", "tp", {}),
    "qwen2-tp-replicated-kv": ("Qwen2ForCausalLM", "tp", {"num_key_value_heads": 1}),
    "qwen3-moe-tp": ("Qwen3MoeForCausalLM", "tp", {}),
    "qwen3-moe-ep": ("Qwen3MoeForCausalLM", "ep", {}),
    "deepseek-v3-tp": ("DeepseekV3ForCausalLM", "tp", {}),
    "deepseek-v2-ep": ("DeepseekV2ForCausalLM", "ep",
                       {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2}),
}


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory):
    """One pair of processes runs every case (process start-up dominates the cost)."""
    root = tmp_path_factory.mktemp("tp")
    paths = {name: make_tiny_hf_model(arch, root / name, **ov) for name, (arch, _, ov) in CASES.items()}
    cases = [(paths[name], CASES[name][1]) for name in CASES]
    mp.start_processes(_worker, args=(2, str(root / "store"), cases, str(root)), nprocs=2, join=True,
                       start_method="spawn")
    return {name: (paths[name], torch.load(root / f"{i}.pt")) for i, name in enumerate(CASES)}


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_match_one(two_rank_results, name):
    path, got = two_rank_results[name]
    want = _run(load_model(ModelConfig.from_path(path), SINGLE), 1)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
