"""The torch-native backend's staged decode KV, end to end: every real decode step goes
through it, so a batch that changes while its lengths line up, and decodes that outgrow
the stage's margin, must still give transformers' greedy tokens (GQA and MLA)."""

from __future__ import annotations

import os

import pytest

import pdserve
from fixtures.oracle import assert_no_leak, greedy, random_prompts
from fixtures.tiny_models import greedy_continuation, make_hf_model_and_dir

# The stage's spare capacity between growth rebuilds (torch_native._DecodeStage.MARGIN); the
# long test decodes more than twice this far, so it crosses growth rebuilds.
STAGE_MARGIN = 64


def _staged(engine: pdserve.Engine) -> pdserve.Engine:
    """The engine with its decode stage on: the CPU decode kernel (which reads float32 pools by slot,
    with no stage) is set aside, as for a bf16 or fp8 pool."""
    engine.scheduler.runner.backend.decode_attention_impl = "torch"
    return engine


@pytest.fixture(scope="module", params=["LlamaForCausalLM", "DeepseekV3ForCausalLM"])
def model(request, tmp_path_factory):
    return make_hf_model_and_dir(request.param, tmp_path_factory.mktemp(request.param))


def test_batch_swap_with_aligned_lengths(model):
    """A and B (10-token prompts) decode together; A stops after 5 tokens and C (14 tokens)
    takes its place. The decode batch [B, C] then has exactly the lengths [A, B] had one
    step earlier plus one: only the requests' identity tells the stage to rebuild."""
    hf, path = model
    a, b, c = random_prompts([10, 10, 14], hf.config.vocab_size, seed=41)
    engine = _staged(pdserve.Engine(model_path=path, max_running_requests=2))
    out = engine.generate(input_ids=[a, b, c], sampling_params=[greedy(5), greedy(20), greedy(20)])
    for o, p, n in zip(out, (a, b, c), (5, 20, 20)):
        assert o["output_ids"] == greedy_continuation(hf, p, n)
    assert_no_leak(engine)


def test_decoding_past_the_staged_kv_margin(model):
    """Decodes long enough to outgrow the stage's capacity (margin) several times, while a
    third request joins when the first finishes."""
    hf, path = model
    prompts = random_prompts([5, 17, 9], hf.config.vocab_size, seed=42)
    lens = [STAGE_MARGIN + 3, 2 * STAGE_MARGIN + 10, 2 * STAGE_MARGIN - 20]
    engine = _staged(pdserve.Engine(model_path=path, page_size=4, max_running_requests=2))
    out = engine.generate(input_ids=prompts, sampling_params=[greedy(n) for n in lens])
    for o, p, n in zip(out, prompts, lens):
        assert o["output_ids"] == greedy_continuation(hf, p, n)
    assert_no_leak(engine)


def test_default_engine_decodes_through_the_cpu_kernel(model):
    """At default flags a float32 model decodes through the CPU decode kernel (where it builds): the
    server info says so, no staged copy is kept, and the greedy tokens are transformers'."""
    from pdserve_kernels import decode_attention_cpu

    hf, path = model
    prompts = random_prompts([10, 3, 21], hf.config.vocab_size, seed=43)
    engine = pdserve.Engine(model_path=path, page_size=4)
    out = engine.generate(input_ids=prompts, sampling_params=[greedy(12)] * 3)
    for o, p in zip(out, prompts):
        assert o["output_ids"] == greedy_continuation(hf, p, 12)
    want = "cpu_kernel" if decode_attention_cpu.load() is not None else "torch"
    assert engine.get_server_info()["attention"]["decode_attention"] == want
    if want == "cpu_kernel":
        assert engine.scheduler.runner.backend.stage.bufs == {}
    # the kernel may share a step with its helpers on every core the forward may use (tuned: all usable)
    threads = engine.scheduler.threads
    assert engine.get_server_info()["attention"]["decode_attention_threads"] == threads.most
    assert threads.most == (len(os.sched_getaffinity(0)) if threads.tuner is not None else threads.pinned)
    assert_no_leak(engine)
