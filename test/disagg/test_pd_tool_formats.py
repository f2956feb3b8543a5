"""Tool-call and reasoning formats through P/D with the official ``openai`` client: one prefill and
one decode (tiny-llama, random weights, Mooncake over loopback) behind pdserve's router, started
once for the module with ``--tool-call-parser kimi_k2 --reasoning-parser deepseek-v3``.

A random model writes no format by itself: each request carries SGLang's ``regex`` extra field,
which forces the reply into the format (its special tokens spelled as plain text, which the
tiny tokenizer lacks as tokens; the parsers read both alike). Kimi-K2 calls (a client-style id
and a bare counter, whose function only the tools' schemas tell) and DeepSeek-V3's
``chat_template_kwargs.thinking`` switch are checked end to end, streamed and not. The parser is
a server flag, so the other formats are generated through the same pair (kimi_k2 leaves their
text as content, byte for byte) and read back in process by the OpenAI output code with their own
parser, streamed at every token the server sent. Decode's received-KV count shows each reply was
served disaggregated.
"""

from __future__ import annotations

import json
import re

import openai
import pytest
from openai.types.chat import ChatCompletion
from pd_servers import RoutedPair

from entrypoints.structured_checks import ASK, PARAMETERS, TOOLS
from pdserve.entrypoints.openai_output import ChoiceStream, OutputPlan, chat_message

MODEL = "tiny-llama"
GREEDY = {"temperature": 0, "max_tokens": 400}
CITY = r'\{"city": "(Paris|Oslo)", "unit": "(celsius|fahrenheit)"\}'
KIMI_SECTION = (r"<\|tool_calls_section_begin\|><\|tool_call_begin\|>ID<\|tool_call_argument_begin\|>"
                + CITY + r"<\|tool_call_end\|><\|tool_calls_section_end\|>")
# the other formats, as regexes of the reply (a get_weather call)
V31 = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>" + CITY
       + "<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
DSML = ('<｜DSML｜SECTION>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">'
        '(Paris|Oslo)</｜DSML｜parameter>\n<｜DSML｜parameter name="unit" string="true">(celsius|fahrenheit)'
        "</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜SECTION>")
# (deepseekv4 is deepseekv32's parser with V4's section name: test/parsers covers it)
OTHER_FORMATS = [("deepseekv31", V31), ("deepseekv32", DSML.replace("SECTION", "function_calls"))]


@pytest.fixture(scope="module")
def pd():
    pair = RoutedPair(MODEL, "--tool-call-parser", "kimi_k2", "--reasoning-parser", "deepseek-v3",
                      "--max-total-tokens", "8192", "--num-threads", "1")
    try:
        yield pair.start()
    finally:
        pair.stop()


@pytest.fixture
def client(pd):
    pd.decode.wait_idle()
    assert pd.decode.post("/flush_cache").status_code == 200  # a prompt decode holds needs no transfer
    before = pd.decode.info()["kv_received"]
    yield openai.OpenAI(base_url=pd.router.url + "/v1", api_key="none", max_retries=0, timeout=180)
    assert pd.decode.info()["kv_received"] > before, "served by decode's local fallback, not through P/D"


def streamed(client, **kw) -> tuple[dict, str | None, list[str]]:
    """The message a client assembles from a stream, its finish_reason, and every content piece."""
    message: dict = {"content": "", "reasoning_content": "", "tool_calls": {}}
    reason, pieces = None, []
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            delta = choice.delta
            pieces.append(delta.content or "")
            message["content"] += delta.content or ""
            message["reasoning_content"] += getattr(delta, "reasoning_content", None) or ""
            for tc in delta.tool_calls or []:
                if tc.index not in message["tool_calls"]:
                    assert tc.id and tc.function.name and not tc.function.arguments, "a call opens with id and name"
                    message["tool_calls"][tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                message["tool_calls"][tc.index]["arguments"] += tc.function.arguments or ""
            reason = choice.finish_reason or reason
    message["tool_calls"] = [message["tool_calls"][i] for i in sorted(message["tool_calls"])]
    return message, reason, pieces


def check_weather_args(arguments: str) -> None:
    args = json.loads(arguments)
    assert args["city"] in ("Paris", "Oslo") and args["unit"] in ("celsius", "fahrenheit")
    assert set(args) == set(PARAMETERS["get_weather"]["properties"])


def test_kimi_call_named_by_the_tools_schemas(client):
    """A Kimi-K2 call whose id names no function (a client's id; a bare counter, streamed): the
    server tells get_weather from get_time by the tools' parameter schemas, and no special token
    reaches the client."""
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, **GREEDY)
    r = client.chat.completions.create(extra_body={"regex": KIMI_SECTION.replace("ID", "call_3")}, **kw)
    (call,) = r.choices[0].message.tool_calls
    assert (call.id, call.function.name, r.choices[0].message.content) == ("call_3", "get_weather", None)
    check_weather_args(call.function.arguments)
    assert r.choices[0].finish_reason == "tool_calls"
    message, reason, _ = streamed(client, extra_body={"regex": KIMI_SECTION.replace("ID", "7")}, **kw)
    assert message["content"] == "" and reason == "tool_calls"
    (call,) = message["tool_calls"]
    assert (call["id"], call["name"]) == ("functions.get_weather:7", "get_weather")
    check_weather_args(call["arguments"])


def test_deepseek_v3_thinks_only_when_the_request_says_so(client):
    """deepseek-v3: without chat_template_kwargs.thinking the reply is content; with it, the reply
    starts inside the thinking part (the template opened it), and a random model that never writes
    </think> gives all of it as reasoning_content. Greedy: the same text both times."""
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Think about the sky."}], max_tokens=24,
              temperature=0)
    plain = client.chat.completions.create(**kw).choices[0].message
    assert plain.content and getattr(plain, "reasoning_content", None) is None
    thinking = client.chat.completions.create(extra_body={"chat_template_kwargs": {"thinking": True}}, **kw)
    message = thinking.choices[0].message
    assert not message.content and message.reasoning_content == plain.content.strip()
    message, _, _ = streamed(client, extra_body={"chat_template_kwargs": {"thinking": True}}, **kw)
    assert (message["content"], message["reasoning_content"]) == ("", plain.content.strip())


@pytest.mark.parametrize("parser,pattern", OTHER_FORMATS, ids=[f[0] for f in OTHER_FORMATS])
def test_other_formats_generated_through_pd(client, parser, pattern):
    """The format's text, generated through P/D (kimi_k2 leaves it as content), read by the OpenAI
    output code with its own parser: whole, and fed the server's stream piece by piece."""
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, extra_body={"regex": pattern}, **GREEDY)
    _, _, pieces = streamed(client, **kw)
    text = "".join(pieces)
    assert re.fullmatch(pattern, text), text
    plan = OutputPlan(tools=parser, tool_names=tuple(PARAMETERS), tool_schemas=PARAMETERS)
    message, reason = chat_message(plan, text, "stop")
    whole = ChatCompletion.model_validate({"id": "x", "object": "chat.completion", "created": 0, "model": MODEL,
                                           "choices": [{"index": 0, "message": message, "finish_reason": reason}]})
    (call,) = whole.choices[0].message.tool_calls
    assert (call.function.name, whole.choices[0].message.content, reason) == ("get_weather", None, "tool_calls")
    check_weather_args(call.function.arguments)
    stream = ChoiceStream(plan)
    deltas = [d for i, piece in enumerate(pieces) for d in stream.deltas(piece, i == len(pieces) - 1)]
    assert not any("content" in d for d in deltas), "format tokens leaked into the content"
    args = "".join(tc["function"]["arguments"] for d in deltas for tc in d.get("tool_calls", []))
    assert args == call.function.arguments
