"""DeepSeek-V4 (sliding, CSA and HCA layers) across P/D: 1 prefill + 1 decode as real processes, on each
transfer backend (Mooncake, NIXL), against transformers' ``DeepseekV4ForCausalLM`` on a tiny float32
checkpoint with a window of 8 and compression rates 4 (CSA) and 8 (HCA).

Every region of a token's slot (the window's K=V rows, the compressors' source rows, the compressed
entries, CSA's index keys) is a replicated region of a regions layout: each moves layer by layer for
the layers that keep it, from the request's random source rank, counted like MLA's latent. Decode's
received bytes are exactly those regions' pages, and its greedy tokens are transformers' for prompts
from one token to many windows and compression blocks long, through pdserve's router and the
PyPI sglang-router. Decode's own
prefix hit (turn 2) asks prefill only for the pages it lacks. One deployment per backend.
"""

from __future__ import annotations

import importlib.util

import pytest
from pd_model_checks import PAGE, Deployment, check_router_tokens, check_sglang_router, check_turn_two

from fixtures.tiny_models import fill_hash_table, make_hf_model_and_dir
from pdserve.transfer import BACKEND_NAMES

pytestmark = pytest.mark.skipif(not pytest.importorskip("mooncake"), reason="needs mooncake")

ARCH = "DeepseekV4ForCausalLM"
WINDOW, CSA_RATE, HCA_RATE = 8, 4, 8
BACKENDS = ["mooncake"] + (["nixl"] if "nixl" in BACKEND_NAMES else [])
# one token (decode prefills it), inside a window, past it, and over many windows and blocks
LENGTHS = (1, WINDOW - 3, 3 * WINDOW + 1, 6 * WINDOW + 5, 12 * WINDOW)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf, path = make_hf_model_and_dir(ARCH, tmp_path_factory.mktemp("v4-pd"))
    fill_hash_table(hf)
    hf.save_pretrained(path, safe_serialization=True)  # again, with the hash table
    c = hf.config
    assert c.sliding_window == WINDOW and c.compress_rates == {"compressed_sparse_attention": CSA_RATE,
                                                               "heavily_compressed_attention": HCA_RATE}
    return hf, path


@pytest.fixture(scope="module", params=BACKENDS)
def pd(request, tiny):
    dep = Deployment(tiny[1], request.param)
    try:
        yield dep.start()
    finally:
        dep.stop()


def _page_bytes(hf) -> int:
    """One page of every region on the layers keeping it (float32): every token's K=V row; a CSA
    layer's sources (kv and gate of two series) and index sources per token, its entries and index
    keys one per CSA_RATE tokens of the page (at least one); an HCA layer's sources (kv and gate) per
    token and its entries one per HCA_RATE tokens (at least one)."""
    c = hf.config
    D, Di = c.head_dim, c.index_head_dim
    csa, hca = -(-PAGE // CSA_RATE), -(-PAGE // HCA_RATE)
    per_kind = {"sliding_attention": PAGE * D,
                "compressed_sparse_attention": PAGE * (D + 4 * D + 4 * Di) + csa * (D + Di),
                "heavily_compressed_attention": PAGE * (D + 2 * D) + hca * D}
    return sum(per_kind[k] for k in c.layer_types) * 4


def test_greedy_tokens_match_transformers_through_the_router(pd, tiny):
    """Every page moved every region its layers keep, nothing more."""
    hf, _ = tiny
    check_router_tokens(pd, hf, LENGTHS, _page_bytes(hf))


def test_turn_two_asks_prefill_only_for_the_pages_decode_lacks(pd, tiny):
    """Compressed entries or window rows missing from the pages decode already held would change
    turn 2's tokens."""
    hf, _ = tiny
    check_turn_two(pd, hf, 5 * WINDOW + 2, 3 * WINDOW, _page_bytes(hf))


@pytest.mark.skipif(importlib.util.find_spec("sglang_router") is None, reason="sglang-router is not installed")
def test_the_same_through_sglang_router(pd, tiny):
    check_sglang_router(pd, tiny[0], (3 * WINDOW + 1, 6 * WINDOW + 5))
