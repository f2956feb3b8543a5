"""Kimi-K2 (``--tool-call-parser kimi_k2``): special-token sections, each call named by the model's
own call id ``functions.NAME:IDX``, which the API returns as the call's id (Kimi's chat template
renders the ids back into later turns):

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
    {"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>
"""

from __future__ import annotations

import re

from pdserve.parsers.base import ToolCall
from pdserve.parsers.tagged import TaggedToolParser

ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
_CALL_ID = re.compile(r"(?:functions\.)?(?P<name>.+):(?P<index>\d+)", re.S)


class KimiK2ToolParser(TaggedToolParser):
    name = "kimi_k2"
    call_open = "<|tool_call_begin|>"
    call_close = "<|tool_call_end|>"
    section_tags = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")

    def read_call(self, body: str, complete: bool) -> ToolCall | None:
        at = body.find(ARGUMENT_BEGIN)
        if at < 0:
            return None
        m = _CALL_ID.fullmatch(body[:at].strip())
        if m is None or m["name"] not in self.tools:
            return None
        args = body[at + len(ARGUMENT_BEGIN):].strip()
        return ToolCall(m["name"], args or ("{}" if complete else ""), id=f"functions.{m['name']}:{m['index']}")
