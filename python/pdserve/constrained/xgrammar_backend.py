"""xgrammar (the default, as in SGLang): JSON schema, regex and EBNF (GBNF: ``root ::= ...``)."""

from __future__ import annotations

import re
from typing import Any

import torch
import xgrammar as xgr

from pdserve.constrained.base import Grammar, GrammarBackend, GrammarError, short_error


class XGrammarGrammar(Grammar):
    def __init__(self, matcher: xgr.GrammarMatcher):
        self.matcher = matcher

    def accept_token(self, token: int) -> bool:
        # after its stop token a matcher takes nothing (and would log a warning for asking)
        return not self.matcher.is_terminated() and self.matcher.accept_token(token)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)

    def copy(self) -> Grammar:
        return XGrammarGrammar(self.matcher.fork())


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size, stop_token_ids, config):
        super().__init__(tokenizer, vocab_size, stop_token_ids, config)
        # ids past the tokenizer's vocabulary (a padded lm_head) are never allowed
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
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
        matchers = [_matcher(g) for _, g in grammars]
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask, [row for row, _ in grammars])

    def accept_each(self, grammars: list[Grammar], tokens: list[int]) -> list[bool]:
        if any(_matcher(g).is_terminated() for g in grammars):  # nothing after the end (XGrammarGrammar says so)
            return super().accept_each(grammars, tokens)
        return list(self.batch.batch_accept_token([_matcher(g) for g in grammars], tokens))

    def matcher(self, compiled: Any) -> Grammar:
        return XGrammarGrammar(xgr.GrammarMatcher(compiled))  # rollback is unlimited


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


def _matcher(grammar: Grammar) -> xgr.GrammarMatcher:
    assert isinstance(grammar, XGrammarGrammar), grammar
    return grammar.matcher
