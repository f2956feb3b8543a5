"""Tokenizer loading and detokenization (full and incremental)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
# transformers warns once per tokenizer of a text longer than the tokenizer's model_max_length;
# pdserve checks every prompt against the context length itself and refuses it with a 400
NO_LENGTH_LIMIT = int(1e30)  # transformers' own "no limit" (VERY_LARGE_INTEGER)
GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
# model types (those pdserve serves) whose declared generic tokenizer class AutoTokenizer keeps
GENERIC_TOKENIZER_MODEL_TYPES = frozenset({"llama", "qwen3", "qwen3_moe", "deepseek_v3", "deepseek_v32", "deepseek_v4"})


def has_tokenizer(path: str | Path) -> bool:
    p = Path(path)
    return p.is_dir() and any((p / f).is_file() for f in TOKENIZER_FILES[:3])


def load_tokenizer(path: str | Path):
    """A transformers fast tokenizer from a local directory, or None if it holds none
    (the engine then serves input_ids only, like SGLang's skip_tokenizer_init)."""
    if not has_tokenizer(path):
        logger.info("no tokenizer files in %s: serving input_ids only", path)
        return None
    if _declares_generic_tokenizer(Path(path)):
        # AutoTokenizer would pick this same class, but importing it imports torch (through
        # transformers' config classes): 2-3 s of CPU in a router or a grammar child, which need no torch
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        tokenizer = TokenizersBackend.from_pretrained(str(path))
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.model_max_length = NO_LENGTH_LIMIT  # the length check is ours (a 400), not a log line
    return tokenizer


def _declares_generic_tokenizer(path: Path) -> bool:
    """Whether AutoTokenizer would load ``path`` as transformers' generic ``TokenizersBackend``:
    ``tokenizer_config.json`` names that class (or its old name), no custom code, and the model
    type is one for which transformers keeps the declared class (it overrides it for some, e.g.
    qwen2; test/engine/test_tokenizer.py checks this list against transformers' own)."""
    try:
        tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return False
    return (isinstance(tok_cfg, dict) and tok_cfg.get("tokenizer_class") in GENERIC_TOKENIZER_CLASSES
            and "auto_map" not in tok_cfg and model_type in GENERIC_TOKENIZER_MODEL_TYPES)


def text_decoder(tokenizer) -> Callable[[list[int], bool], str]:
    """``decode(ids, skip_special_tokens)`` equal to ``tokenizer.decode``, calling the Rust
    tokenizer directly when that is all ``decode`` would do (a transformers fast tokenizer
    without space clean-up or a model-specific ``decode``): streaming decodes every token
    twice, and the Python wrapper costs several times the decode itself."""
    def wrapped(ids: list[int], skip: bool) -> str:
        return tokenizer.decode(ids, skip_special_tokens=skip)

    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: the plain path is always right
        return wrapped
    plain = (backend is not None and not tokenizer.clean_up_tokenization_spaces
             and type(tokenizer).decode is TokenizersBackend.decode
             and type(tokenizer)._decode is TokenizersBackend._decode)
    if backend is None or not plain:
        return wrapped
    return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)


def output_text(tokenizer, output_ids: list[int], finish_reason: dict | None, skip_special_tokens: bool = True) -> str:
    """Final text: a matched stop token is dropped, a matched stop string and what follows are cut."""
    if tokenizer is None:
        return ""
    ids = output_ids
    matched = (finish_reason or {}).get("matched")
    stopped = finish_reason and finish_reason.get("type") == "stop"
    if stopped and isinstance(matched, int) and ids and ids[-1] == matched:
        ids = ids[:-1]
    text = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    if isinstance(matched, str):
        cut = text.find(matched)
        if cut >= 0:
            text = text[:cut]
    return text


class StopPrefixes:
    """For each stop string, the longest of its prefixes the text so far ends with, followed as the
    text grows (Knuth-Morris-Pratt), so a stream's hold-back costs O(stops) per new character. Why:
    searching the text's end for each stop's first character costs a pass per occurrence, and with
    16 stops of 256 characters that was 0.2 ms per token on the frontend's event loop, which every
    other request shares (issue 33)."""

    def __init__(self, stops: list[str]):
        self.stops = list(stops)
        self.fail = [_kmp_failure(s) for s in self.stops]  # fail[i]: the longest proper border of s[:i + 1]
        self.ends = [0] * len(self.stops)  # the longest prefix of each stop the text ends with

    def feed(self, chars: str) -> None:
        """The text grew by ``chars``."""
        for i, s in enumerate(self.stops):
            q, fail, n = self.ends[i], self.fail[i], len(s)
            for c in chars:
                if q == n:  # a whole match: go on from its longest border
                    q = fail[q - 1]
                while q and s[q] != c:
                    q = fail[q - 1]
                if s[q] == c:
                    q += 1
            self.ends[i] = q

    def holdback(self) -> int:
        """Characters at the text's end that could begin a stop string (a proper prefix of one)."""
        return max((min(q, len(s) - 1) for q, s in zip(self.ends, self.stops)), default=0)


def _kmp_failure(s: str) -> list[int]:
    fail, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return fail


class IncrementalDetokenizer:
    """Streams text as tokens arrive without re-emitting or splitting multi-byte characters.

    Decodes a short window (from ``prefix_offset``) and emits only what extends the
    previously emitted text; a trailing U+FFFD means an incomplete UTF-8 sequence,
    so it waits for more tokens.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True, stop: list[str] | None = None,
                 decoder: Callable[[list[int], bool], str] | None = None):
        """``decoder``: ``text_decoder(tokenizer)``, when the caller keeps one for every request."""
        self.tokenizer = tokenizer
        self._decoder = decoder or text_decoder(tokenizer)
        self.skip = skip_special_tokens
        self.stop = stop or []
        self._longest_stop = max(map(len, self.stop), default=0)
        self._prefixes = StopPrefixes(self.stop) if self.stop else None
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.emitted = ""  # full text emitted so far
        self._text = ""  # decoded text of complete characters so far

    def _decode(self, ids):
        return self._decoder(ids, self.skip)

    def add(self, new_ids: list[int]) -> str:
        """Feed new tokens; return the new text that is safe to show now."""
        self.ids.extend(new_ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self._text += full[len(prefix):]
            if self._prefixes is not None:
                self._prefixes.feed(full[len(prefix):])
        text = self._text
        # A stop string found earlier would have cut the text, and none can start before what was
        # emitted minus the longest stop: look only there, so a token costs O(stops x window), not O(text).
        start = max(0, len(self.emitted) - self._longest_stop)
        cut_any = False
        for s in self.stop:
            cut = text.find(s, start)
            if cut >= 0:
                text, cut_any = text[:cut], True
        # uncut, the text's end is what the stop prefixes followed; cut (the stream's last piece), look
        hold = self._stop_holdback(text) if cut_any or self._prefixes is None else self._prefixes.holdback()
        safe = len(text) - hold
        delta = text[len(self.emitted):safe]
        self.emitted += delta
        return delta

    def _stop_holdback(self, text: str) -> int:  # the slow twin of StopPrefixes.holdback, for a cut text
        """Chars at the end of ``text`` that could be the start of a stop string: for each stop,
        the longest of its proper prefixes ``text`` ends with (tried only where its first character
        is, in the last ``len(stop) - 1`` characters)."""
        hold = 0
        for s in self.stop:
            tail = text[max(0, len(text) - len(s) + 1):] if len(s) > 1 else ""
            at = tail.find(s[0])
            while at >= 0 and len(tail) - at > hold:
                if s.startswith(tail[at:]):
                    hold = len(tail) - at
                    break
                at = tail.find(s[0], at + 1)
        return hold

    def add_last(self, new_ids: list[int], finish_reason: dict | None) -> str:
        """The final tokens and the flush. A matched stop token is never shown, as ``output_text``
        drops it from the whole text: with ``skip_special_tokens`` off, ``add`` would have shown
        the text of a special one (``<|im_end|>``) before ``finish`` could leave it out."""
        matched = (finish_reason or {}).get("matched")
        stop_token = ((finish_reason or {}).get("type") == "stop" and isinstance(matched, int)
                      and bool(new_ids) and new_ids[-1] == matched)
        text = self.add(new_ids[:-1] if stop_token else new_ids)
        if stop_token:
            self.ids.append(new_ids[-1])  # finish's output_text sees the stop token and drops it
        return text + self.finish(finish_reason)

    def finish(self, finish_reason: dict | None) -> str:
        """Flush at the end: the rest of the text up to (not including) a matched stop string."""
        final = output_text(self.tokenizer, self.ids, finish_reason, self.skip)
        delta = final[len(self.emitted):] if final.startswith(self.emitted) else ""
        self.emitted += delta
        return delta
