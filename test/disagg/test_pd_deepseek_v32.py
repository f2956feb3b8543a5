"""DeepSeek-V3.2 (MLA + DSA) across P/D: 1 prefill + 1 decode as real processes, on each transfer
backend (Mooncake, NIXL), against transformers' ``DeepseekV32ForCausalLM`` on a tiny float32
checkpoint with ``index_topk`` 8.

The indexer's keys are one more region of the latent's pages, so they move with it layer by layer
and are counted like it: decode's received bytes are the pages of both regions, and its greedy
tokens are transformers' for prompts from shorter than index_topk to 9 times longer, through
pdserve's router and through the PyPI sglang-router. Decode's own prefix hit (turn 2 of a
conversation) asks prefill only for the pages it lacks, index keys included. One deployment per
backend, shared by the module's tests.
"""

from __future__ import annotations

import importlib.util

import pytest
from pd_model_checks import PAGE, Deployment, check_router_tokens, check_sglang_router, check_turn_two

from fixtures.fp8_index_keys import fp8_index_keys
from fixtures.tiny_models import make_hf_model_and_dir
from pdserve.transfer import BACKEND_NAMES

pytestmark = pytest.mark.skipif(not pytest.importorskip("mooncake"), reason="needs mooncake")

ARCH = "DeepseekV32ForCausalLM"
TOPK = 8
BACKENDS = ["mooncake"] + (["nixl"] if "nixl" in BACKEND_NAMES else [])
LENGTHS = (1, TOPK - 3, 3 * TOPK + 1, 6 * TOPK, 9 * TOPK)  # one token (decode prefills it), short, long


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf, path = make_hf_model_and_dir(ARCH, tmp_path_factory.mktemp("v32-pd"))
    assert hf.config.index_topk == TOPK
    return hf, path


@pytest.fixture(scope="module", params=BACKENDS)
def pd(request, tiny):
    dep = Deployment(tiny[1], request.param)
    try:
        yield dep.start()
    finally:
        dep.stop()


def _page_bytes(hf) -> int:
    """One page of every layer: the latent rows and the index keys (float32)."""
    c = hf.config
    return c.num_hidden_layers * PAGE * (c.kv_lora_rank + c.qk_rope_head_dim + c.index_head_dim) * 4


def test_greedy_tokens_match_transformers_through_the_router(pd, tiny):
    """Every page moved its latent rows and its index keys, nothing more."""
    hf, _ = tiny
    check_router_tokens(pd, hf, LENGTHS, _page_bytes(hf))


def test_turn_two_asks_prefill_only_for_the_pages_decode_lacks(pd, tiny):
    """Index keys missing from the pages decode already held would change turn 2's tokens."""
    hf, _ = tiny
    check_turn_two(pd, hf, 5 * TOPK, 2 * TOPK, _page_bytes(hf))


@pytest.mark.skipif(importlib.util.find_spec("sglang_router") is None, reason="sglang-router is not installed")
def test_the_same_through_sglang_router(pd, tiny):
    check_sglang_router(pd, tiny[0], LENGTHS[1:])


def test_fp8_index_keys_move_with_their_scales(tiny):
    """``--index-cache-dtype fp8_e4m3`` on both sides (the CUDA default): every page moves its latent
    rows, its e4m3 index keys and their float32 scales (one a key at index_head_dim 32), and decode's
    tokens are transformers' with its index keys through the same quantization."""
    hf, path = tiny
    c = hf.config
    page_bytes = c.num_hidden_layers * PAGE * ((c.kv_lora_rank + c.qk_rope_head_dim) * 4 + c.index_head_dim + 4)
    dep = Deployment(path, "mooncake", "--index-cache-dtype", "fp8_e4m3")
    try:
        pd = dep.start()
        with fp8_index_keys(hf) as oracle:
            check_router_tokens(pd, oracle, (TOPK - 3, 6 * TOPK), page_bytes)
    finally:
        dep.stop()
