"""Resuming a /generate stream (pure): which bodies resume, the resumed request, events rewritten
to continue what the client has, and SSE events split across chunks."""

from __future__ import annotations

import json

import pytest

from pdserve.router.resume import GenerateStream, continued, prompt_ids_from_probe, resumable


def sse(event) -> bytes:
    return b"data: " + (event if isinstance(event, bytes) else json.dumps(event).encode()) + b"\n\n"


def event(ids, text, finish=None, **meta) -> dict:
    meta = {"id": "a", "prompt_tokens": 3, "completion_tokens": len(ids), "finish_reason": finish, **meta}
    return {"text": text, "output_ids": ids, "meta_info": meta}


@pytest.mark.parametrize("path,body,ok", [
    ("/generate", {"text": "hi", "stream": True}, True),
    ("/generate", {"input_ids": [1, 2], "stream": True}, True),
    ("/generate", {"text": "hi"}, False),  # not streamed
    ("/generate", {"text": ["a", "b"], "stream": True}, False),  # a batch
    ("/generate", {"input_ids": [[1], [2]], "stream": True}, False),
    ("/v1/completions", {"prompt": "hi", "stream": True}, False),  # no token ids in its chunks
])
def test_what_can_resume(path, body, ok):
    assert resumable(path, body) is ok


def test_events_pass_through_until_a_resume_then_continue_the_stream():
    s = GenerateStream({"input_ids": [7, 8, 9], "stream": True, "rid": "r", "bootstrap_room": 3,
                        "sampling_params": {"max_new_tokens": 5, "temperature": 0}})
    first = sse(event([10], "a")) + sse(event([10, 11], "ab"))
    assert s.feed(first[:7]) == b"" and s.feed(first[7:]) == first  # a split event waits for its end
    assert not s.finished
    body = s.resume_body([7, 8, 9])
    assert body == {"input_ids": [7, 8, 9, 10, 11], "stream": True, "rid": "r",
                    "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    out = s.feed(sse(event([12], "c", prompt_tokens=5)) + sse(event([12, 13, 14], "cde", {"type": "length"})) +
                 sse(b"[DONE]"))
    got = [json.loads(line[6:]) for line in out.decode().split("\n\n") if line.startswith("data: {")]
    assert [e["output_ids"] for e in got] == [[10, 11, 12], [10, 11, 12, 13, 14]]
    assert [e["text"] for e in got] == ["abc", "abcde"]
    assert got[-1]["meta_info"] == {"id": "a", "prompt_tokens": 3, "completion_tokens": 5,
                                    "finish_reason": {"type": "length"}}
    assert s.finished and s.done


def test_streamed_logprobs_stay_incremental_across_a_resume():
    """A stream's logprobs are each event's own (issue 33): the resumed decode's output entries pass
    as they are, never prefixed with the last event's again; its prompt entries (the first prompt
    plus the tokens already sent) are dropped, the client had the prompt's in its first event."""
    base = event([1], "x", output_token_logprobs=[[-0.1, 1, None]], input_token_logprobs=[])
    new = event([2], "y", output_token_logprobs=[[-0.2, 2, None]], input_token_logprobs=[[None, 7, None]] * 2,
                input_top_logprobs=[None, [[-0.5, 3, None]]])
    meta = continued(base, new)["meta_info"]
    assert meta["output_token_logprobs"] == [[-0.2, 2, None]]
    assert meta["input_token_logprobs"] == [] and meta["input_top_logprobs"] == []


def test_prompt_ids_come_from_the_probe_answer():
    assert prompt_ids_from_probe({"meta_info": {"input_token_logprobs": [[None, 5, None], [-1.0, 6, None]]}}) == [5, 6]
    with pytest.raises(ValueError, match="input_token_logprobs"):
        prompt_ids_from_probe({"meta_info": {}})
