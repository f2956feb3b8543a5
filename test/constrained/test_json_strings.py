"""JSON from every grammar backend is strict JSON, for every tokenizer family (byte-level BPE,
SentencePiece-style byte fallback, raw pieces: constrained/tokenizer_families.py).

- The bytes each backend believes a token stands for are the bytes the tokenizer decodes it to
  (else the grammar checks text the client never sees).
- Property over the token table: at every step of random walks through each schema, EVERY token the
  mask allows, appended to the text so far, is still lexically valid JSON there: no raw control
  character inside a string (RFC 8259; xgrammar's maxLength strings let them in), only valid
  escapes, nothing outside a string but JSON's own characters; in the compact default no whitespace
  but one space after ``:`` or ``,``; and the bytes stay valid UTF-8 (xgrammar takes encoded
  surrogates, which decode to three U+FFFD and break maxLength). Walks that end parse with
  json.loads and validate.
- The compact default and the permissive flag (--constrained-json-any-whitespace) both hold it."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from constrained.grammar_fixtures import EOS, FUZZ_SCHEMAS, INSTALLED, VOCAB, check_json
from constrained.json_lexer import ANY_WS, BAD, OUT, compact_spacing, run, transitions, utf8_transitions
from constrained.tokenizer_families import FAMILIES, build
from pdserve.config import GrammarConfig
from pdserve.constrained import bitmask as bm
from pdserve.constrained import create_grammar_backend
from pdserve.constrained.vocab import AFTER_E0, ANY, UTF8_BAD, token_bytes, utf8_run

WALKS = 3
STEPS = 60


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("tokenizers")
    made = {f: AutoTokenizer.from_pretrained(str(build(f, root / f))) for f in FAMILIES}
    return made


def backend_bytes(backend: str, tok) -> dict[int, bytes]:
    """The bytes ``backend`` believes each text token stands for."""
    import llguidance.hf
    import xgrammar as xgr

    ids = sorted(token_bytes(tok))
    if backend == "xgrammar":
        vocab = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB, stop_token_ids=[EOS]).decoded_vocab
        return {t: vocab[t] for t in ids}
    if backend == "llguidance":
        ll = llguidance.hf.from_tokenizer(tok, n_vocab=VOCAB, eos_token=[EOS])
        return {t: ll.decode_bytes([t]) for t in ids}
    return token_bytes(tok)  # outlines' vocabulary is built from it


def _utf8(data: bytes) -> bool:
    try:
        data.decode()
        return True
    except UnicodeDecodeError:
        return False


# llguidance keeps byte 0xff for its own use (never valid UTF-8): that one token maps to nothing,
# and it must then never be allowed (the property test checks the masks)
UNMAPPED_OK = {"llguidance": {b"\xff"}}


@pytest.mark.parametrize("family", FAMILIES)
def test_each_backend_maps_tokens_to_the_bytes_the_tokenizer_decodes(families, family):
    tok = families[family]
    table = token_bytes(tok)
    ids = sorted(table)
    backends = [b for b in INSTALLED if not (b == "llguidance" and family == "raw")]
    tables = {b: backend_bytes(b, tok) for b in backends}
    if family == "raw":  # llguidance reads ByteLevel / ByteFallback vocabularies only: refused, clearly
        with pytest.raises(ValueError, match="^grammar_backend: llguidance cannot map"):
            create_grammar_backend(GrammarConfig("llguidance"), tok, VOCAB, [EOS])
    # byte tokens (<0xC3>, a byte-level 0x80-0xff) are parts of characters: compare runs of tokens
    rng = random.Random(0)
    control = [t for t in ids if any(b < 0x20 for b in table[t])]
    assert control, "every family can spell raw control characters (the property test needs them)"
    for _ in range(300):
        seq = [rng.choice(ids) for _ in range(rng.randint(1, 8))] + [rng.choice(control)]
        rng.shuffle(seq)
        joined = b"".join(table[i] for i in seq)
        if _utf8(joined):  # else tokenizers and Python replace broken bytes differently (by token / by run)
            assert joined.decode() == tok.decode(seq), seq
    # byte tokens (<0xC3>, a byte-level 0x80-0xff) spell characters together
    text = '{"tag": "a\x13b\tc\x00"}' + ("" if family == "raw" else ' é€😀 \u0301')
    seq = tok.encode(text, add_special_tokens=False)
    assert b"".join(table[i] for i in seq) == text.encode() and tok.decode(seq) == text
    for name, t in tables.items():
        differ = {table[i] for i in ids if t[i] != table[i]}
        assert differ <= UNMAPPED_OK.get(name, set()), (name, sorted(differ)[:8])


CASES = [(b, f, ws) for b in INSTALLED for f in FAMILIES for ws in (False, True)
         if not (b == "llguidance" and f == "raw")]


@pytest.mark.parametrize("backend, family, any_whitespace", CASES)
def test_every_token_the_grammar_allows_is_valid_json_there(families, backend, family, any_whitespace):
    tok = families[family]
    b = create_grammar_backend(GrammarConfig(backend, any_whitespace=any_whitespace), tok, VOCAB, [EOS])
    table = token_bytes(tok)
    seen_by_backend = backend_bytes(backend, tok)
    unmapped = np.array([t for t in table if seen_by_backend[t] != table[t]], dtype=np.int64)
    moves = transitions(table, ANY_WS if any_whitespace else {ord(" ")})
    utf8 = utf8_transitions(table)
    rng = random.Random(f"{backend}-{family}-{any_whitespace}")
    mask = bm.allocate(1, VOCAB)
    ended = 0
    for name, schema in FUZZ_SCHEMAS.items():
        compiled = b.compile("json_schema", json.dumps(schema))
        for _ in range(WALKS):
            g, ids, state, chars = b.matcher(compiled), [], OUT, ANY
            for _ in range(STEPS):
                if g.is_terminated():  # llguidance ends by itself where only EOS may follow
                    break
                g.fill_bitmask(mask, 0)
                allowed = np.array(bm.allowed_tokens(mask, 0, VOCAB), dtype=np.int64)
                text_ids = allowed[allowed != EOS]
                assert all(t in table for t in text_ids.tolist()), "only text tokens besides EOS"
                assert not np.isin(unmapped, text_ids).any(), "a token the backend cannot spell is never allowed"
                bad = text_ids[moves[state, text_ids] == BAD]
                assert not bad.size, (name, tok.decode(ids), [table[t] for t in bad[:8].tolist()])
                broken = text_ids[utf8[chars, text_ids] == UTF8_BAD]
                assert not broken.size, ("not UTF-8", name, tok.decode(ids), [table[t] for t in broken[:8].tolist()])
                if not text_ids.size or (EOS in allowed and rng.random() < 0.15):
                    assert state == OUT and chars == ANY and g.accept_token(EOS)
                    break
                # now and then a lead byte that narrows what may follow (E0, ED, F0, F4): the property is
                # then checked where a surrogate or an overlong form could slip in
                narrow = text_ids[utf8[chars, text_ids] >= AFTER_E0]
                t = int(rng.choice((narrow if narrow.size and rng.random() < 0.3 else text_ids).tolist()))
                assert g.accept_token(t)
                ids.append(t)
                state, chars = int(moves[state, t]), int(utf8[chars, t])
            else:
                continue
            ended += 1
            text = tok.decode(ids)
            check_json(text, name, backend)
            if not any_whitespace:
                assert compact_spacing(text), text
    assert ended >= len(FUZZ_SCHEMAS), "most walks end: their outputs were parsed"


@pytest.mark.parametrize("text", ['{"a": "x\x13"}', '{"a": "\t"}', '{"a": "\\q"}', '{"a": "\\u12G4"}', "{'a': 1}"])
def test_the_lexer_refuses_what_strict_parsers_refuse(text):
    """The property's oracle agrees with json.loads where it matters."""
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    assert run(OUT, text.encode(), ANY_WS) == BAD


def test_the_lexer_takes_strict_json_and_tells_compact_spacing():
    text = '{"a": "x\\u0013\\n\\"", "b": [1, -2.5e3, true, null], "c": "\x7f\u00e9"}'
    json.loads(text)
    assert run(OUT, text.encode(), {ord(" ")}) == OUT and compact_spacing(text)
    assert compact_spacing('{"a":1,"b":2}') and not compact_spacing('{"a":\n1}')
    assert not compact_spacing('{"a" : 1}') and not compact_spacing('{"a":  1}')


@pytest.mark.parametrize("flags, any_whitespace", [
    ([], False),  # compact by default
    (["--constrained-json-disable-any-whitespace"], False),  # SGLang's flag: still accepted, the default
    (["--constrained-json-any-whitespace"], True),  # the permissive grammar, asked for
])
def test_whitespace_flags_reach_the_grammar_config(flags, any_whitespace):
    from pdserve.entrypoints.cli import build_parser, server_args_from_namespace

    ns = build_parser().parse_args(["serve", "--model-path", "tiny-llama", *flags])
    assert server_args_from_namespace(ns).grammar_config().any_whitespace is any_whitespace


def test_both_whitespace_flags_at_once_are_refused_naming_them():
    from pdserve.config import ServerArgs

    with pytest.raises(ValueError, match="^constrained_json_any_whitespace: .*constrained_json_disable_any_whitespace"):
        ServerArgs(model_path="tiny-llama", constrained_json_any_whitespace=True,
                   constrained_json_disable_any_whitespace=True)


def test_the_utf8_automaton_agrees_with_pythons_decoder():
    """vocab.utf8_run (xgrammar's guard and this file's oracle): a byte string is a valid prefix iff
    some continuation makes it decode whole in Python, and complete iff it decodes whole already."""
    rng = random.Random(5)
    lead = [0x41, 0x7F, 0x80, 0xBF, 0xC0, 0xC1, 0xC2, 0xDF, 0xE0, 0xE1, 0xED, 0xEE, 0xEF, 0xF0, 0xF3, 0xF4, 0xF5, 0xFF]
    cont = [0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0x41]
    for _ in range(20000):
        data = bytes([rng.choice(lead)] + [rng.choice(cont + lead) for _ in range(rng.randint(0, 4))])
        state = utf8_run(ANY, data)
        # what may complete a pending character: after E0 the next byte is A0-BF, after F0 90-BF
        endings = [b""] + [bytes([first]) + b"\x80" * k for first in (0x80, 0x90, 0xA0) for k in range(3)]
        prefix = any(_utf8(data + end) for end in endings)
        assert (state != UTF8_BAD) == prefix, data
        assert (state == ANY) == _utf8(data), data
