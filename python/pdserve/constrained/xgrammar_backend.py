"""xgrammar (the default, as in SGLang): JSON schema, regex and EBNF (GBNF: ``root ::= ...``)."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch
import xgrammar as xgr

from pdserve.constrained import bitmask as bm
from pdserve.constrained.base import Grammar, GrammarBackend, GrammarError, short_error
from pdserve.constrained.vocab import ANY, UTF8_BAD, UTF8_STATES, token_bytes, utf8_run


class Utf8Guard:
    """Keeps xgrammar's outputs valid UTF-8.

    Why: xgrammar (0.2.9) decodes a token's bytes leniently and takes a UTF-8-encoded surrogate
    (``ED A0-BF xx``, U+D800-DFFF) as one character of a string, a class or a ``.``, though valid
    UTF-8 never holds one: the client's text then has three U+FFFD where the grammar counted one
    character, breaking a ``maxLength`` or a ``pattern`` (a random-weight model writes them). So each
    request also walks the UTF-8 automaton (vocab.utf8_step) over its tokens' bytes, and its mask row
    keeps only the tokens valid from where it stands: one row of bits per automaton state, built once
    per backend. Tokens without text (EOS and the other special ids) are allowed at a character
    boundary only and leave it there."""

    def __init__(self, table: dict[int, bytes], vocab_size: int):
        # ASCII tokens (most of a vocabulary), special and padded ids: from a character boundary only,
        # staying there (xgrammar never allows the padded ones)
        nxt = np.full((len(UTF8_STATES), vocab_size), UTF8_BAD, dtype=np.int8)  # [S, V]
        nxt[ANY, :] = ANY
        for token, data in table.items():
            if token < vocab_size and not data.isascii():
                nxt[:, token] = [utf8_run(state, data) for state in range(len(UTF8_STATES))]
        self.next = nxt
        self.masks = bm.from_bools(torch.from_numpy(nxt != UTF8_BAD))  # [S, W]

    def allows(self, state: int, token: int) -> bool:
        return 0 <= token < self.next.shape[1] and self.next[state, token] != UTF8_BAD


class XGrammarGrammar(Grammar):
    def __init__(self, matcher: xgr.GrammarMatcher, guard: Utf8Guard, states: list[int] | None = None):
        self.matcher = matcher
        self.guard = guard
        self.states = states or [ANY]  # the UTF-8 state before and after each accepted token (rollback pops)

    def accept_token(self, token: int) -> bool:
        # after its stop token a matcher takes nothing (and would log a warning for asking)
        if self.matcher.is_terminated() or not self.guard.allows(self.states[-1], token):
            return False
        if not self.matcher.accept_token(token):
            return False
        self.advanced(token)
        return True

    def advanced(self, token: int) -> None:
        """The matcher took ``token``: follow it in the UTF-8 automaton."""
        self.states.append(int(self.guard.next[self.states[-1], token]))

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)
        bitmask[row] &= self.guard.masks[self.states[-1]]

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)
            del self.states[-num_tokens:]

    def copy(self) -> Grammar:
        return XGrammarGrammar(self.matcher.fork(), self.guard, list(self.states))

    def jump_forward_string(self) -> str:
        return "" if self.matcher.is_terminated() else self.matcher.find_jump_forward_string()


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size, stop_token_ids, config):
        super().__init__(tokenizer, vocab_size, stop_token_ids, config)
        # ids past the tokenizer's vocabulary (a padded lm_head) are never allowed
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self.guard = Utf8Guard(token_bytes(tokenizer), vocab_size)
        # CompileService caches by (kind, text) and bounds the count; xgrammar's own cache would be a second copy
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        # one native call per step for a batch's masks and tokens (its own threads: none)
        self.batch = xgr.BatchGrammarMatcher(max_threads=1)

    def compile(self, kind: str, text: str) -> Any:
        try:
            if kind == "json_schema":
                grammar = xgr.Grammar.from_json_schema(text, any_whitespace=self.config.any_whitespace)
                return self.compiler.compile_grammar(without_raw_control_chars(str(grammar)))
            if kind == "regex":
                return self.compiler.compile_regex(text)
            if kind == "ebnf":
                return self.compiler.compile_grammar(text)
        except (RuntimeError, ValueError) as e:
            raise GrammarError(kind, f"does not compile (xgrammar): {short_error(e)}") from None
        raise GrammarError(kind, "is not a constraint this backend knows")

    def fill_bitmasks(self, grammars: list[tuple[int, Grammar]], bitmask: torch.Tensor) -> None:
        mine = [_xgrammar(g) for _, g in grammars]
        rows = [row for row, _ in grammars]
        self.batch.batch_fill_next_token_bitmask([g.matcher for g in mine], bitmask, rows)
        bitmask[rows] &= self.guard.masks[[g.states[-1] for g in mine]]  # Utf8Guard: [R, W]

    def accept_each(self, grammars: list[Grammar], tokens: list[int]) -> list[bool]:
        mine = [_xgrammar(g) for g in grammars]
        # nothing after the end, nothing that breaks UTF-8: XGrammarGrammar.accept_token says so, one by one
        if any(g.matcher.is_terminated() or not self.guard.allows(g.states[-1], t) for g, t in zip(mine, tokens)):
            return super().accept_each(grammars, tokens)
        accepted = list(self.batch.batch_accept_token([g.matcher for g in mine], tokens))
        for g, t, ok in zip(mine, tokens, accepted):
            if ok:
                g.advanced(t)
        return accepted

    def matcher(self, compiled: Any) -> Grammar:
        return XGrammarGrammar(xgr.GrammarMatcher(compiled), self.guard)  # rollback is unlimited


# An EBNF token: a quoted literal (group 1) or a character class (group 2 holds a negated one's members).
_CONTROL = r"\0-\x1f"
_EBNF_LITERAL_OR_CLASS = re.compile(r'("(?:\\.|[^"\\])*")|\[\^((?:\\.|[^\]\\])*)\]|\[(?:\\.|[^\]\\])*\]')


def without_raw_control_chars(ebnf: str) -> str:
    r"""The EBNF xgrammar converted from a JSON schema, with U+0000-U+001F taken out of every negated
    character class.

    Why: xgrammar (0.2.8, 0.2.9) writes a string with ``minLength`` / ``maxLength`` (values, and keys
    under ``propertyNames``) as a counted repeat of ``[^"\\\r\n]``, which lets every other control
    character (the tab, U+0013 ...) into the output raw: RFC 8259 forbids them unescaped and strict
    parsers (json.loads) refuse the document. Its other string rules exclude them already. In a
    grammar converted from JSON schema a negated class only ever matches inside a string (outside
    one JSON is literals and positive classes: digits, whitespace, signs), and no character of a
    JSON string may be a raw control character, so the change removes exactly the invalid outputs.
    Quoted literals (enum and const values, property names) and ``Regex("...")`` patterns (xgrammar
    escapes those itself) are left as they are; positive classes too."""
    def fix(m: re.Match) -> str:
        if m.group(2) is None or m.group(2).startswith(_CONTROL):  # a literal, a positive class, done already
            return m.group(0)
        return "[^" + _CONTROL + m.group(2) + "]"

    return _EBNF_LITERAL_OR_CLASS.sub(fix, ebnf)


def _xgrammar(grammar: Grammar) -> XGrammarGrammar:
    assert isinstance(grammar, XGrammarGrammar), grammar
    return grammar
