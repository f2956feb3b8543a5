"""Draft models from checkpoints: DeepSeek's MTP layer (``model.layers.{num_hidden_layers}.*``)
is read only when NEXTN asks for it, its tensors land where they belong, and a checkpoint
without one is refused naming the flag."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import pdserve
from fixtures.tiny_models import make_tiny_hf_model
from pdserve.config import ModelConfig, SpeculativeConfig
from pdserve.models.base import checkpoint_tensors
from pdserve.models.draft import DeepseekMTP, load_draft
from pdserve.models.loader import init_dummy_weights, load_model

GREEDY = {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A DeepSeek-V3 checkpoint plus an MTP layer in a second safetensors file."""
    d = make_tiny_hf_model("DeepseekV3ForCausalLM", tmp_path_factory.mktemp("dsv3"))
    mc = ModelConfig.from_path(d)
    target = load_model(mc)
    mtp = DeepseekMTP(target, torch.float32)
    init_dummy_weights(mtp, seed=5)
    n = mc.num_layers
    tensors = {f"model.layers.{n}.{k}": v.contiguous() for k, v in checkpoint_tensors(mtp)}
    bare = make_tiny_hf_model("DeepseekV3ForCausalLM", tmp_path_factory.mktemp("bare"))
    save_file(tensors, str(Path(d) / "mtp.safetensors"))
    return d, bare, tensors, n


def test_mtp_layer_loads_from_the_checkpoint_and_only_when_asked(ckpt):
    d, _, tensors, n = ckpt
    mc = ModelConfig.from_path(d)
    target = load_model(mc)  # plain serving: the MTP tensors are skipped
    assert not any(name.startswith(f"model.layers.{n}.") for name in target.state_dict())
    draft = load_draft(mc, SpeculativeConfig("NEXTN"), target, seed=0)
    assert torch.equal(draft.eh_proj.weight, tensors[f"model.layers.{n}.eh_proj.weight"])
    assert torch.equal(draft.shared_head.head.weight, tensors[f"model.layers.{n}.shared_head.head.weight"])
    assert draft.layer_id == n


def test_nextn_from_a_checkpoint_keeps_greedy_output(ckpt):
    d, *_ = ckpt
    prompts = [[5, 17, 99, 3, 250, 7, 8], [11, 12, 13, 14, 15, 16, 17, 18, 19]]
    ref = pdserve.Engine(model_path=d).generate(input_ids=prompts, sampling_params=GREEDY)
    out = pdserve.Engine(model_path=d, speculative_algorithm="NEXTN").generate(input_ids=prompts,
                                                                                sampling_params=GREEDY)
    assert [o["output_ids"] for o in out] == [o["output_ids"] for o in ref]
    assert out[0]["meta_info"]["spec_verify_ct"] >= 1


def test_a_checkpoint_without_an_mtp_layer_is_refused(ckpt):
    _, bare, _, n = ckpt
    with pytest.raises(ValueError, match=rf"NEXTN needs the MTP layer \(model\.layers\.{n}\."):
        pdserve.Engine(model_path=bare, speculative_algorithm="NEXTN")


def test_an_mtp_checkpoint_without_embeddings_shares_the_targets(ckpt, tmp_path):
    d, _, tensors, n = ckpt
    save_file({k: v for k, v in tensors.items() if not k.endswith("embed_tokens.weight")},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((Path(d) / "config.json").read_text())
    mc = ModelConfig.from_path(d)
    target = load_model(mc)
    draft = load_draft(mc, SpeculativeConfig("NEXTN", draft_model_path=str(tmp_path)), target, seed=0)
    assert draft.embed_tokens is target.model.embed_tokens
    assert torch.equal(draft.eh_proj.weight, tensors[f"model.layers.{n}.eh_proj.weight"])
    with pytest.raises(ValueError, match="speculative_draft_model_path"):
        load_draft(mc, SpeculativeConfig("NEXTN", draft_model_path=str(tmp_path / "nowhere")), target, seed=0)


@pytest.fixture(scope="module")
def fp8_mtp(tmp_path_factory):
    """DeepSeek-V3 in the official FP8 format with its MTP layer (decoder linears quantized)."""
    from fixtures.fp8_checkpoints import make_fp8_checkpoint

    return make_fp8_checkpoint("DeepseekV3ForCausalLM", tmp_path_factory.mktemp("fp8mtp"), mtp_layer=True)[0]


def test_nextn_on_an_fp8_checkpoint_dequantizes_the_mtp_layer_and_keeps_greedy_output(fp8_mtp):
    from pdserve.layers.quant.fp8 import dequantize_block_fp8
    from pdserve.models.loader import iter_safetensors

    mc = ModelConfig.from_path(fp8_mtp)
    n = mc.num_layers
    raw = dict(iter_safetensors(fp8_mtp))
    target = load_model(mc)
    draft = load_draft(mc, SpeculativeConfig("NEXTN"), target, seed=0)
    key = f"model.layers.{n}.mlp.experts.0.down_proj.weight"
    want = dequantize_block_fp8(raw[key], raw[key + "_scale_inv"])
    got = dict(checkpoint_tensors(draft))["mlp.experts.0.down_proj.weight"]
    assert raw[key].dtype == torch.float8_e4m3fn and torch.equal(got, want)
    assert torch.equal(draft.eh_proj.weight, raw[f"model.layers.{n}.eh_proj.weight"])  # never quantized
    prompts = [[5, 17, 99, 3, 250, 7, 8], [11, 12, 13, 14, 15, 16, 17, 18, 19]]
    ref = pdserve.Engine(model_path=fp8_mtp).generate(input_ids=prompts, sampling_params=GREEDY)
    out = pdserve.Engine(model_path=fp8_mtp, speculative_algorithm="NEXTN").generate(input_ids=prompts,
                                                                                      sampling_params=GREEDY)
    assert [o["output_ids"] for o in out] == [o["output_ids"] for o in ref]


def test_the_fp8_preset_drafts_with_fp8_representable_mtp_weights():
    from pdserve.layers.quant.fp8 import dequantize_block_fp8, quantize_block_fp8

    mc = ModelConfig.from_path("tiny-deepseek-fp8")
    draft = load_draft(mc, SpeculativeConfig("NEXTN"), load_model(mc), seed=0)
    w = dict(checkpoint_tensors(draft))["self_attn.kv_b_proj.weight"]
    assert torch.equal(dequantize_block_fp8(*quantize_block_fp8(w)), w)
