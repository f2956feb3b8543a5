"""Model outputs in each family's real format, as the models write them (the tokens their chat
templates render tool calls and thinking with), and what each must parse to.

Each case: (parser name, raw output text, expected content, expected [(name, arguments, id)]).
Arguments are the raw JSON text as written: the API passes them on byte for byte.
"""

from __future__ import annotations

TOOLS = ("get_weather", "get_time", "search_web")

# DeepSeek-V3 / R1: special tokens with U+FF5C (｜) and U+2581 (▁); arguments in a ```json fence.
DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def ds_call(name: str, args: str) -> str:
    return f"{DS_CALL}function{DS_SEP}{name}\n```json\n{args}\n```{DS_CALL_END}"


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
    ("kimi_k2", KIMI_BEGIN + kimi_call("not-an-id", WEATHER) + KIMI_END, kimi_call("not-an-id", WEATHER), []),
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
]
