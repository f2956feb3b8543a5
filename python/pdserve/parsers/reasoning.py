"""Reasoning parsers (``--reasoning-parser``, SGLang's names): which part of the output is the
model's thinking (``reasoning_content``) and which its answer (``content``).

- ``deepseek-r1``: DeepSeek-R1's chat template opens ``<think>`` itself, so the model's output
  starts inside the thinking part: everything up to ``</think>`` is reasoning (R1-0528 writes the
  ``<think>`` again; a leading one is dropped). No ``</think>`` at all: all of it is reasoning, as
  in SGLang (a reply cut short while thinking).
- ``qwen3``: Qwen3 writes ``<think>...</think>`` itself when thinking; a reply that does not open
  with ``<think>`` has no reasoning part. With ``chat_template_kwargs.enable_thinking`` false the
  template tells the model not to think, and the API applies no reasoning parser at all.
- ``deepseek-v3`` (DeepSeek-V3.1 / V3.2): Qwen3's tags, but thinking is off unless the request
  sets ``chat_template_kwargs.thinking`` true; the template then opens ``<think>`` itself, so the
  reply starts inside the thinking part, as with R1.
- ``kimi_k2``: Qwen3's tags; the model may go from thinking straight to a tool-call section
  (``<|tool_calls_section_begin|>``) without ``</think>``: the section ends the thinking part and
  stays in the content, for the tool parser. ``chat_template_kwargs.thinking`` false: no parser.

Every parser states its end-of-thinking marker (``think_close``), what else ends thinking
(``tool_start``) and whether a reply starts inside thinking (``forced``), which a grammar that
must wait for the thinking part to end needs to know.

All obey ``base``'s streaming rule: ``split(text, final=False)`` holds back what more text could
change (a partial tag, whitespace at the edge of the thinking part), so deltas replay the whole.
The thinking part is returned stripped of its surrounding whitespace, the answer of its leading
whitespace (the template's newlines after ``</think>``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from pdserve.parsers.base import find_first, partial_marker_len

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


class ReasoningParser:
    """Splits ``<think>``-style output. ``forced``: the output starts inside the thinking part
    (the class's default unless given). ``thinking_kwarg``: the ``chat_template_kwargs`` key that
    switches thinking on and off (``thinking_default`` when the request leaves it out)."""

    name: ClassVar[str]
    think_open: ClassVar[str] = THINK_OPEN
    think_close: ClassVar[str] = THINK_CLOSE
    tool_start: ClassVar[str | None] = None
    thinking_kwarg: ClassVar[str | None] = None
    thinking_default: ClassVar[bool] = True
    forced: bool = False

    def __init__(self, forced: bool | None = None):
        if forced is not None:
            self.forced = forced

    @classmethod
    def thinking(cls, template_kwargs: Mapping[str, Any] | None) -> bool:
        """Whether a request with these ``chat_template_kwargs`` lets the model think at all."""
        if cls.thinking_kwarg is None:
            return True
        value = (template_kwargs or {}).get(cls.thinking_kwarg)
        return cls.thinking_default if value is None else bool(value)

    @classmethod
    def for_request(cls, template_kwargs: Mapping[str, Any] | None) -> ReasoningParser | None:
        """The parser for a request, or None when the request turns thinking off."""
        return cls() if cls.thinking(template_kwargs) else None

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of ``text``; with ``final`` false, only what a longer text keeps."""
        rest = text.lstrip()
        if rest.startswith(self.think_open):
            start = len(text) - len(rest) + len(self.think_open)
        elif not final and self.think_open.startswith(rest):
            return "", ""  # an opening tag may be arriving
        elif self.forced:
            start = 0
        else:
            return "", text
        ends = (self.think_close,) if self.tool_start is None else (self.think_close, self.tool_start)
        hit = find_first(text, ends, start)
        if hit is not None:
            at, marker = hit
            if marker == self.think_close:
                return text[start:at].strip(), text[at + len(marker):].lstrip()
            return text[start:at].strip(), text[at:]  # the tool section is the tool parser's
        body = text[start:]
        if not final:
            body = body[:len(body) - partial_marker_len(body, ends)]
        return body.strip(), ""


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek-r1"
    forced = True


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    thinking_kwarg = "enable_thinking"


class DeepSeekV3ReasoningParser(ReasoningParser):
    name = "deepseek-v3"
    thinking_kwarg = "thinking"
    thinking_default = False

    @classmethod
    def for_request(cls, template_kwargs: Mapping[str, Any] | None) -> ReasoningParser | None:
        # thinking on: the template ends the prompt with <think>, so the reply starts inside it
        return cls(forced=True) if cls.thinking(template_kwargs) else None


class KimiK2ReasoningParser(ReasoningParser):
    name = "kimi_k2"
    tool_start = "<|tool_calls_section_begin|>"
    thinking_kwarg = "thinking"
