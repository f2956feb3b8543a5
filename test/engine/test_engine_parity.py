"""Greedy output of the offline Engine equals transformers', for every architecture and
for the memory shapes that stress the engine: page sizes, chunked prefill, warm radix cache."""

import pytest
import torch

import pdserve
from fixtures.tiny_models import ARCHS, greedy_continuation, make_hf_model_and_dir

STEPS = 32
PROMPT_LENS = (3, 17, 40, 70)


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module", params=ARCHS)
def oracle(request, tmp_path_factory):
    hf, path = make_hf_model_and_dir(request.param, tmp_path_factory.mktemp(request.param))
    prompts = _prompts(hf.config.vocab_size)
    expected = [greedy_continuation(hf, p, STEPS) for p in prompts]
    return path, prompts, expected


GREEDY = {"max_new_tokens": STEPS, "temperature": 0.0, "ignore_eos": True}


def _assert_no_leak(engine):
    s = engine.scheduler
    s.check_memory()
    assert not s.has_work()
    assert s.allocator.num_free + s.cache.num_cached_pages == s.allocator.num_pages


@pytest.mark.parametrize("shape", [
    dict(page_size=1),
    dict(page_size=16),
    dict(page_size=4, chunked_prefill_size=16),  # the 70-token prompt runs in 5 chunks
    dict(page_size=16, cpu_gemm="packed"),  # every CPU linear on oneDNN-packed weights
], ids=["page1", "page16", "chunked", "packed"])
def test_greedy_batch_matches_transformers(oracle, shape):
    path, prompts, expected = oracle
    engine = pdserve.Engine(model_path=path, **shape)
    out = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in out] == expected
    assert all(o["meta_info"]["completion_tokens"] == STEPS for o in out)
    assert [o["meta_info"]["prompt_tokens"] for o in out] == list(PROMPT_LENS)
    _assert_no_leak(engine)


def test_warm_radix_cache_gives_same_tokens(oracle):
    path, prompts, expected = oracle
    engine = pdserve.Engine(model_path=path, page_size=4)
    first = engine.generate(input_ids=prompts[3], sampling_params=GREEDY)
    assert first["meta_info"]["cached_tokens"] == 0
    # A prefix is reused in whole pages, or for DeepSeek-V4's bounded state only at its reusable
    # boundaries (KVPool.reuse_tokens: 256 tokens for the tiny preset, so these prompts never hit it;
    # test_deepseek_v4.py hits its boundaries).
    reuse = engine.scheduler.runner.pool.reuse_tokens
    # Same prompt again: everything but the last partial block comes from the cache.
    again = engine.generate(input_ids=prompts[3], sampling_params=GREEDY)
    assert again["output_ids"] == expected[3]
    assert again["meta_info"]["cached_tokens"] == (len(prompts[3]) - 1) // reuse * reuse
    # A prompt that shares a 40-token prefix with the first one.
    shared = prompts[3][:40] + prompts[1]
    want = greedy_continuation_for(path, shared)
    got = engine.generate(input_ids=shared, sampling_params=GREEDY)
    assert got["meta_info"]["cached_tokens"] == 40 // reuse * reuse
    assert got["output_ids"] == want
    _assert_no_leak(engine)


def greedy_continuation_for(path, prompt):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return greedy_continuation(hf, prompt, STEPS)


def test_changing_decode_batch_matches_transformers(tmp_path):
    """Requests join and leave the decode batch at different steps (the staged KV of
    the torch-native backend is rebuilt and appended to); every output still equals HF's."""
    hf, path = make_hf_model_and_dir("LlamaForCausalLM", tmp_path)
    prompts = _prompts(hf.config.vocab_size, seed=5) + _prompts(hf.config.vocab_size, seed=6)[:2]
    lens = [5, 32, 12, 20, 9, 27]
    engine = pdserve.Engine(model_path=path, page_size=4, max_running_requests=3)
    out = engine.generate(input_ids=prompts, sampling_params=[{**GREEDY, "max_new_tokens": n} for n in lens])
    for o, p, n in zip(out, prompts, lens):
        assert o["output_ids"] == greedy_continuation(hf, p, n)
    _assert_no_leak(engine)


def test_chunked_prefill_and_a_radix_hit_through_the_cpu_extend_kernel(tmp_path, monkeypatch):
    """The default Engine on a float32 Llama runs every extend's attention through the CPU extend kernel
    (keys by slot from the pool): a prompt in chunks (every chunk after the first has a prefix) and a
    radix-cache hit (a prefix of whole pages) give transformers' greedy tokens, and server info says so."""
    from pdserve_kernels import extend_attention_cpu

    if extend_attention_cpu.load() is None:
        pytest.skip("no C compiler: the kernel was not built")
    hf, path = make_hf_model_and_dir("LlamaForCausalLM", tmp_path)
    calls = []
    kernel = extend_attention_cpu.extend_attention
    monkeypatch.setattr(extend_attention_cpu, "extend_attention",
                        lambda *a, **k: calls.append(int(a[4].sum())) or kernel(*a, **k))  # a[4]: prefix_lens
    g = torch.Generator().manual_seed(3)
    long, other = (torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist() for n in (70, 20))
    engine = pdserve.Engine(model_path=path, page_size=4, chunked_prefill_size=32)
    assert engine.generate(input_ids=long, sampling_params=GREEDY)["output_ids"] == greedy_continuation(hf, long, STEPS)
    assert any(p > 0 for p in calls)  # the later chunks attended over a prefix in the kernel
    calls.clear()
    shared = long[:40] + other
    got = engine.generate(input_ids=shared, sampling_params=GREEDY)
    assert got["meta_info"]["cached_tokens"] == 40
    assert got["output_ids"] == greedy_continuation(hf, shared, STEPS)
    assert calls and all(p == 40 for p in calls)  # every layer's extend over the cached 40 tokens
    assert engine.get_server_info()["attention"]["extend_attention"] == "cpu_kernel"
    _assert_no_leak(engine)
