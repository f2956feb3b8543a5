"""One streamed request per backend, in the request shape of the server it imitates, timed per event.

- ``pdserve`` / ``sglang``: SGLang-native ``POST /generate`` with ``stream: true``;
  every SSE event carries the cumulative ``text`` and ``meta_info``
  (``completion_tokens`` so far; the last one may carry a ``timeline``).
- ``openai``: ``POST /v1/completions``; ``openai-chat``: ``POST /v1/chat/completions``;
  both stream deltas and ask for a final usage chunk (``stream_options.include_usage``).

Timing follows sglang.bench_serving and vllm bench serve:
- TTFT: from sending the request to the first event that carries output (native:
  ``completion_tokens`` grew; OpenAI: non-empty text/content, so a role-only or
  finish-only chunk is not a token).
- E2E latency: to the last event that carried output (a trailing usage or
  ``[DONE]`` event carries none), as vLLM does.
- ITL: one entry per gap between output-carrying events. When an event is known
  to carry k > 1 tokens (native streams count them), its gap is split into k equal
  entries, as sglang's native client does, so ITL describes tokens, not HTTP
  writes; OpenAI streams do not say how many tokens a delta holds, so their gaps
  stay one per event (both clients do this).
"""

from __future__ import annotations

import json
import time
import traceback
from dataclasses import dataclass, field

import aiohttp

from pdserve.bench.config import EndpointConfig
from pdserve.bench.datasets import BenchRequest

# Cumulative native events grow with the output; 10 MiB lines, as sglang's client allows.
READ_BUFSIZE = 10 * 1024 * 1024
API_PATHS = {"pdserve": "/generate", "sglang": "/generate", "openai": "/v1/completions",
             "openai-chat": "/v1/chat/completions"}


@dataclass
class RequestOutput:
    """What one request measured. Times in seconds; ``start`` is a ``perf_counter`` stamp."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0
    text: str = ""
    output_ids: list[int] | None = None
    timeline: dict | None = None  # the server's per-stage durations (seconds), when it sends them
    tag: str = ""
    cached_tokens: int | None = None  # prompt tokens the server reused from its prefix cache, when it says
    cached_by_tier: dict[str, int] | None = None  # the same split by tier (device/host/storage), when it says
    round: int = 0  # multi-turn: the request's round (1-based)
    # raw event clock, for other ITL definitions: offsets from start of output-carrying events and their
    # token counts (None where the stream does not say)
    event_times: list[float] = field(default_factory=list)
    event_tokens: list[int | None] = field(default_factory=list)

    def on_output(self, now: float, k: int | None) -> None:
        """An event carrying ``k`` new tokens (None: unknown) arrived at ``now``."""
        offset = now - self.start
        if not self.event_times:
            self.ttft = offset
        else:
            gap = offset - self.event_times[-1]
            self.itl.extend([gap / k] * k if k and k > 1 else [gap])
        self.event_times.append(offset)
        self.event_tokens.append(k)
        self.latency = offset

    def fail(self, error: str) -> RequestOutput:
        self.success, self.error = False, error
        return self


# ------------------------------------------------------------------- bodies
def request_body(ep: EndpointConfig, req: BenchRequest, model: str) -> dict:
    """The JSON body for ``req`` in ``ep.backend``'s shape (greedy, exactly ``output_len`` tokens
    unless --disable-ignore-eos)."""
    if ep.native:
        prompt = {"input_ids": list(req.token_ids)} if ep.tokenize_prompt else {"text": req.prompt}
        sampling = {"temperature": 0.0, "max_new_tokens": req.output_len, "ignore_eos": ep.ignore_eos}
        body = {**prompt, "sampling_params": sampling, "stream": True}
    elif ep.backend == "openai":
        body = {"model": model, "prompt": req.prompt, "temperature": 0.0, "max_tokens": req.output_len,
                "ignore_eos": ep.ignore_eos, "stream": True, "stream_options": {"include_usage": True}}
    else:
        messages = list(req.messages) if req.messages else [{"role": "user", "content": req.prompt}]
        body = {"model": model, "messages": messages, "temperature": 0.0, "max_tokens": req.output_len,
                "ignore_eos": ep.ignore_eos, "stream": True, "stream_options": {"include_usage": True}}
    return {**body, **ep.extra_request_body}


# ------------------------------------------------------------------ parsers
class StreamParser:
    """Turns one backend's SSE data events into ``RequestOutput`` updates."""

    def __init__(self, out: RequestOutput):
        self.out = out

    def feed(self, data: dict, now: float) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        """After ``[DONE]`` (or the end of the stream)."""


class NativeParser(StreamParser):
    """SGLang ``/generate`` events: cumulative text, output_ids and meta_info."""

    def __init__(self, out: RequestOutput):
        super().__init__(out)
        self.tokens = 0

    def feed(self, data: dict, now: float) -> None:
        meta = data.get("meta_info") or {}
        n = meta.get("completion_tokens", len(data.get("output_ids") or []))
        if n > self.tokens:
            self.out.on_output(now, n - self.tokens)
            self.tokens = n
            self.out.text = data.get("text", self.out.text)
        if "output_ids" in data:
            self.out.output_ids = list(data["output_ids"])
        if "prompt_tokens" in meta:
            self.out.prompt_len = meta["prompt_tokens"]
        if isinstance(meta.get("cached_tokens"), int):
            self.out.cached_tokens = meta["cached_tokens"]
        tiers = meta.get("cached_tokens_by_tier")
        if isinstance(tiers, dict):
            self.out.cached_by_tier = {k: v for k, v in tiers.items() if isinstance(v, int)}
        if isinstance(meta.get("timeline"), dict):
            self.out.timeline = meta["timeline"]

    def finish(self) -> None:
        self.out.output_len = self.tokens


class OpenAIParser(StreamParser):
    """``/v1/completions`` (``text``) and ``/v1/chat/completions`` (``delta.content``) chunks."""

    def __init__(self, out: RequestOutput, chat: bool):
        super().__init__(out)
        self.chat = chat

    def feed(self, data: dict, now: float) -> None:
        choices = data.get("choices") or []
        if choices:
            c = choices[0]
            text = (c.get("delta") or {}).get("content") if self.chat else c.get("text")
            if text:
                self.out.on_output(now, None)
                self.out.text += text
        usage = data.get("usage")
        if usage:
            self.out.output_len = usage.get("completion_tokens", self.out.output_len)
            self.out.prompt_len = usage.get("prompt_tokens", self.out.prompt_len)
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            if isinstance(cached, int):
                self.out.cached_tokens = cached


def make_parser(backend: str, out: RequestOutput) -> StreamParser:
    if backend in ("pdserve", "sglang"):
        return NativeParser(out)
    return OpenAIParser(out, chat=backend == "openai-chat")


# --------------------------------------------------------------------- send
async def send(session: aiohttp.ClientSession, ep: EndpointConfig, req: BenchRequest, model: str) -> RequestOutput:
    """Stream ``req`` and time it; never raises (a failure is ``success=False`` with ``error``)."""
    out = RequestOutput(prompt_len=req.prompt_len, tag=req.tag, round=req.round)
    parser = make_parser(ep.backend, out)
    body = request_body(ep, req, model)
    out.start = time.perf_counter()
    try:
        async with session.post(ep.url + API_PATHS[ep.backend], json=body, headers=ep.headers()) as resp:
            if resp.status != 200:
                return out.fail(f"HTTP {resp.status}: {(await resp.text())[:500]}")
            error = await _read_events(resp, parser)
    except Exception as e:  # a benchmark reports every failure per request; it never stops
        return out.fail(f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}")
    if error:
        return out.fail(error)
    parser.finish()
    if not out.event_times:
        return out.fail("the stream ended without any output token")
    out.success = True
    return out


async def _read_events(resp: aiohttp.ClientResponse, parser: StreamParser) -> str:
    """Feed every ``data:`` event to ``parser`` until ``[DONE]``; returns an error event's message or ''."""
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue  # blank separators and SSE comments (pings)
        payload = line[5:].strip()
        if payload == b"[DONE]":
            break
        now = time.perf_counter()
        data = json.loads(payload)
        if isinstance(data, dict) and "error" in data:
            err = data["error"]
            return f"server error: {err.get('message', err) if isinstance(err, dict) else err}"
        parser.feed(data, now)
    return ""


def new_session(ep: EndpointConfig) -> aiohttp.ClientSession:
    """The run's session: a fresh connection per request (``force_close``), as sglang's client opens
    a new session per request.

    Why not keep-alive: a server may write a stream's first event ~40 ms after its
    headers on a reused connection (TCP delayed-ACK timing; pdserve's uvicorn does
    this), which would put a transport artifact into TTFT; and an idle pooled
    connection can be closed by the server's keep-alive timeout just as a request
    is written to it. The concurrency cap is the run's semaphore, not the pool.
    """
    conn = aiohttp.TCPConnector(limit=0, force_close=True)
    return aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=ep.request_timeout),
                                 read_bufsize=READ_BUFSIZE)
