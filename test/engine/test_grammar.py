"""Constrained decoding in the engine (engine/grammar.py) on a random-weight tiny-llama, where
only the grammar can make an output valid: json_schema outputs validate with jsonschema, regex
outputs fullmatch, EBNF outputs parse, for each backend; requests without a grammar in the same
batch decode exactly as alone; every sampling mode stays inside the grammar and logprobs are
those of the masked distribution (as SGLang reports them); a constraint that fails or times out
in the scheduler fails its own request alone (status 400 in its finish reason) while the batch
goes on; retraction and the hierarchical cache keep grammar outputs unchanged. A request with a
thinking part (``think_end``) is free until its marker, then constrained; jump-forward appends the
text a grammar forces without sampling it, and changes nothing for the requests it does not serve."""

from __future__ import annotations

import json
import math
import threading

import pytest
import torch

import pdserve
from constrained.grammar_fixtures import CONSTRAINTS, INSTALLED, THINK_END, check_output, end_thinking_at
from constrained.grammar_fixtures import tokenizer as load_tokenizer
from pdserve.config import GrammarConfig
from pdserve.constrained import bitmask as bm
from pdserve.constrained.service import CompileService
from pdserve.engine.grammar import ReqGrammars, ThinkingGrammar

PROMPTS = ["Give me a record:", "Once upon a time", "1, 2, 3,", "The answer is"]
GREEDY = {"max_new_tokens": 96, "temperature": 0.0}
# outlines-core has no EBNF (refused naming the field: test/constrained/test_backends.py)
CASES = [(b, k) for b in INSTALLED for k in CONSTRAINTS if not (b == "outlines" and k == "ebnf")]


@pytest.fixture(scope="module")
def engines():
    """One tiny-llama engine per grammar backend, made when first asked for."""
    made: dict[str, pdserve.Engine] = {}

    def get(backend: str = "xgrammar", **kw) -> pdserve.Engine:
        key = backend + json.dumps(kw, sort_keys=True)
        if key not in made:
            made[key] = pdserve.Engine(model_path="tiny-llama", grammar_backend=backend,
                                       constrained_json_disable_any_whitespace=True, **kw)
        return made[key]

    yield get
    for e in made.values():
        e.shutdown()


def _sp(kind: str, **kw) -> dict:
    return {**GREEDY, kind: CONSTRAINTS[kind], **kw}


def _no_leak(engine: pdserve.Engine) -> None:
    s = engine.scheduler
    s.check_memory()
    assert not s.has_work() and s.grammar.live == 0 and not s.grammar.pending


@pytest.mark.parametrize("backend, kind", CASES)
def test_each_constraint_holds_for_each_backend(engines, backend, kind):
    engine = engines(backend)
    out = engine.generate(prompt=PROMPTS[:2], sampling_params=_sp(kind))
    for o in out:
        assert o["meta_info"]["finish_reason"]["type"] == "stop", o
        check_output(kind, o["text"], backend)
    _no_leak(engine)


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_without_the_grammar_the_same_requests_are_not_valid(engines, kind):
    """The checks above can fail: the model alone writes nothing of the kind."""
    out = engines().generate(prompt=PROMPTS[:2], sampling_params={**GREEDY, "max_new_tokens": 24})
    for o in out:
        with pytest.raises(Exception):  # noqa: B017 - json, jsonschema or the fullmatch assertion
            check_output(kind, o["text"])


@pytest.mark.parametrize("overlap", [False, True], ids=["inline", "mask-thread"])
def test_a_batch_mixes_grammar_and_plain_requests(engines, overlap):
    """Plain requests decode exactly as alone (greedy), grammar requests as alone too, and the
    second and later grammar rows of the batch are masked as well as the first; with the masks
    filled after the forward (CPU's default) and on the mask thread during it (a GPU's)."""
    engine = engines()
    plain = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    sps = [_sp("json_schema"), plain, _sp("regex"), plain, _sp("ebnf"), _sp("json_schema")]
    prompts = PROMPTS + PROMPTS[:2]
    engine.scheduler.grammar.overlap = overlap
    try:
        together = engine.generate(prompt=prompts, sampling_params=sps)
        alone = [engine.generate(prompt=p, sampling_params=sp) for p, sp in zip(prompts, sps)]
    finally:
        engine.scheduler.grammar.overlap = False
    assert [o["output_ids"] for o in together] == [o["output_ids"] for o in alone]
    for o, sp in zip(together, sps):
        kind = next((k for k in CONSTRAINTS if k in sp), None)
        if kind is not None:
            check_output(kind, o["text"])
    _no_leak(engine)


SAMPLING_MODES = [
    {"temperature": 0.0},
    {"temperature": 0.9, "seed": 3},
    {"temperature": 1.3, "top_k": 5, "seed": 4},
    {"temperature": 1.0, "top_p": 0.5, "seed": 5},
    {"temperature": 1.0, "min_p": 0.2, "seed": 6},
    {"temperature": 0.0, "frequency_penalty": 1.5, "presence_penalty": 1.0},
    {"temperature": 0.8, "frequency_penalty": -1.0, "seed": 7},
    {"temperature": 1.0},  # unseeded
]


@pytest.mark.parametrize("mode", SAMPLING_MODES, ids=lambda m: "-".join(f"{k}={v}" for k, v in m.items()))
def test_every_sampling_mode_stays_inside_the_grammar(engines, mode):
    engine = engines()
    sps = [{**_sp(kind), **mode} for kind in CONSTRAINTS]
    out = engine.generate(prompt=PROMPTS[:3], sampling_params=sps)
    for o, kind in zip(out, CONSTRAINTS):
        check_output(kind, o["text"])
    _no_leak(engine)


def test_logprobs_are_those_of_the_masked_distribution(engines):
    """SGLang reports logprobs after the grammar's mask: each step's top alternatives are tokens
    the grammar allows, normalised over them, and a forced token (the EBNF's opening "(") has
    probability one."""
    engine = engines()
    out = engine.generate(prompt=PROMPTS[0], sampling_params=_sp("ebnf"), return_logprob=True, top_logprobs_num=4)
    meta = out["meta_info"]
    toks = [t for _, t, _ in meta["output_token_logprobs"]]
    assert toks == out["output_ids"]
    first_lp = meta["output_token_logprobs"][0][0]
    assert engine.tokenizer.decode([toks[0]]) == "(" and first_lp == pytest.approx(0.0, abs=1e-5)
    for (lp, tok, _), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"]):
        finite = [t for t in top if t[0] is not None and math.isfinite(t[0])]
        assert finite[0][1] == tok and finite[0][0] == pytest.approx(lp)  # greedy: the best allowed token
        assert sum(math.exp(t[0]) for t in finite) <= 1 + 1e-5
    plain = engine.generate(prompt=PROMPTS[0], sampling_params={**GREEDY, "max_new_tokens": 1},
                            return_logprob=True)
    assert plain["meta_info"]["output_token_logprobs"][0][0] < -1e-3  # unmasked: "(" is not certain


def test_a_constraint_that_fails_in_the_scheduler_fails_alone(engines):
    engine = engines()
    sps = [{**GREEDY, "regex": "(unclosed"}, {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True},
           _sp("regex")]
    out = engine.generate(prompt=PROMPTS[:3], sampling_params=sps)
    reason = out[0]["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["status_code"] == 400
    assert reason["message"].startswith("sampling_params.regex: does not compile") and out[0]["output_ids"] == []
    assert out[1]["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    check_output("regex", out[2]["text"])
    _no_leak(engine)


class SlowBackend:
    """A real backend whose compile of one text waits on ``gate`` (a grammar that compiles slowly)."""

    def __init__(self, inner, slow_text: str):
        self.inner, self.slow_text = inner, slow_text
        self.gate = threading.Event()

    def compile(self, kind, text):
        if text == self.slow_text:
            self.gate.wait(30)
        return self.inner.compile(kind, text)

    def __getattr__(self, name):  # matcher, the batched calls: the real backend's
        return getattr(self.inner, name)


def test_a_compile_timeout_fails_that_request_and_the_batch_goes_on(engines):
    engine = engines(grammar_compile_timeout=0.5)
    grammars = engine.scheduler.grammar
    slow_regex = "[0-9]{3}"
    slow = SlowBackend(grammars._make_backend(), slow_regex)
    grammars._service = CompileService(lambda: slow, grammars.config, grammars.stats)
    plain = {"max_new_tokens": 40, "temperature": 0.0, "ignore_eos": True}
    try:
        out = engine.generate(prompt=PROMPTS[:3], sampling_params=[{**GREEDY, "regex": slow_regex}, plain,
                                                                   _sp("json_schema")])
    finally:
        slow.gate.set()
    reason = out[0]["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["status_code"] == 400
    assert reason["message"].startswith("sampling_params.regex: compiling the grammar took longer than 0.5 s")
    assert out[1]["meta_info"]["finish_reason"] == {"type": "length", "length": 40}
    check_output("json_schema", out[2]["text"])
    assert grammars.stats.to_dict()["timeouts"] == 1
    # the slow compile finished later: the same regex now compiles from the cache and constrains
    again = engine.generate(prompt=PROMPTS[0], sampling_params={**GREEDY, "regex": slow_regex})
    assert again["meta_info"]["finish_reason"]["type"] == "stop" and len(again["text"]) == 3
    _no_leak(engine)


def test_retraction_keeps_the_grammar_and_its_output(engines):
    """Requests retracted under a tiny KV budget resume with their grammar where it was."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 400, (12 + i,), generator=g).tolist() for i in range(8)]
    sps = [_sp("json_schema", max_new_tokens=32)] * 6 + [_sp("ebnf", max_new_tokens=32)] * 2
    # jump-forward off: its forced text ends the documents in fewer steps, and this budget then never retracts
    want = engines(page_size=4, grammar_jump_forward=False).generate(input_ids=prompts, sampling_params=sps)
    tight = engines(page_size=4, max_total_tokens=128, grammar_jump_forward=False)
    got = tight.generate(input_ids=prompts, sampling_params=sps)
    assert tight.scheduler.num_retractions > 0
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    for o in got[6:]:
        check_output("ebnf", o["text"])
    _no_leak(tight)


def test_the_hierarchical_cache_leaves_grammar_outputs_unchanged(engines):
    """Prompts whose pages cycle through host memory (hits loaded back) decode the same."""
    kw = dict(page_size=4, max_total_tokens=64, max_running_requests=2, chunked_prefill_size=64)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (28,), generator=g).tolist() for _ in range(3)]
    sps = [_sp(kind, max_new_tokens=24) for kind in CONSTRAINTS]
    want = engines(**kw).generate(input_ids=prompts, sampling_params=sps)
    hi = engines(enable_hierarchical_cache=True, **kw)
    for _ in range(2):  # the second round hits pages that went to host memory
        got = hi.generate(input_ids=prompts, sampling_params=sps)
        assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    assert hi.scheduler.stats()["cache_hit_tokens_host"] > 0
    _no_leak(hi)


def test_grammar_backend_none_refuses_a_constraint_naming_the_field(engines):
    engine = engines("none")
    with pytest.raises(ValueError, match="^sampling_params.regex: this server runs --grammar-backend none"):
        engine.generate(prompt=PROMPTS[0], sampling_params={"regex": "[a-z]+"})
    assert engine.generate(prompt=PROMPTS[0], sampling_params={"max_new_tokens": 2})["output_ids"]
    _no_leak(engine)


@pytest.mark.parametrize("jump_forward", [False, True], ids=["sampled", "jump-forward"])
def test_a_thinking_part_is_free_then_the_grammar_holds(engines, jump_forward):
    """think_end: the tokens up to the marker are the unconstrained run's own (greedy: the same ids),
    the marker ends the thinking part (the model here writes it at token 6, on purpose), and what
    follows satisfies the grammar; a request that never writes it stays free to the end."""
    engine = engines(grammar_jump_forward=jump_forward)
    k = 6
    free = engine.generate(prompt=PROMPTS[:3], sampling_params={**GREEDY, "max_new_tokens": 24})
    end_thinking_at(engine.scheduler, k)
    try:
        out = engine.generate(prompt=PROMPTS[:3], sampling_params=[_sp(kind, think_end=THINK_END)
                                                                  for kind in CONSTRAINTS])
        unended = engine.generate(prompt=PROMPTS[0], sampling_params={
            **_sp("json_schema", think_end="<never written>"), "max_new_tokens": 24})
    finally:
        del engine.scheduler._sample_and_append  # the class's own again
    for o, f, kind in zip(out, free, CONSTRAINTS):
        assert o["output_ids"][:k] == f["output_ids"][:k]
        thinking, answer = o["text"].split(THINK_END, 1)
        assert thinking == engine.tokenizer.decode(f["output_ids"][:k])
        assert o["meta_info"]["finish_reason"]["type"] == "stop", o
        check_output(kind, answer)
    assert unended["output_ids"] == free[0]["output_ids"]
    _no_leak(engine)


def test_a_thinking_grammar_rolls_back_across_its_end():
    """Speculative walks roll a grammar back over tokens that ended its thinking part: it thinks
    again, unmasked, and the grammar is where it was."""
    tok = load_tokenizer()
    grammars = ReqGrammars(GrammarConfig(), tok, 2048, [1])
    backend = grammars.service.backend()
    g = ThinkingGrammar(backend.matcher(backend.compile("regex", "(cat|dog)")), THINK_END, tok.decode)
    thought = tok.encode("hmm" + THINK_END, add_special_tokens=False)
    mask = bm.allocate(1, 2048)
    assert g.accept_tokens(thought) == len(thought) and not g.thinking
    g.fill_bitmask(mask, 0)
    allowed = {t for t in range(2000) if mask[0, t // 32] >> (t % 32) & 1}
    assert allowed and all(tok.decode([t]) and ("cat".startswith(tok.decode([t])) or "dog".startswith(tok.decode([t])))
                           for t in allowed)
    cat = tok.encode("cat", add_special_tokens=False)
    assert g.accept_tokens(cat) == len(cat) and g.jump_forward_string() == ""
    g.rollback(len(cat) + 1)  # back past the marker's last token
    assert g.thinking
    g.fill_bitmask(mask, 0)
    assert bool((mask[0] == -1).all())
    assert g.accept_tokens(thought[-1:]) == 1 and not g.thinking
    assert g.accept_tokens(cat) == len(cat)
    grammars.close()


def test_jump_forward_appends_the_forced_text_and_changes_nothing_else(engines):
    """With jump-forward every constraint still holds, forced text is appended unsampled (counted),
    and plain requests, and grammar requests asking for logprobs (never jumped), decode exactly as
    on an engine without it."""
    jf, ref = engines(grammar_jump_forward=True), engines(grammar_jump_forward=False)
    plain = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    sps = [_sp(kind) for kind in CONSTRAINTS] + [plain]
    before = jf.scheduler.grammar.jumped_tokens
    out = jf.generate(prompt=PROMPTS, sampling_params=sps)
    for o, kind in zip(out, CONSTRAINTS):
        assert o["meta_info"]["finish_reason"]["type"] == "stop", o
        check_output(kind, o["text"])
    assert jf.scheduler.grammar.jumped_tokens > before
    assert jf.scheduler.stats()["grammar"]["jump_forward_tokens"] == jf.scheduler.grammar.jumped_tokens
    assert out[-1]["output_ids"] == ref.generate(prompt=PROMPTS[-1], sampling_params=plain)["output_ids"]
    with_lp = [jf.generate(prompt=PROMPTS[0], sampling_params=_sp("json_schema"), return_logprob=True)
               for _ in range(1)] + [ref.generate(prompt=PROMPTS[0], sampling_params=_sp("json_schema"),
                                                  return_logprob=True)]
    assert with_lp[0]["output_ids"] == with_lp[1]["output_ids"]
    _no_leak(jf)


def test_jump_forward_stops_at_max_new_tokens(engines):
    engine = engines(grammar_jump_forward=True)
    for n in (3, 9, 17):
        o = engine.generate(prompt=PROMPTS[0], sampling_params=_sp("json_schema", max_new_tokens=n))
        assert len(o["output_ids"]) == n and o["meta_info"]["finish_reason"] == {"type": "length", "length": n}
        assert o["meta_info"]["completion_tokens"] == n
    _no_leak(engine)
