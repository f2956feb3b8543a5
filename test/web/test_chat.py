"""The chat prompt: the tiny presets' template renders tools, earlier tool calls and
enable_thinking; arguments reach a template as objects, or as strings where it concatenates them;
a template that refuses the messages is a 400 naming them."""

from __future__ import annotations

import copy
import json

import pytest
from transformers import AutoTokenizer

from pdserve.assets import preset_dir
from pdserve.web.chat import chat_prompt_text
from pdserve.web.errors import RequestError

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
TURNS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": None, "tool_calls": [CALL]},
         {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
# DeepSeek-V3's way: the arguments concatenated as text
CONCATENATING = ("{% for m in messages %}{% if m['tool_calls'] is defined %}{% for t in m['tool_calls'] %}"
                 "{{ '<call>' + t['function']['name'] + '\\n' + t['function']['arguments'] + '</call>' }}"
                 "{% endfor %}{% else %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endif %}{% endfor %}")


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(preset_dir("tiny-qwen3-moe"))


def test_plain_chat_is_unchanged_chatml(tokenizer):
    assert chat_prompt_text(tokenizer, TURNS[:2]) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_tools_calls_and_results_are_rendered(tokenizer):
    text = chat_prompt_text(tokenizer, TURNS, TOOLS)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert json.loads(text.split("<tools>\n")[1].split("\n</tools>")[0]) == TOOLS[0]
    assert ('<|im_start|>assistant\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            "</tool_call><|im_end|>\n<|im_start|>tool\n{\"temperature\": 21}<|im_end|>\n") in text


def test_enable_thinking_false_closes_an_empty_thinking_part(tokenizer):
    assert chat_prompt_text(tokenizer, TURNS[1:2], enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_a_concatenating_template_gets_arguments_as_text(tokenizer):
    tok = copy.copy(tokenizer)
    tok.chat_template = CONCATENATING
    assert '<call>get_weather\n{"city": "Paris"}</call>' in chat_prompt_text(tok, TURNS[1:3])


def test_a_refusing_template_is_a_400_naming_messages(tokenizer):
    tok = copy.copy(tokenizer)
    tok.chat_template = "{{ raise_exception('only user turns, please') }}"
    with pytest.raises(RequestError, match="only user turns, please") as err:
        chat_prompt_text(tok, TURNS[1:2])
    assert err.value.param == "messages" and err.value.status == 400
