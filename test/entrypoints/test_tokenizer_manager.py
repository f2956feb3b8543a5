"""TokenizerManager state built once per server, not per request (no scheduler started here)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdserve.assets import preset_dir
from pdserve.config import ServerArgs
from pdserve.engine.request import SamplingParams
from pdserve.engine.tokenizer import load_tokenizer
from pdserve.entrypoints import openai_api
from pdserve.entrypoints.parallel_sampling import PromptJob
from pdserve.entrypoints.tokenizer_manager import TokenizerManager

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


def _completion_call(tm: TokenizerManager):
    req = SimpleNamespace(stream=False, stream_options=None, rid=None, model=None)
    job = PromptJob([1, 2, 3], SamplingParams(max_new_tokens=2), 1, True, None, 5)
    return openai_api._call("completion", MODEL, req, [job], 5, None, tm)


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
