"""The token ids a server will make of a request body, so the router can hash its pages.

Mirrors the servers' own tokenization: ``/generate`` text and completions prompts with special
tokens, chat messages through the tokenizer's chat template (``web/chat.py``, as the server does).
Batches (several prompts in one body) and anything malformed give None: the router then routes
that request by load, and the server answers the error itself.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pdserve.engine.tokenizer import has_tokenizer, load_tokenizer
from pdserve.web.chat import chat_prompt_text

logger = logging.getLogger(__name__)


def load_local_tokenizer(path: str | None) -> Any | None:
    """A tokenizer from a local directory only (never a hub download); None if there is none."""
    if not path or not has_tokenizer(Path(path)):
        return None
    try:
        return load_tokenizer(path)
    except (OSError, ValueError) as e:
        logger.warning("tokenizer at %s did not load (%s)", path, e)
        return None


def prompt_ids(tokenizer: Any, path: str, body: dict) -> list[int] | None:
    """Token ids of the single prompt of ``body`` sent to ``path``; None when there is not exactly one
    or it cannot be read."""
    try:
        if path == "/generate":
            return _one(tokenizer, body.get("input_ids"), body.get("text"))
        if path == "/v1/completions":
            prompt = body.get("prompt")
            return _one(tokenizer, prompt if isinstance(prompt, list) else None,
                        prompt if isinstance(prompt, str) else None)
        if path == "/v1/chat/completions":
            return _chat(tokenizer, body.get("messages"))
    except Exception as e:  # noqa: BLE001 - a template or tokenizer error is the server's to report
        logger.debug("prompt of a %s request not tokenized: %s", path, e)
    return None


def _one(tokenizer: Any, ids: Any, text: Any) -> list[int] | None:
    if isinstance(ids, list) and ids and all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        return ids
    if isinstance(text, str) and text:
        return list(tokenizer.encode(text))
    return None


def _chat(tokenizer: Any, messages: Any) -> list[int] | None:
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        return None
    plain = [{**m, "content": _text(m.get("content"))} for m in messages]
    return list(tokenizer.encode(chat_prompt_text(tokenizer, plain), add_special_tokens=False))


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""
