"""Resuming a streamed ``/generate`` on another decode worker when its decode dies mid-stream (pure).

SGLang's ``/generate`` stream is cumulative: every event carries the text and ``output_ids``
so far. So the last event relayed says exactly what the client has: the resumed request is
the prompt's token ids followed by those output ids, with ``max_new_tokens`` (and
``min_new_tokens``) reduced by their count. The new decode's events are rewritten to continue
the first stream: output ids and text prefixed with what was sent, ``completion_tokens``
counted from the start, the first stream's id and prompt figures kept. Logprobs are incremental
(each event's own tokens', the prompt's once in the first event): the new decode's output
logprobs pass as they are, its prompt logprobs (the first stream's prompt plus the tokens sent)
are dropped, the client has the prompt's.
For greedy sampling the client's tokens are those of an undisturbed run.

Limits: a stop string that would span the resume point is not seen (the new decode does not
know the text before it); text decoded across the resume point can differ where a tokenizer's
decoding depends on the tokens before (a SentencePiece word start, a UTF-8 character split
across tokens), the token ids do not. A batch body or n > 1 is not resumed (it is not streamed).
"""

from __future__ import annotations

import json
from typing import TypeGuard

from pdserve.disagg.bootstrap import BOOTSTRAP_FIELDS, batch_size

EVENT_END = b"\n\n"
DATA = b"data: "
DONE = b"[DONE]"
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's and pdserve's default when the body names none
PROMPT_PROBE_SAMPLING = {"max_new_tokens": 0}  # prefill only: the prompt's ids come back as input logprobs


def resumable(path: str, body: dict) -> bool:
    """A single streamed /generate prompt (what SGLang streams cumulatively)."""
    if path != "/generate" or not body.get("stream") or batch_size(body) is not None:
        return False
    return isinstance(body.get("text"), str) or _flat_ids(body.get("input_ids"))


def prompt_probe(body: dict) -> dict:
    """A request whose answer names the prompt's token ids (``meta_info.input_token_logprobs``)."""
    return {"text": body["text"], "sampling_params": PROMPT_PROBE_SAMPLING, "return_logprob": True,
            "logprob_start_len": 0}


def prompt_ids_from_probe(answer: dict) -> list[int]:
    """The ids of a ``prompt_probe`` answer; ValueError if it has none."""
    entries = (answer.get("meta_info") or {}).get("input_token_logprobs")
    if not isinstance(entries, list) or not entries:
        raise ValueError("the prompt probe's answer has no meta_info.input_token_logprobs")
    return [int(e[1]) for e in entries]


def without_bootstrap(body: dict) -> dict:
    return {k: v for k, v in body.items() if k not in BOOTSTRAP_FIELDS}


class GenerateStream:
    """One streamed /generate as the client has received it; ``feed`` the upstream bytes, send what it returns.

    Until the first resume, events pass through untouched (only the last one is kept); after
    it, each event is rewritten to continue what was sent before.
    """

    def __init__(self, body: dict):
        self.body = body
        self.partial = b""
        self.last: bytes | None = None  # payload of the last event sent (already rewritten)
        self.base: dict | None = None  # the client's last event when the current upstream started
        self.done = False  # [DONE] sent
        self.resumes = 0

    def feed(self, chunk: bytes) -> bytes:
        """Complete events of ``chunk`` (plus what was held back) as they go to the client."""
        data = self.partial + chunk
        cut = data.rfind(EVENT_END)
        if cut < 0:
            self.partial = data
            return b""
        complete, self.partial = data[:cut + len(EVENT_END)], data[cut + len(EVENT_END):]
        base = self.base
        if base is None:
            self._note(complete.split(EVENT_END))
            return complete
        return b"".join(self._rewrite(e, base) + EVENT_END for e in complete.split(EVENT_END)[:-1])

    def _note(self, events: list[bytes]) -> None:
        for event in reversed(events):
            if event.startswith(DATA):
                payload = event[len(DATA):]
                if payload == DONE:
                    self.done = True
                else:
                    self.last = payload
                    return

    def _rewrite(self, event: bytes, base: dict) -> bytes:
        if not event.startswith(DATA):
            return event
        payload = event[len(DATA):]
        if payload == DONE:
            self.done = True
            return event
        out = json.loads(payload)
        if isinstance(out, dict) and "error" not in out:
            out = continued(base, out)
        self.last = json.dumps(out).encode()
        return DATA + self.last

    @property
    def last_event(self) -> dict | None:
        return json.loads(self.last) if self.last is not None else None

    @property
    def finished(self) -> bool:
        """The client has had the final event (a finish reason), so nothing is left to resume."""
        last = self.last_event
        return bool(last and (last.get("meta_info") or {}).get("finish_reason"))

    def resume_body(self, prompt_ids: list[int]) -> dict:
        """The request that continues the stream from what the client has; starts rewriting."""
        last = self.last_event or {"text": "", "output_ids": [], "meta_info": {}}
        self.base = last
        self.partial = b""
        self.resumes += 1
        got = len(last["output_ids"])
        body = {k: v for k, v in without_bootstrap(self.body).items() if k not in ("text", "input_ids")}
        sampling = dict(body.get("sampling_params") or {})
        sampling["max_new_tokens"] = max(0, (sampling.get("max_new_tokens") or DEFAULT_MAX_NEW_TOKENS) - got)
        if sampling.get("min_new_tokens"):
            sampling["min_new_tokens"] = max(0, sampling["min_new_tokens"] - got)
        return {**body, "input_ids": list(prompt_ids) + list(last["output_ids"]), "sampling_params": sampling,
                "stream": True}

    def known_prompt_ids(self) -> list[int] | None:
        ids = self.body.get("input_ids")
        return list(ids) if _flat_ids(ids) else None


def continued(base: dict, event: dict) -> dict:
    """``event`` of the resumed stream as the continuation of ``base`` (the client's last event)."""
    meta_base, meta = base.get("meta_info") or {}, dict(event.get("meta_info") or {})
    for key in [k for k in meta if k.startswith("input_") and isinstance(meta[k], list)]:
        meta[key] = []
    for key in ("id", "prompt_tokens"):
        if key in meta_base:
            meta[key] = meta_base[key]
    meta["completion_tokens"] = meta_base.get("completion_tokens", len(base["output_ids"])) + \
        meta.get("completion_tokens", len(event.get("output_ids", [])))
    return {**event, "text": base.get("text", "") + event.get("text", ""),
            "output_ids": list(base["output_ids"]) + list(event.get("output_ids", [])), "meta_info": meta}


def _flat_ids(value: object) -> TypeGuard[list[int]]:
    return isinstance(value, list) and bool(value) and all(isinstance(x, int) for x in value)
