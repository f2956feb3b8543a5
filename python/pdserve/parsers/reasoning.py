"""Reasoning parsers (``--reasoning-parser``, SGLang's names): which part of the output is the
model's thinking (``reasoning_content``) and which its answer (``content``).

- ``deepseek-r1``: DeepSeek-R1's chat template opens ``<think>`` itself, so the model's output
  starts inside the thinking part: everything up to ``</think>`` is reasoning (R1-0528 writes the
  ``<think>`` again; a leading one is dropped). No ``</think>`` at all: all of it is reasoning, as
  in SGLang (a reply cut short while thinking).
- ``qwen3``: Qwen3 writes ``<think>...</think>`` itself when thinking; a reply that does not open
  with ``<think>`` has no reasoning part. With ``chat_template_kwargs.enable_thinking`` false the
  template tells the model not to think, and the API applies no reasoning parser at all.

Both obey ``base``'s streaming rule: ``split(text, final=False)`` holds back what more text could
change (a partial tag, whitespace at the edge of the thinking part), so deltas replay the whole.
The thinking part is returned stripped of its surrounding whitespace, the answer of its leading
whitespace (the template's newlines after ``</think>``).
"""

from __future__ import annotations

from typing import ClassVar

from pdserve.parsers.base import partial_marker_len

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


class ReasoningParser:
    """Splits ``<think>``-style output; ``forced``: the output starts inside the thinking part.

    What constrained decoding needs to know (engine/grammar.py): ``think_end``, the text that ends
    the thinking part, and ``thinks(template_kwargs)``, whether a request's reply starts with one
    (then its grammar constrains only what follows ``think_end``)."""

    name: ClassVar[str]
    forced: ClassVar[bool]
    think_end: ClassVar[str] = THINK_CLOSE

    def thinks(self, template_kwargs: dict) -> bool:
        """Whether a reply to a request rendered with ``template_kwargs`` starts by thinking."""
        return True

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of ``text``; with ``final`` false, only what a longer text keeps."""
        rest = text.lstrip()
        if rest.startswith(THINK_OPEN):
            start = len(text) - len(rest) + len(THINK_OPEN)
        elif not final and THINK_OPEN.startswith(rest):
            return "", ""  # an opening tag may be arriving
        elif self.forced:
            start = 0
        else:
            return "", text
        end = text.find(THINK_CLOSE, start)
        if end >= 0:
            return text[start:end].strip(), text[end + len(THINK_CLOSE):].lstrip()
        body = text[start:]
        if not final:
            body = body[:len(body) - partial_marker_len(body, (THINK_CLOSE,))]
        return body.strip(), ""


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek-r1"
    forced = True


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    forced = False

    def thinks(self, template_kwargs: dict) -> bool:
        return template_kwargs.get("enable_thinking") is not False
