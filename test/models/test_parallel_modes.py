"""Engine-shaped splits over real processes (gloo on loopback), at the model level: the groups
``init_rank_groups`` builds, dummy weights under TP, EP with all-to-all dispatch (and its
all-reduce twin), DP attention with one attention group idle, DeepSeek-V4 under TP and EP. Every
rank's logits equal a single-rank run of the same requests.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fixtures.paged_batches import PagedRequests, make_pool
from fixtures.tiny_models import make_tiny_hf_model
from pdserve.config import ModelConfig, ParallelConfig
from pdserve.distributed.groups import init_method, init_rank_groups
from pdserve.distributed.parallel_state import SINGLE
from pdserve.distributed.rank_layout import RankLayout
from pdserve.layers.forward_batch import ForwardBatch
from pdserve.layers.moe import SparseMoE
from pdserve.models.loader import load_model

# Each rank's requests: (prefill tokens, decode tokens). Attention group 1 (DP attention)
# runs out of decode tokens first and then takes part idle while group 0 goes on.
SEQS = {0: ([5, 9, 200, 31, 7, 88, 41, 300, 2, 17, 18], [11, 12, 13]), 1: ([17, 3, 64], [21])}


def _steps(seqs: dict) -> int:
    return 1 + max(len(dec) for _, dec in seqs.values())


def _run(model, mine: list[int], attn_tp: int, counts=None, hooked: list | None = None) -> list[torch.Tensor]:
    """Prefill then decode the requests in ``mine`` (keys of SEQS) as one batch; a step where
    they have no tokens left runs idle. ``counts(n) -> every group's tokens`` (DP attention);
    ``hooked`` collects (layer, tokens) from the per-layer KV hook."""
    paged = PagedRequests(make_pool(model.config, 4, tp_size=attn_tp))
    out = []
    with torch.no_grad():
        for step in range(_steps(SEQS)):
            reqs = [(r, SEQS[r][0]) if step == 0 else (r, SEQS[r][1][step - 1:step])
                    for r in mine if step == 0 or step <= len(SEQS[r][1])]
            n = sum(len(toks) for _, toks in reqs)
            dp_counts = counts(n) if counts else None
            if n == 0:
                model(ForwardBatch.idle(paged.pool, paged.backend, dp_counts))
                continue
            fb = paged.batch(reqs, decode=step > 0)
            fb.dp_num_tokens = dp_counts
            if hooked is not None:
                fb.layer_hook = lambda layer, b: hooked.append((layer, b.num_tokens))
            out.append(model.compute_logits(model(fb)))
    return out


def _counts_fn(groups):
    def counts(n: int) -> list[int]:
        got = [torch.zeros(1, dtype=torch.int64) for _ in range(groups.layout.world_size)]
        dist.all_gather(got, torch.tensor([n]), group=groups.cpu)
        return [int(got[groups.layout.dp_leader_rank(d)]) for d in range(groups.layout.dp_size)]
    return counts


def _worker(rank: int, world: int, cases: list[tuple], out_dir: str) -> None:
    """cases: (checkpoint path, ParallelConfig kwargs, MoE dispatch); each rank saves its logits."""
    torch.set_num_threads(1)
    configs = [ModelConfig.from_path(path) for path, _, _ in cases]  # before any process group
    for i, (config, (_, kwargs, dispatch)) in enumerate(zip(configs, cases)):
        layout = RankLayout(ParallelConfig(**kwargs), rank)
        groups = init_rank_groups(layout, init_method(out_dir, None, f"store-{i}"))
        try:
            model = load_model(config, groups.parallel)
            for m in model.modules():
                if isinstance(m, SparseMoE):
                    m.ep_dispatch = dispatch
            dp = layout.dp_attention
            mine = [layout.dp_rank] if dp else list(SEQS)
            hooked = []
            logits = _run(model, mine, layout.attn_tp_size, _counts_fn(groups) if dp else None, hooked)
            torch.save((logits, hooked), os.path.join(out_dir, f"{i}-{rank}.pt"))
        finally:
            groups.destroy()


CASES = {
    "llama-tp2-dummy-weights": ("tiny-llama", dict(tp_size=2), "all_to_all"),
    "deepseek-tp2-dummy-weights": ("tiny-deepseek", dict(tp_size=2), "all_to_all"),
    # FP8 dummy weights: quantized once on the whole model, then every rank loads its slices
    "deepseek-fp8-tp2-dummy-weights": ("tiny-deepseek-fp8", dict(tp_size=2), "all_to_all"),
    "deepseek-ep2-all-to-all": ("DeepseekV3ForCausalLM", dict(tp_size=2, ep_size=2), "all_to_all"),
    "deepseek-ep2-all-reduce-twin": ("DeepseekV3ForCausalLM", dict(tp_size=2, ep_size=2), "all_reduce"),
    "qwen3-moe-ep2-all-to-all": ("Qwen3MoeForCausalLM", dict(tp_size=2, ep_size=2), "all_to_all"),
    "deepseek-dp2-attention": ("DeepseekV3ForCausalLM", dict(tp_size=2, dp_size=2, enable_dp_attention=True),
                               "all_to_all"),
    "deepseek-dp2-attention-ep2": ("DeepseekV2ForCausalLM",
                                   dict(tp_size=2, dp_size=2, enable_dp_attention=True, ep_size=2), "all_to_all"),
    # V3.2: the indexer is replicated, its keys a region of the latent's pages (whole on every rank)
    "deepseek-v32-tp2-ep2": ("DeepseekV32ForCausalLM", dict(tp_size=2, ep_size=2), "all_to_all"),
    "deepseek-v32-dp2-attention": ("DeepseekV32ForCausalLM", dict(tp_size=2, dp_size=2, enable_dp_attention=True),
                                   "all_to_all"),
    # V4: query heads and output groups split, its K=V head, compressors and indexer replicated; dummy
    # weights (and the FP4 twin's, quantized once on the whole model) loaded as every rank's slices
    "deepseek-v4-tp2-dummy-weights": ("tiny-deepseek-v4", dict(tp_size=2), "all_to_all"),
    "deepseek-v4-fp4-tp2-ep2-dummy-weights": ("tiny-deepseek-v4-fp4", dict(tp_size=2, ep_size=2), "all_to_all"),
}


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory):
    """One pair of processes runs every case, each in its own process group."""
    root = tmp_path_factory.mktemp("modes")
    paths = {}
    for name, (model, _, _) in CASES.items():
        paths[name] = model if model.startswith("tiny-") else make_tiny_hf_model(model, root / name)
    cases = [(paths[name], kw, dispatch) for name, (_, kw, dispatch) in CASES.items()]
    mp.start_processes(_worker, args=(2, cases, str(root)), nprocs=2, join=True, start_method="spawn")
    return {name: (paths[name], [torch.load(root / f"{i}-{r}.pt") for r in range(2)])
            for i, name in enumerate(CASES)}


@pytest.mark.parametrize("name", list(CASES))
def test_every_rank_matches_one_rank(two_rank_results, name):
    path, per_rank = two_rank_results[name]
    single = load_model(ModelConfig.from_path(path), SINGLE)
    dp = CASES[name][1].get("enable_dp_attention", False)
    for rank, (got, hooked) in enumerate(per_rank):
        want_hooked = []
        want = _run(single, [rank] if dp else list(SEQS), 1, hooked=want_hooked)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=0)
        # The KV hook fired on this rank for every layer of every forward it ran (never when idle).
        assert hooked == want_hooked and len(hooked) == len(want) * single.config.num_hidden_layers
