"""Incremental stop strings: the same answer, at the same token, as decoding the whole output each
step; stop strings spanning tokens and characters split over byte tokens; bounded work per token."""

import random

import pytest

import pdserve
from pdserve.assets import preset_dir
from pdserve.engine.request import SamplingParams
from pdserve.engine.stop import MAX_PENDING_TOKENS, StopStringMatcher
from pdserve.engine.tokenizer import load_tokenizer

TEXTS = ["héllo wörld, the quick brown fox", "日本語のテキスト ✓ done", "naïve café — ok", "plain ascii words here"]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(preset_dir("tiny-llama"))


def _whole_output_answer(tok, ids, stop, skip=True):
    """The old rule: decode everything after each token; (token index, first stop string in it)."""
    for i in range(1, len(ids) + 1):
        text = tok.decode(ids[:i], skip_special_tokens=skip)
        hit = next((s for s in stop if s in text), None)
        if hit is not None:
            return i, hit
    return None


def _incremental_answer(tok, ids, stop, skip=True):
    m = StopStringMatcher(tok, stop, skip)
    for i in range(1, len(ids) + 1):
        hit = m.check(ids[:i])
        if hit is not None:
            return i, hit
    return None


def _random_output(tok, rng):
    """Text tokens (whose multi-byte characters split over byte tokens), random ids, special ids."""
    ids = []
    for _ in range(rng.randint(2, 5)):
        kind = rng.random()
        if kind < 0.6:
            ids += tok.encode(rng.choice(TEXTS), add_special_tokens=False)
        elif kind < 0.9:
            ids += [rng.randrange(5, len(tok)) for _ in range(rng.randint(1, 6))]
        else:
            ids.append(rng.randrange(0, 5))  # special tokens (skipped or not)
    return ids


def test_matches_decoding_the_whole_output_every_token(tok):
    rng = random.Random(0)
    found = 0
    for _ in range(300):
        ids = _random_output(tok, rng)
        skip = rng.random() < 0.8
        text = tok.decode(ids, skip_special_tokens=skip)
        stop = []
        for _ in range(rng.randint(1, 3)):
            a = rng.randrange(len(text))
            stop.append(text[a:a + rng.randint(1, 6)])
        if rng.random() < 0.3:
            stop.insert(0, "never in the output ✗")
        want = _whole_output_answer(tok, ids, stop, skip)
        assert _incremental_answer(tok, ids, stop, skip) == want, (ids, stop, skip)
        found += want is not None
    assert found > 250  # the stop strings come from the text, so nearly all are found


def test_stop_string_spanning_two_tokens_is_found_at_the_second(tok):
    ids = tok.encode("hello world", add_special_tokens=False)
    pieces = [tok.decode([i]) for i in ids]
    k = next(i for i in range(1, len(ids)) if len(pieces[i - 1]) >= 1 and len(pieces[i]) >= 1)
    stop = pieces[k - 1][-1] + pieces[k][0]  # tail of one token + head of the next
    assert stop not in pieces[k - 1] and stop not in pieces[k]
    assert _incremental_answer(tok, ids, [stop]) == (k + 1, stop)


def test_character_split_over_byte_tokens(tok):
    ids = tok.encode("xé日", add_special_tokens=False)
    assert len(ids) > 3, "é and 日 should be split over byte tokens"
    assert tok.decode(ids[:2]).endswith("\ufffd")  # the first byte of é alone
    for stop in ("é", "xé", "é日", "日"):
        i, hit = _incremental_answer(tok, ids, [stop])
        assert hit == stop and stop in tok.decode(ids[:i]) and stop not in tok.decode(ids[:i - 1])


def test_work_per_token_is_bounded(tok):
    """Each check decodes a window of a few tokens, whatever the output's length."""
    decoded = []

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            decoded.append(len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tok.encode(" ".join(TEXTS * 20), add_special_tokens=False)
    assert len(ids) > 500
    m = StopStringMatcher(Counting(), ["never ✗"])
    assert all(m.check(ids[:i]) is None for i in range(1, len(ids) + 1))
    assert max(decoded) <= 2 * MAX_PENDING_TOKENS
    assert len(m.tail) == len("never ✗") - 1


def test_engine_stops_on_a_string_spanning_tokens_and_grows_fill_ids_in_place():
    engine = pdserve.Engine(model_path="tiny-llama")
    sp = {"max_new_tokens": 40, "temperature": 0.0, "ignore_eos": True}
    base = engine.generate(input_ids=[5, 6, 7, 8], sampling_params=sp)
    pieces = [engine.tokenizer.decode([t]) for t in base["output_ids"]]
    k = next(i for i in range(5, len(pieces)) if pieces[i - 1].strip() and pieces[i].strip())
    stop = pieces[k - 1][-1] + pieces[k][0]
    text = engine.tokenizer.decode(base["output_ids"])
    first = next(i for i in range(1, len(pieces) + 1) if stop in engine.tokenizer.decode(base["output_ids"][:i]))

    sched = engine.scheduler
    req = sched.add_request("r", [5, 6, 7, 8], SamplingParams.from_dict({**sp, "stop": [stop]}).validate())
    fill_ids = req.fill_ids
    while sched.has_work():
        sched.step()
    assert req.fill_ids is fill_ids and fill_ids == [5, 6, 7, 8] + req.output_ids
    assert req.output_ids == base["output_ids"][:first]
    assert req.finish_reason == {"type": "stop", "matched": stop}
    out = engine.generate(input_ids=[5, 6, 7, 8], sampling_params={**sp, "stop": stop})
    assert out["text"] == text[:text.find(stop)]
