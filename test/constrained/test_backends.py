"""Every grammar backend (xgrammar, llguidance, outlines) on the bundled tokenizer: random walks
that pick any token the mask allows, until the grammar ends, always produce a valid output (and a
walk that ignores the mask does not); a refused token leaves the state unchanged; rollback and
copy restore and separate states; padded ids are never allowed; a bad constraint is a
GrammarError naming its field."""

from __future__ import annotations

import random

import pytest
import torch

from constrained.grammar_fixtures import CONSTRAINTS, EOS, INSTALLED, VOCAB, check_output, tokenizer
from pdserve.config import GrammarConfig
from pdserve.constrained import GrammarError, create_grammar_backend
from pdserve.constrained import bitmask as bm

MAX_STEPS = 200
# outlines-core has no EBNF (as in SGLang): refused naming the field instead
SUPPORTED = [(b, k) for b in INSTALLED for k in CONSTRAINTS if not (b == "outlines" and k == "ebnf")]


@pytest.fixture(scope="module")
def tok():
    return tokenizer()


@pytest.fixture(scope="module")
def backends(tok):
    config = GrammarConfig()
    made = {}

    def get(name):
        if name not in made:
            made[name] = create_grammar_backend(GrammarConfig(name), tok, VOCAB, [EOS])
        return made[name]

    assert config.backend == "xgrammar" and not config.any_whitespace, "compact JSON by default"
    return get


def _walk(grammar, seed: int, follow_mask: bool = True) -> list[int]:
    rng = random.Random(seed)
    mask = bm.allocate(1, VOCAB)
    out = []
    for _ in range(MAX_STEPS):
        grammar.fill_bitmask(mask, 0)
        allowed = bm.allowed_tokens(mask, 0, VOCAB)
        assert allowed, "a live grammar always allows some token"
        assert all(t < 2000 for t in allowed), "ids past the tokenizer's vocabulary are never allowed"
        # prefer text over ending, so walks are not all empty
        text = [t for t in allowed if t != EOS]
        tok = rng.choice(text if text and rng.random() < 0.8 else allowed) if follow_mask else rng.randrange(3, 2000)
        if not grammar.accept_token(tok):
            return out
        if tok == EOS:
            break
        out.append(tok)
        if grammar.is_terminated():
            break
    return out


@pytest.mark.parametrize("backend, kind", SUPPORTED)
def test_random_walks_inside_the_mask_are_valid(backends, tok, backend, kind):
    b = backends(backend)
    compiled = b.compile(kind, CONSTRAINTS[kind])
    ended = 0
    for seed in range(6):
        g = b.matcher(compiled)
        ids = _walk(g, seed)
        if g.is_terminated() or _ends_with_eos_allowed(g):
            ended += 1
            check_output(kind, tok.decode(ids), backend)
    assert ended >= 4


def _ends_with_eos_allowed(g) -> bool:
    mask = bm.allocate(1, VOCAB)
    if g.is_terminated():
        return True
    g.fill_bitmask(mask, 0)
    return EOS in bm.allowed_tokens(mask, 0, VOCAB)


@pytest.mark.parametrize("backend", INSTALLED)
def test_a_walk_that_ignores_the_mask_is_refused_and_state_kept(backends, tok, backend):
    b = backends(backend)
    g = b.matcher(b.compile("regex", CONSTRAINTS["regex"]))
    for t in tok.encode("cat-", add_special_tokens=False):
        assert g.accept_token(t)
    before, after = bm.allocate(1, VOCAB), bm.allocate(1, VOCAB)
    g.fill_bitmask(before, 0)
    bad = tok.encode("zzz", add_special_tokens=False)[0]
    assert not g.accept_token(bad)
    g.fill_bitmask(after, 0)
    assert torch.equal(before, after)
    digits = tok.encode("42", add_special_tokens=False)
    assert g.accept_tokens(digits) == len(digits)


@pytest.mark.parametrize("backend", INSTALLED)
def test_rollback_and_copy(backends, tok, backend):
    b = backends(backend)
    g = b.matcher(b.compile("regex", CONSTRAINTS["regex"]))
    start = bm.allocate(1, VOCAB)
    g.fill_bitmask(start, 0)
    ids = tok.encode("dog-12", add_special_tokens=False)
    assert g.accept_tokens(ids) == len(ids)
    twin = g.copy()
    assert g.accept_token(EOS) and g.is_terminated()
    assert not twin.is_terminated()
    g.rollback(len(ids) + 1)
    again = bm.allocate(1, VOCAB)
    g.fill_bitmask(again, 0)
    assert torch.equal(start, again) and not g.is_terminated()
    assert twin.accept_token(tok.encode("3", add_special_tokens=False)[0])


@pytest.mark.parametrize("backend", INSTALLED)
@pytest.mark.parametrize("kind, text", [("json_schema", '{"type": "nonsense"}'), ("regex", "(unclosed"),
                                        ("ebnf", 'root ::= undefined_rule')])
def test_a_bad_constraint_names_its_field(backends, backend, kind, text):
    with pytest.raises(GrammarError, match=f"^sampling_params.{kind}: "):
        backends(backend).compile(kind, text)


def test_an_unknown_or_missing_backend_is_refused_naming_the_flag(tok):
    with pytest.raises(ValueError, match="grammar_backend"):
        create_grammar_backend(GrammarConfig("none"), tok, VOCAB, [EOS])
    with pytest.raises(ValueError, match="grammar_backend"):
        GrammarConfig("lmformatenforcer")


@pytest.mark.parametrize("backend", INSTALLED)
def test_batched_fill_and_accept_equal_the_per_grammar_calls(backends, tok, backend):
    """A step's batched calls (xgrammar: one native call) give what one call per grammar gives."""
    b = backends(backend)
    compiled = b.compile("json_schema", CONSTRAINTS["json_schema"])
    batch, alone = [b.matcher(compiled) for _ in range(4)], [b.matcher(compiled) for _ in range(4)]
    for seed, (g1, g2) in enumerate(zip(batch, alone)):  # each pair walked to its own state
        ids = _walk(b.matcher(compiled), seed)[:4 + 5 * seed]
        assert g1.accept_tokens(ids) == g2.accept_tokens(ids) == len(ids)
    rows = [0, 2, 3, 5]  # not every row of the mask carries a grammar
    got, want = bm.allocate(6, VOCAB), bm.allocate(6, VOCAB)
    b.fill_bitmasks(list(zip(rows, batch)), got)
    for row, g in zip(rows, alone):
        g.fill_bitmask(want, row)
    assert torch.equal(got, want)
    nxt = [bm.allowed_tokens(want, r, VOCAB)[0] for r in rows]
    allowed = set(bm.allowed_tokens(want, rows[1], VOCAB))
    nxt[1] = next(t for t in range(3, 2000) if t not in allowed)  # one refused token among them
    assert b.accept_each(batch, nxt) == [g.accept_token(t) for g, t in zip(alone, nxt)] == [True, False, True, True]
