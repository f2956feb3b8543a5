"""The prompt text a chat request becomes: the tokenizer's chat template over the messages (and
the request's tools and template keyword arguments, e.g. ``enable_thinking``).

Shared by the server (``/v1/chat/completions``) and the router, which must tokenize a chat request
exactly as the server will to find the prefill holding its prefix.
"""

from __future__ import annotations

import json

from pdserve.web.errors import RequestError

# Used only when the tokenizer ships no chat template.
FALLBACK_CHAT_TEMPLATE = (
    "{{ bos_token or '' }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def render_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None, **template_kwargs) -> str:
    """The prompt text the tokenizer's chat template makes of ``messages`` (generation prompt added)."""
    template = None if getattr(tokenizer, "chat_template", None) else FALLBACK_CHAT_TEMPLATE
    return tokenizer.apply_chat_template(messages, chat_template=template, tools=tools or None, tokenize=False,
                                         add_generation_prompt=True, **template_kwargs)


def chat_prompt_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None, **template_kwargs) -> list[int]:
    return tokenizer.encode(chat_prompt_text(tokenizer, messages, tools, **template_kwargs), add_special_tokens=False)


def chat_prompt_text(tokenizer, messages: list[dict], tools: list[dict] | None = None, **template_kwargs) -> str:
    """The rendered chat prompt; raises RequestError naming ``messages`` when there are none or the
    template refuses them. Earlier turns' tool-call arguments go in as objects (transformers'
    convention); a template that concatenates them as strings (DeepSeek-V3's) gets strings."""
    if not messages:
        raise RequestError("messages: must hold at least one message", param="messages")
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    try:
        try:
            return render_chat(tokenizer, messages, tools, **template_kwargs)
        except TypeError:
            if not any("tool_calls" in m for m in messages):
                raise
            return render_chat(tokenizer, _string_arguments(messages), tools, **template_kwargs)
    except Exception as e:
        if not _template_error(e):
            raise
        raise RequestError(f"messages: the chat template could not render them ({e})", param="messages") from None


def _template_error(e: Exception) -> bool:
    """What a template raises on messages it cannot render: its own errors (``raise_exception``,
    undefined values; jinja2's classes, matched by module so the router needs no jinja2 import)
    and the TypeError/ValueError of an operation on a value of the wrong kind."""
    return isinstance(e, (TypeError, ValueError)) or type(e).__module__.split(".")[0] == "jinja2"


def _string_arguments(messages: list[dict]) -> list[dict]:
    def call(c: dict) -> dict:
        args = c.get("function", {}).get("arguments")
        return c if isinstance(args, str) else {**c, "function": {**c["function"], "arguments": json.dumps(args)}}

    return [{**m, "tool_calls": [call(c) for c in m["tool_calls"]]} if "tool_calls" in m else m for m in messages]
