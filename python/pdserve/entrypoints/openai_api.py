"""OpenAI-compatible ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``.

Sampling maps onto SGLang's ``SamplingParams`` (``max_tokens`` -> ``max_new_tokens``);
range errors name the OpenAI field. Chat prompts are rendered with the
tokenizer's chat template and tokenized without adding special tokens (the
template owns them, as in HF's ``apply_chat_template(tokenize=True)``).
Streams end with ``data: [DONE]``; ``stream_options.include_usage`` adds a
final usage-only chunk.

Logprobs: completions ``logprobs`` (top-k, 0..``--max-logprobs``) with ``echo`` (the prompt's tokens
and logprobs first, the first one null; ``max_tokens`` 0 scores a prompt, as
lm-evaluation-harness does); chat ``logprobs`` / ``top_logprobs``. ``n`` samples per
prompt (``best_of`` >= n: keep the n with the highest cumulative logprob) share the
prompt's KV (``parallel_sampling``); choice ``i * n + j`` is sample j of prompt i, and
usage counts the prompt once per choice, as OpenAI does.

Structured output, tools and reasoning (``openai_tools`` says what a request asks, ``openai_output``
renders what the parsers read): ``response_format``, ``regex`` and ``ebnf`` become the engine's
grammar fields (a grammar error names the OpenAI field); chat ``tools`` reach the chat template, and
calls come back as ``message.tool_calls`` (streamed as ``tool_calls`` deltas); with
``--reasoning-parser`` the thinking part is ``reasoning_content``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import Request

from pdserve.engine.request import MAX_N, SamplingParams
from pdserve.entrypoints.logprobs import (
    TokenTexts,
    chat_logprobs,
    check_top_logprobs,
    completion_logprobs,
    text_end,
)
from pdserve.entrypoints.openai_output import ChoiceStream, OutputPlan, chat_message, final_reason
from pdserve.entrypoints.openai_tools import (
    Constraint,
    constraint,
    reasoning_parser_name,
    template_kwargs,
    template_messages,
    think_end,
    tool_plan,
)
from pdserve.entrypoints.parallel_sampling import (
    PromptJob,
    attach_prompt_logprobs,
    check_sequences,
    new_group,
    run_job,
    samples_here,
)
from pdserve.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.entrypoints.tokenizer_manager import GenerateChunk, TokenizerManager
from pdserve.parsers.registry import request_reasoning
from pdserve.web.chat import chat_prompt_text
from pdserve.web.errors import RequestError, parse_body, read_body
from pdserve.web.streaming import (
    gather_or_cancel,
    json_response,
    merge_streams,
    prime,
    sse,
    sse_events,
    sse_response,
    until_disconnect,
)

_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "frequency_penalty",
                    "presence_penalty", "stop_token_ids", "n")


@dataclass
class _Call:
    """One OpenAI call after validation: what to run and how to label the response."""

    kind: str  # "chat" or "completion"
    model: str
    jobs: list[PromptJob]  # one per prompt
    n: int
    logprobs: int | None  # top-k per token when logprobs are returned, else None
    echo_texts: list[str] | None  # completions with echo: each prompt's text
    stream: bool
    include_usage: bool
    rid: str | None
    texts: TokenTexts
    output: OutputPlan = OutputPlan()  # chat: the parsers that read each choice
    renames: dict[str, str] | None = None  # engine error fields -> the request fields they came from

    @property
    def id(self) -> str:
        return ("chatcmpl-" if self.kind == "chat" else "cmpl-") + (self.rid or "")


# -------------------------------------------------------------- endpoints
def list_models(model_name: str, model_path: str, context_len: int) -> dict:
    return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                        "owned_by": "pdserve", "root": model_path,
                                        "max_model_len": context_len}]}


async def completions(tm: TokenizerManager, request: Request, model_name: str):
    req: CompletionRequest = parse_body(CompletionRequest, await read_body(request, tm.args.max_request_bytes))
    if req.suffix:
        raise RequestError("suffix: not supported by this server", param="suffix")
    _check_top_k(tm, req.logprobs, "logprobs")
    prompts, texts = await _completion_prompts(tm, req.prompt)
    grammar = constraint(req)
    samplings = [_sampling(tm, req, p, req.max_tokens, "max_tokens", "prompt", grammar) for p in prompts]
    best_of = _best_of(req, samplings[0].n)
    check_sequences([best_of] * len(prompts), tm.args.max_seqs_per_request, "prompt",
                    "best_of" if best_of > samplings[0].n else "n")
    echo_lp = req.echo and req.logprobs is not None
    boots = tm.bootstraps(req, len(prompts), samplings[0].n)
    group = new_group()
    jobs = [PromptJob(ids, sp, samples_here(tm.role, best_of, boot), req.logprobs is not None or best_of > sp.n,
                      0 if echo_lp else None, req.logprobs or 0, bootstrap=boot, group=group,
                      cache_salt=tm.cache_salt(req.cache_salt))
            for ids, sp, boot in zip(prompts, samplings, boots)]
    echo_texts = [_prompt_text(tm, ids, t) for ids, t in zip(prompts, texts)] if req.echo else None
    call = _call("completion", model_name, req, jobs, req.logprobs, echo_texts, tm)
    call.renames = _renames(grammar)
    return await _run(tm, request, call)


async def chat_completions(tm: TokenizerManager, request: Request, model_name: str):
    req: ChatCompletionRequest = parse_body(ChatCompletionRequest, await read_body(request, tm.args.max_request_bytes))
    top = _chat_top_logprobs(tm, req)
    plan = tool_plan(req, tm.args.tool_call_parser)
    grammar = constraint(req, plan)
    ids = await _chat_ids(tm, template_messages(req), plan.template_tools, template_kwargs(req))
    name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    # A model's tool-call tags may be special tokens (Kimi's): keep them in the text its parser reads.
    native = plan.parser is not None and plan.forced is None
    reasoning = reasoning_parser_name(req, tm.args.reasoning_parser)
    sampling = _sampling(tm, req, ids, max_tokens, name, "messages", grammar, keep_special=native)
    sampling.think_end = think_end(reasoning, grammar)
    check_sequences([sampling.n], tm.args.max_seqs_per_request, "messages", "n")
    (boot,) = tm.bootstraps(req, 1, sampling.n)
    job = PromptJob(ids, sampling, samples_here(tm.role, sampling.n, boot), top is not None, None, top or 0,
                    bootstrap=boot, group=new_group(),
                    cache_salt=tm.cache_salt(req.cache_salt))
    call = _call("chat", model_name, req, [job], top, None, tm)
    call.output = OutputPlan(reasoning, plan.parser, plan.names, req.stream_reasoning, plan.schemas,
                             _reasoning_forced(reasoning, req), req.parallel_tool_calls)
    call.renames = _renames(grammar)
    return await _run(tm, request, call)


# ------------------------------------------------------------------- chat
def _reasoning_forced(name: str | None, req: ChatCompletionRequest) -> bool | None:
    """Whether this request's reply starts inside the thinking part (its template opened it)."""
    parser = None if name is None else request_reasoning(name, req.chat_template_kwargs)
    return None if parser is None else parser.forced


async def _chat_ids(tm: TokenizerManager, messages: list[dict], tools: list[dict] | None,
                    kwargs: dict) -> list[int]:
    """``chat_prompt_ids``, tokenized off the event loop when long."""
    if tm.tokenizer is None:
        raise RequestError("messages: this server has no tokenizer; use /generate with input_ids",
                           param="messages")
    return await tm.encode(chat_prompt_text(tm.tokenizer, messages, tools, **kwargs), add_special_tokens=False)


def _chat_top_logprobs(tm: TokenizerManager, req: ChatCompletionRequest) -> int | None:
    """Top-k per token when chat logprobs are asked for, else None."""
    if req.top_logprobs is not None:
        _check_top_k(tm, req.top_logprobs, "top_logprobs")
        if req.top_logprobs and not req.logprobs:
            raise RequestError("top_logprobs: needs logprobs: true", param="top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


# -------------------------------------------------------------- requests
def _check_top_k(tm: TokenizerManager, k: int | None, name: str) -> None:
    if k is None:
        return
    try:
        check_top_logprobs(k, name, tm.args.max_logprobs, tm.request_limits.vocab_size)
    except ValueError as e:
        raise RequestError.from_value_error(e) from None


def _best_of(req: CompletionRequest, n: int) -> int:
    """Samples to generate per prompt: best_of (>= n), else n."""
    if req.best_of is None:
        return n
    if not n <= req.best_of <= MAX_N:
        raise RequestError(f"best_of: must be in [n ({n}), {MAX_N}], got {req.best_of}", param="best_of")
    if req.stream and req.best_of > n:
        raise RequestError("best_of: cannot stream when best_of > n (the best are known only at the end)",
                           param="best_of")
    return req.best_of


async def _completion_prompts(tm: TokenizerManager, prompt) -> tuple[list[list[int]], list[str | None]]:
    """str | [str] | [int] | [[int]] -> token id lists (and the texts, where given); text needs a tokenizer."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], str)):
        texts = [prompt] if isinstance(prompt, str) else prompt
        if tm.tokenizer is None:
            raise RequestError("prompt: this server has no tokenizer; send token ids", param="prompt")
        for i, t in enumerate(texts):
            if not t:
                name = "prompt" if isinstance(prompt, str) else f"prompt[{i}]"
                raise RequestError(f"{name}: the prompt is empty", param=name)
        return [await tm.encode(t) for t in texts], list(texts)
    if not prompt:
        raise RequestError("prompt: the prompt is empty", param="prompt")
    ids = [list(prompt)] if isinstance(prompt[0], int) else [list(p) for p in prompt]
    return ids, [None] * len(ids)


def _prompt_text(tm: TokenizerManager, ids: list[int], text: str | None) -> str:
    if text is not None:
        return text
    return tm.tokenizer.decode(ids) if tm.tokenizer is not None else ""


def _sampling(tm: TokenizerManager, req, prompt_ids: list[int], max_tokens: int | None,
              max_field: str, prompt_field: str, grammar: Constraint | None = None,
              keep_special: bool = False) -> SamplingParams:
    """Validated SamplingParams for one prompt; ``max_tokens=None`` means as many as fit."""
    if max_tokens is None:
        limits = tm.request_limits
        room = min(limits.context_len - len(prompt_ids), limits.max_total_tokens + 1 - len(prompt_ids))
        max_tokens = max(0, room)
    d = {"max_new_tokens": max_tokens, "ignore_eos": req.ignore_eos,
         "skip_special_tokens": req.skip_special_tokens and not keep_special}
    if grammar is not None:
        d[grammar.kind] = grammar.text
    d.update({k: getattr(req, k) for k in _SAMPLING_FIELDS if getattr(req, k) is not None})
    if req.stop is not None:
        d["stop"] = [req.stop] if isinstance(req.stop, str) else req.stop
    try:
        sampling = SamplingParams.from_dict(d).validate(tm.request_limits.vocab_size)
    except ValueError as e:
        renames = {"max_new_tokens": max_field} | (_renames(grammar) or {})
        raise RequestError.from_value_error(e, renames, "sampling_params.") from None
    tm.check_input(prompt_ids, sampling.max_new_tokens, prompt_field, max_field)
    return sampling


def _call(kind: str, model_name: str, req, jobs: list[PromptJob], logprobs: int | None,
          echo_texts: list[str] | None, tm: TokenizerManager) -> _Call:
    if req.stream and len(jobs) > 1:
        raise RequestError("prompt: a batch of prompts cannot stream; send one request per prompt",
                           param="prompt")
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    if len(jobs) == 1:
        jobs[0].rid = tm.new_rid(req.rid)
    return _Call(kind, req.model or model_name, jobs, jobs[0].sampling.n, logprobs, echo_texts, req.stream,
                 include_usage, jobs[0].rid, tm.token_texts)


def _renames(grammar: Constraint | None) -> dict[str, str] | None:
    """The engine names a grammar error by its SamplingParams field: name the request's instead."""
    return None if grammar is None else {grammar.kind: grammar.field}


def _renamed(err: RequestError, renames: dict[str, str] | None) -> RequestError:
    engine_field = (err.param or "").removeprefix("sampling_params.")
    field = (renames or {}).get(engine_field)
    if field is None:
        return err
    message = err.message
    for prefix in (f"{err.param}:", f"{engine_field}:"):
        if message.startswith(prefix):
            message = f"{field}:{message[len(prefix):]}"
            break
    return RequestError(message, param=field, status=err.status, code=err.code)


async def _run(tm: TokenizerManager, request: Request, call: _Call):
    try:
        return await _run_call(tm, request, call)
    except RequestError as e:
        raise _renamed(e, call.renames) from None


async def _run_call(tm: TokenizerManager, request: Request, call: _Call):
    if call.stream:
        return await _stream(tm, request, call)
    results = await until_disconnect(request, gather_or_cancel(*(run_job(tm, job) for job in call.jobs)))
    call.rid = call.rid or results[0][0].rid
    choices = [(i, c) for i, chunks in enumerate(results) for c in _best(chunks, call.n)]
    return json_response(_response(call, choices))


async def _stream(tm: TokenizerManager, request: Request, call: _Call):
    job = call.jobs[0]
    shared = await until_disconnect(request, job.prefill(tm)) if job.shares_prefill else None
    gens = job.generators(tm, stream=True)
    streamer = _Streamer(call, shared)
    if len(gens) == 1:  # its chunks straight from the generator: no merge, nor a generator pairing them with 0
        first_chunk = await until_disconnect(request, prime(gens[0]))
        return sse_response(sse_events(first_chunk, gens[0], streamer.render_only, streamer.tail))
    merged = merge_streams(gens)
    first = await until_disconnect(request, prime(merged))
    return sse_response(sse_events(first, merged, streamer.render, streamer.tail))


def _best(chunks: list[GenerateChunk], n: int) -> list[GenerateChunk]:
    """The n samples with the highest cumulative logprob (all of them when there are n), in order."""
    if len(chunks) <= n:
        return chunks
    keep = sorted(range(len(chunks)), key=lambda j: -sum(chunks[j].logprobs or []))[:n]
    return [chunks[j] for j in sorted(keep)]


# -------------------------------------------------------------- responses
def finish_reason(reason: dict | None) -> str | None:
    return None if reason is None else reason.get("type")


def _usage(chunks) -> dict:
    prompt = sum(c.prompt_tokens for c in chunks)
    completion = sum(c.completion_tokens for c in chunks)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(c.cached_tokens for c in chunks)}}


def _choice_logprobs(call: _Call, prompt: int, c: GenerateChunk, echo: bool, text_offset: int = 0) -> dict | None:
    """``logprobs`` of one choice (or stream chunk); ``echo`` puts the prompt's tokens first."""
    if call.logprobs is None:
        return None
    ids, lps = c.token_ids, c.logprobs or []
    tops = c.top_logprobs if call.logprobs else None
    if call.kind == "chat":
        return chat_logprobs(ids, lps, tops, call.texts)
    if echo:
        ids = call.jobs[prompt].input_ids + ids
        lps = list(c.input_logprobs or []) + lps
        if call.logprobs:
            tops = list(c.input_top_logprobs or []) + list(tops or [])
    return completion_logprobs(ids, lps, tops, call.texts, text_offset)


def _choice(call: _Call, index: int, prompt: int, c: GenerateChunk) -> dict:
    matched = (c.finish_reason or {}).get("matched")
    lp = _choice_logprobs(call, prompt, c, call.echo_texts is not None)
    body: dict[str, Any]
    reason = finish_reason(c.finish_reason)
    if call.kind == "chat":
        message, reason = chat_message(call.output, c.text, reason)
        body = {"message": message}
    else:
        body = {"text": (call.echo_texts[prompt] if call.echo_texts is not None else "") + c.text}
    return {"index": index, **body, "logprobs": lp, "finish_reason": reason, "matched_stop": matched}


def _response(call: _Call, choices: list[tuple[int, GenerateChunk]]) -> dict:
    obj = "chat.completion" if call.kind == "chat" else "text_completion"
    return {"id": call.id, "object": obj, "created": int(time.time()), "model": call.model,
            "choices": [_choice(call, k, i, c) for k, (i, c) in enumerate(choices)],
            "usage": _usage([c for _, c in choices])}


class _Streamer:
    """Renders the (sample index, chunk) pairs of one prompt's streams as OpenAI stream events."""

    def __init__(self, call: _Call, shared: GenerateChunk | None):
        self.call = call
        self.shared = shared  # the shared prefill (prompt logprobs) of n > 1
        self.created = int(time.time())
        self.object = "chat.completion.chunk" if call.kind == "chat" else "text_completion"
        self.last: dict[int, GenerateChunk] = {}
        self.offsets: dict[int, int] = {}  # completions: text offset of each choice's next token
        self.parsed: dict[int, ChoiceStream] = {}  # chat with parsers: each choice's parser state
        self.frame: tuple[bytes, bytes] | None = None  # _frame(), made at the first event (the id is set by then)

    def render_only(self, c: GenerateChunk) -> list[bytes]:
        """``render`` of the only choice's chunk (n = 1)."""
        return self.render((0, c))

    def render(self, item: tuple[int, GenerateChunk]) -> list[bytes]:
        index, c = item
        out = []
        opening = index not in self.last
        self.last[index] = c
        text = c.text
        echo_texts = self.call.echo_texts
        echo = opening and echo_texts is not None
        if opening:
            attach_prompt_logprobs(c, self.shared)
            if self.call.kind == "chat":  # the role comes first, alone
                out.append(self._event(index, {"role": "assistant", "content": ""}, None, None))
            elif echo_texts is not None:  # echo
                text = echo_texts[0] + text
        lp = self._logprobs(index, c, echo) if c.token_ids or echo else None
        if self.call.kind == "chat" and self.call.output.active:
            out += self._parsed(index, text, c.finished, lp)
        elif text or lp is not None or (c.token_ids and not c.finished):
            # a step whose tokens hold no text yet (an incomplete UTF-8 character) still sends its event,
            # with empty text, as vLLM does: the client sees every step arrive, not a silent stream
            out.append(self._event(index, self._delta(text), lp, None))
        if c.finished:
            called = index in self.parsed and self.parsed[index].called
            reason = final_reason(finish_reason(c.finish_reason), called)
            out.append(self._event(index, self._delta(None), None, reason))
        return out

    def _parsed(self, index: int, text: str, finished: bool, lp: dict | None) -> list[bytes]:
        """The events of one chunk of a parsed choice: its reasoning, content and tool-call
        deltas, the chunk's logprobs on the first (alone, if the parsers hold everything back)."""
        stream = self.parsed.setdefault(index, ChoiceStream(self.call.output))
        deltas = stream.deltas(text, finished) or ([{}] if lp is not None else [])
        return [self._event(index, d, lp if i == 0 else None, None) for i, d in enumerate(deltas)]

    def _logprobs(self, index: int, c: GenerateChunk, echo: bool) -> dict | None:
        start = self.offsets.get(index, 0)
        lp = _choice_logprobs(self.call, 0, c, echo, start)
        if lp is not None and self.call.kind != "chat":
            self.offsets[index] = text_end(lp, start)
        return lp

    def tail(self) -> list[bytes]:
        if not (self.call.include_usage and self.last):
            return []
        return [sse(self._envelope([], _usage(self.last.values())))]

    def _delta(self, text: str | None):
        if self.call.kind == "chat":
            return {} if text is None else {"content": text}
        return "" if text is None else text

    def _event(self, index: int, delta, logprobs: dict | None, reason: str | None) -> bytes:
        key = "delta" if self.call.kind == "chat" else "text"
        choice = {"index": index, key: delta, "logprobs": logprobs, "finish_reason": reason}
        if self.frame is None:
            self.frame = self._frame()
        head, tail = self.frame
        return head + orjson.dumps(choice) + tail

    def _frame(self) -> tuple[bytes, bytes]:
        """The bytes of an event around its one choice: ``sse(self._envelope([choice], None))`` is
        ``head + orjson.dumps(choice) + tail`` (the envelope is the same for every event of the stream,
        and dumping it, its id and model strings included, was most of an event's JSON)."""
        body = sse(self._envelope([0], None))
        head, tail = body.split(b'"choices":[0]', 1)  # the key's first unescaped occurrence: id and model are escaped
        return head + b'"choices":[', b"]" + tail

    def _envelope(self, choices: list, usage: dict | None) -> dict:
        body = {"id": self.call.id, "object": self.object, "created": self.created, "model": self.call.model,
                "choices": choices}
        if self.call.include_usage:
            body["usage"] = usage
        return body
