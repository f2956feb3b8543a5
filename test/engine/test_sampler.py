import pytest
import torch

from pdserve.engine.request import SamplingParams
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


def test_unknown_sampling_field_is_rejected():
    with pytest.raises(ValueError, match="sampling_params.bogus"):
        SamplingParams.from_dict({"bogus": 1})
