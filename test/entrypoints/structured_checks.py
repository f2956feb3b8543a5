"""The openai-client checks of structured output and tool calls, shared by the colocated server
test and the P/D ones (behind pdserve's router and sglang-router): each sends one kind of request,
streamed and not, and asserts the reply holds what only the grammar can make a random-weight model
write (a JSON document valid under the schema, calls whose arguments validate, a regex match)."""

from __future__ import annotations

import json
import re

import jsonschema

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["Ada", "Grace", "Linus"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "admin": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["ops", "dev"]}, "maxItems": 2},
    },
    "required": ["name", "age", "admin", "tags"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a timezone",
    "parameters": {"type": "object",
                   "properties": {"timezone": {"type": "string", "enum": ["Europe/Paris", "America/Lima"]}},
                   "required": ["timezone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time there?"}]
REGEX = r"(yes|no), because [a-z]{3,8}\."
EBNF = 'root ::= "The answer is " digit digit? "."\ndigit ::= [0-9]'
EBNF_MATCH = r"The answer is [0-9][0-9]?\."
GREEDY = {"temperature": 0, "max_tokens": 160}


def person_schema_format() -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


def streamed_chat(client, **kw) -> tuple[str, list[dict], str | None, list]:
    """(content, tool calls assembled from their deltas, finish_reason, chunks) of a streamed chat."""
    chunks = list(client.chat.completions.create(stream=True, **kw))
    content, calls, reason = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                if tc.index not in calls:
                    assert tc.id and tc.function.name, "a call's first delta carries its id and name"
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                calls[tc.index]["arguments"] += tc.function.arguments or ""
            reason = choice.finish_reason or reason
    return content, [calls[i] for i in sorted(calls)], reason, chunks


def check_json_schema(client, model: str, extra: dict | None = None) -> dict:
    """A response_format json_schema reply validates, streamed and not, and both agree (greedy).
    ``extra``: more body fields (extra_body), in each check here."""
    kw = dict(model=model, messages=[{"role": "user", "content": "Describe an engineer as JSON."}],
              response_format=person_schema_format(), extra_body=extra or {}, **GREEDY)
    r = client.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "stop", r
    doc = json.loads(r.choices[0].message.content)
    jsonschema.validate(doc, PERSON)
    content, calls, reason, _ = streamed_chat(client, **kw)
    assert (content, calls, reason) == (r.choices[0].message.content, [], "stop")
    return doc


def check_required_tool_call(client, model: str, stream: bool = True, extra: dict | None = None) -> list[dict]:
    """tool_choice required: calls of the offered tools whose arguments validate against the
    tool's parameters, finish_reason tool_calls; the stream's deltas assemble to the same calls."""
    kw = dict(model=model, messages=ASK, tools=TOOLS, tool_choice="required", extra_body=extra or {}, **GREEDY)
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
             for c in choice.message.tool_calls]
    assert calls and choice.message.content is None
    for call in calls:
        assert call["id"].startswith("call_") and call["name"] in PARAMETERS
        jsonschema.validate(json.loads(call["arguments"]), PARAMETERS[call["name"]])
    if stream:
        content, streamed, reason, _ = streamed_chat(client, **kw)
        assert content == "" and reason == "tool_calls"
        assert [(c["name"], c["arguments"]) for c in streamed] == [(c["name"], c["arguments"]) for c in calls]
    return calls


def check_regex(client, model: str) -> str:
    """SGLang's ``regex`` extra (extra_body): the whole reply matches, streamed and not."""
    r = client.completions.create(model=model, prompt="Is the sky blue?", extra_body={"regex": REGEX}, **GREEDY)
    text = r.choices[0].text
    assert re.fullmatch(REGEX, text), text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt="Is the sky blue?", extra_body={"regex": REGEX}, stream=True, **GREEDY) if c.choices)
    assert streamed == text
    return text


def check_ebnf(client, model: str, extra: dict | None = None) -> str:
    """SGLang's ``ebnf`` extra (extra_body) on chat: the reply is a sentence of the grammar."""
    kw = dict(model=model, messages=[{"role": "user", "content": "What is six times seven?"}],
              extra_body={"ebnf": EBNF, **(extra or {})}, **GREEDY)
    text = client.chat.completions.create(**kw).choices[0].message.content
    assert re.fullmatch(EBNF_MATCH, text), text
    content, _, _, _ = streamed_chat(client, **kw)
    assert content == text
    return text


def check_json_fuzz(client, model: str, per_request: int = 10, extra: dict | None = None) -> int:
    """Random-weight samples of json_schema replies (issue 32's request: temperature 0.8, seed 4, a
    maxLength string, then every fuzz schema at temperatures 0.7-1.2), ``per_request`` concurrent
    requests (one sample each, seeds apart: a disaggregated request runs one sample) per schema,
    streamed and not: each is strict JSON valid under its schema and compact (no whitespace but one
    space after ':' and ','). ``extra``: more body fields (extra_body). Returns how many samples were checked."""
    from concurrent.futures import ThreadPoolExecutor

    from constrained.grammar_fixtures import FUZZ_MAX_TOKENS, FUZZ_SCHEMAS, check_json
    from constrained.json_lexer import compact_spacing

    checked = 0
    for i, name in enumerate(FUZZ_SCHEMAS):
        for stream in (False, True):
            temperature, seed = (0.8, 4) if i == 0 else (0.7 + 0.1 * i, 1000 * i + stream)
            kw = dict(model=model, messages=[{"role": "user", "content": f"A {name} record as JSON."}],
                      response_format={"type": "json_schema", "json_schema": {
                          "name": name, "schema": FUZZ_SCHEMAS[name], "strict": True}},
                      temperature=temperature, max_tokens=FUZZ_MAX_TOKENS, extra_body=extra or {})
            requests = [{**kw, "seed": seed + j} for j in range(per_request)]
            with ThreadPoolExecutor(per_request) as pool:
                replies = list(pool.map(_sample, [client] * per_request, [stream] * per_request, requests))
            for content, reason in replies:
                assert reason == "stop", (name, stream, content)
                check_json(content, name)
                assert compact_spacing(content), content
                checked += 1
    return checked


def _sample(client, stream: bool, kw: dict) -> tuple[str, str | None]:
    """(content, finish_reason) of one chat reply, streamed or not."""
    if not stream:
        choice = client.chat.completions.create(**kw).choices[0]
        return choice.message.content, choice.finish_reason
    content, _, reason, _ = streamed_chat(client, **kw)
    return content, reason
