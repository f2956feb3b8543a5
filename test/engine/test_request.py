"""engine/request.py: the prompt check every request passes, in the frontend and in the scheduler."""

from __future__ import annotations

import enum
import random

import pytest

from pdserve.engine.request import RequestLimits, check_request, token_ids_in_range

VOCAB = 1000


def _per_id(ids: list, vocab: int) -> bool:
    """The slow twin: each id on its own."""
    return all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids)


class _Token(enum.IntEnum):
    A = 5
    B = VOCAB  # an int subclass out of range


def _cases() -> list[list]:
    rng = random.Random(0)
    plain = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 300))] for _ in range(50)]
    edges = [[], [0], [VOCAB - 1], [VOCAB], [-1], [0, VOCAB - 1, 3], [3, -5, 4], [1, 2, VOCAB + 10**30],
             [True], [1, False, 2], [1.0], [1, 2.5], ["1"], [1, None], [_Token.A], [_Token.A, _Token.B],
             [1, _Token.B], [2**63], [1, 2, 3, 10**40]]
    return plain + edges + [p[:-1] + [x] for p, x in zip(plain, [VOCAB, -1, True, 7.0, "x", None, _Token.B] * 7)]


@pytest.mark.parametrize("ids", _cases())
def test_token_ids_in_range_agrees_with_the_per_id_check(ids):
    assert token_ids_in_range(ids, VOCAB) is _per_id(ids, VOCAB)


def test_check_request_names_the_prompt_field_for_a_bad_id():
    limits = RequestLimits(context_len=4096, vocab_size=VOCAB, max_total_tokens=8192)
    check_request([1, 2, VOCAB - 1], 16, limits, "prompt")
    for bad in ([1, VOCAB], [True, 2], [1, 2.0]):
        with pytest.raises(ValueError, match=r"^prompt: token ids must be integers in \[0, 1000\)"):
            check_request(bad, 16, limits, "prompt")
