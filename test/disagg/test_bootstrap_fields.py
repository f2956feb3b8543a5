"""Bootstrap fields added to a request body (SGLang's wire format; batches get lists)."""

from __future__ import annotations

import copy
import random

import pytest

from pdserve.disagg.bootstrap import batch_size, bootstrap_host, with_bootstrap
from pdserve.engine.io_struct import BootstrapRef
from pdserve.entrypoints.protocol import GenerateRequest
from pdserve.web.errors import RequestError


@pytest.mark.parametrize("body,size", [
    ({"text": "hi"}, None),
    ({"text": ["a", "b", "c"]}, 3),
    ({"input_ids": [1, 2, 3]}, None),  # one tokenized prompt
    ({"input_ids": [[1, 2], [3]]}, 2),
    ({"prompt": "hi"}, None),
    ({"prompt": ["a", "b"]}, 2),
    ({"prompt": [5, 6, 7]}, None),
    ({"prompt": [[5], [6], [7], [8]]}, 4),
    ({"text": []}, None),  # empty: the worker rejects it with its own error
    ({"messages": [{"role": "user", "content": "x"}], "n": 3}, None),
])
def test_batch_size(body, size):
    assert batch_size(body) == size


def test_single_request_gets_scalar_fields_and_keeps_the_body():
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 4}, "bootstrap_room": 1}
    before = copy.deepcopy(body)
    out = with_bootstrap(body, "10.0.0.5", 9000)
    assert body == before  # the caller's body is not changed
    assert out["bootstrap_host"] == "10.0.0.5" and out["bootstrap_port"] == 9000
    assert isinstance(out["bootstrap_room"], int) and 0 <= out["bootstrap_room"] < 2**63
    assert out["bootstrap_room"] != 1  # a client-sent room is replaced
    assert {k: v for k, v in out.items() if not k.startswith("bootstrap_")} == \
        {k: v for k, v in body.items() if not k.startswith("bootstrap_")}


def test_batch_gets_one_room_per_prompt():
    out = with_bootstrap({"text": ["a", "b", "c"]}, "h", 8998)
    assert out["bootstrap_host"] == ["h"] * 3 and out["bootstrap_port"] == [8998] * 3
    rooms = out["bootstrap_room"]
    assert len(rooms) == 3 and len(set(rooms)) == 3
    assert all(isinstance(r, int) and 0 <= r < 2**63 for r in rooms)


def test_rooms_use_all_63_bits():
    rooms = [with_bootstrap({"text": "x"}, "h", 1)["bootstrap_room"] for _ in range(200)]
    assert max(rooms) >= 2**62  # the top bit is used (probability of failure ~2**-200)
    assert len(set(rooms)) == 200


def test_rooms_do_not_follow_the_python_random_state():
    """Rooms used to come from the router's ``random.Random`` (MT19937): one seed, or 624 observed
    outputs, and every later room was known. Now two draws after the same seeding differ."""
    random.seed(7)
    first = [with_bootstrap({"text": "x"}, "h", 1)["bootstrap_room"] for _ in range(4)]
    random.seed(7)
    assert first != [with_bootstrap({"text": "x"}, "h", 1)["bootstrap_room"] for _ in range(4)]


@pytest.mark.parametrize("url,host", [
    ("http://127.0.0.1:30000", "127.0.0.1"),
    ("http://prefill-0.svc:8080", "prefill-0.svc"),
    ("http://[::1]:30000", "[::1]"),
    ("https://example.org", "example.org"),
])
def test_bootstrap_host(url, host):
    assert bootstrap_host(url) == host


# --- what a server reads back (entrypoints/protocol.py) -----------------------------------------
def _refs(body: dict, prompts: int, samples: int = 1):
    return GenerateRequest.model_validate(body).bootstraps(prompts, 8998, samples)


def test_a_single_prompt_s_room_per_sample_pairs_its_first_room():
    """sglang-router gives chat n=3 a room per sample; the prompt is prefilled once, in the first."""
    body = {"text": "hi", "bootstrap_host": ["h"] * 3, "bootstrap_port": [9000] * 3, "bootstrap_room": [7, 8, 9]}
    assert _refs(body, 1, samples=3) == [BootstrapRef("h", 9000, 7)]
    assert _refs({"text": "hi", "bootstrap_host": "h", "bootstrap_room": 5}, 1, samples=3) == [
        BootstrapRef("h", 8998, 5)]


@pytest.mark.parametrize("rooms, prompts, samples, field", [
    ([7, 8], 1, 3, "bootstrap_room"),  # neither one per prompt nor one per sample
    ([7, 8, 9], 2, 3, "bootstrap_room"),  # a batch: one per prompt only
    ([7, 7, 8], 1, 3, "bootstrap_room"),  # rooms repeat
])
def test_room_lists_that_fit_neither_reading_are_refused(rooms, prompts, samples, field):
    body = {"text": ["a"] * prompts, "bootstrap_host": "h", "bootstrap_room": rooms}
    with pytest.raises(RequestError) as e:
        _refs(body, prompts, samples)
    assert e.value.param == field
