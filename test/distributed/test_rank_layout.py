"""Where each rank sits (pure arithmetic) and which parallel settings are refused, naming the field."""

from __future__ import annotations

import pytest

from pdserve.config import ModelConfig, ParallelConfig, ServerArgs
from pdserve.distributed.rank_layout import RankLayout, layouts_on_node


def _layouts(**kw) -> list[RankLayout]:
    cfg = ParallelConfig(**kw)
    return [RankLayout(cfg, r) for r in range(cfg.world_size)]


def test_tensor_parallel_only():
    ls = _layouts(tp_size=4)
    assert [lay.tp_rank for lay in ls] == [0, 1, 2, 3]
    assert [lay.dp_rank for lay in ls] == [0, 0, 0, 0]
    assert [lay.is_dp_leader for lay in ls] == [True, False, False, False]
    assert ls[0].attn_tp_groups() == ls[0].tp_groups() == [[0, 1, 2, 3]]
    assert ls[0].attn_dp_groups() == []
    assert [lay.ep_rank for lay in ls] == [0, 0, 0, 0]


def test_data_parallel_replicas():
    """Without DP attention every replica is a whole TP group of its own."""
    ls = _layouts(tp_size=2, dp_size=3)
    assert len(ls) == 6
    assert [lay.dp_rank for lay in ls] == [0, 0, 1, 1, 2, 2]
    assert [lay.tp_rank for lay in ls] == [0, 1, 0, 1, 0, 1]
    assert ls[0].tp_groups() == ls[0].attn_tp_groups() == [[0, 1], [2, 3], [4, 5]]
    assert [ls[0].dp_leader_rank(d) for d in range(3)] == [0, 2, 4]
    assert not ls[0].dp_attention and ls[0].attn_dp_groups() == []


def test_dp_attention():
    """DP attention: tp_size ranks in all; attention in dp groups; dense/MoE layers over all ranks."""
    ls = _layouts(tp_size=4, dp_size=2, enable_dp_attention=True, ep_size=4)
    assert len(ls) == 4
    assert [lay.dp_rank for lay in ls] == [0, 0, 1, 1]
    assert [lay.attn_tp_rank for lay in ls] == [0, 1, 0, 1]
    assert [lay.tp_rank for lay in ls] == [0, 1, 2, 3]
    assert [lay.ep_rank for lay in ls] == [0, 1, 2, 3]
    assert ls[0].attn_tp_groups() == [[0, 1], [2, 3]]
    assert ls[0].tp_groups() == [[0, 1, 2, 3]]
    assert ls[0].attn_dp_groups() == [[0, 2], [1, 3]]
    assert [lay.is_dp_leader for lay in ls] == [True, False, True, False]
    assert ls[0].is_leader and not ls[2].is_leader
    assert [ls[0].leader_of(r) for r in range(4)] == [0, 0, 2, 2]


def test_ranks_per_node():
    cfg = ParallelConfig(tp_size=4, nnodes=2, node_rank=1, dist_init_addr="10.0.0.1:5000")
    assert [lay.rank for lay in layouts_on_node(cfg)] == [2, 3]
    assert RankLayout(cfg, 0).ranks_on_node(0) == [0, 1]


@pytest.mark.parametrize("kw, field", [
    (dict(tp_size=0), "tp_size"),
    (dict(tp_size=4, dp_size=3, enable_dp_attention=True), "dp_size"),
    (dict(tp_size=4, ep_size=2), "ep_size"),
    (dict(tp_size=2, ep_size=2, moe_a2a_backend="nvshmem"), "moe_a2a_backend"),
    (dict(tp_size=2, moe_a2a_backend="deepep"), "moe_a2a_backend"),
    (dict(tp_size=2, nnodes=2), "dist_init_addr"),
    (dict(tp_size=3, nnodes=2, dist_init_addr="h:1"), "nnodes"),
    (dict(tp_size=2, nnodes=2, node_rank=2, dist_init_addr="h:1"), "node_rank"),
    (dict(dist_init_addr="no-port"), "dist_init_addr"),
    (dict(dist_init_addr="host:70000"), "dist_init_addr"),
])
def test_bad_parallel_config_is_refused(kw, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        ParallelConfig(**kw)


def test_server_args_refuse_bad_split_before_any_process():
    with pytest.raises(ValueError, match="^ep_size:"):
        ServerArgs(model_path="tiny-llama", tp_size=2, ep_size=4)


@pytest.mark.parametrize("preset, kw, message", [
    ("tiny-llama", dict(tp_size=3), "tp_size: num_attention_heads (8) is not divisible"),
    ("tiny-llama", dict(tp_size=2, ep_size=2), "ep_size: LlamaForCausalLM has no routed experts"),
    ("tiny-llama", dict(tp_size=2, dp_size=2, enable_dp_attention=True), "enable_dp_attention: only MLA"),
    ("tiny-qwen3-moe", dict(tp_size=8), "tp_size: num_attention_heads (4) is not divisible"),
    ("tiny-deepseek", dict(tp_size=32, dp_size=8, enable_dp_attention=True, ep_size=32),
     "ep_size: 32 does not divide the number of experts (16)"),
    ("tiny-deepseek", dict(tp_size=4, dp_size=2, enable_dp_attention=True), None),  # 4 heads over 2: fine
])
def test_split_that_cannot_shard_the_model_is_refused(preset, kw, message):
    """Checked where config.json is read, so `pdserve serve` exits 2 before starting any rank."""
    args = ServerArgs(model_path=preset, **kw)
    if message is None:
        args.model_config()
        return
    with pytest.raises(ValueError) as e:
        args.model_config()
    assert str(e.value).startswith(message)


def test_kv_heads_that_cannot_be_split_or_replicated_are_refused(tmp_path):
    from fixtures.tiny_models import make_tiny_hf_model

    path = make_tiny_hf_model("LlamaForCausalLM", tmp_path, num_attention_heads=12, num_key_value_heads=3,
                              hidden_size=96, intermediate_size=192)
    with pytest.raises(ValueError, match=r"^tp_size: num_key_value_heads \(3\) and the attention TP size 2"):
        ServerArgs(model_path=path, tp_size=2).model_config()
    ServerArgs(model_path=path, tp_size=6, load_format="auto").model_config()  # 3 heads, each on 2 ranks


def test_accepted_splits_of_the_presets():
    for preset, kw in [("tiny-llama", dict(tp_size=2)), ("tiny-llama", dict(tp_size=8)),  # kv heads replicated
                       ("tiny-deepseek", dict(tp_size=2, ep_size=2)),
                       ("tiny-deepseek", dict(tp_size=2, dp_size=2, enable_dp_attention=True)),
                       ("tiny-qwen3-moe", dict(tp_size=2, ep_size=2))]:
        model = ServerArgs(model_path=preset, **kw).model_config()
        assert isinstance(model, ModelConfig)


def test_serve_flags_set_the_parallel_fields():
    from pdserve.entrypoints.cli import build_parser, server_args_from_namespace

    ns = build_parser().parse_args(["serve", "--model-path", "tiny-deepseek", "--tp-size", "2", "--dp-size", "2",
                                    "--enable-dp-attention", "--ep-size", "2", "--moe-a2a-backend", "none",
                                    "--dist-init-addr", "127.0.0.1:5000", "--nnodes", "2", "--node-rank", "1"])
    args = server_args_from_namespace(ns)
    assert args.parallel_config() == ParallelConfig(2, 2, 2, True, "none", "127.0.0.1:5000", 2, 1)


@pytest.mark.parametrize("flags, message", [
    (["--tp-size", "2", "--ep-size", "2", "--moe-a2a-backend", "deepep"], "moe_a2a_backend: 'deepep'"),
    (["--tp-size", "3"], "tp_size: num_attention_heads (4)"),
    (["--tp-size", "2", "--nnodes", "2"], "dist_init_addr: required"),
])
def test_serve_refuses_a_bad_split_with_exit_code_2(flags, message, capsys):
    """Before any process starts; deepep needs CUDA (and is not wired to the CPU model runner)."""
    from pdserve.entrypoints.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--model-path", "tiny-deepseek", *flags])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_engine_refuses_deepep_on_this_host():
    import torch

    import pdserve

    if torch.cuda.is_available():
        pytest.skip("the CPU-host error is what this checks")
    with pytest.raises(ValueError, match="^moe_a2a_backend: 'deepep' runs on CUDA GPUs only"):
        pdserve.Engine(model_path="tiny-deepseek", tp_size=2, ep_size=2, moe_a2a_backend="deepep")


def test_disaggregation_takes_several_ranks_but_one_prefill_attention_group():
    for mode, kw in (("prefill", dict(tp_size=2, ep_size=2)),
                     ("decode", dict(tp_size=2, dp_size=2, enable_dp_attention=True)),
                     ("decode", dict(dp_size=2))):
        assert ServerArgs(model_path="tiny-deepseek", disaggregation_mode=mode, **kw).parallel_config().world_size == 2
    for kw in (dict(dp_size=2), dict(tp_size=2, dp_size=2, enable_dp_attention=True)):
        with pytest.raises(ValueError, match="^dp_size: a prefill server runs one attention group"):
            ServerArgs(model_path="tiny-deepseek", disaggregation_mode="prefill", **kw)
