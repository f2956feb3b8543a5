"""IncrementalDetokenizer: streamed pieces join to exactly the final text, stop strings never leak."""

from __future__ import annotations

import random

import pytest

from pdserve.config import resolve_model_path
from pdserve.engine.tokenizer import IncrementalDetokenizer, load_tokenizer, output_text, text_decoder


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model_path("tiny-deepseek")[0])


def _stream(tokenizer, ids, rng, stop=(), reason=None):
    d = IncrementalDetokenizer(tokenizer, stop=list(stop))
    pieces, i = [], 0
    while i < len(ids):
        k = rng.randrange(1, 4)
        pieces.append(d.add(ids[i:i + k]))
        i += k
    pieces.append(d.finish(reason))
    return pieces


def test_stream_joins_to_final_text(tokenizer):
    rng = random.Random(0)
    vocab = len(tokenizer)
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        reason = {"type": "length", "length": len(ids)}
        assert "".join(_stream(tokenizer, ids, rng, reason=reason)) == output_text(tokenizer, ids, reason)


def test_multibyte_characters_are_never_split(tokenizer):
    ids = tokenizer.encode("naïve café — 東京 🙂 done")
    pieces = _stream(tokenizer, ids, random.Random(1), reason={"type": "length"})
    assert "".join(pieces) == tokenizer.decode(ids)
    assert not any("\ufffd" in p for p in pieces)


def test_stop_string_is_held_back_and_cut(tokenizer):
    ids = tokenizer.encode("alpha beta STOP gamma")
    reason = {"type": "stop", "matched": "STOP"}
    for seed in range(5):
        pieces = _stream(tokenizer, ids, random.Random(seed), stop=["STOP"], reason=reason)
        assert not any("S" in p and "T" in p for p in pieces)
        assert "".join(pieces) == output_text(tokenizer, ids, reason) == "alpha beta "


@pytest.mark.parametrize("skip", [True, False])
def test_matched_stop_token_is_never_streamed(tokenizer, skip):
    """A special stop token (<|im_end|>) ends the stream without its text, special tokens shown
    or not: the streamed pieces join to output_text's, which drops it."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer.encode("A reply, then the end of the turn.") + [end]
    reason = {"type": "stop", "matched": end}
    for k in (1, 3, len(ids)):  # the stop token alone, or with the tokens before it
        d = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
        pieces = [d.add(ids[:-k]), d.add_last(ids[-k:], reason)]
        assert "".join(pieces) == output_text(tokenizer, ids, reason, skip) == "A reply, then the end of the turn."


@pytest.mark.parametrize("preset", ["tiny-deepseek", "tiny-llama", "tiny-qwen3-moe"])
def test_text_decoder_equals_tokenizer_decode(preset):
    """The streaming fast path (the Rust tokenizer directly) decodes exactly as transformers does."""
    tok = load_tokenizer(resolve_model_path(preset)[0])
    decode = text_decoder(tok)
    rng = random.Random(1)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 10))]
        for skip in (True, False):
            assert decode(ids, skip) == tok.decode(ids, skip_special_tokens=skip)


class _SlowDetokenizer(IncrementalDetokenizer):
    """The slow twin: every stop searched over the whole text, every proper prefix of every stop
    tried against its end."""

    def add(self, new_ids):
        self.ids.extend(new_ids)
        self._text = self._decode(self.ids)
        text = self._text
        for s in self.stop:
            cut = text.find(s)
            if cut >= 0:
                text = text[:cut]
        hold = max((k for s in self.stop for k in range(1, min(len(s) - 1, len(text)) + 1)
                    if text.endswith(s[:k])), default=0)
        delta = text[len(self.emitted):len(text) - hold]
        self.emitted += delta
        return delta


class _CharTokenizer:
    """One character per token id (ids index ``alphabet``), so the text is known exactly."""

    def __init__(self, alphabet: str):
        self.alphabet = alphabet

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.alphabet[i] for i in ids)


def test_windowed_stop_search_and_holdback_agree_with_the_slow_twins():
    """The stream's stop search looks only near the emitted end and its hold-back only where a
    stop's first character is: after every token, what it has emitted is what searching and
    holding back over the whole text would have emitted."""
    rng = random.Random(7)
    alphabet = "ab c"
    tok = _CharTokenizer(alphabet)
    for _ in range(300):
        stop = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 7))) for _ in range(rng.randrange(1, 4))]
        ids = [rng.randrange(len(alphabet)) for _ in range(rng.randrange(1, 60))]
        fast, slow = IncrementalDetokenizer(tok, stop=stop), _SlowDetokenizer(tok, stop=stop)
        fast._decoder = slow._decoder = lambda ids, skip: tok.decode(ids)
        i = 0
        while i < len(ids):
            k = rng.randrange(1, 4)
            assert fast.add(ids[i:i + k]) == slow.add(ids[i:i + k]), (stop, ids[:i + k])
            i += k


def test_stop_prefixes_follow_the_longest_prefix_each_stop_the_text_ends_with():
    """StopPrefixes (KMP as the text grows) against the brute force, on stops full of borders
    ("abab", "aaa") so the failure links are walked, text fed in pieces of any size."""
    from pdserve.engine.tokenizer import StopPrefixes

    rng = random.Random(11)
    for _ in range(300):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randrange(1, 9))) for _ in range(rng.randrange(1, 5))]
        prefixes, text = StopPrefixes(stops), ""
        while len(text) < 40:
            piece = "".join(rng.choice("abc") for _ in range(rng.randrange(0, 5)))
            prefixes.feed(piece)
            text += piece
            longest = [max(k for k in range(len(s) + 1) if text.endswith(s[:k])) for s in stops]
            assert prefixes.ends == longest, (stops, text)
            assert prefixes.holdback() == max(min(k, len(s) - 1) for k, s in zip(longest, stops))
