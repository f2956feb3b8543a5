"""Decode from captured CUDA graphs answers like eager decode (gpu-marked); on CPU the flags are
accepted and nothing is captured."""

from __future__ import annotations

import logging

import pytest

from pdserve.config import ServerArgs
from pdserve.engine.model_runner import build_model_runner

PROMPTS = ["The capital of France is", "1 2 3 4 5", "Hello", "a b"]


def test_cuda_graph_flags_are_ignored_on_cpu():
    args = ServerArgs(model_path="tiny-llama", device="cpu", cuda_graph_max_bs=4, max_total_tokens=64)
    runner = build_model_runner(args, args.model_config())
    assert runner.graphs is None and not args.device_config().use_cuda_graph


def _tokens(preset: str, **kwargs) -> list[list[int]]:
    from pdserve import Engine

    with Engine(preset, device="cuda", attention_backend="triton", dtype="float32", page_size=16,
                max_total_tokens=2048, **kwargs) as engine:
        outs = engine.generate(PROMPTS, sampling_params={"max_new_tokens": 12, "temperature": 0.0,
                                                          "ignore_eos": True})
    return [o["output_ids"] for o in outs]


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-deepseek", "tiny-qwen3-moe"])
def test_graph_decode_matches_eager(preset, caplog):
    with caplog.at_level(logging.INFO, logger="pdserve.engine.cuda_graph"):
        graphed = _tokens(preset, cuda_graph_max_bs=8)
    assert any("Captured" in r.getMessage() for r in caplog.records)
    assert graphed == _tokens(preset, disable_cuda_graph=True)
