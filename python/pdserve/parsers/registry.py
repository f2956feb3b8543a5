"""Parsers by name: ``--tool-call-parser`` and ``--reasoning-parser`` values (SGLang's), whose
lists live in ``config.py`` (TOOL_CALL_PARSERS, REASONING_PARSERS) so the flags can be checked
below this package; a test keeps the two in step. Names are case-insensitive, as in SGLang
(``DeepSeek-R1`` is ``deepseek-r1``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from pdserve.parsers.base import ToolParser
from pdserve.parsers.deepseekv3 import DeepSeekV3ToolParser
from pdserve.parsers.deepseekv31 import DeepSeekV31ToolParser
from pdserve.parsers.dsml import DeepSeekV4ToolParser, DeepSeekV32ToolParser
from pdserve.parsers.json_array import JsonArrayToolParser
from pdserve.parsers.kimi_k2 import KimiK2ToolParser
from pdserve.parsers.llama3 import Llama3ToolParser
from pdserve.parsers.qwen25 import Qwen25ToolParser
from pdserve.parsers.reasoning import (
    DeepSeekR1ReasoningParser,
    DeepSeekV3ReasoningParser,
    KimiK2ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningParser,
)

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (DeepSeekV3ToolParser, Qwen25ToolParser, Llama3ToolParser, KimiK2ToolParser,
                              DeepSeekV31ToolParser, DeepSeekV32ToolParser, DeepSeekV4ToolParser)}
REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser, DeepSeekV3ReasoningParser,
                              KimiK2ReasoningParser)}


def tool_parser(name: str, tools: Iterable[str] | Mapping[str, Any]) -> ToolParser:
    """The ``--tool-call-parser`` ``name`` (or "json_array", the forced form) for these functions:
    their names, or each name with its parameters schema (``base.ToolParser``)."""
    key = name.lower()
    cls = JsonArrayToolParser if key == JsonArrayToolParser.name else TOOL_PARSERS.get(key)
    if cls is None:
        raise ValueError(f"tool_call_parser: unknown parser {name!r} (known: {', '.join(TOOL_PARSERS)})")
    return cls(tools)


def reasoning_class(name: str) -> type[ReasoningParser]:
    cls = REASONING_PARSERS.get(name.lower())
    if cls is None:
        raise ValueError(f"reasoning_parser: unknown parser {name!r} (known: {', '.join(REASONING_PARSERS)})")
    return cls


def reasoning_parser(name: str, forced: bool | None = None) -> ReasoningParser:
    """The ``--reasoning-parser`` ``name``; ``forced``: whether the reply starts inside the
    thinking part (None: the parser's own default)."""
    return reasoning_class(name)(forced)


def request_reasoning(name: str, template_kwargs: Mapping[str, Any] | None) -> ReasoningParser | None:
    """The reasoning parser ``name`` as a request with these ``chat_template_kwargs`` needs it (a
    template told to think may open the thinking part itself), or None when they turn thinking off."""
    return reasoning_class(name).for_request(template_kwargs)
