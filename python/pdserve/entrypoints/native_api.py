"""SGLang's native ``POST /generate``: text or input_ids in, ``{"text", "output_ids", "meta_info"}`` out.

``meta_info`` has the offline Engine's keys (with ``return_logprob``, SGLang's
``input_token_logprobs`` / ``output_token_logprobs`` and, with ``top_logprobs_num``,
``input_top_logprobs`` / ``output_top_logprobs``). ``sampling_params.n`` > 1 returns
n bodies per prompt. Streaming sends SGLang's shape: every event carries the
cumulative text and output ids so far, then ``data: [DONE]``; logprobs are incremental (an
event's ``output_*`` entries are its own tokens', the prompt's ``input_*`` come once, in the
first event), so a stream carries each entry once, as an unstreamed answer does (issue 33).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import Request

from pdserve.engine.logprobs import check_logprob_params, resolve_start

if TYPE_CHECKING:
    from typing_extensions import TypeIs  # typing.TypeIs is 3.13+
from pdserve.engine.request import SamplingParams
from pdserve.entrypoints.logprobs import LogprobData, TokenTexts, check_top_logprobs, sglang_meta
from pdserve.entrypoints.parallel_sampling import PromptJob, check_sequences, new_group, run_job, samples_here
from pdserve.entrypoints.protocol import GenerateRequest
from pdserve.entrypoints.tokenizer_manager import GenerateChunk, TokenizerManager
from pdserve.web.errors import RequestError, parse_body, read_body
from pdserve.web.streaming import (
    gather_or_cancel,
    json_response,
    prime,
    sse,
    sse_events,
    sse_response,
    until_disconnect,
)


@dataclass
class _Item:
    """One prompt of a /generate call, validated."""

    job: PromptJob
    top_logprobs_num: int  # as asked (the meta_info keys depend on it)


async def generate(tm: TokenizerManager, request: Request):
    req = parse_body(GenerateRequest, await read_body(request, tm.args.max_request_bytes))
    items, single = await _items(tm, req)
    texts = tm.token_texts if req.return_text_in_logprobs else None
    if req.stream:
        if not single or items[0].job.count > 1:
            raise RequestError("stream: only one prompt with n = 1 can stream; send one request per sample",
                               param="stream")
        return await _stream(tm, request, items[0], texts)
    results = await until_disconnect(request, gather_or_cancel(*(run_job(tm, it.job) for it in items)))
    bodies = [_body(it, c, c.text, c.token_ids, texts) for it, chunks in zip(items, results) for c in chunks]
    return json_response(bodies[0] if single and len(bodies) == 1 else bodies)


async def _stream(tm: TokenizerManager, request: Request, item: _Item, texts: TokenTexts | None):
    gen = item.job.generators(tm, stream=True)[0]
    first = await until_disconnect(request, prime(gen))
    acc = _Cumulative(item, texts)
    return sse_response(sse_events(first, gen, lambda c: [sse(acc.add(c))]))


class _Cumulative:
    """Running text / ids of one streamed request (SGLang streams them cumulative); each event's
    logprobs are the chunk's own (resending them all would make a stream of n tokens carry
    O(n^2) entries: 126 MiB for 400 tokens at top-20 of a 2,000-token prompt)."""

    def __init__(self, item: _Item, texts: TokenTexts | None):
        self.item = item
        self.texts = texts
        self.text = ""
        self.ids: list[int] = []

    def add(self, c: GenerateChunk) -> dict:
        self.text += c.text
        self.ids += c.token_ids
        return _body(self.item, c, self.text, self.ids, self.texts)


def _body(item: _Item, c: GenerateChunk, text: str, ids: list[int], texts: TokenTexts | None) -> dict:
    """SGLang's response body; its logprobs are those ``c`` holds (all of them unstreamed, a
    stream event's own)."""
    meta = {"id": c.rid, "prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
            "cached_tokens": c.cached_tokens, "finish_reason": c.finish_reason}
    if c.cached_tokens_by_tier is not None:
        meta["cached_tokens_by_tier"] = c.cached_tokens_by_tier
    if c.decode_cached_tokens is not None:  # a decode server: its own hit, beside prefill's cached_tokens
        meta["decode_cached_tokens"] = c.decode_cached_tokens
    if c.spec:
        meta.update(c.spec)
    if c.timeline is not None:
        meta["timeline"] = c.timeline
    if item.job.return_logprob:
        data = LogprobData()
        data.extend(c.token_ids, c.logprobs, c.top_logprobs)
        data.set_input(c.input_logprobs, c.input_top_logprobs)
        meta.update(sglang_meta(data, item.job.input_ids, texts, item.top_logprobs_num))
    return {"text": text, "output_ids": list(ids), "meta_info": meta}


# ------------------------------------------------------------- normalising
async def _items(tm: TokenizerManager, req: GenerateRequest) -> tuple[list[_Item], bool]:
    """One _Item per prompt, validated with /generate's field names."""
    ids_list, single, field_name = await _prompts(tm, req)
    n = len(ids_list)
    sps = _per_prompt(req.sampling_params, n, "sampling_params", dict)
    lps = _per_prompt(req.return_logprob, n, "return_logprob", bool)
    starts = _per_prompt(req.logprob_start_len, n, "logprob_start_len", int)
    tops = _per_prompt(req.top_logprobs_num, n, "top_logprobs_num", int)
    rids = _per_prompt(req.rid, n, "rid", str)
    samplings = [_sampling(sp, tm.request_limits.vocab_size) for sp in sps]
    check_sequences([s.n for s in samplings], tm.args.max_seqs_per_request, field_name, "sampling_params.n")
    _check_sample_rids(tm, rids, [s.n for s in samplings])
    boots = tm.bootstraps(req, n, samplings[0].n)
    group = new_group()
    items = []
    for ids, sampling, lp, start, top, rid, boot in zip(ids_list, samplings, lps, starts, tops, rids, boots):
        tm.check_input(ids, sampling.max_new_tokens, field_name, "sampling_params.max_new_tokens")
        start, top = -1 if start is None else start, top or 0
        if lp:
            _check_logprobs(ids, start, top, tm)
        count = samples_here(tm.role, sampling.n, boot)
        job = PromptJob(ids, sampling.for_copy(0), count, bool(lp), resolve_start(start, len(ids)) if lp else None,
                        top if lp else 0, rid, boot, group,
                        tm.cache_salt(req.cache_salt))
        items.append(_Item(job, top if lp else 0))
    return items, single


def _check_logprobs(ids: list[int], start, top, tm: TokenizerManager) -> None:
    vocab_size = tm.request_limits.vocab_size
    try:
        check_logprob_params(len(ids), start, top, vocab_size)
        check_top_logprobs(top, "top_logprobs_num", tm.args.max_logprobs, vocab_size)
    except ValueError as e:
        raise RequestError.from_value_error(e) from None


async def _prompts(tm: TokenizerManager, req: GenerateRequest) -> tuple[list[list[int]], bool, str]:
    if (req.text is None) == (req.input_ids is None):
        raise RequestError("text/input_ids: give exactly one of them", param="text")
    if req.text is not None:
        if tm.tokenizer is None:
            raise RequestError("text: this server has no tokenizer; send input_ids instead", param="text")
        single = isinstance(req.text, str)
        texts = [req.text] if isinstance(req.text, str) else req.text
        if not texts or not all(texts):
            raise RequestError("text: the prompt is empty", param="text")
        return [await tm.encode(t) for t in texts], single, "text"
    raw = req.input_ids
    assert raw is not None  # exactly one of text / input_ids, checked above
    single = not _is_batch(raw)
    ids = raw if _is_batch(raw) else [raw]
    if not ids:
        raise RequestError("input_ids: the prompt is empty", param="input_ids")
    return [list(x) for x in ids], single, "input_ids"


def _is_batch(ids: list[int] | list[list[int]]) -> TypeIs[list[list[int]]]:
    return bool(ids) and isinstance(ids[0], list)


def _per_prompt(value, n: int, name: str, kind: type) -> list:
    if value is None or (isinstance(value, kind) and not isinstance(value, list)):
        return [value] * n
    if len(value) != n:
        raise RequestError(f"{name}: expected {n} entries (one per prompt), got {len(value)}", param=name)
    return list(value)


def _check_sample_rids(tm: TokenizerManager, rids: list[str | None], counts: list[int]) -> None:
    """The rids the samples will run under (``PromptJob``: the rid, or ``rid-j`` for n > 1) are
    distinct and free before any sample starts: one refused later would fail the request while
    the others already run (a 500 from ``gather_or_cancel`` until it re-raises the first error)."""
    first: dict[str, int] = {}
    for i, (rid, count) in enumerate(zip(rids, counts)):
        for sample_rid in [] if rid is None else [rid] if count == 1 else [f"{rid}-{j}" for j in range(count)]:
            if sample_rid in first:
                raise RequestError(f"rid[{i}]: {rid!r} collides with rid[{first[sample_rid]}] "
                                   f"(as {sample_rid!r}); each prompt needs its own", param="rid")
            first[sample_rid] = i
            tm.new_rid(sample_rid)  # refuses a rid already in use


_BOOL_FIELDS = ("ignore_eos", "skip_special_tokens")  # SamplingParams.validate leaves them unchecked


def _sampling(d: dict | None, vocab_size: int) -> SamplingParams:
    try:
        sampling = SamplingParams.from_dict(d).validate(vocab_size)
    except TypeError as e:
        raise RequestError(f"sampling_params: {e}", param="sampling_params") from None
    except ValueError as e:
        raise RequestError.from_value_error(e) from None
    for name in _BOOL_FIELDS:  # a non-bool reaches the tokenizer's decode, which raises TypeError
        value = getattr(sampling, name)
        if not isinstance(value, bool):
            raise RequestError(f"sampling_params.{name}: must be a boolean, got {value!r}",
                               param=f"sampling_params.{name}")
    return sampling
