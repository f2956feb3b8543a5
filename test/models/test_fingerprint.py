"""models/fingerprint.py: the same weights give the same fingerprint at any path, split, rank or
file sharding; other weights with the same shapes, another dummy seed or another config do not;
and a refused compatibility record names ``weights``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fixtures.tiny_models import make_tiny_hf_model
from pdserve.config import ModelConfig, ServerArgs
from pdserve.disagg.bootstrap import CompatRecord, IncompatiblePeer
from pdserve.disagg.roles import compat_record
from pdserve.models import fingerprint
from pdserve.models.loader import load_model


def _fp(path, seed: int = 0, **kw) -> str:
    """A fresh computation (the per-process cache cleared), so equal values are not the cache's."""
    fingerprint._fingerprint.cache_clear()
    return fingerprint.weights_fingerprint(ModelConfig.from_path(str(path), **kw), seed)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``a`` and ``other``: tiny Llamas of the same shapes from different seeds; ``copy``: ``a``
    copied elsewhere, with the keys a re-save rewrites changed."""
    root = tmp_path_factory.mktemp("fp")
    a = Path(make_tiny_hf_model("LlamaForCausalLM", root / "a", seed=0))
    other = Path(make_tiny_hf_model("LlamaForCausalLM", root / "other", seed=1))
    copy = Path(shutil.copytree(a, root / "elsewhere" / "copy"))
    cfg = json.loads((copy / "config.json").read_text())
    cfg.update(_name_or_path="/somewhere/else", transformers_version="0.0.1")
    (copy / "config.json").write_text(json.dumps(cfg, indent=4))
    return {"a": a, "other": other, "copy": copy}


def test_same_weights_at_two_paths_have_one_fingerprint(checkpoints):
    fp = _fp(checkpoints["a"])
    assert len(fp) == 64 and fp == _fp(checkpoints["copy"])


def test_same_shapes_other_weights_differ_and_the_record_names_weights(checkpoints):
    a, other = (ModelConfig.from_path(str(checkpoints[k])) for k in ("a", "other"))
    mine, theirs = (CompatRecord.from_model(mc, page_size=4) for mc in (a, other))
    assert vars(mine) | {"weights": "", "model": ""} == vars(theirs) | {"weights": "", "model": ""}
    with pytest.raises(IncompatiblePeer, match="^weights: prefill has ") as err:
        mine.check(theirs)
    msg = str(err.value)
    assert mine.weights[:12] in msg and theirs.weights[:12] in msg
    assert str(checkpoints["a"]) in msg and str(checkpoints["other"]) in msg


def test_model_name_alone_is_not_compared(checkpoints):
    mine = CompatRecord.from_model(ModelConfig.from_path(str(checkpoints["a"])), 4, model="llama")
    theirs = CompatRecord.from_model(ModelConfig.from_path(str(checkpoints["copy"])), 4, model="my-llama")
    mine.check(theirs)
    assert mine == theirs


def test_a_changed_value_changes_the_fingerprint(tmp_path, checkpoints):
    tensors = load_file(str(checkpoints["a"] / "model.safetensors"))
    first = sorted(tensors)[0]  # always sampled, and its first window starts at [0, ..., 0]
    tensors[first] = tensors[first].clone()
    tensors[first].view(-1)[0] += 1.0
    shutil.copy(checkpoints["a"] / "config.json", tmp_path / "config.json")
    save_file(tensors, str(tmp_path / "model.safetensors"))
    assert _fp(tmp_path) != _fp(checkpoints["a"])


def test_resharded_checkpoint_keeps_the_fingerprint(tmp_path, checkpoints):
    """Tensors are keyed by name: the same tensors in two index-named shards hash as one file."""
    tensors = load_file(str(checkpoints["a"] / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(tmp_path / file))
    weight_map = {n: file for file, part in shards.items() for n in part}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    shutil.copy(checkpoints["a"] / "config.json", tmp_path / "config.json")
    assert _fp(tmp_path) == _fp(checkpoints["a"])


def test_config_keys_that_shape_the_model_count_and_the_others_do_not(tmp_path, checkpoints):
    shutil.copytree(checkpoints["a"], tmp_path / "m")
    path = tmp_path / "m"
    cfg = json.loads((path / "config.json").read_text())
    base = _fp(path)
    (path / "config.json").write_text(json.dumps({**cfg, "architectures": [cfg["architectures"][0], "Other"],
                                                  "torch_dtype": "bfloat16", "use_cache": False}))
    assert _fp(path) == base
    (path / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 1e-3}))
    assert _fp(path) != base


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory):
    return make_tiny_hf_model("DeepseekV3ForCausalLM", tmp_path_factory.mktemp("ds"))


@pytest.mark.parametrize("split", [dict(tp_size=2), dict(tp_size=2, ep_size=2),
                                   dict(tp_size=2, dp_size=2, enable_dp_attention=True)])
@pytest.mark.parametrize("model", ["checkpoint", "tiny-deepseek"])
def test_fingerprint_does_not_depend_on_the_parallel_split(deepseek_dir, model, split):
    """What each rank publishes (compat_record) for a real checkpoint and for dummy weights."""
    path = deepseek_dir if model == "checkpoint" else model
    records = []
    for flags in ({}, split):
        fingerprint._fingerprint.cache_clear()
        args = ServerArgs(model_path=path, **flags)
        records.append(compat_record(args, args.model_config()))
    assert records[0].weights == records[1].weights


def test_dummy_weights_are_identified_by_config_seed_and_dtype(tmp_path):
    shutil.copytree(ModelConfig.from_path("tiny-llama").path, tmp_path / "m")
    base = _fp("tiny-llama", seed=0)
    assert _fp(tmp_path / "m", seed=0, load_format="dummy") == base
    assert _fp("tiny-llama", seed=1) != base
    assert _fp("tiny-llama", seed=0, dtype="bfloat16") != base
    assert _fp("tiny-deepseek", seed=0) != base


def test_dummy_weights_depend_only_on_config_seed_and_dtype(tmp_path):
    """What the dummy fingerprint relies on: the same config at another path and the same seed
    load the same weights; another seed does not."""
    shutil.copytree(ModelConfig.from_path("tiny-llama").path, tmp_path / "m")
    one = load_model(ModelConfig.from_path("tiny-llama"), seed=3).state_dict()
    two = load_model(ModelConfig.from_path(str(tmp_path / "m"), load_format="dummy"), seed=3).state_dict()
    other = load_model(ModelConfig.from_path("tiny-llama"), seed=4).state_dict()
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)
    assert not all(torch.equal(one[k], other[k]) for k in one)


def test_sample_is_bounded_and_keeps_first_and_last():
    names = [f"t{i:05d}" for i in range(10_001)]
    chosen = fingerprint.sample_names(names)
    assert chosen[0] == names[0] and chosen[-1] == names[-1]
    assert len(chosen) <= fingerprint.MAX_SAMPLED_TENSORS + 1 and chosen == sorted(set(chosen))
    assert fingerprint.sample_names(names[:3]) == names[:3] and fingerprint.sample_names([]) == []


def test_record_without_a_digest_is_refused_naming_weights():
    with pytest.raises(ValueError, match="^weights: "):
        CompatRecord("m", "LlamaForCausalLM", "float32", 4, "gqa-hnd", 2, 2, 16, "not-a-digest")


def _content(path, seed: int = 0, **kw) -> str:
    return fingerprint.content_fingerprint(ModelConfig.from_path(str(path), **kw), seed)


def test_the_content_fingerprint_sees_every_byte_and_ignores_path_and_sharding(tmp_path, checkpoints):
    """The storage tier's namespace: one changed value in a tensor the sample never reads changes
    it (the sampled fingerprint does not), and it is the same at another path or re-sharded."""
    tensors = load_file(str(checkpoints["a"] / "model.safetensors"))
    names = sorted(tensors)
    matrix = next(n for n in names if tensors[n].dim() == 2 and tensors[n].shape[0] >= 4)
    tensors[matrix] = tensors[matrix].clone()
    tensors[matrix][1, 0] += 1.0  # row 1: the sample reads rows 0, the middle one and the last
    shutil.copy(checkpoints["a"] / "config.json", tmp_path / "config.json")
    save_file(tensors, str(tmp_path / "model.safetensors"))
    assert _fp(tmp_path) == _fp(checkpoints["a"])  # why the storage tier does not use the sample
    base = _content(checkpoints["a"])
    assert len(base) == 64 and base == _content(checkpoints["copy"])
    assert _content(tmp_path) != base
    assert _content(checkpoints["other"]) != base
    resharded = tmp_path / "resharded"
    resharded.mkdir()
    original = load_file(str(checkpoints["a"] / "model.safetensors"))
    save_file({n: original[n] for n in names[::2]}, str(resharded / "model-00001-of-00002.safetensors"))
    save_file({n: original[n] for n in names[1::2]}, str(resharded / "model-00002-of-00002.safetensors"))
    shutil.copy(checkpoints["a"] / "config.json", resharded / "config.json")
    assert _content(resharded) == base
    assert _content("tiny-llama", seed=1) != _content("tiny-llama", seed=2)
