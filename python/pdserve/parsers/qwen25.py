"""Qwen2.5 / Qwen3 (``--tool-call-parser qwen25``): Hermes-style JSON between ``<tool_call>`` tags,
one block per call, as the models' chat templates ask for:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""

from __future__ import annotations

from pdserve.parsers.base import ToolCall
from pdserve.parsers.json_scan import object_call, scan_object, skip_ws
from pdserve.parsers.tagged import TaggedToolParser

ARGUMENT_KEYS = ("arguments", "parameters")


class Qwen25ToolParser(TaggedToolParser):
    name = "qwen25"
    call_open = "<tool_call>"
    call_close = "</tool_call>"

    def read_call(self, body: str, complete: bool) -> ToolCall | None:
        start = skip_ws(body, 0, len(body))
        if start >= len(body) or body[start] != "{":
            return None
        return object_call(body, len(body), scan_object(body, start, len(body)), self.tools, ARGUMENT_KEYS, complete)
