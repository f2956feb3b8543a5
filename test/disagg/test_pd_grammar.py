"""Constrained decoding across P/D, in process (a prefill and a decode scheduler over the in-memory
transfer backend): the grammar lives on decode alone (prefill compiles nothing), decode's first
token is sampled under it, outputs equal a colocated engine's under the same grammar (with NEXTN
speculation too); a request whose KV lands before its grammar compiled waits, holding its pages,
until it has; a grammar that fails on decode aborts that request alone, cleanly, and prefill's half with it.
A thinking part (``think_end``) and jump-forward work on decode alone and give colocated's outputs."""

from __future__ import annotations

import threading

import pytest
import torch
from pd_pair import PDPair

import pdserve
from constrained.grammar_fixtures import CONSTRAINTS, THINK_END, check_output, end_thinking_at
from pdserve.constrained.service import CompileService
from pdserve.engine.request import ReqState, SamplingParams

NEW = 96
KW = dict(page_size=4, constrained_json_disable_any_whitespace=True)


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1500, (n,), generator=g).tolist() for n in lengths]


def _sampling(kind: str, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=NEW, temperature=0.0, **{kind: CONSTRAINTS[kind]}, **kw).validate()


@pytest.fixture
def pairs():
    made = []

    def make(model="tiny-llama", **flags) -> PDPair:
        made.append(PDPair(model, backend="memory", **KW, **flags))
        return made[-1]

    yield make
    for p in made:
        p.close()


@pytest.mark.parametrize("spec", [{}, {"speculative_algorithm": "NEXTN", "speculative_num_steps": 2}],
                         ids=["plain", "nextn"])
def test_1p1d_equals_colocated_under_the_grammar_and_prefill_compiles_nothing(pairs, spec):
    model = "tiny-deepseek" if spec else "tiny-llama"
    prompts = _prompts([9, 14, 23])
    kinds = list(CONSTRAINTS)
    # speculative decoding never jumps forward: with NEXTN on decode the reference does not either
    eng = pdserve.Engine(model_path=model, num_threads=1, **KW, **({"grammar_jump_forward": False} if spec else {}))
    ref = eng.generate(input_ids=prompts, sampling_params=[{"max_new_tokens": NEW, "temperature": 0.0,
                                                            k: CONSTRAINTS[k]} for k in kinds])
    eng.shutdown()
    pair = pairs(model, **spec)
    for i, (p, kind) in enumerate(zip(prompts, kinds)):
        pair.submit(f"r{i}", p, _sampling(kind))
    pair.run()
    got = [pair.outputs[f"r{i}"]["ids"] for i in range(len(prompts))]
    assert got == [o["output_ids"] for o in ref]
    for o, kind in zip(ref, kinds):
        check_output(kind, o["text"])
    assert pair.decode.stats()["kv_received"] == len(prompts)
    assert pair.prefill.grammar.stats.to_dict()["requests"] == 0 and pair.prefill.grammar._service is None
    assert pair.decode.grammar.stats.to_dict()["requests"] == len(prompts)
    pair.assert_idle_and_accounted()


class GatedBackend:
    """The real backend, whose compiles wait for ``gate`` (or fail, for ``bad``)."""

    def __init__(self, inner, bad: str | None = None):
        self.inner, self.bad = inner, bad
        self.gate = threading.Event()

    def compile(self, kind, text):
        self.gate.wait(30)
        if text == self.bad:
            from pdserve.constrained import GrammarError
            raise GrammarError(kind, "refused by the test")
        return self.inner.compile(kind, text)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _gate(scheduler, bad: str | None = None) -> GatedBackend:
    grammars = scheduler.grammar
    gated = GatedBackend(grammars._make_backend(), bad)
    grammars._service = CompileService(lambda: gated, grammars.config, grammars.stats)
    return gated


def test_kv_before_the_grammar_waits_parked_holding_its_pages(pairs):
    pair = pairs()
    gated = _gate(pair.decode)
    prompt = _prompts([17], seed=3)[0]
    try:
        pair.submit("r0", prompt, _sampling("regex"))
        pair.run(until=lambda: bool(pair.decode.parked))  # the KV landed, the grammar has not compiled
        req = pair.decode.parked[0]
        assert req.state is ReqState.RUNNING and req.grammar is None and not req.output_ids
        assert pair.decode.pages_held_by_requests() == len(req.pages) > 0
        pair.decode.check_memory()
        for _ in range(5):  # it waits without sampling, and without stalling the loop
            pair.step()
        assert not pair.outputs["r0"]["ids"]
    finally:
        gated.gate.set()
    pair.run()
    final = pair.outputs["r0"]["final"]
    assert final.finish_reason["type"] == "stop"
    check_output("regex", pair.decode.tokenizer.decode(pair.outputs["r0"]["ids"], skip_special_tokens=True))
    pair.assert_idle_and_accounted()


def test_a_grammar_failing_on_decode_aborts_that_request_alone(pairs):
    pair = pairs()
    gated = _gate(pair.decode, bad=CONSTRAINTS["regex"])
    prompts = _prompts([12, 15], seed=5)
    pair.submit("bad", prompts[0], _sampling("regex"))
    pair.submit("ok", prompts[1], SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True).validate())
    gated.gate.set()
    pair.run()
    bad = pair.outputs["bad"]["final"]
    assert bad.finish_reason["type"] == "abort" and bad.finish_reason["status_code"] == 400
    assert bad.finish_reason["message"].startswith("sampling_params.regex: refused by the test")
    assert pair.outputs["bad"]["ids"] == [] and len(pair.outputs["ok"]["ids"]) == 8
    # decode gave up before its prefill's records arrived: prefill is told once they do, so its
    # half ends on decode's word, not after waiting for a KV half that never comes
    why = pair.prefill_finals["bad"].finish_reason
    assert why["type"] == "abort" and why["message"].startswith("decode gave up on the room: sampling_params.regex")
    assert pair.decode.mode.owed_aborts == []
    pair.assert_idle_and_accounted()


@pytest.mark.parametrize("jump_forward", [False, True], ids=["sampled", "jump-forward"])
def test_1p1d_thinks_then_constrains_on_decode_as_colocated(pairs, jump_forward):
    """The thinking part is free and the grammar holds after its end (the model writes it at token
    5, on purpose) on decode, with or without jump-forward (whose appended tokens decode prefills
    itself): the same ids as a colocated engine's."""
    prompts = _prompts([9, 14, 23], seed=7)
    kinds = list(CONSTRAINTS)
    eng = pdserve.Engine(model_path="tiny-llama", num_threads=1, grammar_jump_forward=jump_forward, **KW)
    end_thinking_at(eng.scheduler, 5)
    ref = eng.generate(input_ids=prompts, sampling_params=[{"max_new_tokens": NEW, "temperature": 0.0,
                                                            k: CONSTRAINTS[k], "think_end": THINK_END} for k in kinds])
    eng.shutdown()
    pair = pairs(grammar_jump_forward=jump_forward)
    end_thinking_at(pair.decode, 5)
    for i, (p, kind) in enumerate(zip(prompts, kinds)):
        pair.submit(f"r{i}", p, _sampling(kind, think_end=THINK_END))
    pair.run()
    assert [pair.outputs[f"r{i}"]["ids"] for i in range(len(prompts))] == [o["output_ids"] for o in ref]
    for o, kind in zip(ref, kinds):
        assert o["meta_info"]["finish_reason"]["type"] == "stop", o
        check_output(kind, o["text"].split(THINK_END, 1)[1])
    assert pair.prefill.grammar._service is None
    assert (pair.decode.grammar.jumped_tokens > 0) == jump_forward
    pair.assert_idle_and_accounted()
