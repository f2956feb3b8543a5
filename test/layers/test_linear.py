"""Linear / embedding / norm layers: TP shards reassemble the single-rank result, checkpoint
slicing is right, RMSNorm and SiluAndMul match transformers' formulas."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from pdserve.distributed.parallel_state import SINGLE, ParallelState
from pdserve.layers.activation import SiluAndMul
from pdserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pdserve.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from pdserve.layers.norm import RMSNorm
from pdserve.models.base import load_into


def _tp(rank: int, size: int) -> ParallelState:
    return ParallelState(tp_rank=rank, tp_size=size)


def _load(layer: nn.Module, name: str, tensors: dict) -> nn.Module:
    load_into(nn.ModuleDict({name: layer}), tensors.items())
    return layer


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_merged_column_shards_reassemble():
    In, I = 8, 12
    ckpt = {"gate_proj.weight": _randn(I, In, seed=1), "up_proj.weight": _randn(I, In, seed=2)}
    x = _randn(5, In, seed=3)
    full = _load(MergedColumnParallelLinear(In, [I, I], SINGLE, ckpt_names=("gate_proj", "up_proj")),
                 "gate_up_proj", ckpt)(x)
    torch.testing.assert_close(full, torch.cat([x @ ckpt["gate_proj.weight"].T, x @ ckpt["up_proj.weight"].T], -1))
    shards = [_load(MergedColumnParallelLinear(In, [I, I], _tp(r, 2), ckpt_names=("gate_proj", "up_proj")),
                    "gate_up_proj", ckpt)(x) for r in range(2)]
    # Each rank holds [its gate slice | its up slice].
    gate = torch.cat([s[:, :I // 2] for s in shards], -1)
    up = torch.cat([s[:, I // 2:] for s in shards], -1)
    torch.testing.assert_close(torch.cat([gate, up], -1), full)


@pytest.mark.parametrize("Hq,Hkv,p", [(4, 2, 2), (4, 2, 4), (8, 1, 2)])
def test_qkv_shards_pick_their_heads(Hq, Hkv, p):
    Hd, D = 16, 4
    ckpt = {f"{n}_proj.{t}": _randn(*((H * D, Hd) if t == "weight" else (H * D,)), seed=i)
            for i, (n, H) in enumerate([("q", Hq), ("k", Hkv), ("v", Hkv)]) for t in ("weight", "bias")}
    x = _randn(3, Hd, seed=9)
    ref = {n: (x @ ckpt[f"{n}_proj.weight"].T + ckpt[f"{n}_proj.bias"]).view(3, -1, D) for n in "qkv"}
    for r in range(p):
        layer = _load(QKVParallelLinear(Hd, D, Hq, Hkv, _tp(r, p), bias=True), "qkv_proj", ckpt)
        hq, hk = layer.num_heads, layer.num_kv_heads
        q, k, v = layer(x).split([hq * D, hk * D, hk * D], -1)
        kv_head = r * Hkv // p if Hkv < p else r * hk
        torch.testing.assert_close(q.view(3, hq, D), ref["q"][:, r * hq:(r + 1) * hq])
        torch.testing.assert_close(k.view(3, hk, D), ref["k"][:, kv_head:kv_head + hk])
        torch.testing.assert_close(v.view(3, hk, D), ref["v"][:, kv_head:kv_head + hk])


def test_row_parallel_partials_sum_to_full_with_bias_once():
    In, Out = 12, 6
    ckpt = {"o_proj.weight": _randn(Out, In, seed=1), "o_proj.bias": _randn(Out, seed=2)}
    x = _randn(4, In, seed=3)
    full = _load(RowParallelLinear(In, Out, SINGLE, bias=True), "o_proj", ckpt)(x)
    torch.testing.assert_close(full, x @ ckpt["o_proj.weight"].T + ckpt["o_proj.bias"])
    parts = [_load(RowParallelLinear(In, Out, _tp(r, 3), bias=True, reduce_results=False), "o_proj", ckpt)(
        x[:, r * 4:(r + 1) * 4]) for r in range(3)]
    torch.testing.assert_close(sum(parts), full)


def test_column_parallel_and_replicated_merge():
    ckpt = {"q_a_proj.weight": _randn(5, 8, seed=1), "kv_a_proj_with_mqa.weight": _randn(7, 8, seed=2)}
    layer = _load(ReplicatedLinear(8, [5, 7], ckpt_names=("q_a_proj", "kv_a_proj_with_mqa")), "fused", ckpt)
    x = _randn(2, 8)
    torch.testing.assert_close(layer(x), torch.cat([x @ ckpt["q_a_proj.weight"].T,
                                                    x @ ckpt["kv_a_proj_with_mqa.weight"].T], -1))
    col = [_load(ColumnParallelLinear(8, 10, _tp(r, 2)), "proj", {"proj.weight": _randn(10, 8, seed=4)})(x)
           for r in range(2)]
    torch.testing.assert_close(torch.cat(col, -1), x @ _randn(10, 8, seed=4).T)


def test_wrong_checkpoint_shape_names_the_tensor():
    with pytest.raises(ValueError, match=r"o_proj\.weight.*\(6, 11\).*\(6, 12\)"):
        _load(RowParallelLinear(12, 6, SINGLE), "o_proj", {"o_proj.weight": torch.zeros(6, 11)})


def test_vocab_shards_pad_and_cover_the_vocab():
    V, Hd = 11, 4
    table = _randn(V, Hd)
    shards = [_load(VocabParallelEmbedding(V, Hd, _tp(r, 2), torch.float32), "embed", {"embed.weight": table})
              for r in range(2)]
    assert [s.weight.shape[0] for s in shards] == [6, 6]
    torch.testing.assert_close(torch.cat([s.weight for s in shards])[:V], table)
    assert shards[1].weight[-1].abs().sum() == 0
    ids = torch.tensor([0, 10, 3])
    full = _load(VocabParallelEmbedding(V, Hd, SINGLE, torch.float32), "embed", {"embed.weight": table})
    torch.testing.assert_close(full(ids), table[ids])


def test_tied_lm_head_shares_the_embedding_and_returns_float32():
    embed = VocabParallelEmbedding(11, 4, SINGLE, torch.bfloat16)
    head = ParallelLMHead(11, 4, SINGLE, torch.bfloat16, tie_to=embed)
    assert head.weight is embed.weight
    assert head(torch.randn(3, 4, dtype=torch.bfloat16)).dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_transformers(dtype):
    hf = LlamaRMSNorm(64, eps=1e-6)
    ours = RMSNorm(64, 1e-6, dtype)
    with torch.no_grad():
        hf.weight.copy_(1 + _randn(64) * 0.1)
        ours.weight.copy_(hf.weight)
    hf = hf.to(dtype)
    x, res = _randn(5, 64, seed=1).to(dtype), _randn(5, 64, seed=2).to(dtype)
    torch.testing.assert_close(ours(x), hf(x), atol=0 if dtype == torch.float32 else 1e-2, rtol=1e-6)
    out, new_res = ours(x, res)
    torch.testing.assert_close(new_res, x + res)
    torch.testing.assert_close(out, hf(x + res), atol=0 if dtype == torch.float32 else 1e-2, rtol=1e-6)


def test_silu_and_mul():
    x = _randn(3, 10)
    torch.testing.assert_close(SiluAndMul()(x), torch.nn.functional.silu(x[:, :5]) * x[:, 5:])
