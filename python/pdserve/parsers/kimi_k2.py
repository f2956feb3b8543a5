"""Kimi-K2 (``--tool-call-parser kimi_k2``): special-token sections, each call named by the model's
own call id ``functions.NAME:IDX``, which the API returns as the call's id (Kimi's chat template
renders the ids back into later turns):

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
    {"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

Kimi-K2.5 and later sometimes write another id: a bare counter (``3``) or, copying the ids of
earlier turns, a client's (``call_3``, ``toolu_...``, a UUID). The function is then the one tool
the arguments fit (``tool_match``): known at once when the request offers a single tool, else
only when the call is complete; the id becomes ``functions.NAME:IDX`` for a counter and stays the
client's own otherwise. A call that fits no single tool, or names a function the request does not
offer, is dropped, special tokens and all; so are this format's tokens met outside a call.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from pdserve.parsers.base import ToolCall
from pdserve.parsers.tagged import TaggedToolParser
from pdserve.parsers.tool_match import infer_tool

ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
_CALL_ID = re.compile(r"(?:functions\.)?(?P<name>[^\s:]+):(?P<index>\d+)")
_COUNTER = re.compile(r"\d+")


class KimiK2ToolParser(TaggedToolParser):
    name = "kimi_k2"
    call_open = "<|tool_call_begin|>"
    call_close = "<|tool_call_end|>"
    section_tags = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
    stray_tags = (ARGUMENT_BEGIN, "<|tool_call_end|>")
    unmatched_is_content = False

    def __init__(self, tools: Iterable[Any] | Mapping[str, Any]):
        super().__init__(tools)
        # a stream rescans every complete call on each token: each one's arguments are matched once
        self._inferred: dict[str, str | None] = {}

    def read_call(self, body: str, complete: bool) -> ToolCall | None:
        at = body.find(ARGUMENT_BEGIN)
        if at < 0:
            return None
        call_id = body[:at].strip()
        args = body[at + len(ARGUMENT_BEGIN):].strip()
        named = _CALL_ID.fullmatch(call_id)
        if named is not None:
            name = named["name"]
            if name not in self.tools:
                return None
            return ToolCall(name, _arguments(args, complete), id=f"functions.{name}:{named['index']}")
        inferred = self._infer(args if complete else None)
        if inferred is None:
            return None
        own_id = f"functions.{inferred}:{call_id}" if _COUNTER.fullmatch(call_id) else call_id or None
        return ToolCall(inferred, _arguments(args, complete), id=own_id)

    def _infer(self, args: str | None) -> str | None:
        if args is None or len(self.tools) < 2:
            return infer_tool(self.schemas, self.tools, args)
        if args not in self._inferred:
            self._inferred[args] = infer_tool(self.schemas, self.tools, args)
        return self._inferred[args]


def _arguments(args: str, complete: bool) -> str:
    return args or ("{}" if complete else "")
