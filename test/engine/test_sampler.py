import re

import pytest
import torch

from pdserve.engine.request import MAX_GRAMMAR_CHARS, SamplingParams
from pdserve.engine.sampler import Sampler


def _params(n, **kw):
    return [SamplingParams(**kw).validate() for _ in range(n)]


def _gens(seeds):
    return [torch.Generator().manual_seed(s) if s is not None else None for s in seeds]


def test_greedy_is_argmax_and_consumes_no_randomness():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    s = Sampler(seed=1)
    before = s.generator.get_state().clone()
    res = s(logits, _params(4, temperature=0.0), [None] * 4, [[]] * 4)
    assert res.tokens == logits.argmax(-1).tolist()
    assert torch.equal(before, s.generator.get_state())
    res_k1 = s(logits, _params(4, top_k=1), [None] * 4, [[]] * 4)
    assert res_k1.tokens == res.tokens


def test_seeded_sampling_is_reproducible_and_independent_of_batch():
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(0))
    p = _params(3, temperature=1.0, seed=7)
    a = Sampler()(logits, p, _gens([7, 7, 7]), [[]] * 3).tokens
    b = Sampler()(logits[1:2], p[:1], _gens([7]), [[]]).tokens
    assert a[1] == b[0]


def test_sampling_follows_softmax_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    s = Sampler(seed=0)
    counts = torch.zeros(4)
    for _ in range(4000):
        counts[s(logits, _params(1, temperature=1.0), [None], [[]]).tokens[0]] += 1
    freq = counts / counts.sum()
    assert torch.allclose(freq, torch.softmax(logits[0], 0), atol=0.03)


LOGITS = torch.tensor([2.0, 1.0, 0.0, -1.0])


def _frequencies(rows: list[dict], draws: int, seed: int = 0) -> torch.Tensor:
    """[len(rows), V] frequencies of tokens drawn for ``draws`` copies of each row's params over
    LOGITS, all in one batch (rows interleaved), from a fixed seed: deterministic."""
    params = [SamplingParams(**rows[i % len(rows)]).validate() for i in range(draws * len(rows))]
    logits = LOGITS.expand(len(params), -1).clone()  # [B, V]
    tokens = torch.tensor(Sampler(seed=seed)(logits, params, [None] * len(params), [[]] * len(params)).tokens)
    counts = torch.zeros(len(rows), LOGITS.numel())
    counts.index_put_((torch.arange(len(params)) % len(rows), tokens), torch.ones(len(params)), accumulate=True)
    return counts / draws


# Frequencies of n independent draws have standard deviation sqrt(p(1-p)/n) <= 0.5/sqrt(n).
# The tolerance is >= 4 such deviations (a correct sampler with another seed would miss it
# with probability < 1e-4 per token), and the seed is fixed, so the test cannot flake. Every
# bug it guards against (temperature applied the wrong way, one row's filter on another row)
# moves some probability by more than 0.3, i.e. dozens of deviations.
def _tolerance(draws: int) -> float:
    return 4 * 0.5 / draws ** 0.5


def test_temperature_half_follows_softmax_of_twice_the_logits():
    draws = 20000
    freq = _frequencies([{"temperature": 0.5}], draws)[0]
    torch.testing.assert_close(freq, torch.softmax(2 * LOGITS, 0), atol=_tolerance(draws), rtol=0)


def _renormalised(probs: list[float]) -> torch.Tensor:
    p = torch.tensor(probs)
    return p / p.sum()


def test_temperature_and_filters_apply_per_row():
    """One batch mixing temperatures and filters: each row follows its own distribution
    (worked out by hand from LOGITS), none leaks into another row."""
    sm = torch.softmax(LOGITS, 0).tolist()
    rows = [  # params, expected distribution
        ({"temperature": 1.0}, torch.tensor(sm)),
        ({"temperature": 0.5}, torch.softmax(2 * LOGITS, 0)),
        ({"temperature": 2.0}, torch.softmax(LOGITS / 2, 0)),
        ({"temperature": 1.0, "top_p": 0.5}, torch.tensor([1.0, 0, 0, 0])),  # p0 = 0.64 covers 0.5
        ({"temperature": 1.0, "top_k": 2}, _renormalised(sm[:2] + [0, 0])),
        ({"temperature": 1.0, "min_p": 0.3}, _renormalised(sm[:2] + [0, 0])),  # p1/p0 = 0.37, p2/p0 = 0.14
        ({"temperature": 0.5, "top_k": 3}, _renormalised(torch.softmax(2 * LOGITS, 0)[:3].tolist() + [0])),
    ]
    draws = 12000
    freq = _frequencies([r for r, _ in rows], draws, seed=1)
    for (params, want), got in zip(rows, freq):
        torch.testing.assert_close(got, want, atol=_tolerance(draws), rtol=0, msg=lambda m, p=params: f"{p}: {m}")
        assert set(got.nonzero().flatten().tolist()) == set(want.nonzero().flatten().tolist()), params


@pytest.mark.parametrize("kw, allowed", [
    ({"top_k": 2}, {0, 1}),
    ({"top_p": 0.5}, {0}),  # p(token 0) = 0.64 already covers 0.5
    ({"min_p": 0.3}, {0, 1}),  # p1/p0 = e^-1 = 0.37 >= 0.3, p2/p0 = 0.14 < 0.3
])
def test_filters_restrict_support(kw, allowed):
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    s = Sampler(seed=0)
    seen = {s(logits, _params(1, temperature=1.0, **kw), [None], [[]]).tokens[0] for _ in range(400)}
    assert seen == allowed


def test_penalties_discourage_repeats():
    logits = torch.tensor([[1.0, 0.9, 0.0]])
    res = Sampler()(logits, _params(1, temperature=0.0, frequency_penalty=0.5), [None], [[0]])
    assert res.tokens == [1]
    res = Sampler()(logits, _params(1, temperature=0.0), [None], [[0]])
    assert res.tokens == [0]


def test_logprobs_are_log_softmax_of_raw_logits():
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(3))
    res = Sampler()(logits, _params(2, temperature=0.0), [None] * 2, [[]] * 2, want_logprobs=True)
    expect = torch.log_softmax(logits, -1).max(-1).values
    assert torch.allclose(torch.tensor(res.logprobs), expect)


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", 0), ("min_p", 2.0),
    ("max_new_tokens", -1), ("stop", [""]), ("stop_token_ids", [-1]), ("n", 0),
    ("seed", 1 << 64), ("seed", -(1 << 63) - 1),
])
def test_invalid_sampling_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"sampling_params.{field}"):
        SamplingParams(**{field: value}).validate(100)


@pytest.mark.parametrize("kw, says", [
    ({"regex": "a", "ebnf": "b"}, "sampling_params.ebnf: at most one of json_schema, regex, ebnf"),
    ({"json_schema": "{}", "regex": "a"}, "sampling_params.regex: at most one of"),
    ({"regex": ""}, "sampling_params.regex: must be a non-empty string"),
    ({"ebnf": 3}, "sampling_params.ebnf: must be a non-empty string"),
    ({"json_schema": {"type": "object"}}, "sampling_params.json_schema: must be a non-empty string"),
    ({"json_schema": "{not json"}, "sampling_params.json_schema: not a JSON document"),
    ({"regex": "a" * (MAX_GRAMMAR_CHARS + 1)}, "sampling_params.regex: too large"),
])
def test_grammar_fields_are_checked_and_exclusive(kw, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        SamplingParams.from_dict(kw).validate(100)


def test_grammar_names_the_one_constraint():
    assert SamplingParams().validate().grammar is None
    schema = '{"type": "integer"}'
    assert SamplingParams(json_schema=schema).validate().grammar == ("json_schema", schema)
    assert SamplingParams(regex="[0-9]+").validate().grammar == ("regex", "[0-9]+")


def test_unknown_sampling_field_is_rejected():
    with pytest.raises(ValueError, match="sampling_params.bogus"):
        SamplingParams.from_dict({"bogus": 1})
