"""Constrained decoding: grammar backends (xgrammar, llguidance, outlines-core) behind one
contract (base.py), each imported only when chosen; the compile service (thread pool + bounded
LRU of compiled grammars); token bitmasks; the figures a server reports."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pdserve.constrained.base import GRAMMAR_KINDS, Grammar, GrammarBackend, GrammarError, GrammarTimeout

if TYPE_CHECKING:
    from pdserve.config import GrammarConfig

# --grammar-backend name -> (module, class); "none" has no backend (grammar requests are refused)
BACKENDS: dict[str, tuple[str, str]] = {
    "xgrammar": ("pdserve.constrained.xgrammar_backend", "XGrammarBackend"),
    "llguidance": ("pdserve.constrained.llguidance_backend", "LLGuidanceBackend"),
    "outlines": ("pdserve.constrained.outlines_backend", "OutlinesBackend"),
}


def create_grammar_backend(config: GrammarConfig, tokenizer: Any, vocab_size: int,
                           stop_token_ids: list[int]) -> GrammarBackend:
    """The backend ``config.backend`` names, for this tokenizer and logits width (imports it now)."""
    if config.backend not in BACKENDS:
        raise ValueError(f"grammar_backend: {config.backend!r} compiles nothing (one of {sorted(BACKENDS)})")
    module, cls = BACKENDS[config.backend]
    try:
        backend_cls = getattr(importlib.import_module(module), cls)
    except ImportError as e:
        raise ValueError(f"grammar_backend: {config.backend} is not installed ({e})") from None
    return backend_cls(tokenizer, vocab_size, stop_token_ids, config)


__all__ = ["BACKENDS", "GRAMMAR_KINDS", "Grammar", "GrammarBackend", "GrammarError", "GrammarTimeout",
           "create_grammar_backend"]
