"""Logprobs in the three shapes clients expect: SGLang's ``meta_info``, OpenAI completions, OpenAI chat.

Every shape is built from the same per-request data (``LogprobData``): the logprob
of each output token, optionally its top-k alternatives, and the prompt's logprobs
from some start position on (None for position 0, which has no context).
"""

from __future__ import annotations

from dataclasses import dataclass, field

TopLogprobs = list[tuple[float, int]]  # (logprob, token id), most likely first


def check_top_logprobs(k: int, name: str, max_logprobs: int, vocab_size: int) -> None:
    """Raise ValueError naming ``name`` for a top-k over ``--max-logprobs`` (-1: no cap but the vocabulary).

    A response carries k alternatives at every position asked for, prompt positions included
    (``logprob_start_len`` 0, ``echo``): with k up to the vocabulary a 5 KB request answered with
    63 MB. Capping k caps the response at (prompt + output tokens) x k, both bounded already."""
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise ValueError(f"{name}: must be an integer >= 0, got {k!r}")
    if 0 <= max_logprobs < k:
        raise ValueError(f"{name}: must be at most --max-logprobs ({max_logprobs}), got {k}")
    if k > vocab_size:
        raise ValueError(f"{name}: must be at most the vocabulary size ({vocab_size}), got {k}")


class TokenTexts:
    """Token id -> its text (the tokenizer's decode of that one token), memoised.

    Without a tokenizer, SGLang's text is None and OpenAI's token is ``token_id:<id>``
    (vLLM's spelling for servers that return token ids).
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def text(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        s = self._cache.get(token_id)
        if s is None:
            s = self._cache[token_id] = self.tokenizer.decode([token_id])
        return s

    def token(self, token_id: int) -> str:
        s = self.text(token_id)
        return f"token_id:{token_id}" if s is None else s


@dataclass
class LogprobData:
    """Logprobs of one sequence. ``input_*`` cover prompt positions ``[len(prompt) - len(input), len(prompt))``."""

    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top: list[TopLogprobs] | None = None
    input_logprobs: list[float | None] | None = None
    input_top: list[TopLogprobs | None] | None = None

    def extend(self, ids: list[int], logprobs: list[float] | None, top: list[TopLogprobs] | None) -> None:
        self.output_ids += ids
        self.output_logprobs += logprobs or []
        if top is not None:
            self.output_top = (self.output_top or []) + top

    def set_input(self, logprobs: list | None, top: list | None) -> None:
        if logprobs is not None:
            self.input_logprobs, self.input_top = logprobs, top


# ------------------------------------------------------------------ SGLang
def sglang_meta(data: LogprobData, prompt_ids: list[int], texts: TokenTexts | None, top_k: int) -> dict:
    """``meta_info`` logprob keys: lists of (logprob, token id, text or None) tuples, as SGLang."""
    def triple(lp, tid):
        return (lp, tid, texts.text(tid) if texts is not None else None)

    def tops(top):
        return None if top is None else [triple(lp, tid) for lp, tid in top]

    inputs = data.input_logprobs or []
    first = len(prompt_ids) - len(inputs)
    meta = {"input_token_logprobs": [triple(lp, prompt_ids[first + j]) for j, lp in enumerate(inputs)],
            "output_token_logprobs": [triple(lp, t) for lp, t in zip(data.output_logprobs, data.output_ids)]}
    if top_k:
        meta["input_top_logprobs"] = [tops(t) for t in (data.input_top or [])]
        meta["output_top_logprobs"] = [tops(t) for t in (data.output_top or [])]
    return meta


# ------------------------------------------------------------------ OpenAI
def completion_logprobs(ids: list[int], logprobs: list, tops: list | None, texts: TokenTexts,
                        text_offset: int = 0) -> dict:
    """OpenAI completions ``logprobs``: ``{tokens, token_logprobs, top_logprobs, text_offset}``.
    ``tops[j]`` is token j's top-k (None for a first prompt token; ``tops`` None: no top-k asked,
    empty dicts); offsets count characters into the choice's text, from ``text_offset``."""
    tokens = [texts.token(t) for t in ids]
    offsets = []
    for tok in tokens:
        offsets.append(text_offset)
        text_offset += len(tok)
    top_dicts: list[dict[str, float] | None]
    if tops is None:
        top_dicts = [None if lp is None else {} for lp in logprobs]
    else:
        top_dicts = [None if top is None else {texts.token(t): lp for lp, t in top} for top in tops]
    return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": top_dicts, "text_offset": offsets}


def text_end(lp: dict, start: int) -> int:
    """Character offset just past the last token of a completions ``logprobs`` (``start`` if none)."""
    return lp["text_offset"][-1] + len(lp["tokens"][-1]) if lp["tokens"] else start


def chat_logprobs(ids: list[int], logprobs: list[float], tops: list | None, texts: TokenTexts) -> dict:
    """OpenAI chat ``logprobs``: ``{content: [{token, logprob, bytes, top_logprobs}]}``."""
    def entry(lp, tid):
        tok = texts.token(tid)
        return {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8"))}

    content = []
    for j, (lp, tid) in enumerate(zip(logprobs, ids)):
        top = tops[j] if tops is not None else []
        content.append({**entry(lp, tid), "top_logprobs": [entry(tlp, t) for tlp, t in top]})
    return {"content": content}
