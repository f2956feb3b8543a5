"""load_model: safetensors (single, sharded, fused-expert layout), dummy weights, dtype, tying,
and errors that name what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fixtures.paged_batches import PagedRequests, make_pool
from fixtures.tiny_models import ARCHS, make_hf_model_and_dir, make_tiny_hf_model
from pdserve.config import ModelConfig
from pdserve.models.loader import load_model
from pdserve.models.registry import get_model_class, supported_architectures


def _logits(model, seq):
    fb = PagedRequests(make_pool(model.config, 16)).batch([(0, seq)])
    with torch.no_grad():
        return model.compute_logits(model(fb))


def _greedy(model, prompt, steps=32):
    paged = PagedRequests(make_pool(model.config, 1))
    out, new = [], prompt
    with torch.no_grad():
        for i in range(steps):
            fb = paged.batch([(0, new)], decode=i > 0)
            nxt = int(model.compute_logits(model(fb))[-1].argmax())
            out.append(nxt)
            new = [nxt]
    return out


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_tiny_hf_model("LlamaForCausalLM", tmp_path_factory.mktemp("llama"))


def test_registry_knows_every_fixture_architecture():
    assert sorted(ARCHS) == supported_architectures()
    with pytest.raises(ValueError, match="architectures: 'GPT2LMHeadModel' is not supported"):
        get_model_class("GPT2LMHeadModel")


def test_unknown_architecture_in_config_is_a_value_error(tmp_path, llama_dir):
    cfg = json.loads((Path(llama_dir) / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="architectures.*MambaForCausalLM"):
        load_model(ModelConfig.from_path(str(tmp_path)))


def test_loaded_model_is_eval_no_grad_in_dtype(llama_dir):
    model = load_model(ModelConfig.from_path(llama_dir, dtype="bfloat16"))
    assert not model.training
    assert all(not p.requires_grad for p in model.parameters())
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    logits = _logits(model, [5, 6, 7])
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_missing_tensor_is_named(tmp_path, llama_dir):
    tensors = load_file(str(Path(llama_dir) / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((Path(llama_dir) / "config.json").read_text())
    with pytest.raises(ValueError, match=r"missing 1 tensor\(s\): model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(ModelConfig.from_path(str(tmp_path)))


def test_missing_weight_files_is_a_value_error(tmp_path, llama_dir):
    (tmp_path / "config.json").write_text((Path(llama_dir) / "config.json").read_text())
    with pytest.raises(ValueError, match="no model.safetensors"):
        load_model(ModelConfig.from_path(str(tmp_path)))


def test_missing_weight_files_are_refused_when_the_config_is_read_naming_the_cli_flag(tmp_path, llama_dir):
    """Known before any process starts, so `pdserve serve` reports it in one line; the hint is
    the flag an operator types, not the Python keyword."""
    (tmp_path / "config.json").write_text((Path(llama_dir) / "config.json").read_text())
    with pytest.raises(ValueError, match=r"^model_path: .*--load-format dummy") as err:
        ModelConfig.from_path(str(tmp_path))
    assert "load_format=" not in str(err.value)
    assert ModelConfig.from_path(str(tmp_path), load_format="dummy").load_format == "dummy"


@pytest.mark.parametrize("arch", ARCHS)
def test_config_without_architectures_is_resolved_from_model_type(tmp_path, arch):
    """As transformers' AutoModelForCausalLM does: model_type picks the class."""
    path = Path(make_tiny_hf_model(arch, tmp_path / "m"))
    cfg = json.loads((path / "config.json").read_text())
    del cfg["architectures"]
    (path / "config.json").write_text(json.dumps(cfg))
    mc = ModelConfig.from_path(str(path))
    assert mc.architecture == arch
    assert type(load_model(mc)).__name__ == arch


def test_config_without_architectures_or_known_model_type_names_both(tmp_path, llama_dir):
    cfg = json.loads((Path(llama_dir) / "config.json").read_text())
    del cfg["architectures"]
    cfg["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="architectures: .*model_type 'gpt2' is not one of llama, qwen2"):
        ModelConfig.from_path(str(tmp_path))


def test_unused_checkpoint_tensors_are_ignored(tmp_path, llama_dir):
    tensors = load_file(str(Path(llama_dir) / "model.safetensors"))
    tensors["model.layers.99.mlp.mtp_proj.weight"] = torch.zeros(2, 2)  # e.g. DeepSeek's MTP layers
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((Path(llama_dir) / "config.json").read_text())
    load_model(ModelConfig.from_path(str(tmp_path)))


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "DeepseekV3ForCausalLM"])
def test_sharded_checkpoint_loads_like_single_file(tmp_path, arch):
    hf, single = make_hf_model_and_dir(arch, tmp_path / "single")
    hf.save_pretrained(str(tmp_path / "sharded"), max_shard_size="200KB")
    sharded = tmp_path / "sharded"
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    a = load_model(ModelConfig.from_path(single))
    b = load_model(ModelConfig.from_path(str(sharded)))
    torch.testing.assert_close(_logits(a, [3, 4, 5, 6]), _logits(b, [3, 4, 5, 6]), atol=0, rtol=0)
    # An index naming a shard that is not there.
    victim = sorted(sharded.glob("*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(ValueError, match=victim.name):
        load_model(ModelConfig.from_path(str(sharded)))


@pytest.mark.parametrize("where", ["../outside/w.safetensors", "ABSOLUTE", "sub/../../outside/w.safetensors"])
def test_index_entries_outside_the_model_directory_are_refused(tmp_path, llama_dir, where):
    """An index is data: a weight_map entry of ``../outside/w.safetensors`` used to load that file."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text((Path(llama_dir) / "config.json").read_text())
    outside = tmp_path / "outside"
    outside.mkdir()
    tensors = load_file(str(Path(llama_dir) / "model.safetensors"))
    save_file(tensors, str(outside / "w.safetensors"))
    name = str(outside / "w.safetensors") if where == "ABSOLUTE" else where
    index = {"metadata": {}, "weight_map": {t: name for t in tensors}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"weight_map\[.*\] = .* is not a file inside the model directory"):
        load_model(ModelConfig.from_path(str(model)))


def test_index_shards_in_a_subdirectory_load(tmp_path, llama_dir):
    model = tmp_path / "model"
    (model / "shards").mkdir(parents=True)
    (model / "config.json").write_text((Path(llama_dir) / "config.json").read_text())
    tensors = load_file(str(Path(llama_dir) / "model.safetensors"))
    save_file(tensors, str(model / "shards" / "w.safetensors"))
    index = {"metadata": {}, "weight_map": {t: "shards/w.safetensors" for t in tensors}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    a, b = load_model(ModelConfig.from_path(str(llama_dir))), load_model(ModelConfig.from_path(str(model)))
    torch.testing.assert_close(_logits(a, [3, 4, 5]), _logits(b, [3, 4, 5]), atol=0, rtol=0)


def test_fused_expert_checkpoint_layout_loads(tmp_path):
    """transformers 5 writes per-expert keys on save, but holds experts fused in memory; a
    checkpoint saved in that fused layout must load to the same model."""
    _, path = make_hf_model_and_dir("Qwen3MoeForCausalLM", tmp_path / "per_expert")
    tensors = load_file(str(Path(path) / "model.safetensors"))
    cfg = json.loads((Path(path) / "config.json").read_text())
    E, fused = cfg.get("num_experts") or cfg["num_local_experts"], {}
    for layer in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{layer}.mlp.experts"
        if f"{pre}.0.gate_proj.weight" not in tensors:
            continue
        fused[f"{pre}.gate_up_proj"] = torch.stack([torch.cat([tensors.pop(f"{pre}.{e}.gate_proj.weight"),
                                                               tensors.pop(f"{pre}.{e}.up_proj.weight")])
                                                    for e in range(E)])
        fused[f"{pre}.down_proj"] = torch.stack([tensors.pop(f"{pre}.{e}.down_proj.weight") for e in range(E)])
    out = tmp_path / "fused"
    out.mkdir()
    save_file({**tensors, **fused}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg))
    a, b = load_model(ModelConfig.from_path(path)), load_model(ModelConfig.from_path(str(out)))
    torch.testing.assert_close(_logits(a, [7, 8, 9]), _logits(b, [7, 8, 9]), atol=0, rtol=0)


def test_tie_word_embeddings_is_honoured(tmp_path):
    tied = load_model(ModelConfig.from_path(make_tiny_hf_model("Qwen2ForCausalLM", tmp_path / "q2")))
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    untied = load_model(ModelConfig.from_path(
        make_tiny_hf_model("DeepseekV2ForCausalLM", tmp_path / "ds", tie_word_embeddings=True)))
    assert untied.lm_head.weight is untied.model.embed_tokens.weight


@pytest.mark.parametrize("arch", ARCHS)
def test_dummy_weights_are_seeded_and_not_degenerate(tmp_path, arch):
    path = make_tiny_hf_model(arch, tmp_path)
    mc = ModelConfig.from_path(path, load_format="dummy")
    a, b, c = load_model(mc, seed=0), load_model(mc, seed=0), load_model(mc, seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    tokens = _greedy(a, [5, 17, 99, 3, 250])
    assert len(set(tokens)) >= 4, tokens


def test_fp8_checkpoint_is_refused_by_name(tmp_path, llama_dir):
    tensors = load_file(str(Path(llama_dir) / "model.safetensors"))
    key = "model.layers.0.mlp.down_proj.weight"
    tensors[key] = tensors[key].to(torch.float8_e4m3fn)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((Path(llama_dir) / "config.json").read_text())
    with pytest.raises(ValueError, match=rf"{key}.*FP8"):
        load_model(ModelConfig.from_path(str(tmp_path)))
