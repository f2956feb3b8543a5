"""entrypoints/openai_api.py: the stream events' bytes."""

from __future__ import annotations

import pytest

from pdserve.entrypoints.openai_api import _Call, _Streamer
from pdserve.web.streaming import sse


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("rid, model", [("r1", "tiny"), (None, 'a "choices":[0] model'), ('x"choices":[0]\\', "é")])
def test_an_event_is_its_envelope_dumped_whole(kind, include_usage, rid, model):
    """Each event is spliced from bytes made once per stream (``_frame``); its slow twin dumps the
    whole envelope, as every event once did."""
    call = _Call(kind, model, [], 1, None, None, True, include_usage, rid, None)  # type: ignore[arg-type]
    streamer = _Streamer(call, None)
    cases = [(0, "Hello", None, None), (3, "", {"tokens": ["a"]}, None), (1, None, None, "stop"),
             (0, '"choices":[0] \n\u2028', None, "length")]
    for index, text, logprobs, reason in cases:
        delta = streamer._delta(text)
        key = "delta" if kind == "chat" else "text"
        whole = sse(streamer._envelope([{"index": index, key: delta, "logprobs": logprobs, "finish_reason": reason}],
                                       None))
        assert streamer._event(index, delta, logprobs, reason) == whole
