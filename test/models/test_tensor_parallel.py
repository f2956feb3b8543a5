"""TP / EP over real processes (gloo on loopback): two ranks' logits equal the single-rank run.

Each rank loads the same checkpoint with its ParallelState and runs the same steps; rank 0
writes its logits for the parent to compare.
"""

from __future__ import annotations

import os
import socket

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


def _worker(rank: int, world: int, port: int, cases: list[tuple[str, str]], out_dir: str) -> None:
    """cases: (checkpoint path, "tp" | "ep"); rank 0 saves case i's logits as ``{out_dir}/{i}.pt``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        group = dist.group.WORLD
        for i, (path, axis) in enumerate(cases):
            parallel = (ParallelState(tp_rank=rank, tp_size=world, tp_group=group) if axis == "tp"
                        else ParallelState(ep_rank=rank, ep_size=world, ep_group=group))
            logits = _run(load_model(ModelConfig.from_path(path), parallel), parallel.tp_size)
            if rank == 0:
                torch.save(logits, os.path.join(out_dir, f"{i}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    mp.start_processes(_worker, args=(2, _free_port(), cases, str(root)), nprocs=2, join=True,
                       start_method="spawn")
    return {name: (paths[name], torch.load(root / f"{i}.pt")) for i, name in enumerate(CASES)}


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_match_one(two_rank_results, name):
    path, got = two_rank_results[name]
    want = _run(load_model(ModelConfig.from_path(path), SINGLE), 1)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
