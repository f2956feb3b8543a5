"""P/D with a block-FP8 checkpoint (DeepSeek-V3's format, written by our quantizer): decode's greedy
tokens equal transformers' on the dequantized copy, and an FP8 prefill is never paired with a
full-precision decode (the handshake names the quantization). In-process pairs over the in-memory
transfer backend (pd_pair.py); the multi-rank case is in test_pd_ranks.py."""

from __future__ import annotations

import pytest
import torch
from pd_pair import PDPair, greedy

from fixtures.fp8_checkpoints import make_fp8_checkpoint
from fixtures.tiny_models import greedy_continuation

NEW = 10
PROMPTS = ([5, 17, 99, 3, 250, 8, 1000], list(range(40, 77)), [9])  # the one-token prompt never transfers


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    fp8_dir, plain_dir = make_fp8_checkpoint("DeepseekV3ForCausalLM", tmp_path_factory.mktemp("ds-fp8"),
                                             mtp_layer=True)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(plain_dir, dtype=torch.float32).eval()
    return fp8_dir, [greedy_continuation(hf, p, NEW) for p in PROMPTS]


def _pair(request, model: str, **flags) -> PDPair:
    pair = PDPair(model, backend="memory", **flags)
    request.addfinalizer(pair.close)
    return pair


def test_1p1d_on_an_fp8_checkpoint_matches_transformers_on_its_dequantized_copy(request, fp8_checkpoint):
    path, expected = fp8_checkpoint
    pair = _pair(request, path, page_size=4, chunked_prefill_size=16)
    for i, p in enumerate(PROMPTS):
        pair.submit(f"r{i}", p, greedy(NEW))
    pair.run()
    assert [pair.outputs[f"r{i}"]["ids"] for i in range(len(PROMPTS))] == expected
    d = pair.decode.stats()
    assert d["kv_received"] == len(PROMPTS) - 1 and d["fallbacks"] == 0, d
    pair.assert_idle_and_accounted()


def test_fp8_prefill_and_full_precision_decode_are_refused_naming_the_quantization(request):
    """The two presets have the same shapes, dtype and page size: only the quantization (and with
    it the weights) differs, and the refusal says so in its own field."""
    pair = _pair(request, "tiny-deepseek-fp8", decode_flags={"model_path": "tiny-deepseek"})
    pair.submit("a", PROMPTS[1], greedy(NEW))
    pair.run(until=lambda: pair.outputs["a"]["final"] is not None)
    reason = pair.outputs["a"]["final"].finish_reason
    assert reason["type"] == "abort", reason
    assert "quantization:" in reason["message"] and "has fp8-block128x128" in reason["message"], reason
    assert "has none" in reason["message"], reason
    assert pair.prefill.stats()["rooms_completed"] == 0
