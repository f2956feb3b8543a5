"""models/fused_decode.py end to end: a default engine on a float32 GQA model decodes through the one-call
decode stack (pdserve_kernels.decode_stack_cpu), the server info says so, and the greedy tokens are
transformers'; the switches that keep the layers do."""

from __future__ import annotations

import pytest

import pdserve
from fixtures.oracle import assert_no_leak, greedy, random_prompts
from fixtures.tiny_models import greedy_continuation, make_hf_model_and_dir
from pdserve_kernels import decode_stack_cpu


@pytest.fixture(scope="module", params=["LlamaForCausalLM", "Qwen2ForCausalLM"])  # Qwen2: q/k/v biases
def model(request, tmp_path_factory):
    return make_hf_model_and_dir(request.param, tmp_path_factory.mktemp(request.param))


def test_default_engine_decodes_through_the_one_call(model):
    if decode_stack_cpu.load() is None:
        pytest.skip("no C compiler: the decode stack was not built")
    hf, path = model
    prompts = random_prompts([10, 3, 21, 7], hf.config.vocab_size, seed=44)
    engine = pdserve.Engine(model_path=path, page_size=4)
    try:
        out = engine.generate(input_ids=prompts, sampling_params=[greedy(12)] * len(prompts))
        for o, p in zip(out, prompts):
            assert o["output_ids"] == greedy_continuation(hf, p, 12)
        info = engine.get_server_info()["attention"]
        assert info["decode_stack"] == "cpu_kernel"
        assert engine.scheduler.runner.backend.decode_stack_steps >= 11  # every decode step of the batch
        assert_no_leak(engine)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("switch", ["env", "cpu_gemm_plain"])
def test_the_switches_keep_the_layers(model, switch, monkeypatch):
    """``PDSERVE_DECODE_STACK=layers`` or ``--cpu-gemm plain`` (F.linear everywhere): the layers, one by one."""
    hf, path = model
    kwargs = {}
    if switch == "env":
        monkeypatch.setenv("PDSERVE_DECODE_STACK", "layers")
    else:
        kwargs["cpu_gemm"] = "plain"
    prompts = random_prompts([6, 11], hf.config.vocab_size, seed=45)
    engine = pdserve.Engine(model_path=path, page_size=4, **kwargs)
    try:
        out = engine.generate(input_ids=prompts, sampling_params=[greedy(6)] * len(prompts))
        for o, p in zip(out, prompts):
            assert o["output_ids"] == greedy_continuation(hf, p, 6)
        assert engine.get_server_info()["attention"]["decode_stack"] == "layers"
        assert engine.scheduler.runner.backend.decode_stack_steps == 0
    finally:
        engine.shutdown()
