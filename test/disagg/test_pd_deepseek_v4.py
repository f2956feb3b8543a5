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

With NEXTN on both sides (the checkpoint's MTP layer, ``mtp.0.*``) the draft layer's window rows are
one more layer of ``window_kv`` and move like the target's, and the aux row carries all ``hc_mult``
streams of the last prefilled position (what V4's MTP layer reads).
"""

from __future__ import annotations

import importlib.util
import shutil

import pytest
import torch
from pd_model_checks import NEW, PAGE, Deployment, check_router_tokens, check_sglang_router, check_turn_two, prompt
from pd_pair import PDPair, greedy

from fixtures.tiny_models import add_v4_mtp_layer, fill_hash_table, greedy_continuation, make_hf_model_and_dir
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


# ------------------------------------------------------------------ NEXTN (the MTP layer across P/D)
@pytest.fixture(scope="module")
def with_mtp(tiny, tmp_path_factory):
    hf, path = tiny
    d = tmp_path_factory.mktemp("v4-pd-mtp") / "ckpt"
    shutil.copytree(path, d)
    add_v4_mtp_layer(d)
    return hf, str(d)


def _draft_rows(sched, req, n: int) -> torch.Tensor:
    """The MTP layer's window rows (the pool's extra layer) of ``req``'s positions 0..n-1."""
    pool = sched.runner.pool
    return pool.get_rows("window_kv", pool.num_layers - 1, torch.tensor(sched.kv_manager.slots(req, 0, n))).clone()


def test_nextn_1p1d_matches_transformers_and_moves_the_draft_layer(with_mtp):
    """Prefill runs the MTP layer over the prompt; its window rows land on decode as prefill wrote
    them (not zeros, not recomputed), every page moves the target's regions plus the draft layer's
    window row, the aux row carries the last prefilled position's hc_mult streams whole, and decode
    drafts from its first step with transformers' greedy tokens."""
    hf, path = with_mtp
    c = hf.config
    prompts = [prompt(n, seed=n) for n in LENGTHS]
    pair = PDPair(path, backend="mooncake", page_size=PAGE, chunked_prefill_size=16, max_total_tokens=4096,
                  speculative_algorithm="NEXTN", speculative_num_steps=2)
    try:
        prefill, decode = pair.prefill, pair.decode
        after_prefill, activate = prefill.mode.after_prefill, decode.activate
        finish, land = prefill.mode.sender.finish, decode.mode._land
        longest, got, aux = f"r{len(prompts) - 1}", {}, {}
        n_longest = len(prompts[-1]) - 1

        def prefill_done(reqs, done):
            for i in done:
                if reqs[i].rid == longest:
                    got["prefill"] = _draft_rows(prefill, reqs[i], n_longest)
            return after_prefill(reqs, done)

        def landed(req):
            if req.rid == longest:
                got["decode"] = _draft_rows(decode, req, n_longest)
            activate(req)

        def sent(room, hidden):
            aux.setdefault(room, {})["sent"] = hidden.float().clone()
            finish(room, hidden)

        def arrived(room, now):
            w = decode.mode.rooms[room]
            aux.setdefault(room, {})["landed"] = decode.mode.aux[w.aux_slot].clone()
            land(room, now)

        prefill.mode.after_prefill, decode.activate = prefill_done, landed
        prefill.mode.sender.finish, decode.mode._land = sent, arrived
        for i, p in enumerate(prompts):
            pair.submit(f"r{i}", p, greedy(NEW))
        pair.run()
        assert [pair.outputs[f"r{i}"]["ids"] for i in range(len(prompts))] == \
            [greedy_continuation(hf, p, NEW) for p in prompts]
        assert got["prefill"].abs().sum() > 0 and torch.equal(got["decode"], got["prefill"])
        moved = sum(n > 1 for n in LENGTHS)
        assert len(aux) == moved
        for row in aux.values():
            assert row["sent"].shape == (c.hc_mult * c.hidden_size,) and torch.equal(row["sent"], row["landed"])
        d = decode.stats()
        assert d["kv_received"] == moved and d["fallbacks"] == 0 and d["transfer_failures"] == 0, d
        assert d["spec_verify_ct"] > 0
        requested = sum(-(-(n - 1) // PAGE) for n in LENGTHS)
        assert d["kv_pages_requested"] == requested
        draft_page = PAGE * c.head_dim * 4  # the MTP layer's window_kv rows of one page (float32)
        assert d["kv_bytes_received"] == requested * (_page_bytes(hf) + draft_page)
        pair.assert_idle_and_accounted()
    finally:
        pair.close()


@pytest.fixture(scope="module")
def pd_nextn(with_mtp):
    dep = Deployment(with_mtp[1], "mooncake", "--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2")
    try:
        yield dep.start()
    finally:
        dep.stop()


def test_nextn_through_the_routers_as_real_servers(pd_nextn, with_mtp):
    """NEXTN prefill and decode servers behind pdserve's router, then sglang-router: transformers'
    tokens, and every page moved the target's regions plus the MTP layer's window row; decode's own
    prefix hit (turn 2, the MTP layer's rows of its cached pages included) asks only for what it lacks."""
    hf, _ = with_mtp
    page_bytes = _page_bytes(hf) + PAGE * hf.config.head_dim * 4
    check_router_tokens(pd_nextn, hf, LENGTHS, page_bytes)
    check_turn_two(pd_nextn, hf, 5 * WINDOW + 2, 3 * WINDOW, page_bytes)
    assert pd_nextn.decode.info()["spec_verify_ct"] > 0
    if importlib.util.find_spec("sglang_router") is not None:
        check_sglang_router(pd_nextn, hf, (3 * WINDOW + 1, 6 * WINDOW + 5))
