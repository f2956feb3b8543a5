"""Prompt and output logprobs of the offline Engine equal transformers' log-softmax (float32, 1e-4),
through chunked prefill, the radix cache, mixed batches and parallel sampling (``n``)."""

import pytest
import torch

import pdserve
from fixtures.tiny_models import make_hf_model_and_dir

TOL = 1e-4
TOP = 5


@pytest.fixture(scope="module", params=["LlamaForCausalLM", "DeepseekV3ForCausalLM"])
def model(request, tmp_path_factory):
    hf, path = make_hf_model_and_dir(request.param, tmp_path_factory.mktemp(request.param))
    return hf, path


def _prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 400, (n,), generator=g).tolist()


def hf_logprobs(hf, seq: list[int]) -> torch.Tensor:
    """[len(seq), V]: row i is log p(. | seq[:i + 1]) from transformers."""
    with torch.no_grad():
        return torch.log_softmax(hf(input_ids=torch.tensor([seq])).logits[0].float(), -1)


def assert_token_logprobs(entries, ref: torch.Tensor, seq: list[int], first: int):
    """entries[j] = (logprob, id, text) of seq[first + j]; position 0 has logprob None."""
    assert [t for _, t, _ in entries] == seq[first:first + len(entries)]
    for j, (lp, tok, _) in enumerate(entries):
        pos = first + j
        if pos == 0:
            assert lp is None
        else:
            assert lp == pytest.approx(float(ref[pos - 1, tok]), abs=TOL), pos


def assert_top_logprobs(tops, ref: torch.Tensor, first: int, k: int = TOP):
    for j, top in enumerate(tops):
        pos = first + j
        if pos == 0:
            assert top is None
            continue
        vals, ids = ref[pos - 1].topk(k)
        assert [t for _, t, _ in top] == ids.tolist()
        assert [lp for lp, _, _ in top] == pytest.approx(vals.tolist(), abs=TOL)


GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def test_input_and_output_logprobs_match_transformers_across_chunks(model):
    hf, path = model
    engine = pdserve.Engine(model_path=path, page_size=4, chunked_prefill_size=8)
    prompt = _prompt(30)
    out = engine.generate(input_ids=prompt, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0,
                          top_logprobs_num=TOP)
    seq = prompt + out["output_ids"]
    ref = hf_logprobs(hf, seq)
    meta = out["meta_info"]
    assert len(meta["input_token_logprobs"]) == len(prompt)
    assert_token_logprobs(meta["input_token_logprobs"], ref, seq, 0)
    assert_token_logprobs(meta["output_token_logprobs"], ref, seq, len(prompt))
    assert_top_logprobs(meta["input_top_logprobs"], ref, 0)
    assert_top_logprobs(meta["output_top_logprobs"], ref, len(prompt))
    _assert_no_leak(engine)


def test_mixed_batch_start_positions_and_defaults(model):
    hf, path = model
    engine = pdserve.Engine(model_path=path, page_size=1)
    prompts = [_prompt(9, 1), _prompt(13, 2), _prompt(6, 3)]
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=[True, False, True],
                           logprob_start_len=[3, 0, -1])
    first, second, third = outs
    assert "input_token_logprobs" not in second["meta_info"]
    for out, prompt, start in ((first, prompts[0], 3), (third, prompts[2], len(prompts[2]) - 1)):
        seq = prompt + out["output_ids"]
        ref = hf_logprobs(hf, seq)
        entries = out["meta_info"]["input_token_logprobs"]
        assert start + len(entries) == len(prompt)  # SGLang's contract
        assert_token_logprobs(entries, ref, seq, start)
        assert_token_logprobs(out["meta_info"]["output_token_logprobs"], ref, seq, len(prompt))
        assert "input_top_logprobs" not in out["meta_info"]
    _assert_no_leak(engine)


def test_prefix_cache_stops_before_wanted_logits(model):
    hf, path = model
    engine = pdserve.Engine(model_path=path, page_size=4)
    prompt = _prompt(23, 4)
    engine.generate(input_ids=prompt, sampling_params=GREEDY)  # warm the cache
    full = engine.generate(input_ids=prompt, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0)
    assert full["meta_info"]["cached_tokens"] == 0
    late = engine.generate(input_ids=prompt, sampling_params=GREEDY, return_logprob=True, logprob_start_len=14)
    assert late["meta_info"]["cached_tokens"] == 12  # page-aligned, below position 13 (whose logits are needed)
    plain = engine.generate(input_ids=prompt, sampling_params=GREEDY)
    assert plain["meta_info"]["cached_tokens"] == 20
    seq = prompt + full["output_ids"]
    ref = hf_logprobs(hf, seq)
    assert_token_logprobs(full["meta_info"]["input_token_logprobs"], ref, seq, 0)
    assert_token_logprobs(late["meta_info"]["input_token_logprobs"], ref, seq, 14)
    _assert_no_leak(engine)


def test_prefill_only_request_returns_prompt_logprobs(model):
    """lm-eval's loglikelihood shape: no new tokens, every prompt token scored."""
    hf, path = model
    engine = pdserve.Engine(model_path=path, page_size=4)
    prompt = _prompt(17, 5)
    out = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                          logprob_start_len=0)
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"]["type"] == "length"
    assert_token_logprobs(out["meta_info"]["input_token_logprobs"], hf_logprobs(hf, prompt), prompt, 0)
    # Its full pages are now cached: the same prompt hits them.
    again = engine.generate(input_ids=prompt, sampling_params=GREEDY)
    assert again["meta_info"]["cached_tokens"] == 16
    _assert_no_leak(engine)


def test_parallel_sampling_shares_the_prompt(model):
    hf, path = model
    engine = pdserve.Engine(model_path=path, page_size=4)
    prompt = _prompt(22, 6)
    sampled = {"max_new_tokens": 12, "temperature": 1.0, "seed": 7, "ignore_eos": True, "n": 4}
    outs = engine.generate(input_ids=prompt, sampling_params=sampled, return_logprob=True, logprob_start_len=0)
    assert len(outs) == 4
    assert len({tuple(o["output_ids"]) for o in outs}) > 1  # seeded copies differ
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [20] * 4
    for o in outs:
        seq = prompt + o["output_ids"]
        ref = hf_logprobs(hf, seq)
        assert_token_logprobs(o["meta_info"]["input_token_logprobs"], ref, seq, 0)
        assert_token_logprobs(o["meta_info"]["output_token_logprobs"], ref, seq, len(prompt))
    # Reproducible: the same seed gives the same n samples; copy 0 is the n=1 request.
    again = engine.generate(input_ids=prompt, sampling_params=sampled)
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in outs]
    single = engine.generate(input_ids=prompt, sampling_params={**sampled, "n": 1})
    assert single["output_ids"] == outs[0]["output_ids"]
    greedy = engine.generate(input_ids=prompt, sampling_params={**GREEDY, "n": 3})
    assert len({tuple(o["output_ids"]) for o in greedy}) == 1
    _assert_no_leak(engine)


def test_retracted_request_keeps_its_prompt_logprobs(model):
    hf, path = model
    engine = pdserve.Engine(model_path=path, page_size=4, max_total_tokens=96)
    prompts = [_prompt(12 + i, 10 + i) for i in range(8)]
    outs = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 24},
                           return_logprob=True, logprob_start_len=0)
    assert engine.scheduler.num_retractions > 0
    for prompt, out in zip(prompts, outs):
        seq = prompt + out["output_ids"]
        ref = hf_logprobs(hf, seq)
        assert len(out["meta_info"]["input_token_logprobs"]) == len(prompt)
        assert_token_logprobs(out["meta_info"]["input_token_logprobs"], ref, seq, 0)
        assert_token_logprobs(out["meta_info"]["output_token_logprobs"], ref, seq, len(prompt))
    _assert_no_leak(engine)


@pytest.mark.parametrize("kwargs,field", [
    (dict(return_logprob=True, logprob_start_len=99), "logprob_start_len"),
    (dict(return_logprob=True, logprob_start_len=-2), "logprob_start_len"),
    (dict(return_logprob=True, top_logprobs_num=-1), "top_logprobs_num"),
    (dict(sampling_params={"n": 0}), "sampling_params.n"),
    (dict(sampling_params={"seed": 1 << 64}), "sampling_params.seed"),
])
def test_bad_logprob_and_n_params_name_the_field(model, kwargs, field):
    _, path = model
    engine = pdserve.Engine(model_path=path)
    with pytest.raises(ValueError, match=f"^{field}:"):
        engine.generate(input_ids=[5, 6, 7], **kwargs)
    assert not engine.scheduler.has_work()


def _assert_no_leak(engine):
    s = engine.scheduler
    s.check_memory()
    assert not s.has_work()
    assert s.allocator.num_free + s.cache.num_cached_pages == s.allocator.num_pages


def test_sampler_top_logprobs_use_raw_logits():
    """Top-k logprobs are the log-softmax of the raw logits, whatever the penalties and temperature."""
    from pdserve.engine.request import SamplingParams
    from pdserve.engine.sampler import Sampler

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0, frequency_penalty=2.0), SamplingParams(temperature=0.5, seed=1),
              SamplingParams(temperature=0.0)]
    res = Sampler()(logits, params, [None] * 3, [[3, 3], [], []], want_logprobs=True, top_logprobs_nums=[4, 2, 0])
    logp = torch.log_softmax(logits, -1)
    for b, k in enumerate((4, 2, 0)):
        assert res.logprobs[b] == pytest.approx(float(logp[b, res.tokens[b]]), abs=1e-6)
        vals, ids = logp[b].topk(k) if k else (torch.tensor([]), torch.tensor([], dtype=torch.int64))
        assert [t for _, t in res.top_logprobs[b]] == ids.tolist()
        assert [lp for lp, _ in res.top_logprobs[b]] == pytest.approx(vals.tolist(), abs=1e-6)
