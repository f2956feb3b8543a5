"""The tool-call parser contract, and the pieces every family's parser is built from.

A parser is a pure function of the text generated so far: ``scan(text, final)`` says which part
of it is content and which calls it holds. While the text is still growing (``final`` false) a
scan reports only what no later text can change: a content suffix that may be the start of a tag,
and trailing whitespace that may turn out to precede one, are held back; a call appears once its
function name is known, with as much of its arguments as is certain. That one rule makes
streaming an exact replay of the whole parse: ``output.ChatOutputParser`` rescans the text as it
grows and emits the difference, so the deltas of a stream add up to ``scan(text, final=True)``
whatever the split points (a tag cut in the middle included).

What a scan may never do, for that to hold: take back content it reported, rename a call, or
report arguments that are not a prefix of what a longer text reports. ``output.diff`` checks it.

Formats are lenient where models are: a call whose function is not among the request's tools,
or whose text never yields a name, is returned as content, verbatim; arguments are passed on as
the model wrote them (the raw JSON text, as OpenAI does: a truncated or malformed argument object
reaches the client as such), so the API never invents or reorders a byte of them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True)
class ToolCall:
    """One function call found in the output. ``arguments`` is the raw JSON text of the argument
    object (possibly incomplete while streaming); ``id`` is the model's own call id where its
    format has one (Kimi-K2's ``functions.NAME:IDX``), else None and the API makes one."""

    name: str
    arguments: str
    id: str | None = None


@dataclass
class Scan:
    """What a text is: its content (all text outside calls, joined) and its calls, in order."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class ToolParser(ABC):
    """A model family's tool-call format. Subclasses set ``name`` (SGLang's ``--tool-call-parser``
    value) and implement ``scan`` under the rules of this module's docstring.

    ``tools``: the function names the request offers; or what they take as well, which formats
    whose calls may lack a name (Kimi-K2's foreign call ids) need to tell the function from the
    arguments: a mapping of each name to its parameters schema (None: the tool takes none), or the
    request's tools themselves (OpenAI's ``{"type": "function", "function": {...}}``, as dicts or
    as the API's models)."""

    name: ClassVar[str]

    def __init__(self, tools: Iterable[Any] | Mapping[str, Any]):
        offered = tools if isinstance(tools, Mapping) else list(tools)
        self.schemas = tool_schemas(offered)
        self.tools = frozenset(self.schemas if self.schemas is not None else offered)

    @abstractmethod
    def scan(self, text: str, final: bool) -> Scan:
        """Content and calls of ``text``; with ``final`` false, only what a longer text keeps."""

    def parse(self, text: str) -> Scan:
        return self.scan(text, final=True)


def tool_schemas(tools: list[Any] | Mapping[str, Any]) -> dict[str, Any] | None:
    """Each offered function's parameters schema, or None when ``tools`` are bare names."""
    if isinstance(tools, Mapping):
        return dict(tools)
    if all(isinstance(t, str) for t in tools):
        return None
    out: dict[str, Any] = {}
    for tool in tools:
        spec = tool.model_dump(by_alias=True) if hasattr(tool, "model_dump") else tool
        function = spec.get("function", spec) if isinstance(spec, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ValueError(f"tools: {tool!r} is neither a function name nor a function tool")
        out[function["name"]] = function.get("parameters")
    return out


def partial_marker_len(text: str, markers: Iterable[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``markers``:
    what a stream must hold back, since the next characters may complete the marker."""
    best = 0
    for marker in markers:
        tail = text[max(0, len(text) - len(marker) + 1):] if len(marker) > 1 else ""
        i = tail.find(marker[0])
        while i >= 0 and len(tail) - i > best:
            if marker.startswith(tail[i:]):
                best = len(tail) - i
                break
            i = tail.find(marker[0], i + 1)
    return best


def find_first(text: str, markers: Iterable[str], start: int = 0) -> tuple[int, str] | None:
    """The earliest occurrence of any of ``markers`` in ``text[start:]``: (offset, marker)."""
    found = [(i, m) for m in markers if (i := text.find(m, start)) >= 0]
    return min(found, key=lambda f: (f[0], -len(f[1]))) if found else None


class ContentBuilder:
    """Joins the content pieces around calls. Whitespace next to a call or a tag is layout, not
    content (the newline between two ``</tool_call>`` blocks), so a piece is stripped on the sides
    that touch one; and while the text may still grow, a trailing run of whitespace is held back,
    since a call may follow it."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.calls: list[ToolCall] = []
        self.pending = ""
        self.after_boundary = False

    def text(self, piece: str) -> None:
        self.pending += piece

    def boundary(self) -> None:
        """A tag or a call follows the pending text."""
        self.parts.append(self._stripped(right=True))
        self.pending = ""
        self.after_boundary = True

    def call(self, call: ToolCall) -> None:
        self.boundary()
        self.calls.append(call)

    def result(self, final: bool) -> Scan:
        """The scan so far; ``final`` false keeps the pending text's trailing whitespace back."""
        return Scan("".join(self.parts) + self._stripped(right=not final), self.calls)

    def _stripped(self, right: bool) -> str:
        piece = self.pending.lstrip() if self.after_boundary else self.pending
        return piece.rstrip() if right else piece
