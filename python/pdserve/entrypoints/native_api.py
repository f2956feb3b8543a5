"""SGLang's native ``POST /generate``: text or input_ids in, ``{"text", "output_ids", "meta_info"}`` out.

``meta_info`` has the offline Engine's keys. Streaming sends SGLang's shape:
every event carries the cumulative text and output ids so far, then ``data: [DONE]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse

from pdserve.engine.request import SamplingParams
from pdserve.entrypoints.errors import RequestError, parse_body
from pdserve.entrypoints.protocol import GenerateRequest
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


@dataclass
class _Item:
    input_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool
    rid: str | None


async def generate(tm: TokenizerManager, request: Request):
    req: GenerateRequest = parse_body(GenerateRequest, await request.body())
    items, single = _items(tm, req)
    if req.stream:
        if not single:
            raise RequestError("stream: a batch of prompts cannot stream; send one request per prompt",
                               param="stream")
        return await _stream(tm, request, items[0])
    gens = [_gen(tm, it, stream=False) for it in items]
    chunks = await until_disconnect(request, gather_or_cancel(*(collect(g) for g in gens)))
    bodies = [_body(c, c.text, c.token_ids, c.logprobs) for c in chunks]
    return JSONResponse(bodies[0] if single else bodies)


async def _stream(tm: TokenizerManager, request: Request, item: _Item):
    gen = _gen(tm, item, stream=True)
    first = await until_disconnect(request, prime(gen))
    acc = _Cumulative()
    return sse_response(sse_events(first, gen, lambda c: [sse(acc.add(c))]))


def _gen(tm: TokenizerManager, it: _Item, stream: bool):
    return tm.generate(it.input_ids, it.sampling, it.return_logprob, it.rid, stream=stream)


@dataclass
class _Cumulative:
    """Running text / ids / logprobs of one streamed request."""

    text: str = ""
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None

    def add(self, c: GenerateChunk) -> dict:
        self.text += c.text
        self.ids += c.token_ids
        if c.logprobs is not None:
            self.logprobs = (self.logprobs or []) + c.logprobs
        return _body(c, self.text, self.ids, self.logprobs)


def _body(c: GenerateChunk, text: str, ids: list[int], logprobs: list[float] | None) -> dict:
    meta = {"id": c.rid, "prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
            "cached_tokens": c.cached_tokens, "finish_reason": c.finish_reason}
    if logprobs:
        meta["output_token_logprobs"] = [(lp, t, None) for lp, t in zip(logprobs, ids)]
    return {"text": text, "output_ids": list(ids), "meta_info": meta}


# ------------------------------------------------------------- normalising
def _items(tm: TokenizerManager, req: GenerateRequest) -> tuple[list[_Item], bool]:
    """One _Item per prompt, validated with /generate's field names."""
    ids_list, single, field_name = _prompts(tm, req)
    n = len(ids_list)
    sps = _per_prompt(req.sampling_params, n, "sampling_params", dict)
    lps = _per_prompt(req.return_logprob, n, "return_logprob", bool)
    rids = _per_prompt(req.rid, n, "rid", str)
    items = []
    for ids, sp, lp, rid in zip(ids_list, sps, lps, rids):
        sampling = _sampling(sp, tm.limits.vocab_size)
        tm.check_input(ids, sampling.max_new_tokens, field_name, "sampling_params.max_new_tokens")
        items.append(_Item(ids, sampling, bool(lp), rid))
    return items, single


def _prompts(tm: TokenizerManager, req: GenerateRequest) -> tuple[list[list[int]], bool, str]:
    if (req.text is None) == (req.input_ids is None):
        raise RequestError("text/input_ids: give exactly one of them", param="text")
    if req.text is not None:
        if tm.tokenizer is None:
            raise RequestError("text: this server has no tokenizer; send input_ids instead", param="text")
        single = isinstance(req.text, str)
        texts = [req.text] if single else req.text
        if not texts or not all(texts):
            raise RequestError("text: the prompt is empty", param="text")
        return [tm.tokenizer.encode(t) for t in texts], single, "text"
    single = not req.input_ids or not isinstance(req.input_ids[0], list)
    ids = [req.input_ids] if single else req.input_ids
    if not ids:
        raise RequestError("input_ids: the prompt is empty", param="input_ids")
    return [list(x) for x in ids], single, "input_ids"


def _per_prompt(value, n: int, name: str, kind: type) -> list:
    if value is None or isinstance(value, kind):
        return [value] * n
    if len(value) != n:
        raise RequestError(f"{name}: expected {n} entries (one per prompt), got {len(value)}", param=name)
    return list(value)


def _sampling(d: dict | None, vocab_size: int) -> SamplingParams:
    try:
        return SamplingParams.from_dict(d).validate(vocab_size)
    except TypeError as e:
        raise RequestError(f"sampling_params: {e}", param="sampling_params") from None
    except ValueError as e:
        raise RequestError.from_value_error(e) from None
