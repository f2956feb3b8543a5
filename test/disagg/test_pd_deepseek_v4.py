"""DeepSeek-V4 (sliding, CSA and HCA layers) across P/D: 1 prefill + 1 decode as real processes, on each
transfer backend (Mooncake, NIXL), against transformers' ``DeepseekV4ForCausalLM`` on a tiny float32
checkpoint with a window of 8 and compression rates 4 (CSA) and 8 (HCA).

Both sides run the bounded layout (docs/kv-cache.md): the window's K=V rows and the compressors' open
windows live in a fixed-size per-request record, and only the compressed entries, CSA's index keys and
the reusable boundaries' tails are pages. Each page region moves layer by layer for the layers that keep
it, and after the last chunk each layer's record moves whole into the record slot decode named, all from
the request's random source rank and counted like MLA's latent. Decode's received bytes are exactly
those pages plus one record per room, whatever the prompt's length (its memory per request does not
grow with the context in the window), and its greedy tokens are transformers' for prompts from one token
to many windows and compression blocks long, through pdserve's router and the PyPI sglang-router.
Decode's own prefix hit (turn 2, at a reusable boundary) asks prefill only for the pages it lacks.
One deployment per backend. A record left out is short of decode's count (the room falls back); a
prefill keeping the window in pages is refused by the compatibility record.

With NEXTN on both sides (the checkpoint's MTP layer, ``mtp.0.*``) the draft layer keeps a window ring
in the record too and it moves like the target's, and the aux row carries all ``hc_mult`` streams of
the last prefilled position (what V4's MTP layer reads).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import shutil

import pytest
import torch
from pd_model_checks import NEW, PAGE, Deployment, check_router_tokens, check_sglang_router, check_turn_two, prompt
from pd_pair import PDPair, greedy

from fixtures.tiny_models import add_v4_mtp_layer, fill_hash_table, greedy_continuation, make_hf_model_and_dir
from pdserve.config import ServerArgs
from pdserve.transfer import BACKEND_NAMES

pytestmark = pytest.mark.skipif(not pytest.importorskip("mooncake"), reason="needs mooncake")

ARCH = "DeepseekV4ForCausalLM"
WINDOW, CSA_RATE, HCA_RATE = 8, 4, 8
REUSE = 16 * WINDOW  # the bounded layout's reusable boundaries (lcm of the page and the rates: 8 | 128)
NEXTN_STEPS = 2
NEXTN_ROLLBACK = NEXTN_STEPS + 1  # the draft tokens of a step: rows a rejected draft may have written
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


def _tail_rows(rows: int) -> int:
    """Rows a page keeps of a boundary tail of ``rows`` rows, spread over the REUSE tokens it closes."""
    return -(-rows * PAGE // REUSE)


def _page_bytes(hf, draft_layers: int = 0) -> int:
    """One page of every page region on the layers keeping it (float32), in the bounded layout: no
    per-token row; the window's tail (W - 1 rows) on every layer (the draft's too); a CSA layer's
    entries and index keys one per CSA_RATE tokens of the page (at least one) and the tails of its
    sources (its last closed window: CSA_RATE rows of kv and gate of two series, and of index sources);
    an HCA layer's entries one per HCA_RATE tokens (at least one)."""
    c = hf.config
    D, Di = c.head_dim, c.index_head_dim
    csa, hca, window, src = -(-PAGE // CSA_RATE), -(-PAGE // HCA_RATE), _tail_rows(WINDOW - 1), _tail_rows(CSA_RATE)
    per_kind = {"sliding_attention": window * D,
                "compressed_sparse_attention": window * D + csa * (D + Di) + src * (4 * D + 4 * Di),
                "heavily_compressed_attention": window * D + hca * D}
    return (sum(per_kind[k] for k in c.layer_types) + draft_layers * window * D) * 4


def _record_bytes(hf, rollback: int = 0, draft_layers: int = 0) -> int:
    """One request's record (float32): rings of the window's last W - 1 rows on every layer (the
    draft's too), of CSA's previous and open windows (2 CSA_RATE - 1 rows of sources and of index
    sources) and of HCA's open window (HCA_RATE - 1 rows of kv and gate), each ``rollback`` rows longer."""
    c = hf.config
    D, Di = c.head_dim, c.index_head_dim
    window = (WINDOW - 1 + rollback) * D
    per_kind = {"sliding_attention": window,
                "compressed_sparse_attention": window + (2 * CSA_RATE - 1 + rollback) * (4 * D + 4 * Di),
                "heavily_compressed_attention": window + (HCA_RATE - 1 + rollback) * 2 * D}
    return (sum(per_kind[k] for k in c.layer_types) + draft_layers * window) * 4


def test_greedy_tokens_match_transformers_through_the_router(pd, tiny):
    """Every page moved every page region its layers keep and every room one record, nothing more: a
    prompt of 12 windows costs decode no more window memory than one of 2."""
    hf, _ = tiny
    check_router_tokens(pd, hf, LENGTHS, _page_bytes(hf), _record_bytes(hf))


def test_turn_two_asks_prefill_only_for_the_pages_decode_lacks(pd, tiny):
    """Decode's hit is shortened to the reusable boundary; compressed entries or tails missing from the
    pages decode already held, or a record not moved whole, would change turn 2's tokens."""
    hf, _ = tiny
    check_turn_two(pd, hf, REUSE + 2, 3 * WINDOW, _page_bytes(hf), _record_bytes(hf), reuse=REUSE)


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


def _record(sched, req) -> dict[str, torch.Tensor]:
    """Every record buffer's slot of ``req`` (its table row), every layer keeping it."""
    return {name: buf[:, req.row].clone() for name, buf in sched.runner.pool.record_buffers()}


def test_nextn_1p1d_matches_transformers_and_moves_the_draft_layer(with_mtp):
    """Both sides keep the bounded layout. Prefill runs the MTP layer over the prompt; the record
    (every layer's rings, the MTP layer's window ring included) lands on decode as prefill wrote it (not
    zeros, not recomputed), every page moves the target's page regions plus the draft layer's window
    tail, the aux row carries the last prefilled position's hc_mult streams whole, and decode drafts
    from its first step with transformers' greedy tokens."""
    hf, path = with_mtp
    c = hf.config
    prompts = [prompt(n, seed=n) for n in LENGTHS]
    pair = PDPair(path, backend="mooncake", page_size=PAGE, chunked_prefill_size=16, max_total_tokens=4096,
                  speculative_algorithm="NEXTN", speculative_num_steps=NEXTN_STEPS)
    try:
        prefill, decode = pair.prefill, pair.decode
        for side in (prefill, decode):  # no per-token window or source rows in the pages
            pool = side.runner.pool
            assert pool.records and not {"window_kv", "csa_src", "hca_src"} & set(pool.buffers)
        after_prefill, activate = prefill.mode.after_prefill, decode.activate
        finish, land = prefill.mode.sender.finish, decode.mode._land
        longest, got, aux = f"r{len(prompts) - 1}", {}, {}

        def prefill_done(reqs, done):
            for i in done:
                if reqs[i].rid == longest:
                    got["prefill"] = _record(prefill, reqs[i])
            return after_prefill(reqs, done)

        def landed(req):
            if req.rid == longest:
                got["decode"] = _record(decode, req)
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
        assert got["decode"].keys() == got["prefill"].keys()
        for name, rows in got["prefill"].items():
            assert rows.abs().sum() > 0 and torch.equal(got["decode"][name], rows), name
        draft = decode.runner.pool.rows["window_kv"][decode.runner.pool.num_layers - 1]
        assert got["prefill"]["window_kv"][draft].abs().sum() > 0  # the MTP layer's ring moved too
        moved = sum(n > 1 for n in LENGTHS)
        assert len(aux) == moved
        for row in aux.values():
            assert row["sent"].shape == (c.hc_mult * c.hidden_size,) and torch.equal(row["sent"], row["landed"])
        d = decode.stats()
        assert d["kv_received"] == moved and d["fallbacks"] == 0 and d["transfer_failures"] == 0, d
        assert d["spec_verify_ct"] > 0
        requested = sum(-(-(n - 1) // PAGE) for n in LENGTHS)
        assert d["kv_pages_requested"] == requested
        assert d["kv_bytes_received"] == requested * _page_bytes(hf, draft_layers=1) + moved * _record_bytes(
            hf, NEXTN_ROLLBACK, draft_layers=1)
        pair.assert_idle_and_accounted()
    finally:
        pair.close()


@pytest.fixture(scope="module")
def pd_nextn(with_mtp):
    dep = Deployment(with_mtp[1], "mooncake", "--speculative-algorithm", "NEXTN", "--speculative-num-steps",
                     str(NEXTN_STEPS))
    try:
        yield dep.start()
    finally:
        dep.stop()


def test_nextn_through_the_routers_as_real_servers(pd_nextn, with_mtp):
    """NEXTN prefill and decode servers behind pdserve's router, then sglang-router: transformers'
    tokens, and every page moved the target's regions plus the MTP layer's window row; decode's own
    prefix hit (turn 2, the MTP layer's rows of its cached pages included) asks only for what it lacks."""
    hf, _ = with_mtp
    page_bytes, record_bytes = _page_bytes(hf, draft_layers=1), _record_bytes(hf, NEXTN_ROLLBACK, draft_layers=1)
    check_router_tokens(pd_nextn, hf, LENGTHS, page_bytes, record_bytes)
    check_turn_two(pd_nextn, hf, REUSE + 2, 3 * WINDOW, page_bytes, record_bytes, reuse=REUSE)
    assert pd_nextn.decode.info()["spec_verify_ct"] > 0
    if importlib.util.find_spec("sglang_router") is not None:
        check_sglang_router(pd_nextn, hf, (3 * WINDOW + 1, 6 * WINDOW + 5))


# ------------------------------------------------------------------ the record's counted writes
def test_a_record_left_out_is_short_of_decodes_count_and_falls_back(tiny, monkeypatch):
    """Prefill sends every page but no record write: its completion reports fewer page-writes than
    decode expects, so the room falls back to a local prefill (transformers' tokens all the same), and
    the room's pages and table row (whose record prefill wrote) leave quarantine once prefill settled."""
    hf, path = tiny
    monkeypatch.setattr("pdserve.disagg.sender.plan_record_writes", lambda *a, **k: [])
    pair = PDPair(path, backend="mooncake", page_size=PAGE, chunked_prefill_size=16, max_total_tokens=4096)
    try:
        p = prompt(3 * WINDOW + 1, seed=3)
        pair.submit("a", p, greedy(NEW))
        pair.run()
        assert pair.outputs["a"]["ids"] == greedy_continuation(hf, p, NEW)
        d = pair.decode.stats()
        assert d["kv_received"] == 0 and d["transfer_failures"] == 1 and d["fallbacks"] == 1, d
        assert d["quarantine_entries"] == 0
        pair.assert_idle_and_accounted()
    finally:
        pair.close()


def test_a_prefill_keeping_the_window_in_pages_is_refused(tiny, monkeypatch):
    """A prefill whose pool keeps V4's window in pages (a pool built without records, as a server of
    another layout would run it) against a decode that keeps it in records: decode refuses the peer
    at the handshake, naming the compatibility record's field."""
    hf, path = tiny
    built = ServerArgs.cache_config

    def page_layout_prefill(args):
        cfg = built(args)
        return dataclasses.replace(cfg, state_records=0) if args.disaggregation_mode == "prefill" else cfg

    monkeypatch.setattr(ServerArgs, "cache_config", page_layout_prefill)
    pair = PDPair(path, backend="mooncake", page_size=PAGE, chunked_prefill_size=16, max_total_tokens=4096)
    monkeypatch.undo()
    try:
        assert not pair.prefill.runner.pool.records and pair.decode.runner.pool.records
        pair.submit("a", prompt(3 * WINDOW + 1, seed=3), greedy(NEW))
        pair.run(until=lambda: pair.outputs["a"]["final"] is not None)
        reason = pair.outputs["a"]["final"].finish_reason
        assert reason["type"] == "abort" and "state_records: decode has window_kv[" in reason["message"], reason
        assert "prefill" in reason["message"] and "has none" in reason["message"], reason
    finally:
        pair.close()
