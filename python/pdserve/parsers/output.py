"""One chat choice's output through the parsers: reasoning split off first, tool calls read from
what remains, whole (``parse``) or as a stream of deltas (``feed`` / ``finish``).

The stream rescans the text generated so far on every chunk and emits what the scan gained since
the last one (``diff``), so the deltas of a stream add up to ``parse`` of the whole text, split
points anywhere. Each scan costs a few C-level string searches over the text (and a regex pass over
an open call's JSON), which is small beside the tokenizer's own per-token work.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.parsers.base import Scan, ToolCall, ToolParser
from pdserve.parsers.reasoning import ReasoningParser


@dataclass
class ChatOutput:
    """A whole choice: ``reasoning`` is None when no reasoning parser applied."""

    reasoning: str | None
    content: str
    calls: list[ToolCall] = field(default_factory=list)


@dataclass
class CallDelta:
    """One entry of OpenAI's streamed ``tool_calls``: a call's first delta carries its ``name``
    (and the model's own ``id``, if any) with empty arguments; later ones carry argument text."""

    index: int
    name: str | None = None
    id: str | None = None
    arguments: str = ""


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


class NotAPrefix(AssertionError):
    """A scan took back what an earlier scan of a shorter text reported: a parser bug."""


class ChatOutputParser:
    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None):
        self.reasoning = reasoning
        self.tools = tools
        self.text = ""
        self.sent = ChatOutput(None if reasoning is None else "", "")

    def parse(self, text: str) -> ChatOutput:
        """The whole output ``text`` (a fresh parser's; the stream state is not used)."""
        return self._scan(text, final=True)

    def feed(self, chunk: str) -> ChatDelta:
        """The delta a new piece of text makes; empty while nothing is certain yet."""
        if not chunk:
            return ChatDelta()
        self.text += chunk
        return self._advance(self._scan(self.text, final=False))

    def finish(self) -> ChatDelta:
        """What the end of the output releases (held-back text, a call cut short)."""
        return self._advance(self._scan(self.text, final=True))

    def _scan(self, text: str, final: bool) -> ChatOutput:
        reasoning, content = (None, text) if self.reasoning is None else self.reasoning.split(text, final)
        scan = Scan(content) if self.tools is None else self.tools.scan(content, final)
        return ChatOutput(reasoning, scan.content, scan.calls)

    def _advance(self, new: ChatOutput) -> ChatDelta:
        delta = diff(self.sent, new)
        self.sent = new
        return delta


def diff(old: ChatOutput, new: ChatOutput) -> ChatDelta:
    """What ``new`` adds to ``old``; raises NotAPrefix if it changes anything ``old`` held."""
    out = ChatDelta(_suffix(old.reasoning or "", new.reasoning or "", "reasoning"),
                    _suffix(old.content, new.content, "content"))
    if len(new.calls) < len(old.calls):
        raise NotAPrefix(f"calls: {len(old.calls)} reported, then {len(new.calls)}")
    for i, call in enumerate(new.calls):
        if i >= len(old.calls):
            out.calls.append(CallDelta(i, call.name, call.id, ""))
            before = ""
        else:
            if (old.calls[i].name, old.calls[i].id) != (call.name, call.id):
                raise NotAPrefix(f"calls[{i}]: {old.calls[i].name!r} became {call.name!r}")
            before = old.calls[i].arguments
        more = _suffix(before, call.arguments, f"calls[{i}].arguments")
        if more:
            out.calls.append(CallDelta(i, arguments=more))
    return out


def _suffix(old: str, new: str, what: str) -> str:
    if not new.startswith(old):
        raise NotAPrefix(f"{what}: {old!r} is not a prefix of {new!r}")
    return new[len(old):]
