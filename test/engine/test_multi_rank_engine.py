"""Colocated multi-rank engines (one process per rank, gloo on loopback) give the single-rank
engine's greedy tokens for 16 mixed requests (fixtures/parallel_runs.py). Afterwards every
rank's pages add up (free + cached == total) and every rank process is gone.

Configs: TP2 (tiny-llama, tiny-deepseek, and a Qwen2 safetensors checkpoint with one KV head,
replicated on both ranks), EP2 (tiny-deepseek, tiny-qwen3-moe), DP2 with DP attention
(tiny-deepseek, also with EP2), and plain DP2 replicas.
"""

from __future__ import annotations

import pytest
import torch

import pdserve
from fixtures.parallel_runs import ENGINE_ARGS, LOGPROB_REQS, OUTPUT_LENS, run_mixed, single_rank_answers


def _logprobs(meta: dict, key: str) -> list[float]:
    return [lp for lp, _tok, _text in meta[key] if lp is not None]


def assert_same_answers(got: list[dict], want: list[dict]) -> None:
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    assert len(got) == 16 and len({len(o["output_ids"]) for o in got}) == len(OUTPUT_LENS)
    for i in LOGPROB_REQS:
        for key in ("input_token_logprobs", "output_token_logprobs"):
            g, w = _logprobs(got[i]["meta_info"], key), _logprobs(want[i]["meta_info"], key)
            assert len(g) == len(w) > 0
            torch.testing.assert_close(torch.tensor(g), torch.tensor(w), atol=1e-4, rtol=0)
        got_top = [[t for _, t, _ in row] for row in got[i]["meta_info"]["output_top_logprobs"]]
        want_top = [[t for _, t, _ in row] for row in want[i]["meta_info"]["output_top_logprobs"]]
        assert got_top == want_top


def assert_every_rank_clean(engine, world: int) -> None:
    ranks = engine.scheduler.check_memory().ranks  # raises if any rank's check failed
    assert [m.rank for m in ranks] == list(range(world))
    for m in ranks:
        assert not m.has_work and m.free_pages + m.cached_pages == m.total_pages, m
    assert all(m.cached_pages > 0 for m in ranks)  # every attention group served something


CONFIGS = {
    "llama-tp2": ("tiny-llama", dict(tp_size=2)),
    "deepseek-tp2": ("tiny-deepseek", dict(tp_size=2)),
    "deepseek-ep2": ("tiny-deepseek", dict(tp_size=2, ep_size=2)),
    "qwen3-moe-ep2": ("tiny-qwen3-moe", dict(tp_size=2, ep_size=2)),
    "deepseek-dp2-attention": ("tiny-deepseek", dict(tp_size=2, dp_size=2, enable_dp_attention=True)),
    "deepseek-dp2-attention-ep2": ("tiny-deepseek", dict(tp_size=2, dp_size=2, enable_dp_attention=True,
                                                         ep_size=2)),
    "llama-dp2-replicas": ("tiny-llama", dict(dp_size=2)),
    "qwen2-tp2-one-kv-head": ("qwen2-one-kv-head", dict(tp_size=2)),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from fixtures.tiny_models import make_tiny_hf_model

    path = make_tiny_hf_model("Qwen2ForCausalLM", tmp_path_factory.mktemp("qwen2"), num_key_value_heads=1)
    return {"qwen2-one-kv-head": path}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_multi_rank_engine_matches_single_rank(name, checkpoints):
    preset, parallel = CONFIGS[name]
    preset = checkpoints.get(preset, preset)
    want = single_rank_answers(preset)
    engine = pdserve.Engine(model_path=preset, **ENGINE_ARGS, **parallel)
    pids = engine.scheduler.ranks.pids
    try:
        assert len(pids) == 2
        assert_same_answers(run_mixed(engine), want)
        assert_every_rank_clean(engine, 2)
        stats = engine.get_server_info()
        if parallel.get("dp_size", 1) > 1:  # each attention group reports its own pages
            assert [s["total_pages"] for s in stats["dp_ranks"]] == [256, 256]
    finally:
        engine.shutdown()
    assert all(p.exitcode == 0 for p in engine.scheduler.ranks.processes), engine.scheduler.ranks.describe_exit()


def test_grammars_on_two_ranks_in_lock_step_match_one_rank():
    """TP2: both ranks compile each grammar on arrival (ranks admit the same requests in the same
    step) and sample under it: the single-rank engine's outputs, valid; a constraint that does
    not compile is refused by the ranks naming the field."""
    from constrained.grammar_fixtures import CONSTRAINTS, check_output

    sps = [{"max_new_tokens": 64, "temperature": 0.0, kind: text} for kind, text in CONSTRAINTS.items()]
    sps.append({"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True})
    prompts = [[5, 17, 99, 3], [40, 41], [7] * 9, [300, 2, 8]]
    kw = dict(constrained_json_disable_any_whitespace=True)
    one = pdserve.Engine(model_path="tiny-llama", **kw)
    want = one.generate(input_ids=prompts, sampling_params=sps)
    one.shutdown()
    engine = pdserve.Engine(model_path="tiny-llama", tp_size=2, **kw)
    try:
        got = engine.generate(input_ids=prompts, sampling_params=sps)
        assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
        for o, kind in zip(got, CONSTRAINTS):
            check_output(kind, o["text"])
        with pytest.raises(ValueError, match="^sampling_params.regex: does not compile"):
            engine.generate(input_ids=prompts[0], sampling_params={"regex": "(unclosed"})
        assert_every_rank_clean(engine, 2)
    finally:
        engine.shutdown()
