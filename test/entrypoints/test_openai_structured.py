"""response_format, tools and reasoning through the real ``openai`` client against one real server
(tiny-llama, random weights: only the grammar can make its replies valid), started with
``--tool-call-parser qwen25 --reasoning-parser deepseek-r1``, compact JSON and jump-forward.

deepseek-r1 reads a reply as thinking until ``</think>``, which a random model never writes: every
reply read by it here is all reasoning, which is what the reasoning tests check, and a constrained
one thinks first, unconstrained (the grammar waits for ``</think>``: openai_tools' docstring). The
grammar tests send ``separate_reasoning`` false (``PLAIN``): no reasoning parser reads the reply, so
the grammar constrains it from its first token. engine/test_grammar.py and
disagg/test_pd_grammar.py end the thinking part on purpose and check the grammar after it.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from structured_checks import (
    ASK,
    GREEDY,
    PARAMETERS,
    PERSON,
    TOOLS,
    check_ebnf,
    check_json_fuzz,
    check_json_schema,
    check_regex,
    check_required_tool_call,
    person_schema_format,
    streamed_chat,
)
from transformers import AutoTokenizer

from constrained.json_lexer import compact_spacing
from entrypoints.server_utils import Server
from pdserve.assets import preset_dir
from pdserve.web.chat import chat_prompt_ids

MODEL = "tiny-llama"
PLAIN = {"separate_reasoning": False}  # no reasoning parser reads the reply: the grammar holds from its first token
# The qwen25 format, forced by a regex so that the auto path's native parser has a call to read.
QWEN_CALL = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Oslo)", '
             r'"unit": "(celsius|fahrenheit)"\}\}\n</tool_call>')


@pytest.fixture(scope="module")
def server():
    s = Server("--tool-call-parser", "qwen25", "--reasoning-parser", "deepseek-r1", "--max-total-tokens", "8192",
               "--constrained-json-disable-any-whitespace", "--grammar-jump-forward", model=MODEL)
    try:
        yield s.start()
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(preset_dir(MODEL))


def bad_request(server: Server, path: str, body: dict) -> dict:
    r = server.post(path, json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    return r.json()["error"]


# ------------------------------------------------------------- response_format
def test_json_schema(client):
    check_json_schema(client, MODEL, PLAIN)


def test_random_samples_are_strict_compact_json(client):
    """Issue 32: raw control characters in a maxLength string and unbounded whitespace, seen at
    temperature 0.8 / seed 4; 100 samples streamed and not (the engine fuzz has the thousands)."""
    assert check_json_fuzz(client, MODEL, extra=PLAIN) == 100


def test_json_object_is_compact(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, response_format={"type": "json_object"},
                                       temperature=1.0, seed=7, max_tokens=48, extra_body=PLAIN)
    content = r.choices[0].message.content
    assert content.startswith("{") and compact_spacing(content), content


def test_json_object_and_completions(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, response_format={"type": "json_object"},
                                       extra_body=PLAIN, **GREEDY)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # a random model may fill any object until max_tokens; what it wrote is still a JSON prefix
        assert r.choices[0].finish_reason == "length" and r.choices[0].message.content.lstrip().startswith("{")
    r = client.completions.create(model=MODEL, prompt="A person:",
                                  extra_body={"response_format": person_schema_format()}, **GREEDY)
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)


def test_json_schema_with_n(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, response_format=person_schema_format(), n=2,
                                       temperature=1.0, seed=5, max_tokens=160, extra_body=PLAIN)
    for choice in r.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_regex_and_ebnf(client):
    check_regex(client, MODEL)
    check_ebnf(client, MODEL, PLAIN)


# ------------------------------------------------------------------- tools
def test_tool_choice_required(client):
    check_required_tool_call(client, MODEL, extra=PLAIN)


def test_tool_choice_named_and_not_parallel(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, parallel_tool_calls=False,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}},
                                       extra_body=PLAIN, **GREEDY)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time" and r.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS["get_time"])


def test_tool_choice_auto_reads_the_models_own_format(client):
    """Under auto, --tool-call-parser qwen25 reads the model's <tool_call> block (forced here by a
    regex, the only way a random model writes one) into tool_calls, streamed and not."""
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, extra_body={"regex": QWEN_CALL, **PLAIN}, **GREEDY)
    r = client.chat.completions.create(**kw)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS["get_weather"])
    assert r.choices[0].message.content is None
    content, calls, reason, chunks = streamed_chat(client, **kw)
    assert (content, reason) == ("", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", call.function.arguments)]
    deltas = [tc for c in chunks for ch in c.choices for tc in ch.delta.tool_calls or []]
    assert deltas[0].function.name == "get_weather" and deltas[0].function.arguments == ""
    assert len(deltas) > 2, "the arguments stream in fragments after the name"
    # tool_choice none: the same reply is plain content
    r = client.chat.completions.create(**{**kw, "tool_choice": "none"})
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content.startswith("<tool_call>")


def test_tool_results_are_rendered_by_the_template(client, tokenizer):
    """A conversation with an assistant tool-call turn (content None) and a tool result: accepted,
    and the prompt is the template's rendering of the tools, the call and the result."""
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=4, temperature=0)
    rendered = [dict(m, tool_calls=[{**messages[1]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]) if m.get("tool_calls") else m
        for m in messages]
    ids = chat_prompt_ids(tokenizer, [{k: v for k, v in m.items() if v is not None} for m in rendered], TOOLS)
    text = tokenizer.decode(ids)
    assert '"arguments": {"city": "Paris", "unit": "celsius"}' in text and '{"temperature": 21}' in text
    assert "<tools>" in text and r.usage.prompt_tokens == len(ids)



WEATHER_NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("choice,parallel", [(WEATHER_NAMED, True), ("required", False)], ids=["named", "required"])
def test_forced_tool_calls_end_with_the_call(client, choice, parallel):
    """A named function is called once, a required array without parallel calls holds one: the
    grammar ends the reply with the call (a two-enum schema, compact JSON, jump-forward), well
    inside 64 tokens, for every seed."""
    for seed in range(20 if choice == "required" else 10):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                           parallel_tool_calls=parallel, temperature=1.0, seed=seed, max_tokens=64,
                                           extra_body=PLAIN)
        choice0 = r.choices[0]
        assert choice0.finish_reason == "tool_calls" and r.usage.completion_tokens < 64, (seed, choice0)
        (call,) = choice0.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_truncated_forced_call_keeps_what_it_wrote_and_can_be_echoed_back(client, tokenizer):
    """A named call cut by max_tokens reports the arguments written so far (none yet: "", never an
    invented "{}"), and an agent sending that call back in the history is served, not refused."""
    partial = []
    for max_tokens in range(16, 46, 3):  # the name is written by token 15 (tiny-llama spells it in pieces)
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=WEATHER_NAMED,
                                           max_tokens=max_tokens, temperature=0, extra_body=PLAIN)
        assert r.choices[0].finish_reason == "length", r
        (call,) = r.choices[0].message.tool_calls
        args = call.function.arguments
        assert '{"city": "'.startswith(args) or args.startswith('{"city": "'), args  # "" included
        with pytest.raises(ValueError):
            json.loads(args)  # cut short: not a whole object
        partial.append(args)
        echoed = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                        {"role": "tool", "tool_call_id": call.id, "content": "cut short"}]
        again = client.chat.completions.create(model=MODEL, messages=echoed, tools=TOOLS, max_tokens=2)
        assert again.choices[0].finish_reason == "length"
    assert "" in partial and any(len(a) > 1 for a in partial), partial


def test_parallel_tool_calls_false_holds_under_auto(client):
    """Under auto the model may write several calls (two here, forced by a regex); with
    parallel_tool_calls false only the first is returned, streamed and not."""
    two = QWEN_CALL + r"\n" + QWEN_CALL
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, extra_body={"regex": two, **PLAIN}, **GREEDY)
    both = client.chat.completions.create(**kw).choices[0].message.tool_calls
    assert len(both) == 2
    r = client.chat.completions.create(parallel_tool_calls=False, **kw)
    (call,) = r.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == (both[0].function.name, both[0].function.arguments)
    assert r.choices[0].finish_reason == "tool_calls"
    content, calls, reason, _ = streamed_chat(client, parallel_tool_calls=False, **kw)
    assert [(c["name"], c["arguments"]) for c in calls] == [(call.function.name, call.function.arguments)]
    assert reason == "tool_calls"

# --------------------------------------------------------------- reasoning
def test_reasoning_is_split_streamed_and_kept_on_request(client, tokenizer):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Think about the sea."}], max_tokens=24,
              temperature=0)
    whole = client.chat.completions.create(**kw).choices[0].message
    assert whole.content == "" and whole.reasoning_content  # deepseek-r1: no </think>, all thinking
    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed = [getattr(c.choices[0].delta, "reasoning_content", None) for c in chunks if c.choices]
    assert "".join(s for s in streamed if s) == whole.reasoning_content and sum(map(bool, streamed)) > 1
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    # stream_reasoning false: the thinking part in one piece
    chunks = list(client.chat.completions.create(stream=True, extra_body={"stream_reasoning": False}, **kw))
    pieces = [c.choices[0].delta.reasoning_content for c in chunks
              if c.choices and getattr(c.choices[0].delta, "reasoning_content", None)]
    assert pieces == [whole.reasoning_content]
    # separate_reasoning false: it stays in content, unsplit
    kept = client.chat.completions.create(extra_body={"separate_reasoning": False}, **kw).choices[0].message
    assert kept.content.strip() == whole.reasoning_content and getattr(kept, "reasoning_content", None) is None



def test_a_constrained_reply_thinks_first(client):
    """With the reasoning parser reading it, a constrained reply's thinking part is free: the same
    tokens as without the grammar (greedy), all reasoning (a random model never closes it); the
    grammar is waiting for </think>. Read unsplit (separate_reasoning false) the grammar holds at once."""
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Describe an engineer as JSON."}], max_tokens=24,
              temperature=0)
    free = client.chat.completions.create(**kw).choices[0].message
    r = client.chat.completions.create(response_format=person_schema_format(), **kw).choices[0]
    assert r.finish_reason == "length" and not r.message.content
    assert r.message.reasoning_content == free.reasoning_content and not free.reasoning_content.startswith("{")
    plain = client.chat.completions.create(response_format=person_schema_format(), extra_body=PLAIN, **kw)
    assert plain.choices[0].message.content.startswith('{"name": "')
    # a forced tool choice too: thinking first, the call (never reached here) after it
    tool = client.chat.completions.create(tools=TOOLS, tool_choice="required", **kw).choices[0]
    assert tool.finish_reason == "length" and tool.message.tool_calls is None
    assert tool.message.reasoning_content and not tool.message.reasoning_content.startswith("[")

def test_logprobs_ride_the_parsed_deltas(client):
    """With a parser holding text back, every token's logprob still reaches the client, once."""
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count."}], max_tokens=12, temperature=0, stream=True,
        logprobs=True, top_logprobs=2, stream_options={"include_usage": True}))
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == chunks[-1].usage.completion_tokens and all(len(e.top_logprobs) == 2 for e in entries)


def test_chat_template_kwargs_reach_the_template(client, tokenizer):
    msgs = [{"role": "user", "content": "Hi"}]
    plain = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1)
    off = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert plain.usage.prompt_tokens == len(chat_prompt_ids(tokenizer, msgs))
    assert off.usage.prompt_tokens == len(chat_prompt_ids(tokenizer, msgs, enable_thinking=False))
    assert off.usage.prompt_tokens > plain.usage.prompt_tokens


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_object"}, "regex": "a+"}, "regex"),
    ({"regex": "(unclosed"}, "regex"),
    ({"ebnf": "root ::= "}, "ebnf"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "launch_rocket"}}},
     "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tools"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
])
def test_bad_requests_name_the_field(server, body, param):
    err = bad_request(server, "/v1/chat/completions", {"messages": ASK, **body})
    assert err["param"] == param and err["message"].startswith(param + ":"), err


def test_bad_messages_name_the_field(server):
    bad_args = [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                      "function": {"name": "get_weather", "arguments": "not json"}}]}]
    err = bad_request(server, "/v1/chat/completions", {"messages": ASK + bad_args})
    assert err["param"] == "messages[1].tool_calls[0].function.arguments"
    err = bad_request(server, "/v1/chat/completions", {"messages": [
        {"role": "user", "content": "x", "tool_calls": bad_args[0]["tool_calls"]}]})
    assert err["param"] == "messages[0].tool_calls"
    err = bad_request(server, "/v1/completions", {"prompt": "x", "response_format": {"type": "json_schema"}})
    assert err["param"] == "response_format.json_schema.schema"


def test_server_still_serves_after_errors(server):
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 200
