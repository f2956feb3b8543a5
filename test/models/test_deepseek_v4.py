"""DeepSeek-V4 (sliding, CSA and HCA layers, mHC, hash-routed MoE) through the offline Engine against
transformers' ``DeepseekV4ForCausalLM`` on a tiny float32 checkpoint: a window of 8 and compression
rates 4 (CSA) and 8 (HCA), so prompts of a few dozen tokens cross many window and block boundaries,
and ``index_topk`` 3, so CSA queries attend to a strict subset of the compressed entries."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys

import pytest
import torch

import pdserve
from entrypoints.server_utils import Server
from fixtures.tiny_models import greedy_continuation, make_hf_model_and_dir
from pdserve.config import ServerArgs

ARCH = "DeepseekV4ForCausalLM"
WINDOW, CSA_RATE, HCA_RATE, TOPK = 8, 4, 8, 3
TOL = 1e-4
STEPS = 10
GREEDY = {"max_new_tokens": STEPS, "temperature": 0.0, "ignore_eos": True}


def _hash_table(hf, seed: int = 0) -> None:
    """transformers leaves ``tid2eid`` zero (a checkpoint fills it): draw k distinct experts per token."""
    c = hf.config
    g = torch.Generator().manual_seed(seed)
    table = torch.stack([torch.randperm(c.n_routed_experts, generator=g)[:c.num_experts_per_tok]
                         for _ in range(c.vocab_size)])
    for layer, kind in zip(hf.model.layers, c.mlp_layer_types):
        if kind == "hash_moe":
            layer.mlp.gate.tid2eid.copy_(table)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from fixtures import tiny_models

    out = tmp_path_factory.mktemp("v4")
    hf = tiny_models.build_tiny_hf_model(ARCH)
    _hash_table(hf)
    tiny_models.check_not_degenerate(hf)
    hf.save_pretrained(str(out), safe_serialization=True)
    tiny_models._copy_tokenizer(out)
    c = hf.config
    assert (c.sliding_window, c.index_topk) == (WINDOW, TOPK)
    assert c.compress_rates == {"compressed_sparse_attention": CSA_RATE, "heavily_compressed_attention": HCA_RATE}
    return hf, str(out)


def _prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 400, (n,), generator=g).tolist()


def _hf_logprobs(hf, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(input_ids=torch.tensor([seq]), use_cache=False).logits[0].float(), -1)  # [L, V]


@pytest.mark.parametrize("length", [3, 11, 6 * WINDOW + 5])
def test_greedy_tokens_and_logprobs_match_transformers(tiny, length):
    """Prompts shorter than one block, past the window, and over many windows and blocks; chunked
    prefill cuts windows open, and decode closes windows one token at a time."""
    hf, path = tiny
    engine = pdserve.Engine(model_path=path, page_size=4, chunked_prefill_size=16)
    prompt = _prompt(length, seed=length)
    out = engine.generate(input_ids=prompt, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0)
    assert out["output_ids"] == greedy_continuation(hf, prompt, STEPS)
    seq = prompt + out["output_ids"]
    ref = _hf_logprobs(hf, seq)
    meta = out["meta_info"]
    for j, (lp, tok, _) in enumerate(meta["input_token_logprobs"][1:] + meta["output_token_logprobs"], start=1):
        assert tok == seq[j]
        assert lp == pytest.approx(float(ref[j - 1, tok]), abs=TOL), j
