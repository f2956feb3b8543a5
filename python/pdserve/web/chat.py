"""The prompt text a chat request becomes: the tokenizer's chat template over the messages.

Shared by the server (``/v1/chat/completions``) and the router, which must tokenize a chat request
exactly as the server will to find the prefill holding its prefix.
"""

from __future__ import annotations

from pdserve.web.errors import RequestError

# Used only when the tokenizer ships no chat template.
FALLBACK_CHAT_TEMPLATE = (
    "{{ bos_token or '' }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def render_chat(tokenizer, messages: list[dict]) -> str:
    """The prompt text the tokenizer's chat template makes of ``messages`` (generation prompt added)."""
    template = None if getattr(tokenizer, "chat_template", None) else FALLBACK_CHAT_TEMPLATE
    return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                         add_generation_prompt=True)


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    return tokenizer.encode(chat_prompt_text(tokenizer, messages), add_special_tokens=False)


def chat_prompt_text(tokenizer, messages: list[dict]) -> str:
    """The rendered chat prompt; raises RequestError naming ``messages`` when there are none."""
    if not messages:
        raise RequestError("messages: must hold at least one message", param="messages")
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    return render_chat(tokenizer, messages)
