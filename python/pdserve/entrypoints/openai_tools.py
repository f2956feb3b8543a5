"""What an OpenAI request asks of the output, before it runs: the grammar that constrains it
(``response_format``, SGLang's ``regex`` / ``ebnf`` extras, or the tool choice), which tools the
chat template is shown, and which parsers read the reply (``parsers/``).

- ``response_format`` json_object: any JSON object (the schema ``{"type": "object"}``, as SGLang
  does); json_schema: the given schema. The engine compiles it; a schema that does not compile is
  a 400 naming ``response_format.json_schema.schema``.
- ``tool_choice`` auto (the default with tools): the model writes calls in its own format, which
  ``--tool-call-parser`` reads; with no parser configured the reply is content, unparsed (SGLang's
  behaviour: the tools still reach the chat template). none: no tools at all, not even in the
  prompt. required, or a named function: a grammar forces a JSON array of
  ``{"name", "parameters"}`` objects built from the tools' parameter schemas (only the named one,
  which alone reaches the template), read back by ``parsers/json_array.py``; no parser needed.
  A named function is called once, and ``parallel_tool_calls`` false caps a required array at one
  call: the grammar then ends the reply with the call (finish_reason "tool_calls").
- Reasoning: with ``--reasoning-parser`` and ``separate_reasoning`` (default true), the thinking
  part goes to ``reasoning_content``; qwen3 with ``chat_template_kwargs.enable_thinking`` false
  has none, nor has deepseek-v3 without ``chat_template_kwargs.thinking`` true (each parser
  states its switch: ``parsers/reasoning.py``). A constrained reply to a request a reasoning
  parser reads thinks freely first: the grammar constrains only what follows the parser's
  end-of-thinking marker (``think_close``: SGLang's reasoner grammar). Where no reasoning parser
  reads the reply (none configured, ``separate_reasoning`` false, thinking off), the grammar
  constrains it from its first token.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pdserve.entrypoints.protocol import ChatCompletionRequest, CompletionRequest, NamedToolChoice, Tool
from pdserve.parsers import json_array
from pdserve.parsers.registry import reasoning_class, request_reasoning
from pdserve.web.errors import RequestError

JSON_OBJECT_SCHEMA = '{"type": "object"}'
# apply_chat_template's own parameters: the server sets them, chat_template_kwargs may not
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})


@dataclass(frozen=True)
class Constraint:
    """One grammar for the engine: ``kind`` is a SamplingParams field (json_schema, regex, ebnf);
    ``field`` the request field to name when it does not compile."""

    field: str
    kind: str
    text: str


@dataclass(frozen=True)
class ToolPlan:
    """How a chat request uses its tools."""

    template_tools: list[dict] | None = None  # what apply_chat_template is given as ``tools``
    parser: str | None = None  # the tool parser reading the reply ("json_array": the forced form)
    names: tuple[str, ...] = ()  # function names a call may have
    forced: Constraint | None = None  # required / named: the grammar of the JSON array
    schemas: dict[str, Any] | None = None  # auto: each name's parameters schema (parsers that infer names)


def tool_plan(req: ChatCompletionRequest, configured_parser: str | None) -> ToolPlan:
    """Validates tools and tool_choice (400s naming the field) and says how they are served."""
    tools = req.tools or []
    names = _tool_names(tools)
    choice = req.tool_choice or ("auto" if tools else "none")
    if choice == "none" or (not tools and choice == "auto"):
        return ToolPlan()
    if not tools:
        raise RequestError("tool_choice: needs tools (the request has none)", param="tool_choice")
    if choice == "auto":
        return ToolPlan(_template_tools(tools), configured_parser, names,
                        schemas={t.function.name: t.function.parameters for t in tools})
    chosen = tools
    parallel = req.parallel_tool_calls
    if isinstance(choice, NamedToolChoice):
        parallel = False  # one call of the named function: the reply ends with it
        chosen = [t for t in tools if t.function.name == choice.function.name]
        if not chosen:
            raise RequestError(f"tool_choice.function.name: no tool named {choice.function.name!r} in tools "
                               f"(tools: {', '.join(names)})", param="tool_choice.function.name")
    schema = json_array.schema([(t.function.name, t.function.parameters) for t in chosen], parallel)
    forced = Constraint("tools", "json_schema", json.dumps(schema))
    return ToolPlan(_template_tools(chosen), json_array.JsonArrayToolParser.name,
                    tuple(t.function.name for t in chosen), forced)


def _tool_names(tools: list[Tool]) -> tuple[str, ...]:
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):
        if tool.function.name in seen:
            field = f"tools[{i}].function.name"
            raise RequestError(f"{field}: {tool.function.name!r} is also tools[{seen[tool.function.name]}]'s name; "
                               f"function names must be distinct", param=field)
        seen[tool.function.name] = i
    return tuple(seen)


def _template_tools(tools: list[Tool]) -> list[dict]:
    return [t.model_dump(exclude_none=True, by_alias=True) for t in tools]


def constraint(req: ChatCompletionRequest | CompletionRequest, plan: ToolPlan | None = None) -> Constraint | None:
    """The one grammar the request asks for, if any; two at once is a 400 naming the second."""
    found = [c for c in (_response_format(req), _extra(req, "regex"), _extra(req, "ebnf"),
                         plan.forced if plan else None) if c is not None]
    if len(found) > 1:
        first, second = found[0], found[1]
        raise RequestError(f"{second.field}: cannot be combined with {first.field} (one constraint per request)",
                           param=second.field)
    return found[0] if found else None


def _response_format(req: ChatCompletionRequest | CompletionRequest) -> Constraint | None:
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Constraint("response_format", "json_schema", JSON_OBJECT_SCHEMA)
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise RequestError("response_format.json_schema.schema: required with type json_schema",
                           param="response_format.json_schema.schema")
    return Constraint("response_format.json_schema.schema", "json_schema", json.dumps(fmt.json_schema.schema_))


def _extra(req: ChatCompletionRequest | CompletionRequest, name: str) -> Constraint | None:
    value = getattr(req, name)
    return None if value is None else Constraint(name, name, value)


def reasoning_parser_name(req: ChatCompletionRequest, configured: str | None) -> str | None:
    """The reasoning parser for this request, or None (see the module docstring)."""
    if configured is None or not req.separate_reasoning:
        return None
    if request_reasoning(configured, req.chat_template_kwargs) is None:
        return None  # the request turned thinking off (qwen3 enable_thinking, deepseek-v3 thinking)
    return configured


def think_end(reasoning: str | None, grammar: Constraint | None) -> str | None:
    """``SamplingParams.think_end`` of a request read by the ``reasoning`` parser: its grammar, if
    any, waits for the end of the thinking part."""
    return None if reasoning is None or grammar is None else reasoning_class(reasoning).think_close


def template_kwargs(req: ChatCompletionRequest) -> dict:
    kwargs = dict(req.chat_template_kwargs or {})
    for key in kwargs:
        if key in RESERVED_TEMPLATE_KWARGS:
            raise RequestError(f"chat_template_kwargs.{key}: set by the server, not by the request",
                               param=f"chat_template_kwargs.{key}")
    return kwargs


def template_messages(req: ChatCompletionRequest) -> list[dict]:
    """The messages as chat templates take them: content as one string ("" for a turn that only
    called tools), an assistant turn's calls with their arguments as objects (transformers'
    convention, which Qwen's and Llama's templates render with ``tojson``)."""
    out = []
    for i, m in enumerate(req.messages):
        msg = m.model_dump(exclude={"tool_calls"}) | {"content": m.text()}
        if m.tool_calls is not None:
            if m.role != "assistant":
                raise RequestError(f"messages[{i}].tool_calls: only assistant messages carry tool calls",
                                   param=f"messages[{i}].tool_calls")
            msg["tool_calls"] = [_call_for_template(i, j, c.model_dump()) for j, c in enumerate(m.tool_calls)]
        out.append(msg)
    return out


def _call_for_template(i: int, j: int, call: dict) -> dict:
    """Arguments that are a JSON object go to the template as an object; a JSON object cut short
    (a call this server returned with finish_reason "length", echoed back by an agent) as the text
    it is (a template's ``tojson`` prints it as a JSON string); anything else is a 400 naming the field."""
    text = call["function"]["arguments"]
    try:
        args = json.loads(text)
    except (ValueError, RecursionError):  # nested past the stack: the request's fault, like bad JSON
        args = text if is_json_object_prefix(text) else None
    if not isinstance(args, (dict, str)):
        field = f"messages[{i}].tool_calls[{j}].function.arguments"
        raise RequestError(f"{field}: must be a JSON object (or one cut short), as a string", param=field)
    return {**call, "function": {**call["function"], "arguments": args}}


_NUMBER_PREFIX = re.compile(r"-?(0|[1-9][0-9]*)?(\.[0-9]*)?([eE][-+]?[0-9]*)?")
_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?")
_STRING = re.compile(r'"(?:[^"\\\x00-\x1f]|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*"?')
_STRING_TAIL = re.compile(r'\\(u[0-9a-fA-F]{0,3})?')  # an escape cut short at the end


class _End(Exception):
    """The text ended inside a value: it is a prefix so far."""


def is_json_object_prefix(text: str) -> bool:
    """Whether ``text`` is the beginning of a JSON object (the whole object included)."""
    s = text.strip()
    if not s or s[0] != "{":
        return not s
    try:
        end = _JsonPrefix(s).value(0)
    except _End:
        return True
    except (ValueError, RecursionError):  # nested past the stack: nothing this server wrote
        return False
    return end == len(s)


class _JsonPrefix:
    """A JSON value read from ``s``; raises _End where ``s`` ends inside it, ValueError where it breaks."""

    def __init__(self, s: str):
        self.s = s

    def ws(self, i: int) -> int:
        while i < len(self.s) and self.s[i] in " \t\r\n":
            i += 1
        if i == len(self.s):
            raise _End
        return i

    def value(self, i: int) -> int:
        i = self.ws(i)
        c = self.s[i]
        if c == "{":
            return self.items(i, "}", key=True)
        if c == "[":
            return self.items(i, "]", key=False)
        if c == '"':
            return self.string(i)
        for word in ("true", "false", "null"):
            if c == word[0]:
                piece = self.s[i:i + len(word)]
                if not word.startswith(piece):
                    raise ValueError(i)
                if len(piece) < len(word):
                    raise _End
                return i + len(word)
        return self.number(i)

    def items(self, i: int, close: str, key: bool) -> int:
        i = self.ws(i + 1)
        if self.s[i] == close:
            return i + 1
        while True:
            if key:
                if self.s[i] != '"':
                    raise ValueError(i)
                i = self.ws(self.string(i))
                if self.s[i] != ":":
                    raise ValueError(i)
                i += 1
            i = self.ws(self.value(i))
            if self.s[i] == close:
                return i + 1
            if self.s[i] != ",":
                raise ValueError(i)
            i = self.ws(i + 1)

    def string(self, i: int) -> int:
        m = _STRING.match(self.s, i)
        assert m is not None  # it matches the opening quote at least
        if m.group().endswith('"') and m.end() > i + 1:
            return m.end()
        if m.end() == len(self.s) or _STRING_TAIL.fullmatch(self.s, m.end()):
            raise _End
        raise ValueError(i)

    def number(self, i: int) -> int:
        j = i
        while j < len(self.s) and self.s[j] in "+-.eE0123456789":
            j += 1
        if j == len(self.s) and _NUMBER_PREFIX.fullmatch(self.s, i):
            raise _End
        if j == i or not _NUMBER.fullmatch(self.s, i, j):
            raise ValueError(i)
        return j
