"""outlines-core: JSON schema (through its regex) and regex, as a token-level automaton. No EBNF
(SGLang's outlines backend has none either)."""

from __future__ import annotations

from typing import Any

import outlines_core
import torch
from outlines_core.json_schema import build_regex_from_schema

from pdserve.constrained.base import MAX_ROLLBACK, Grammar, GrammarBackend, GrammarError, short_error
from pdserve.constrained.bitmask import allow, clear_from
from pdserve.constrained.vocab import token_bytes


class OutlinesGrammar(Grammar):
    """The automaton's guide, plus the end: a stop token accepted in a final state (the guide itself
    has no transition for it)."""

    def __init__(self, index: outlines_core.Index, stop_token_ids: list[int], vocab_end: int):
        self.index = index
        self.guide = outlines_core.Guide(index, max_rollback=MAX_ROLLBACK)
        self.stop_token_ids = stop_token_ids
        self.vocab_end = vocab_end  # first id the automaton's vocabulary lacks
        self.tokens: list[int] = []  # accepted so far (copy replays them)
        self.terminated = False

    def accept_token(self, token: int) -> bool:
        if self.terminated:
            return False
        if token in self.stop_token_ids:
            if not self.guide.is_finished():
                return False
            self.terminated = True
        else:
            try:
                self.guide.advance(token, return_tokens=False)
            except ValueError:  # no transition: the state is unchanged
                return False
        self.tokens.append(token)
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        words = bitmask[row]
        words.zero_()
        if self.terminated:
            return
        self.guide.write_mask_into(words.data_ptr(), words.numel(), words.element_size())
        clear_from(bitmask, row, self.vocab_end)
        if self.guide.is_finished():
            for t in self.stop_token_ids:  # the index knows one EOS; the model may have several
                allow(bitmask, row, t)

    def is_terminated(self) -> bool:
        return self.terminated

    def rollback(self, num_tokens: int) -> None:
        if not num_tokens:
            return
        dropped, self.tokens = self.tokens[-num_tokens:], self.tokens[:-num_tokens]
        guide_steps = num_tokens - (1 if self.terminated else 0)
        self.terminated = False
        if guide_steps:
            self.guide.rollback_state(guide_steps)
        assert len(dropped) == num_tokens

    def copy(self) -> Grammar:
        twin = OutlinesGrammar(self.index, self.stop_token_ids, self.vocab_end)
        for t in self.tokens:
            twin.accept_token(t)
        return twin


class OutlinesBackend(GrammarBackend):
    name = "outlines"

    def __init__(self, tokenizer, vocab_size, stop_token_ids, config):
        super().__init__(tokenizer, vocab_size, stop_token_ids, config)
        if not stop_token_ids:
            raise ValueError("grammar_backend: outlines needs the model's EOS token id")
        pieces: dict[bytes, list[int]] = {}
        for i, b in token_bytes(tokenizer).items():
            if i < vocab_size and i not in stop_token_ids:
                pieces.setdefault(b, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(stop_token_ids[0], pieces)
        self.vocab_end = max((i for ids in pieces.values() for i in ids), default=0) + 1
        # compact JSON by default; the permissive grammar allows one optional space between JSON tokens (a
        # pattern allowing any run, outlines' own default, would let a model pad until max_tokens)
        self.whitespace = r"[ ]?" if config.any_whitespace else r""

    def compile(self, kind: str, text: str) -> Any:
        if kind == "ebnf":
            raise GrammarError(kind, "the outlines grammar backend takes json_schema and regex only "
                                     "(use --grammar-backend xgrammar or llguidance for EBNF)")
        try:
            regex = build_regex_from_schema(text, whitespace_pattern=self.whitespace) if kind == "json_schema" else text
            return outlines_core.Index(regex, self.vocabulary)
        except (ValueError, RuntimeError, TypeError) as e:
            raise GrammarError(kind, f"does not compile (outlines): {short_error(e)}") from None

    def matcher(self, compiled: Any) -> Grammar:
        return OutlinesGrammar(compiled, self.stop_token_ids, self.vocab_end)
