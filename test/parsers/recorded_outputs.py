"""Model outputs in each family's real format, as the models write them (the tokens their chat
templates render tool calls and thinking with), and what each must parse to.

Each case: (parser name, raw output text, expected content, expected [(name, arguments, id)]).
Arguments are the raw JSON text as written: the API passes them on byte for byte.
"""

from __future__ import annotations

TOOLS = ("get_weather", "get_time", "search_web")
# The same tools with their parameters schemas, as a request declares them (Kimi-K2 needs them to
# tell the function of a call whose id does not name it).
SCHEMAS = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                    "required": ["city"]},
    "get_time": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]},
    "search_web": {"type": "object", "properties": {"query": {"type": "string"}, "max_results": {"type": "integer"},
                                                    "filters": {"type": "object"}}, "required": ["query"]},
}

# DeepSeek-V3 / R1: special tokens with U+FF5C (｜) and U+2581 (▁); arguments in a ```json fence.
DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def ds_call(name: str, args: str) -> str:
    return f"{DS_CALL}function{DS_SEP}{name}\n```json\n{args}\n```{DS_CALL_END}"




def v31_call(name: str, args: str) -> str:
    """DeepSeek-V3.1: the name right after the call token, bare JSON arguments."""
    return f"{DS_CALL}{name}{DS_SEP}{args}{DS_CALL_END}"


# DeepSeek-V3.2 / V4: DSML tags (U+FF5C around DSML), one parameter tag per argument.
DSML_BEGIN, DSML_END = "<｜DSML｜function_calls>", "</｜DSML｜function_calls>"
V4_BEGIN, V4_END = "<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>"


def dsml_param(name: str, value: str, string: bool = True) -> str:
    return f'<｜DSML｜parameter name="{name}" string="{"true" if string else "false"}">{value}</｜DSML｜parameter>'


def dsml_invoke(name: str, *params: str) -> str:
    return f'<｜DSML｜invoke name="{name}">\n' + "\n".join(params) + "\n</｜DSML｜invoke>"


KIMI_BEGIN, KIMI_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"


def kimi_call(call_id: str, args: str) -> str:
    return f"<|tool_call_begin|>{call_id}<|tool_call_argument_begin|>{args}<|tool_call_end|>"


WEATHER = '{"city": "Paris", "unit": "celsius"}'
TIME = '{"timezone": "Europe/Paris"}'
PRETTY = '{\n  "query": "flights to Tokyo in May",\n  "max_results": 5,\n  "filters": {"direct": true, "cabin": ["economy", "premium"]}\n}'  # noqa: E501
CODEY = '{"query": "what does `}` mean in \\"JSON\\" {braces}? \\\\ <tool_call>"}'

CASES = [
    # ---------------------------------------------------------------- deepseekv3
    ("deepseekv3", "I'll check the weather in Paris for you." + DS_BEGIN + ds_call("get_weather", WEATHER) + DS_END,
     "I'll check the weather in Paris for you.", [("get_weather", WEATHER, None)]),
    ("deepseekv3", DS_BEGIN + ds_call("get_weather", WEATHER) + "\n" + ds_call("get_time", TIME) + DS_END,
     "", [("get_weather", WEATHER, None), ("get_time", TIME, None)]),
    ("deepseekv3", DS_BEGIN + ds_call("search_web", PRETTY) + DS_END, "", [("search_web", PRETTY, None)]),
    ("deepseekv3", DS_BEGIN + ds_call("search_web", CODEY) + DS_END + "\n\nLet me know if that helps.",
     "Let me know if that helps.", [("search_web", CODEY, None)]),
    ("deepseekv3", "The capital of France is Paris.", "The capital of France is Paris.", []),
    # ---------------------------------------------------------------- qwen25 (Qwen2.5, Qwen3)
    ("qwen25", '<tool_call>\n{"name": "get_weather", "arguments": ' + WEATHER + "}\n</tool_call>",
     "", [("get_weather", WEATHER, None)]),
    ("qwen25", "Let me look both up.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": " + WEATHER
     + "}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": " + TIME + "}\n</tool_call>",
     "Let me look both up.", [("get_weather", WEATHER, None), ("get_time", TIME, None)]),
    ("qwen25", '<tool_call>\n{"name": "search_web", "arguments": ' + CODEY + "}\n</tool_call>",
     "", [("search_web", CODEY, None)]),
    ("qwen25", '<tool_call>\n{"arguments": ' + PRETTY + ', "name": "search_web"}\n</tool_call>',
     "", [("search_web", PRETTY, None)]),
    ("qwen25", "I can answer that directly: it is 42.", "I can answer that directly: it is 42.", []),
    # ---------------------------------------------------------------- llama3 (Llama 3.1 / 3.2 / 3.3)
    ("llama3", '{"name": "get_weather", "parameters": ' + WEATHER + "}", "", [("get_weather", WEATHER, None)]),
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": ' + WEATHER + '}; {"name": "get_time", '
     '"parameters": ' + TIME + "}", "", [("get_weather", WEATHER, None), ("get_time", TIME, None)]),
    ("llama3", 'Checking now. <|python_tag|>{"name": "search_web", "parameters": ' + PRETTY + "}",
     "Checking now.", [("search_web", PRETTY, None)]),
    ("llama3", '{"answer": 42, "unit": "none"}', '{"answer": 42, "unit": "none"}', []),
    ("llama3", "Paris is the capital of France.", "Paris is the capital of France.", []),
    # ---------------------------------------------------------------- kimi_k2
    ("kimi_k2", "I'll look that up." + KIMI_BEGIN + kimi_call("functions.get_weather:0", WEATHER) + KIMI_END,
     "I'll look that up.", [("get_weather", WEATHER, "functions.get_weather:0")]),
    ("kimi_k2", KIMI_BEGIN + kimi_call("functions.get_weather:2", WEATHER) + kimi_call("functions.get_time:3", TIME)
     + KIMI_END, "", [("get_weather", WEATHER, "functions.get_weather:2"), ("get_time", TIME, "functions.get_time:3")]),
    ("kimi_k2", KIMI_BEGIN + kimi_call("functions.search_web:0", PRETTY) + KIMI_END,
     "", [("search_web", PRETTY, "functions.search_web:0")]),
    # Kimi-K2.5+: a bare counter, or a client's id copied from earlier turns: the function is the
    # one tool whose schema the arguments fit; a counter becomes functions.NAME:IDX
    ("kimi_k2", KIMI_BEGIN + kimi_call("3", WEATHER) + KIMI_END, "",
     [("get_weather", WEATHER, "functions.get_weather:3")]),
    ("kimi_k2", "Checking both." + KIMI_BEGIN + kimi_call("call_3", TIME)
     + kimi_call("toolu_01AkmjoowNgNx2qNfJzc8z2F", WEATHER) + kimi_call("functions.search_web:7", CODEY) + KIMI_END,
     "Checking both.", [("get_time", TIME, "call_3"), ("get_weather", WEATHER, "toolu_01AkmjoowNgNx2qNfJzc8z2F"),
                        ("search_web", CODEY, "functions.search_web:7")]),
    ("kimi_k2", KIMI_BEGIN + kimi_call("0b3d1c2e-4f5a-6b7c-8d9e-0f1a2b3c4d5e", PRETTY) + KIMI_END,
     "", [("search_web", PRETTY, "0b3d1c2e-4f5a-6b7c-8d9e-0f1a2b3c4d5e")]),
    ("kimi_k2", "Let me check. " + KIMI_BEGIN + kimi_call("functions.get_weather:0", WEATHER) + KIMI_END
     + " And now the time: " + KIMI_BEGIN + kimi_call("functions.get_time:1", TIME) + KIMI_END,
     "Let me check.And now the time:", [("get_weather", WEATHER, "functions.get_weather:0"),
                                         ("get_time", TIME, "functions.get_time:1")]),
    # ---------------------------------------------------------------- deepseekv31 (DeepSeek-V3.1)
    ("deepseekv31", "I'll check the weather in Paris." + DS_BEGIN + v31_call("get_weather", WEATHER) + DS_END,
     "I'll check the weather in Paris.", [("get_weather", WEATHER, None)]),
    ("deepseekv31", DS_BEGIN + v31_call("get_weather", WEATHER) + v31_call("get_time", TIME) + DS_END,
     "", [("get_weather", WEATHER, None), ("get_time", TIME, None)]),
    ("deepseekv31", DS_BEGIN + v31_call("search_web", PRETTY) + DS_END, "", [("search_web", PRETTY, None)]),
    ("deepseekv31", DS_BEGIN + v31_call("search_web", CODEY) + DS_END + "\n\nDone.", "Done.",
     [("search_web", CODEY, None)]),
    ("deepseekv31", DS_BEGIN + v31_call("get_time", "{}") + DS_END, "", [("get_time", "{}", None)]),
    ("deepseekv31", "The capital of France is Paris.", "The capital of France is Paris.", []),
    # ---------------------------------------------------------------- deepseekv32 / deepseekv4 (DSML)
    ("deepseekv32", "Let me look.\n\n" + DSML_BEGIN + "\n" + dsml_invoke(
        "get_weather", dsml_param("city", "Paris"), dsml_param("unit", "celsius")) + "\n" + DSML_END,
     "Let me look.", [("get_weather", '{"city": "Paris", "unit": "celsius"}', None)]),
    ("deepseekv32", DSML_BEGIN + "\n" + dsml_invoke(
        "search_web", dsml_param("query", "  flights to Tokyo \"in May\"\n"), dsml_param("max_results", "5", False),
        dsml_param("filters", '{"direct": true,\n "cabin": ["economy"]}', False)) + "\n"
     + dsml_invoke("get_time", dsml_param("timezone", "Europe/Paris")) + "\n" + DSML_END,
     "", [("search_web", '{"query": "flights to Tokyo \\"in May\\"", "max_results": 5, '
                         '"filters": {"direct": true, "cabin": ["economy"]}}', None),
          ("get_time", TIME, None)]),
    # string="false" with a value that is no JSON: the model's text, as a string
    ("deepseekv32", DSML_BEGIN + dsml_invoke("search_web", dsml_param("query", "Здравствуйте, мир! <b>", False))
     + DSML_END, "", [("search_web", '{"query": "Здравствуйте, мир! <b>"}', None)]),
    # the JSON form: an object instead of parameter tags, passed on as written
    ("deepseekv32", DSML_BEGIN + '<｜DSML｜invoke name="get_weather">\n' + WEATHER + "\n</｜DSML｜invoke>" + DSML_END,
     "", [("get_weather", WEATHER, None)]),
    # the tags without ｜DSML｜, as SGLang also reads them
    ("deepseekv32", '<function_calls>\n<invoke name="get_time">\n<parameter name="timezone" string="true">'
     "Europe/Paris</parameter>\n</invoke>\n</function_calls>", "", [("get_time", TIME, None)]),
    ("deepseekv32", "No tools needed: 2 < 3 and <b>bold</b>.", "No tools needed: 2 < 3 and <b>bold</b>.", []),
    ("deepseekv4", "On it." + V4_BEGIN + "\n" + dsml_invoke("get_weather", dsml_param("city", "Oslo")) + "\n" + V4_END,
     "On it.", [("get_weather", '{"city": "Oslo"}', None)]),
    ("deepseekv4", V4_BEGIN + dsml_invoke("get_time", dsml_param("timezone", "UTC")) + V4_END,
     "", [("get_time", '{"timezone": "UTC"}', None)]),
]

# Not what the format promises: never a crash; returned as content, or as the call the model began.
MALFORMED = [
    # cut off inside the arguments (max_tokens): the call stands, its arguments as far as written
    ("qwen25", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
     "", [("get_weather", '{"city": "Par', None)]),
    ("qwen25", "<tool_call>\nthis is not JSON\n</tool_call>", "<tool_call>\nthis is not JSON\n</tool_call>", []),
    ("qwen25", '<tool_call>\n{"name": "delete_everything", "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name": "delete_everything", "arguments": {}}\n</tool_call>', []),
    ("qwen25", '<tool_call>\n{"name": "get_time"}\n</tool_call>', "", [("get_time", "{}", None)]),
    ("qwen25", '<tool_call>\n{"name": 7, "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name": 7, "arguments": {}}\n</tool_call>', []),
    ("qwen25", "A stray </tool_call> and a <tool_call", "A stray </tool_call> and a <tool_call", []),
    ("deepseekv3", DS_BEGIN + DS_CALL + "function" + DS_SEP + 'get_weather\n{"city": "Oslo"}' + DS_CALL_END
     + DS_END, "", [("get_weather", '{"city": "Oslo"}', None)]),
    ("deepseekv3", DS_BEGIN + DS_CALL + "function" + DS_SEP + "get_weather\n```json\n{\"city\": ",
     "", [("get_weather", '{"city":', None)]),
    ("deepseekv3", DS_BEGIN + DS_CALL + "garbage" + DS_CALL_END + DS_END, DS_CALL + "garbage" + DS_CALL_END, []),
    # an id that names no function and arguments that fit no single tool: dropped, tokens and all
    ("kimi_k2", KIMI_BEGIN + kimi_call("not-an-id", '{"unknown_key": 1}') + KIMI_END, "", []),
    ("kimi_k2", "Hm." + KIMI_BEGIN + kimi_call("call_3", "{}") + kimi_call("call_4", TIME) + KIMI_END,
     "Hm.", [("get_time", TIME, "call_4")]),
    ("kimi_k2", KIMI_BEGIN + kimi_call("functions.delete_everything:0", "{}") + KIMI_END, "", []),
    # a named call's arguments are the client's to validate: passed on as written
    ("kimi_k2", KIMI_BEGIN + kimi_call("functions.get_weather:1", '{"city": "Bad", "valid": fasle') + KIMI_END,
     "", [("get_weather", '{"city": "Bad", "valid": fasle', "functions.get_weather:1")]),
    # the format's tokens outside a call never reach the content
    ("kimi_k2", "normal text<|tool_calls_section_end|>", "normal text", []),
    ("kimi_k2", "text<|tool_call_argument_begin|>more<|tool_call_end|>", "textmore", []),
    ("deepseekv31", DS_BEGIN + v31_call("delete_everything", "{}") + DS_END, "", []),
    ("deepseekv31", DS_BEGIN + DS_CALL + "get_weather" + DS_SEP + '{"city": "Par', "",
     [("get_weather", '{"city": "Par', None)]),
    ("deepseekv31", "Done." + DS_CALL_END + DS_END, "Done.", []),
    ("deepseekv32", DSML_BEGIN + dsml_invoke("delete_everything", dsml_param("path", "/")) + DSML_END, "", []),
    ("deepseekv32", DSML_BEGIN + '<｜DSML｜invoke name="get_weather">\n'
     '<｜DSML｜parameter name="city" string="true">Par',
     "", [("get_weather", '{"city": "Par', None)]),
    ("deepseekv32", DSML_BEGIN + '<｜DSML｜invoke name="get_time">\n\n</｜DSML｜invoke>' + DSML_END,
     "", [("get_time", "{}", None)]),
    ("deepseekv32", DSML_BEGIN + '<｜DSML｜invoke name="get_weather"><｜DSML｜parameter name="city" string="true">Oslo '
     "</｜DSML｜invoke>" + DSML_END, "", [("get_weather", '{"city": "Oslo"}', None)]),  # the invoke ends the parameter
    ("deepseekv32", DSML_BEGIN + '<｜DSML｜invoke name="search_web"><｜DSML｜parameter name="filters" string="false">'
     '{"cabin": ["eco', "", [("search_web", '{"filters": {"cabin": ["eco', None)]),  # cut short: as written
    ("deepseekv32", "All done.</｜DSML｜invoke>", "All done.", []),
    ("deepseekv32", "An <invoke of nothing> here", "An <invoke of nothing> here", []),
    ("kimi_k2", KIMI_BEGIN + "<|tool_call_begin|>functions.get_time:0<|tool_call_argument_begin|>{\"timezone\"",
     "", [("get_time", '{"timezone"', "functions.get_time:0")]),
    ("llama3", '{"name": "get_weather", "parameters": {"city": }}', "", [("get_weather", '{"city": }', None)]),
    # the name was complete (and streamed) before the object broke: the call stands, the rest is content
    ("llama3", '{"name": "get_weather" "parameters": {}}', '"parameters": {}}', [("get_weather", "{}", None)]),
    ("llama3", '{"nam": "get_weather", "parameters": {}}', '{"nam": "get_weather", "parameters": {}}', []),
    ("llama3", '<|python_tag|>brave_search.call(query="Paris")', '<|python_tag|>brave_search.call(query="Paris")', []),
    ("llama3", '{"name": "get_weather", "parameters": ' + WEATHER + "}; ", "", [("get_weather", WEATHER, None)]),
]

# Reasoning: (parser, text, expected reasoning, expected content).
REASONING = [
    ("deepseek-r1", "Okay, the user asks for 2 + 2. That is 4.\n</think>\n\nThe answer is 4.",
     "Okay, the user asks for 2 + 2. That is 4.", "The answer is 4."),
    ("deepseek-r1", "<think>\nLet me think step by step.\n</think>\n\n**4**", "Let me think step by step.", "**4**"),
    ("deepseek-r1", "Still thinking when max_tokens ran out", "Still thinking when max_tokens ran out", ""),
    ("qwen3", "<think>\nThe user greets me; reply briefly.\n</think>\n\nHello! How can I help?",
     "The user greets me; reply briefly.", "Hello! How can I help?"),
    ("qwen3", "<think>\n\n</think>\n\nHello!", "", "Hello!"),
    ("qwen3", "Hello! No thinking here.", "", "Hello! No thinking here."),
    ("qwen3", "<thinking is not a tag", "", "<thinking is not a tag"),
    ("deepseek-v3", "<think>\nThe user asks the time.\n</think>\n\nIt is noon.", "The user asks the time.",
     "It is noon."),
    ("deepseek-v3", "It is noon.", "", "It is noon."),
    ("kimi_k2", "<think>I need to check the file.</think>Here it is.", "I need to check the file.", "Here it is."),
    ("kimi_k2", "Hello, how can I help?", "", "Hello, how can I help?"),
    # a tool section ends the thinking part and stays in the content, for the tool parser
    ("kimi_k2", "<think>Let me read this file..." + KIMI_BEGIN + kimi_call("functions.get_time:0", TIME) + KIMI_END,
     "Let me read this file...", KIMI_BEGIN + kimi_call("functions.get_time:0", TIME) + KIMI_END),
]

# Reasoning as a request's chat_template_kwargs switch it: (parser, kwargs, text, reasoning, content);
# reasoning None: the request turned thinking off, no parser applies.
REQUEST_REASONING = [
    # DeepSeek-V3.1: thinking true makes the template open <think>: the reply starts inside it
    ("deepseek-v3", {"thinking": True}, "The user asks the time.</think>It is noon.", "The user asks the time.",
     "It is noon."),
    ("deepseek-v3", {"thinking": True}, "Cut short while thinking", "Cut short while thinking", ""),
    ("deepseek-v3", {}, "It is noon.</think>", None, "It is noon.</think>"),
    ("deepseek-v3", {"thinking": False}, "It is noon.", None, "It is noon."),
    ("qwen3", {"enable_thinking": False}, "Hello!", None, "Hello!"),
    ("qwen3", {}, "<think>hm</think>Hello!", "hm", "Hello!"),
    ("kimi_k2", {"thinking": False}, "Hello!", None, "Hello!"),
    ("deepseek-r1", {"thinking": False}, "hm</think>Hello!", "hm", "Hello!"),
]
