"""TokenizerManager state built once per server, not per request (no scheduler started here)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from pdserve.assets import preset_dir
from pdserve.config import ServerArgs
from pdserve.engine.request import SamplingParams
from pdserve.engine.tokenizer import load_tokenizer
from pdserve.entrypoints import openai_api
from pdserve.entrypoints.parallel_sampling import PromptJob
from pdserve.entrypoints.tokenizer_manager import GenerateChunk, TokenizerManager, _Wake

MODEL = "tiny-llama"


class CountingTokenizer:
    """The preset's tokenizer, counting ``decode`` calls."""

    def __init__(self):
        self.inner = load_tokenizer(preset_dir(MODEL))
        self.decodes = 0

    def decode(self, ids, **kwargs):
        self.decodes += 1
        return self.inner.decode(ids, **kwargs)


@pytest.fixture
def tm():
    manager = TokenizerManager(ServerArgs(model_path=MODEL), CountingTokenizer())
    yield manager
    manager._tokenize_pool.shutdown(wait=False)


def _completion_call(tm: TokenizerManager, kind: str = "completion", stream: bool = False, logprobs: int | None = 5):
    req = SimpleNamespace(stream=stream, stream_options=None, rid=None, model=None)
    job = PromptJob([1, 2, 3], SamplingParams(max_new_tokens=2), 1, True, None, 5)
    return openai_api._call(kind, MODEL, req, [job], logprobs, None, tm)


def _choices(events: list[bytes]) -> list[dict]:
    assert all(e.startswith(b"data: ") and e.endswith(b"\n\n") for e in events)
    return [json.loads(e[len(b"data: "):])["choices"][0] for e in events]


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_streamed_step_whose_text_is_held_back_still_sends_an_event(tm, kind):
    """A step whose token ends in an incomplete UTF-8 character has no text yet. Its event still goes
    out, with empty text (as vLLM's), so the client sees every step arrive: a model that keeps emitting
    such tokens would otherwise stream nothing until its last token."""
    streamer = openai_api._Streamer(_completion_call(tm, kind, stream=True, logprobs=None), None)
    key = "text" if kind == "completion" else "delta"
    empty = "" if kind == "completion" else {"content": ""}
    opening = 1 if kind == "chat" else 0  # chat's role comes first, alone
    held = _choices(streamer.render((0, GenerateChunk("r", "", [200], None, False, None, 3, 1, 0))))
    assert [(c[key], c["finish_reason"]) for c in held[opening:]] == [(empty, None)]
    shown = _choices(streamer.render((0, GenerateChunk("r", "é", [201], None, False, None, 3, 2, 0))))
    assert [c[key] for c in shown] == ["é" if kind == "completion" else {"content": "é"}]
    # the last step: its text (none here) and the finish event, no empty event before it
    last = _choices(streamer.render((0, GenerateChunk("r", "", [202], None, True, {"type": "length"}, 3, 3, 0))))
    assert [c["finish_reason"] for c in last] == ["length"]
    # a chunk that carried no token (nothing new) sends nothing
    assert streamer.render((0, GenerateChunk("r", "", [], None, False, None, 3, 3, 0))) == []


def test_token_texts_are_one_memo_per_server(tm):
    """Logprob texts (top-k alternatives at every position) are decoded once per token id for the
    server's life, not again for every request that shows them."""
    first, second = _completion_call(tm), _completion_call(tm)
    assert first.texts is second.texts is tm.token_texts
    ids = list(range(100, 140))
    assert [first.texts.text(t) for t in ids] == [tm.tokenizer.inner.decode([t]) for t in ids]
    before = tm.tokenizer.decodes
    assert [second.texts.text(t) for t in ids] == [first.texts.text(t) for t in ids]
    assert tm.tokenizer.decodes == before  # the second request decoded nothing


def test_a_wake_up_set_before_or_while_its_request_waits_is_seen_once_cleared():
    async def main():
        wake = _Wake()
        wake.set()
        assert wake.pending() is None  # set before the wait: no waiting at all
        wake.clear()
        waiting = wake.pending()
        assert waiting is not None and not waiting.done()
        asyncio.get_running_loop().call_soon(wake.set)
        await asyncio.wait_for(waiting, 5)  # the router's set wakes the waiting request
        assert wake.is_set()
        wake.clear()
        gone = wake.pending()
        assert gone is not None
        gone.cancel()  # the request's coroutine was cancelled while it waited
        wake.set()  # a late output for it: no error
        return wake.is_set()

    assert asyncio.run(main())
