"""Speculative decoding across P/D (docs/disaggregation.md, "Speculative decoding across P/D"):
prefill computes the MTP layer's KV for the prompt and sends it as one more pool layer; decode
drafts from its first step. Greedy output equals colocated plain decoding; a side without the
same algorithm is refused naming the field."""

from __future__ import annotations

import pytest
import torch
from pd_pair import PDPair, greedy

import pdserve

NEW = 10
SPEC = {"speculative_algorithm": "NEXTN", "speculative_num_steps": 2}


def _prompts(lengths, seed=0, vocab=1500):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture
def pairs():
    made = []

    def make(model="tiny-deepseek", **flags) -> PDPair:
        made.append(PDPair(model, backend="memory", page_size=4, **flags))
        return made[-1]

    yield make
    for p in made:
        p.close()


@pytest.fixture(scope="module")
def eagle_dir():
    """tiny-llama's EAGLE draft preset (one Llama layer, config only: seeded dummy weights)."""
    return "tiny-llama-eagle"


@pytest.mark.parametrize("alg", ["NEXTN", "EAGLE"])
def test_1p1d_greedy_equals_colocated_plain_decoding(pairs, alg, eagle_dir):
    """MLA (NEXTN on tiny-deepseek) and GQA (EAGLE on tiny-llama with a draft checkpoint)."""
    model = "tiny-deepseek" if alg == "NEXTN" else "tiny-llama"
    spec = SPEC if alg == "NEXTN" else {**SPEC, "speculative_algorithm": "EAGLE",
                                        "speculative_draft_model_path": eagle_dir}
    prompts = _prompts([9, 14, 23])
    eng = pdserve.Engine(model_path=model, num_threads=1, page_size=4)
    ref = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params={
        "max_new_tokens": NEW, "temperature": 0, "ignore_eos": True})]
    pair = pairs(model, **spec, chunked_prefill_size=8)
    for i, p in enumerate(prompts):
        pair.submit(f"r{i}", p, greedy(NEW))
    pair.run()
    assert [pair.outputs[f"r{i}"]["ids"] for i in range(len(prompts))] == ref
    d = pair.decode.stats()
    # every request's KV (the MTP layer's included: its writes are counted) landed from prefill
    assert d["kv_received"] == len(prompts) and d["fallbacks"] == 0 and d["transfer_failures"] == 0, d
    assert d["spec_verify_ct"] > 0
    final = pair.outputs["r0"]["final"]
    assert final.spec_verify_ct >= 1 and final.spec_draft_token_num >= 1
    # decode's first token came from a one-row verify: every token was emitted by a verify, so
    # with nothing accepted (random drafts) the accept length is exactly 1
    meta = final.spec_meta()
    assert final.spec_verify_ct + final.spec_accept_token_num == NEW
    assert meta["spec_accept_length"] == pytest.approx(NEW / final.spec_verify_ct)
    pair.assert_idle_and_accounted()


def _mtp_rows(sched, req, n):
    """The MTP (draft) layer's latent rows of ``req``'s positions 0..n-1 in ``sched``'s pool."""
    pool = sched.runner.pool
    slots = sched.kv_manager.slots(req, 0, n)
    return pool.latent[pool.num_layers - 1].view(pool.num_slots, -1)[slots].clone()


def test_v32_mtp_layers_index_keys_move_and_decode_drafts_sparsely(pairs):
    """DeepSeek-V3.2 (its FP8 preset carries the MTP layer, a V3.2 layer with its own indexer): the
    draft layer's latent and index keys are one more layer of both regions, so 1P1D NEXTN gives
    colocated plain decoding's tokens for prompts shorter and longer than index_topk (32)."""
    model = "tiny-deepseek-v32-fp8"
    prompts = _prompts([9, 40, 75], seed=5)
    eng = pdserve.Engine(model_path=model, num_threads=1, page_size=4)
    ref = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params={
        "max_new_tokens": NEW, "temperature": 0, "ignore_eos": True})]
    got: dict[str, torch.Tensor] = {}
    pair = pairs(model, **SPEC, chunked_prefill_size=16)
    prefill, decode = pair.prefill, pair.decode
    after_prefill, activate = prefill.mode.after_prefill, decode.activate

    def index_rows(sched, req, n):
        pool = sched.runner.pool
        return pool.index_k[pool.num_layers - 1].view(pool.num_slots, -1)[sched.kv_manager.slots(req, 0, n)].clone()

    def prefill_done(reqs, done):
        for i in done:
            got.setdefault("prefill", index_rows(prefill, reqs[i], len(prompts[0]) - 1))
        return after_prefill(reqs, done)

    def landed(req):
        got.setdefault("decode", index_rows(decode, req, len(prompts[0]) - 1))
        activate(req)

    prefill.mode.after_prefill, decode.activate = prefill_done, landed
    pair.submit("r0", prompts[0], greedy(NEW))
    pair.run()
    for i, p in enumerate(prompts[1:], start=1):
        pair.submit(f"r{i}", p, greedy(NEW))
    pair.run()
    assert [pair.outputs[f"r{i}"]["ids"] for i in range(len(prompts))] == ref
    assert got["prefill"].abs().sum() > 0 and torch.equal(got["decode"], got["prefill"])  # the draft's index keys
    d = pair.decode.stats()
    assert d["kv_received"] == len(prompts) and d["fallbacks"] == 0 and d["spec_verify_ct"] > 0, d
    pair.assert_idle_and_accounted()


def test_the_mtp_layers_prompt_kv_lands_on_decode(pairs):
    """What decode holds in the MTP layer for the prompt (before its first step) is what prefill
    computed there: sent, not recomputed, and not zeros."""
    (prompt,) = _prompts([13], seed=4)
    pair = pairs(**SPEC)
    got: dict[str, torch.Tensor] = {}
    prefill, decode = pair.prefill, pair.decode
    after_prefill, activate = prefill.mode.after_prefill, decode.activate

    def prefill_done(reqs, done):
        for i in done:
            got["prefill"] = _mtp_rows(prefill, reqs[i], len(prompt) - 1)
        return after_prefill(reqs, done)

    def landed(req):
        got["decode"] = _mtp_rows(decode, req, len(prompt) - 1)
        activate(req)

    prefill.mode.after_prefill, decode.activate = prefill_done, landed
    pair.submit("a", prompt, greedy(2))
    pair.run()
    assert got["prefill"].abs().sum() > 0
    assert torch.equal(got["decode"], got["prefill"])


def test_a_decode_without_speculation_is_refused_naming_the_field(pairs):
    pair = pairs(prefill_flags=SPEC)
    (prompt,) = _prompts([12])
    pair.submit("a", prompt, greedy(NEW))
    pair.run(until=lambda: pair.outputs["a"]["final"] is not None)
    reason = pair.outputs["a"]["final"].finish_reason
    assert reason["type"] == "abort" and "speculative" in reason["message"], reason
