"""llguidance: JSON schema, regex and EBNF (Lark, or GBNF converted to Lark)."""

from __future__ import annotations

from typing import Any

import llguidance
import llguidance.hf
import torch
from llguidance.gbnf_to_lark import any_to_lark

from pdserve.constrained.base import Grammar, GrammarBackend, GrammarError, short_error


class LLGuidanceGrammar(Grammar):
    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher

    def accept_token(self, token: int) -> bool:
        # try_consume leaves the matcher as it was on a refused token (consume_token would poison it)
        return self.matcher.try_consume_tokens([token]) == 1

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        words = bitmask[row]
        self.matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())

    def is_terminated(self) -> bool:
        # llguidance stops by itself when nothing but a stop token can follow
        return self.matcher.is_stopped()

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)

    def copy(self) -> Grammar:
        return LLGuidanceGrammar(self.matcher.deep_copy())


class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size, stop_token_ids, config):
        super().__init__(tokenizer, vocab_size, stop_token_ids, config)
        # n_vocab: the model's width, so a mask row covers the padded ids (never allowed)
        try:
            self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                    eos_token=list(stop_token_ids) or None)
        except ValueError as e:  # e.g. a vocabulary of raw pieces (no ByteLevel / ByteFallback decoder)
            raise ValueError(f"grammar_backend: llguidance cannot map this tokenizer's tokens to bytes "
                             f"({short_error(e, 120)}); use xgrammar") from None

    def _grammar(self, kind: str, text: str) -> str:
        if kind == "json_schema":
            options = {"whitespace_flexible": self.config.any_whitespace}
            return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=options)  # type: ignore[arg-type]
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(text)
        if kind == "ebnf":
            return llguidance.LLMatcher.grammar_from_lark(any_to_lark(text))
        raise GrammarError(kind, "is not a constraint this backend knows")

    def compile(self, kind: str, text: str) -> Any:
        """A matcher at the start of the grammar (building it is the expensive part); each
        request gets a deep copy."""
        try:
            grammar = self._grammar(kind, text)
        except (ValueError, RuntimeError, TypeError) as e:  # gbnf_to_lark raises its own Exception subclass
            raise GrammarError(kind, f"does not compile (llguidance): {short_error(e)}") from None
        except Exception as e:  # noqa: BLE001 - GbnfToLarkError: a GBNF text that does not parse
            raise GrammarError(kind, f"does not parse (llguidance): {short_error(e)}") from None
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tok)
        if error:
            raise GrammarError(kind, f"does not compile (llguidance): {short_error(error)}")
        matcher = llguidance.LLMatcher(self.tok, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(kind, f"does not compile (llguidance): {short_error(matcher.get_error())}")
        return matcher

    def matcher(self, compiled: Any) -> Grammar:
        return LLGuidanceGrammar(compiled.deep_copy())
