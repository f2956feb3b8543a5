"""The contract of a grammar backend and of one request's grammar (matcher state).

A backend turns a request's constraint, ``(kind, text)`` with kind one of ``GRAMMAR_KINDS``
(SGLang's field names), into a compiled grammar once (``compile``: slow, run on a compile
thread, cached by ``CompileService``), and makes a cheap per-request ``Grammar`` from it
(``matcher``). A ``Grammar`` says which tokens may come next as one row of a token bitmask, and
advances by the tokens the request really emits.

Token bitmask (the format xgrammar, llguidance and outlines-core share): int32 ``[B, W]`` with
``W = ceil(V / 32)``; token ``t`` is allowed in row ``b`` when bit ``t % 32`` of word
``bitmask[b, t // 32]`` is set. ``V`` is the model's logits width, which may exceed the
tokenizer's vocabulary: ids past it are never allowed.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from pdserve.config import GrammarConfig

GRAMMAR_KINDS = ("json_schema", "regex", "ebnf")


class GrammarError(ValueError):
    """A constraint that cannot be served: ``sampling_params.<kind>: why`` (a 400 at the API)."""

    def __init__(self, kind: str, why: str):
        super().__init__(f"sampling_params.{kind}: {why}")
        self.kind = kind
        self.why = why


class GrammarTimeout(GrammarError):
    """Compiling took longer than ``--grammar-compile-timeout`` (only its request fails)."""


class Grammar(ABC):
    """One request's position in its grammar.

    Contract: ``accept_token`` advances by one token and returns False (state unchanged) when
    the grammar does not allow it; ``fill_bitmask`` writes the tokens allowed next into one row
    without changing the state; ``is_terminated`` once the grammar has ended (a stop token was
    accepted, or, for backends that stop by themselves, nothing more can follow); ``rollback(n)``
    undoes the last ``n`` accepted tokens (speculative verification walks along a draft, then
    rolls back; at most ``MAX_ROLLBACK`` at a time); ``copy`` is independent of the original.
    Calls for one Grammar come from one thread at a time (the scheduler, or the mask thread
    while the scheduler waits for it)."""

    @abstractmethod
    def accept_token(self, token: int) -> bool: ...

    def accept_tokens(self, tokens: list[int]) -> int:
        """Accept ``tokens`` in order up to the first refused one; returns how many were accepted."""
        for i, tok in enumerate(tokens):
            if not self.accept_token(tok):
                return i
        return len(tokens)

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None: ...

    @abstractmethod
    def is_terminated(self) -> bool: ...

    @abstractmethod
    def rollback(self, num_tokens: int) -> None: ...

    @abstractmethod
    def copy(self) -> Grammar: ...

    def jump_forward_string(self) -> str:
        """The text the grammar allows as the only continuation from here ("" when there is a
        choice, or for a backend that cannot tell), without changing the state (jump-forward)."""
        return ""


# Speculative verification rolls back at most its draft length; backends keep this many states.
MAX_ROLLBACK = 64


class GrammarBackend(ABC):
    """Compiles constraints for one tokenizer and vocabulary.

    ``compile`` may take long and runs on a compile thread (never the scheduler's); it raises
    GrammarError naming the field for a constraint that does not compile. ``matcher`` is cheap
    (the scheduler calls it when a compile is done) and returns a fresh Grammar at the start.
    ``vocab_size``: the model's logits width (bitmask rows cover it); ``stop_token_ids``: the
    tokens that end a grammar (the model's EOS ids)."""

    name = ""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], config: GrammarConfig):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.config = config

    @abstractmethod
    def compile(self, kind: str, text: str) -> Any: ...

    @abstractmethod
    def matcher(self, compiled: Any) -> Grammar: ...

    # A step's work over a batch; backends with a batched call override these (one native call
    # instead of one Python call per request), the results must equal the loops'.
    def fill_bitmasks(self, grammars: list[tuple[int, Grammar]], bitmask: torch.Tensor) -> None:
        """``fill_bitmask`` of each ``(row, grammar)``."""
        for row, grammar in grammars:
            grammar.fill_bitmask(bitmask, row)

    def accept_each(self, grammars: list[Grammar], tokens: list[int]) -> list[bool]:
        """``accept_token`` of ``tokens[i]`` by ``grammars[i]``, for each i."""
        return [g.accept_token(t) for g, t in zip(grammars, tokens)]


def short_error(e: BaseException | str, limit: int = 300) -> str:
    """A library's error message without its C++ source location prefix, bounded."""
    text = re.sub(r"^\[[\d:]+\] [^\s:]+:\d+: ", "", str(e).strip()).strip()
    return (text or type(e).__name__)[:limit]
