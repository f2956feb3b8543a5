"""The token ids a server will make of a request body, so the router can hash its pages.

Mirrors the servers' own tokenization: ``/generate`` text and completions prompts with special
tokens, chat messages through the tokenizer's chat template (``web/chat.py``, as the server does).
Batches (several prompts in one body) and anything malformed give None: the router then routes
that request by load, and the server answers the error itself.

Without a tokenizer, ``prompt_ids`` gives only the ids a request carries itself, and
``prompt_text`` the prompt as text (chat messages joined in a fixed form, so a conversation's next
turn extends its last one character for character), for the approximate index's text blocks.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pdserve.engine.tokenizer import has_tokenizer, load_tokenizer
from pdserve.web.chat import chat_prompt_text

logger = logging.getLogger(__name__)
# A token is rarely longer than this many characters: a prompt cut at max_tokens * this keeps its
# first max_tokens tokens (the last one may be split: only the last page hash can differ).
MAX_CHARS_PER_TOKEN = 16


def load_local_tokenizer(path: str | None) -> Any | None:
    """A tokenizer from a local directory only (never a hub download); None if there is none."""
    if not path or not has_tokenizer(Path(path)):
        return None
    try:
        return load_tokenizer(path)
    except (OSError, ValueError) as e:
        logger.warning("tokenizer at %s did not load (%s)", path, e)
        return None


def prompt_ids(tokenizer: Any | None, path: str, body: dict, max_tokens: int | None = None) -> list[int] | None:
    """Token ids of the single prompt of ``body`` sent to ``path``; None when there is not exactly one
    or it cannot be read (or, without a tokenizer, when the request gives text). ``max_tokens``: at
    most this many leading ids, from at most ``MAX_CHARS_PER_TOKEN`` times as many characters of text
    (a prompt longer than the context is the server's to refuse; its prefix is all routing needs)."""
    chars = None if max_tokens is None else max_tokens * MAX_CHARS_PER_TOKEN
    try:
        if path == "/generate":
            ids = _one(tokenizer, body.get("input_ids"), body.get("text"), max_tokens, chars)
        elif path == "/v1/completions":
            prompt = body.get("prompt")
            ids = _one(tokenizer, prompt if isinstance(prompt, list) else None,
                       prompt if isinstance(prompt, str) else None, max_tokens, chars)
        elif path == "/v1/chat/completions":
            ids = _chat(tokenizer, body.get("messages"), chars)
        else:
            return None
        return ids if ids is None or max_tokens is None else ids[:max_tokens]
    except Exception as e:  # noqa: BLE001 - a template or tokenizer error is the server's to report
        logger.debug("prompt of a %s request not tokenized: %s", path, e)
    return None


def prompt_text(path: str, body: dict) -> str | None:
    """The single prompt of ``body`` as text, for matching without a tokenizer; None when there is
    not exactly one text prompt. Chat messages become ``role``, ``content`` pairs each closed by
    separators no message holds in practice (the form is the router's own: only prefixes matter)."""
    if path == "/generate":
        text = body.get("text")
    elif path == "/v1/completions":
        text = body.get("prompt")
    elif path == "/v1/chat/completions":
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            return None
        text = "".join(f"{m.get('role')}\x1f{_text(m.get('content'))}\x1e" for m in messages)
    else:
        return None
    return text if isinstance(text, str) and text else None


def _one(tokenizer: Any | None, ids: Any, text: Any, max_tokens: int | None, chars: int | None) -> list[int] | None:
    if isinstance(ids, list) and ids:
        head = ids[:max_tokens]
        return head if all(isinstance(t, int) and not isinstance(t, bool) for t in head) else None
    if tokenizer is not None and isinstance(text, str) and text:
        return list(tokenizer.encode(text[:chars]))
    return None


def _chat(tokenizer: Any | None, messages: Any, chars: int | None) -> list[int] | None:
    if tokenizer is None or not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        return None
    plain = [{**m, "content": _text(m.get("content"))} for m in messages]
    return list(tokenizer.encode(chat_prompt_text(tokenizer, plain)[:chars], add_special_tokens=False))


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""
