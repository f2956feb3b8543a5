"""A chat choice's reply in OpenAI's shape once parsers apply: ``reasoning_content``,
``tool_calls`` (ids ``call_...``, or the model's own where its format has one),
``finish_reason`` "tool_calls" when the model stopped after calling tools (a reply cut by
``max_tokens`` keeps "length"), and the same as stream deltas (``ChoiceStream``). With
``parallel_tool_calls`` false only the first call is returned, under any tool choice (the forced
ones' grammar allows one call; under auto the model may write more, which are dropped)."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdserve.parsers.output import CallDelta, ChatDelta, ChatOutputParser
from pdserve.parsers.registry import reasoning_parser, tool_parser


@dataclass(frozen=True)
class OutputPlan:
    """Which parsers read a chat request's choices (none: the text is the content)."""

    reasoning: str | None = None  # --reasoning-parser name
    tools: str | None = None  # tool parser name
    tool_names: tuple[str, ...] = ()
    stream_reasoning: bool = True  # stream the thinking part as it comes, else once it ends
    tool_schemas: Mapping[str, Any] | None = None  # each tool's parameters schema, where known
    reasoning_forced: bool | None = None  # the reply starts inside thinking (None: the parser's default)
    parallel: bool = True  # parallel_tool_calls: false keeps the first call alone (whatever the tool choice)

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.tools is not None

    def parser(self) -> ChatOutputParser:
        tools = self.tool_schemas if self.tool_schemas is not None else self.tool_names
        return ChatOutputParser(reasoning_parser(self.reasoning, self.reasoning_forced) if self.reasoning else None,
                                tool_parser(self.tools, tools) if self.tools else None)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def final_reason(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason


def chat_message(plan: OutputPlan, text: str, reason: str | None) -> tuple[dict, str | None]:
    """(message, finish_reason) of a whole choice."""
    if not plan.active:
        return {"role": "assistant", "content": text}, reason
    out = plan.parser().parse(text)
    message: dict = {"role": "assistant", "content": out.content if out.content or not out.calls else None}
    if out.reasoning is not None:
        message["reasoning_content"] = out.reasoning or None
    calls = out.calls if plan.parallel else out.calls[:1]
    if calls:
        message["tool_calls"] = [{"id": c.id or new_call_id(), "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
    return message, final_reason(reason, bool(calls))


class ChoiceStream:
    """One choice's stream through its parsers: text pieces in, OpenAI ``delta`` objects out."""

    def __init__(self, plan: OutputPlan):
        self.parser = plan.parser()
        self.stream_reasoning = plan.stream_reasoning
        self.parallel = plan.parallel
        self.held = ""  # thinking not sent yet (stream_reasoning false)
        self.ids: dict[int, str] = {}  # call index -> the id its first delta carried

    @property
    def called(self) -> bool:
        return bool(self.ids)

    def deltas(self, text: str, finished: bool) -> list[dict]:
        d = self.parser.feed(text)
        if finished:
            end = self.parser.finish()
            d = ChatDelta(d.reasoning + end.reasoning, d.content + end.content, d.calls + end.calls)
        out: list[dict] = []
        reasoning = self._reasoning(d, finished)
        if reasoning:
            out.append({"reasoning_content": reasoning})
        if d.content:
            out.append({"content": d.content})
        out += [{"tool_calls": [self._call(c)]} for c in d.calls if self.parallel or c.index == 0]
        return out

    def _reasoning(self, d: ChatDelta, finished: bool) -> str:
        if self.stream_reasoning:
            return d.reasoning
        self.held += d.reasoning
        if self.held and (d.content or d.calls or finished):  # the thinking part has ended
            out, self.held = self.held, ""
            return out
        return ""

    def _call(self, c: CallDelta) -> dict:
        if c.name is None:
            return {"index": c.index, "function": {"arguments": c.arguments}}
        self.ids[c.index] = c.id or new_call_id()
        return {"index": c.index, "id": self.ids[c.index], "type": "function",
                "function": {"name": c.name, "arguments": ""}}
