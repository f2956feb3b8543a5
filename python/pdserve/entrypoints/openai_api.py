"""OpenAI-compatible ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``.

Sampling maps onto SGLang's ``SamplingParams`` (``max_tokens`` -> ``max_new_tokens``);
range errors name the OpenAI field. Chat prompts are rendered with the
tokenizer's chat template and tokenized without adding special tokens (the
template owns them, as in HF's ``apply_chat_template(tokenize=True)``).
Streams end with ``data: [DONE]``; ``stream_options.include_usage`` adds a
final usage-only chunk.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse

from pdserve.engine.request import SamplingParams
from pdserve.entrypoints.errors import RequestError, parse_body
from pdserve.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.entrypoints.streaming import (
    collect,
    gather_or_cancel,
    prime,
    sse,
    sse_events,
    sse_response,
    until_disconnect,
)
from pdserve.entrypoints.tokenizer_manager import GenerateChunk, TokenizerManager

# Used only when the tokenizer ships no chat template.
FALLBACK_CHAT_TEMPLATE = (
    "{{ bos_token or '' }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "frequency_penalty",
                    "presence_penalty", "stop_token_ids", "n")


@dataclass
class _Call:
    """One OpenAI call after validation: what to run and how to label the response."""

    kind: str  # "chat" or "completion"
    model: str
    prompts: list[list[int]]
    samplings: list[SamplingParams]
    stream: bool
    include_usage: bool
    rid: str | None

    @property
    def id(self) -> str:
        return ("chatcmpl-" if self.kind == "chat" else "cmpl-") + (self.rid or "")


# -------------------------------------------------------------- endpoints
def list_models(model_name: str, model_path: str, context_len: int) -> dict:
    return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                        "owned_by": "pdserve", "root": model_path,
                                        "max_model_len": context_len}]}


async def completions(tm: TokenizerManager, request: Request, model_name: str):
    req: CompletionRequest = parse_body(CompletionRequest, await request.body())
    _reject_unsupported_completion(req)
    prompts = _completion_prompts(tm, req.prompt)
    samplings = [_sampling(tm, req, p, req.max_tokens, "max_tokens", "prompt") for p in prompts]
    call = _call("completion", model_name, req, prompts, samplings)
    return await _run(tm, request, call)


async def chat_completions(tm: TokenizerManager, request: Request, model_name: str):
    req: ChatCompletionRequest = parse_body(ChatCompletionRequest, await request.body())
    if req.logprobs or req.top_logprobs:
        raise RequestError("logprobs: not supported on /v1/chat/completions yet; use /generate with "
                           "return_logprob", param="logprobs")
    ids = chat_prompt_ids(tm.tokenizer, [m.model_dump() | {"content": m.text()} for m in req.messages])
    name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    sampling = _sampling(tm, req, ids, max_tokens, name, "messages")
    call = _call("chat", model_name, req, [ids], [sampling])
    return await _run(tm, request, call)


# ------------------------------------------------------------------- chat
def render_chat(tokenizer, messages: list[dict]) -> str:
    """The prompt text the tokenizer's chat template makes of ``messages`` (generation prompt added)."""
    template = None if getattr(tokenizer, "chat_template", None) else FALLBACK_CHAT_TEMPLATE
    return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                         add_generation_prompt=True)


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    if tokenizer is None:
        raise RequestError("messages: this server has no tokenizer; use /generate with input_ids",
                           param="messages")
    if not messages:
        raise RequestError("messages: must hold at least one message", param="messages")
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    return tokenizer.encode(render_chat(tokenizer, messages), add_special_tokens=False)


# -------------------------------------------------------------- requests
def _reject_unsupported_completion(req: CompletionRequest) -> None:
    for name, bad in (("echo", req.echo), ("logprobs", req.logprobs), ("suffix", req.suffix),
                      ("best_of", req.best_of not in (None, 1))):
        if bad:
            raise RequestError(f"{name}: not supported by this server", param=name)


def _completion_prompts(tm: TokenizerManager, prompt) -> list[list[int]]:
    """str | [str] | [int] | [[int]] -> token id lists; text needs a tokenizer."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], str)):
        texts = [prompt] if isinstance(prompt, str) else prompt
        if tm.tokenizer is None:
            raise RequestError("prompt: this server has no tokenizer; send token ids", param="prompt")
        if not all(texts):
            raise RequestError("prompt: the prompt is empty", param="prompt")
        return [tm.tokenizer.encode(t) for t in texts]
    if not prompt:
        raise RequestError("prompt: the prompt is empty", param="prompt")
    return [list(prompt)] if isinstance(prompt[0], int) else [list(p) for p in prompt]


def _sampling(tm: TokenizerManager, req, prompt_ids: list[int], max_tokens: int | None,
              max_field: str, prompt_field: str) -> SamplingParams:
    """Validated SamplingParams for one prompt; ``max_tokens=None`` means up to the context length."""
    if max_tokens is None:
        max_tokens = max(0, tm.limits.context_len - len(prompt_ids))
    d = {"max_new_tokens": max_tokens, "ignore_eos": req.ignore_eos,
         "skip_special_tokens": req.skip_special_tokens}
    d.update({k: getattr(req, k) for k in _SAMPLING_FIELDS if getattr(req, k) is not None})
    if req.stop is not None:
        d["stop"] = [req.stop] if isinstance(req.stop, str) else req.stop
    try:
        sampling = SamplingParams.from_dict(d).validate(tm.limits.vocab_size)
    except ValueError as e:
        raise RequestError.from_value_error(e, {"max_new_tokens": max_field}, "sampling_params.") from None
    tm.check_input(prompt_ids, sampling.max_new_tokens, prompt_field, max_field)
    return sampling


def _call(kind: str, model_name: str, req, prompts, samplings) -> _Call:
    if req.stream and len(prompts) > 1:
        raise RequestError("prompt: a batch of prompts cannot stream; send one request per prompt",
                           param="prompt")
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return _Call(kind, req.model or model_name, prompts, samplings, req.stream, include_usage, req.rid)


async def _run(tm: TokenizerManager, request: Request, call: _Call):
    rids = [tm.new_rid(call.rid)] if len(call.prompts) == 1 else [None] * len(call.prompts)
    gens = [tm.generate(p, s, False, rid, stream=call.stream)
            for p, s, rid in zip(call.prompts, call.samplings, rids)]
    if call.stream:
        first = await until_disconnect(request, prime(gens[0]))
        call.rid = first.rid
        return sse_response(_Streamer(call).events(first, gens[0]))
    chunks = await until_disconnect(request, gather_or_cancel(*(collect(g) for g in gens)))
    call.rid = chunks[0].rid
    return JSONResponse(_response(call, chunks))


# -------------------------------------------------------------- responses
def finish_reason(reason: dict | None) -> str | None:
    return None if reason is None else reason.get("type")


def _usage(chunks: list[GenerateChunk]) -> dict:
    prompt = sum(c.prompt_tokens for c in chunks)
    completion = sum(c.completion_tokens for c in chunks)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(c.cached_tokens for c in chunks)}}


def _choice(call: _Call, index: int, c: GenerateChunk) -> dict:
    matched = (c.finish_reason or {}).get("matched")
    body = {"message": {"role": "assistant", "content": c.text}} if call.kind == "chat" else {"text": c.text}
    return {"index": index, **body, "logprobs": None, "finish_reason": finish_reason(c.finish_reason),
            "matched_stop": matched}


def _response(call: _Call, chunks: list[GenerateChunk]) -> dict:
    obj = "chat.completion" if call.kind == "chat" else "text_completion"
    return {"id": call.id, "object": obj, "created": int(time.time()), "model": call.model,
            "choices": [_choice(call, i, c) for i, c in enumerate(chunks)], "usage": _usage(chunks)}


class _Streamer:
    """Renders one request's chunks as OpenAI stream events."""

    def __init__(self, call: _Call):
        self.call = call
        self.created = int(time.time())
        self.object = "chat.completion.chunk" if call.kind == "chat" else "text_completion"
        self.last: GenerateChunk | None = None

    def events(self, first: GenerateChunk, gen):
        return sse_events(first, gen, self.render, self.tail)

    def render(self, c: GenerateChunk) -> list[bytes]:
        out = []
        if self.last is None and self.call.kind == "chat":  # the role comes first, alone
            out.append(self._event({"role": "assistant", "content": ""}, None))
        self.last = c
        if c.text:
            out.append(self._event(self._delta(c.text), None))
        if c.finished:
            out.append(self._event(self._delta(None), finish_reason(c.finish_reason)))
        return out

    def tail(self) -> list[bytes]:
        if not (self.call.include_usage and self.last is not None):
            return []
        return [sse(self._envelope([], _usage([self.last])))]

    def _delta(self, text: str | None):
        if self.call.kind == "chat":
            return {} if text is None else {"content": text}
        return "" if text is None else text

    def _event(self, delta, reason: str | None) -> bytes:
        key = "delta" if self.call.kind == "chat" else "text"
        choice = {"index": 0, key: delta, "logprobs": None, "finish_reason": reason}
        return sse(self._envelope([choice], None))

    def _envelope(self, choices: list, usage: dict | None) -> dict:
        body = {"id": self.call.id, "object": self.object, "created": self.created, "model": self.call.model,
                "choices": choices}
        if self.call.include_usage:
            body["usage"] = usage
        return body

