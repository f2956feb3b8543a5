"""Tool-call and reasoning parsers on recorded outputs of each model family: the whole parse, and
the stream at every split point (two chunks split anywhere, a tag cut in the middle included, and
one character at a time) adding up to exactly the whole parse."""

from __future__ import annotations

import random

import pytest
from recorded_outputs import (
    CASES,
    DS_BEGIN,
    DS_CALL,
    DS_SEP,
    DSML_BEGIN,
    KIMI_BEGIN,
    MALFORMED,
    REASONING,
    REQUEST_REASONING,
    SCHEMAS,
    TOOLS,
    kimi_call,
)

from pdserve.config import REASONING_PARSERS, TOOL_CALL_PARSERS, ServerArgs
from pdserve.parsers.output import ChatOutput, ChatOutputParser
from pdserve.parsers.registry import REASONING_PARSERS as REASONING_REGISTRY
from pdserve.parsers.registry import TOOL_PARSERS, reasoning_parser, request_reasoning, tool_parser

FORCED_ARRAY = ('[{"name": "get_weather", "parameters": {"city": "Oslo"}}, '
                '{"name": "get_time", "arguments": {"timezone": "UTC"}}]')


def assemble(parser: ChatOutputParser, chunks: list[str]) -> ChatOutput:
    """The message a client builds from the stream's deltas (OpenAI's accumulation rules)."""
    out = ChatOutput(None if parser.reasoning is None else "", "")
    calls: dict[int, dict] = {}
    for delta in [parser.feed(c) for c in chunks] + [parser.finish()]:
        if out.reasoning is not None:
            out.reasoning += delta.reasoning
        out.content += delta.content
        for d in delta.calls:
            if d.name is not None:
                assert d.index == len(calls) and d.arguments == "", "a call opens with its name alone, in order"
                calls[d.index] = {"name": d.name, "id": d.id, "arguments": ""}
            else:
                calls[d.index]["arguments"] += d.arguments
    from pdserve.parsers.base import ToolCall
    out.calls = [ToolCall(c["name"], c["arguments"], c["id"]) for c in calls.values()]
    return out


def splits(text: str):
    """Every two-chunk split, and one character at a time."""
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text)


def make(tool: str | None = None, reasoning: str | None = None, tools=SCHEMAS) -> ChatOutputParser:
    return ChatOutputParser(reasoning_parser(reasoning) if reasoning else None,
                            tool_parser(tool, tools) if tool else None)


def expected(content: str, calls: list) -> tuple:
    return content, [(n, a, i) for n, a, i in calls]


def got(out: ChatOutput) -> tuple:
    return out.content, [(c.name, c.arguments, c.id) for c in out.calls]


def test_names_match_the_flags():
    assert tuple(TOOL_PARSERS) == TOOL_CALL_PARSERS
    assert tuple(REASONING_REGISTRY) == REASONING_PARSERS
    with pytest.raises(ValueError, match="tool_call_parser: unknown parser 'hermes'"):
        tool_parser("hermes", TOOLS)


@pytest.mark.parametrize("name,text,content,calls", CASES + MALFORMED,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES + MALFORMED)])
def test_whole_output(name, text, content, calls):
    assert got(make(name).parse(text)) == expected(content, calls)


@pytest.mark.parametrize("name,text,content,calls", CASES + MALFORMED,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES + MALFORMED)])
def test_stream_at_every_split_point(name, text, content, calls):
    for chunks in splits(text):
        assert got(assemble(make(name), chunks)) == expected(content, calls), chunks


@pytest.mark.parametrize("name,text,reasoning,content", REASONING, ids=[f"{r[0]}-{i}" for i, r in enumerate(REASONING)])
def test_reasoning(name, text, reasoning, content):
    whole = make(reasoning=name).parse(text)
    assert (whole.reasoning, whole.content) == (reasoning, content)
    for chunks in splits(text):
        streamed = assemble(make(reasoning=name), chunks)
        assert (streamed.reasoning, streamed.content) == (reasoning, content), chunks


def test_reasoning_then_tool_calls():
    """Qwen3 thinking, then a call: the thinking part never reaches the tool parser."""
    text = ("<think>\nThe user wants Paris weather; <tool_call> is how I call tools.\n</think>\n\n"
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    for chunks in splits(text):
        out = assemble(make("qwen25", "qwen3"), chunks)
        assert out.reasoning == "The user wants Paris weather; <tool_call> is how I call tools."
        assert got(out) == ("", [("get_weather", '{"city": "Paris"}', None)])


def test_name_comes_first_then_argument_fragments():
    parser = make("kimi_k2")
    text = CASES[15][1]
    deltas = [d for d in (parser.feed(c) for c in text) if d.calls]
    first = deltas[0].calls[0]
    assert (first.index, first.name, first.id, first.arguments) == (0, "get_weather", "functions.get_weather:0", "")
    fragments = [c.arguments for d in deltas[1:] for c in d.calls]
    assert len(fragments) > 5 and "".join(fragments) == '{"city": "Paris", "unit": "celsius"}'


@pytest.mark.parametrize("name", TOOL_CALL_PARSERS)
def test_no_partial_tag_leaks_as_content(name):
    """While a call's opening tag is arriving, none of it is content."""
    text = next(t for n, t, c, calls in CASES if n == name and calls and not c)
    parser = make(name)
    for ch in text:
        assert parser.feed(ch).content == "", "call syntax leaked into content"


@pytest.mark.parametrize("seed", range(40))
def test_mangled_outputs_never_diverge(seed):
    """Outputs cut, spliced and sprinkled with format characters: the stream still replays the
    whole parse exactly (no exception, no retracted byte) for every parser."""
    rng = random.Random(seed)
    texts = [c[1] for c in CASES] + [FORCED_ARRAY]
    text, other = texts[seed % len(texts)], texts[rng.randrange(len(texts))]
    pieces = list(text[:rng.randrange(len(text) + 1)] + other[rng.randrange(len(other) + 1):])
    for _ in range(rng.randrange(6)):
        pieces.insert(rng.randrange(len(pieces) + 1), rng.choice(['"', "{", "}", ";", "\n", "<", "``", ",", "\\"]))
    mangled = "".join(pieces)
    for tool in (*TOOL_CALL_PARSERS, "json_array"):
        for reasoning in (None, *REASONING_PARSERS):
            whole = make(tool, reasoning).parse(mangled)
            cut = sorted(rng.sample(range(len(mangled) + 1), min(6, len(mangled) + 1)))
            chunks = [mangled[a:b] for a, b in zip([0, *cut], [*cut, len(mangled)])]
            assert assemble(make(tool, reasoning), chunks) == whole, (tool, reasoning, mangled, chunks)


def test_parser_names_are_case_insensitive():
    """As in SGLang: --reasoning-parser DeepSeek-R1 is deepseek-r1, on the flag and in the registry."""
    assert reasoning_parser("DeepSeek-R1").name == "deepseek-r1"
    assert tool_parser("DeepSeekV31", TOOLS).name == "deepseekv31"
    args = ServerArgs(model_path="tiny-llama", tool_call_parser="Kimi_K2", reasoning_parser="DeepSeek-V3")
    assert (args.tool_call_parser, args.reasoning_parser) == ("kimi_k2", "deepseek-v3")
    with pytest.raises(ValueError, match="reasoning_parser: unknown parser 'DeepSeek-R2'"):
        reasoning_parser("DeepSeek-R2")


@pytest.mark.parametrize("name,kwargs,text,reasoning,content", REQUEST_REASONING,
                         ids=[f"{r[0]}-{i}" for i, r in enumerate(REQUEST_REASONING)])
def test_reasoning_as_the_request_switches_it(name, kwargs, text, reasoning, content):
    parser = request_reasoning(name, kwargs)
    if reasoning is None:
        assert parser is None
        return
    assert parser is not None
    for chunks in [[text], *splits(text)]:
        out = assemble(ChatOutputParser(request_reasoning(name, kwargs), None), chunks)
        assert (out.reasoning, out.content) == (reasoning, content), chunks


def test_reasoning_parsers_state_their_markers():
    """What a grammar that waits for the thinking part to end needs: the marker that ends it and
    whether a reply starts inside it."""
    assert {n: (c.think_close, c.tool_start) for n, c in REASONING_REGISTRY.items()} == {
        "deepseek-r1": ("</think>", None), "qwen3": ("</think>", None), "deepseek-v3": ("</think>", None),
        "kimi_k2": ("</think>", "<|tool_calls_section_begin|>")}
    assert reasoning_parser("deepseek-r1").forced and not reasoning_parser("qwen3").forced
    assert request_reasoning("deepseek-v3", {"thinking": True}).forced
    assert not reasoning_parser("deepseek-v3").forced and reasoning_parser("kimi_k2", forced=True).forced


def test_kimi_thinking_then_tool_call_without_think_close():
    """Kimi-K2 goes from thinking straight to a tool section: the thinking part stays clean and the
    call is read, whole and at every split."""
    call = kimi_call("call_0", '{"timezone": "Europe/Paris"}')
    text = "<think>The user wants the time in Paris." + KIMI_BEGIN + call + "<|tool_calls_section_end|>"
    for chunks in [[text], *splits(text)]:
        out = assemble(make("kimi_k2", "kimi_k2"), chunks)
        assert out.reasoning == "The user wants the time in Paris."
        assert got(out) == ("", [("get_time", '{"timezone": "Europe/Paris"}', "call_0")]), chunks


def first_call_at(parser: ChatOutputParser, text: str) -> tuple[int, list[str]]:
    """Fed one character at a time: how much text was in when the first call opened, and the
    argument fragments after it."""
    opened, fragments = -1, []
    for i, ch in enumerate(text):
        for c in parser.feed(ch).calls:
            if c.name is not None and opened < 0:
                opened = i + 1
            elif c.arguments:
                fragments.append(c.arguments)
    return opened, fragments


def test_kimi_foreign_id_is_named_once_certain():
    """A client-style id among several tools: nothing until the call ends (the arguments decide the
    function); with one tool offered, the name is certain at once and the arguments stream."""
    text = KIMI_BEGIN + kimi_call("call_3", '{"city": "Tokyo"}') + "<|tool_calls_section_end|>"
    opened, _ = first_call_at(make("kimi_k2"), text)
    assert opened == text.index("<|tool_call_end|>") + len("<|tool_call_end|>")
    alone = make("kimi_k2", tools={"get_weather": SCHEMAS["get_weather"]})
    opened, fragments = first_call_at(alone, text)
    assert opened == text.index("{")
    assert len(fragments) > 5 and "".join(fragments) == '{"city": "Tokyo"}'


@pytest.mark.parametrize("name,text,args", [
    ("deepseekv31", DS_BEGIN + DS_CALL + "get_weather" + DS_SEP + '{"city": "Tokyo", "unit": "celsius"}',
     '{"city": "Tokyo", "unit": "celsius"}'),
    ("deepseekv32", DSML_BEGIN + '<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">'
     'San Francisco</｜DSML｜parameter>\n<｜DSML｜parameter name="unit" string="false">"celsius"</｜DSML｜parameter>'
     "\n</｜DSML｜invoke>", '{"city": "San Francisco", "unit": "celsius"}'),
])
def test_arguments_stream_as_they_come(name, text, args):
    """V3.1's JSON and DSML's text parameters reach the client while the model writes them."""
    opened, fragments = first_call_at(make(name), text)
    assert 0 < opened < text.index("Tokyo" if name == "deepseekv31" else "San")
    assert len(fragments) > 10 and "".join(fragments) == args


def test_tools_as_names_schemas_or_the_requests_own():
    """A parser takes the offered functions as names, as name -> parameters schema, or as the
    request's tools (OpenAI's dicts or the API's models); only the last two let Kimi-K2 tell a
    call by its arguments."""
    from pdserve.entrypoints.protocol import Tool

    dicts = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in SCHEMAS.items()]
    text = KIMI_BEGIN + kimi_call("call_9", '{"timezone": "UTC"}') + "<|tool_calls_section_end|>"
    for tools in (SCHEMAS, dicts, [Tool.model_validate(d) for d in dicts], iter(dicts)):
        assert got(make("kimi_k2", tools=tools).parse(text)) == ("", [("get_time", '{"timezone": "UTC"}', "call_9")])
    assert got(make("kimi_k2", tools=TOOLS).parse(text)) == ("", [])  # names alone: no schema tells
    assert make("qwen25", tools=iter(TOOLS)).tools.tools == frozenset(TOOLS)
    with pytest.raises(ValueError, match="tools: 7 is neither"):
        tool_parser("kimi_k2", [dicts[0], 7])
