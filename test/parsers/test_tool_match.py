"""Which tool a call's arguments belong to when the model's call id does not say (Kimi-K2's bare
counters and client ids): a name only when exactly one tool's schema accepts the arguments."""

from __future__ import annotations

import pytest

from pdserve.parsers.tool_match import infer_tool


def obj(required: list[str], **props) -> dict:
    return {"type": "object", "properties": {k: {"type": t} for k, t in props.items()}, "required": required}


# An agent's tool set, where argument names are shared (file_path, pattern, path).
AGENT = {
    "Read": obj(["file_path"], file_path="string", offset="number", limit="number"),
    "Write": obj(["file_path", "content"], file_path="string", content="string"),
    "Edit": obj(["file_path", "old_string", "new_string"], file_path="string", old_string="string",
                new_string="string"),
    "Glob": obj(["pattern"], pattern="string", path="string"),
    "Grep": obj(["pattern"], pattern="string", path="string", output_mode="string"),
    "LS": {"type": "object", "properties": {"path": {"type": "string"}, "ignore": {"type": "array"}},
           "required": ["path"]},
    "Ping": {"type": "object", "properties": {}},
}


def infer(schemas: dict, args: str | None) -> str | None:
    return infer_tool(schemas, frozenset(schemas), args)


@pytest.mark.parametrize("args,name", [
    ('{"file_path": "/x"}', "Read"),
    ('{"file_path": "/x", "content": "c"}', "Write"),
    ('{"file_path": "/x", "old_string": "a", "new_string": "b"}', "Edit"),
    ('{"path": "/x"}', "LS"),
    ('{"pattern": "a", "output_mode": "c"}', "Grep"),
    ("{}", "Ping"),
    ('{"pattern": "a", "path": "/x"}', None),  # Glob and Grep both take it
    ('{"pattern": "a"}', None),
    ('{"old_string": "a", "new_string": "b"}', None),  # a required key missing
    ('{"file_path": "/x", "bogus": 1}', None),  # a key no schema declares
    ('{"path": 5}', None),  # a declared key of the wrong type
    ('{"path": "/x"', None),  # not complete
    ("[1, 2]", None),
    ('"text"', None),
    ("", None),
    (None, None),
])
def test_exactly_one_schema_must_accept(args, name):
    assert infer(AGENT, args) == name
    assert infer(dict(reversed(AGENT.items())), args) == name, "the order of the tools decides nothing"


def test_one_tool_needs_no_check_and_none_gives_nothing():
    assert infer({"Read": AGENT["Read"]}, '{"bogus": 1}') == "Read"
    assert infer({"Read": AGENT["Read"]}, None) == "Read"
    assert infer({}, '{"x": 1}') is None
    assert infer_tool(None, frozenset({"a", "b"}), '{"x": 1}') is None, "names without schemas: nothing is certain"
    assert infer_tool(None, frozenset({"a"}), None) == "a"


def test_schemaless_and_boolean_schemas_take_only_the_empty_object():
    tools = {"anything": True, "never": False, "bare": None, "query": obj(["q"], q="string")}
    assert infer(tools, '{"q": "x"}') == "query"
    assert infer({"anything": True, "query": tools["query"]}, "{}") == "anything"
    assert infer(tools, "{}") is None  # anything and bare both take it


def test_composition_and_value_constraints_are_honoured():
    locate = {"type": "object", "anyOf": [obj(["city"], city="string"), obj(["zip"], zip="string")]}
    tools = {"locate": locate, "query": obj(["q"], q="string")}
    assert infer(tools, "{}") is None
    assert infer(tools, '{"zip": "94110"}') == "locate"
    assert infer(tools, '{"q": "x"}') == "query"
    consts = {"delete": {"type": "object", "properties": {"action": {"const": "delete"}}, "required": ["action"]},
              "dispatch": {"type": "object", "additionalProperties": {"type": "string"}}}
    assert infer(consts, '{"action": "read"}') == "dispatch"
    assert infer(consts, '{"action": "delete"}') is None
    assert infer(consts, '{"action": 5}') is None
    refs = {"a": {"type": "object", "$defs": {"p": {"properties": {"k": {"type": "integer"}}}},
                  "allOf": [{"$ref": "#/$defs/p"}]},
            "b": obj(["k"], k="string")}
    assert infer(refs, '{"k": 1}') == "a"
    assert infer(refs, '{"k": "1"}') == "b"


def test_a_schema_that_cannot_be_evaluated_gives_no_name():
    remote = {"type": "object", "properties": {"x": {"$ref": "http://127.0.0.1:9/schema.json"}}}
    assert infer({"remote": remote, "other": obj(["y"], y="string")}, '{"x": 1}') is None
    broken = {"type": "object", "properties": {"x": {"type": 7}}}
    assert infer({"broken": broken, "other": obj(["y"], y="string")}, '{"x": 1}') is None
