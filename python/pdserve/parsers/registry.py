"""Parsers by name: ``--tool-call-parser`` and ``--reasoning-parser`` values (SGLang's), whose
lists live in ``config.py`` (TOOL_CALL_PARSERS, REASONING_PARSERS) so the flags can be checked
below this package; a test keeps the two in step."""

from __future__ import annotations

from collections.abc import Iterable

from pdserve.parsers.base import ToolParser
from pdserve.parsers.deepseekv3 import DeepSeekV3ToolParser
from pdserve.parsers.json_array import JsonArrayToolParser
from pdserve.parsers.kimi_k2 import KimiK2ToolParser
from pdserve.parsers.llama3 import Llama3ToolParser
from pdserve.parsers.qwen25 import Qwen25ToolParser
from pdserve.parsers.reasoning import DeepSeekR1ReasoningParser, Qwen3ReasoningParser, ReasoningParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (DeepSeekV3ToolParser, Qwen25ToolParser, Llama3ToolParser, KimiK2ToolParser)}
REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)}


def tool_parser(name: str, tools: Iterable[str]) -> ToolParser:
    """The ``--tool-call-parser`` ``name`` (or "json_array", the forced form) for these function names."""
    cls = JsonArrayToolParser if name == JsonArrayToolParser.name else TOOL_PARSERS.get(name)
    if cls is None:
        raise ValueError(f"tool_call_parser: unknown parser {name!r} (known: {', '.join(TOOL_PARSERS)})")
    return cls(tools)


def reasoning_parser(name: str) -> ReasoningParser:
    cls = REASONING_PARSERS.get(name)
    if cls is None:
        raise ValueError(f"reasoning_parser: unknown parser {name!r} (known: {', '.join(REASONING_PARSERS)})")
    return cls()
