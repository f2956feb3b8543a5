"""The form tool_choice required / named forces: its schema accepts exactly arrays of calls of the
offered tools, and its parser reads such an array back, whole or streamed at any split."""

from __future__ import annotations

import jsonschema
import pytest
from test_tool_parsers import assemble, got, splits

from pdserve.parsers.json_array import schema
from pdserve.parsers.output import ChatOutputParser
from pdserve.parsers.registry import tool_parser

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
FUNCTIONS = [("get_weather", CITY), ("get_time", None)]


def test_schema_accepts_calls_of_the_offered_tools_only():
    s = schema(FUNCTIONS, parallel=True)
    jsonschema.Draft202012Validator.check_schema(s)
    ok = [{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}]
    jsonschema.validate(ok, s)
    for bad in ([], [{"name": "launch", "parameters": {}}], [{"name": "get_weather", "parameters": {}}],
                [{"name": "get_time"}], [{"name": "get_time", "parameters": {}, "extra": 1}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, s)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(ok, schema(FUNCTIONS, parallel=False))
    named = schema(FUNCTIONS[:1], parallel=True)
    jsonschema.validate(ok[:1], named)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(ok[1:], named)


FORCED = ('[{"name": "get_weather", "parameters": {"city": "Oslo"}},\n {"name": "get_time", "parameters": {}}]',
          '', [("get_weather", '{"city": "Oslo"}', None), ("get_time", "{}", None)])
CASES = [
    FORCED,
    ('  [ {"parameters": {"city": "Lima"}, "name": "get_weather"} ]  ', "",
     [("get_weather", '{"city": "Lima"}', None)]),
    ('[{"name": "get_weather", "parameters": {"city": "Li', "", [("get_weather", '{"city": "Li', None)]),  # max_tokens
    # cut before its arguments began: they are what was written (nothing), not an invented "{}"
    ('[{"name": "get_weather", "para', "", [("get_weather", "", None)]),
    ('[{"name": "get_weather", ', "", [("get_weather", "", None)]),
    ("I cannot call tools.", "I cannot call tools.", []),  # not the forced form: content
    ('[{"name": "nope", "parameters": {}}]', '[{"name": "nope", "parameters": {}}]', []),
    ('[{"name": "get_time", "parameters": {}}, {"name": "nope"}]', '{"name": "nope"}]', [("get_time", "{}", None)]),
]


@pytest.mark.parametrize("text,content,calls", CASES)
def test_forced_array_whole_and_streamed(text, content, calls):
    parser = tool_parser("json_array", [n for n, _ in FUNCTIONS])
    assert got(parser.parse(text)) == (content, calls)
    for chunks in splits(text):
        out = assemble(ChatOutputParser(None, tool_parser("json_array", [n for n, _ in FUNCTIONS])), chunks)
        assert got(out) == (content, calls), chunks
