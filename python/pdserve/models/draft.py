"""Draft models of speculative decoding: DeepSeek's MTP layer (NEXTN) and a Llama EAGLE head.

A draft reads, for each token row, the token one position ahead and a hidden state of the
target at that row ("target_hidden": the target's final-normed hidden states, what
``CausalLM.forward`` returns), runs one decoder layer whose KV goes to the pool's extra layer
(index = the target's ``num_hidden_layers``), and returns its own hidden state (the input of its
next step) and logits over the vocabulary.

Legend: T tokens, H hidden, N rows to score, V vocab.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from pdserve.config import Fp8BlockConfig, ModelConfig, SpeculativeConfig, has_weight_files, resolve_model_path
from pdserve.distributed.parallel_state import SINGLE
from pdserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pdserve.layers.forward_batch import ForwardBatch
from pdserve.layers.linear import ReplicatedLinear
from pdserve.layers.norm import RMSNorm
from pdserve.layers.rotary import get_rope, rope_parameters_of
from pdserve.models.base import CausalLM, load_into
from pdserve.models.decoder import DecoderLayer, GQAAttention, head_dim_of


class DraftModel(nn.Module):
    """``forward(fb, target_hidden [T, H]) -> hidden [T, H]``; ``compute_logits(hidden [N, H])
    -> [N, V]`` float32. Writes its KV into the pool layer ``layer_id`` and nothing else."""

    layer_id: int

    def forward(self, fb: ForwardBatch, target_hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def process_weights_after_loading(self) -> None:
        for module in self.modules():
            derive = getattr(module, "process_weights_after_loading", None)
            if module is not self and derive is not None:
                derive()


def _rotation(rope, fb: ForwardBatch):
    rope.ensure_capacity(int(fb.positions.max()) + 1)
    return rope.rotation(fb.positions)


class _SharedHead(nn.Module):
    def __init__(self, c, dtype: torch.dtype):
        super().__init__()
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.head = ParallelLMHead(c.vocab_size, c.hidden_size, SINGLE.attention, dtype)


class DeepseekMTP(DecoderLayer, DraftModel):
    """DeepSeek-V3's next-token module; its checkpoint tensors are ``model.layers.{N}.<name>``
    with N = num_hidden_layers, ``<name>`` this module's own parameter names (a full MLA + MoE
    decoder layer, ``enorm``, ``hnorm``, ``eh_proj`` [H, 2H], ``shared_head.{norm,head}``,
    ``embed_tokens``). hidden = shared_head.norm(layer(eh_proj(cat(enorm(embed(tok)),
    hnorm(target_hidden))))), as SGLang's DeepseekModelNextN. Its attention is the target's kind:
    DeepSeek-V3.2's MTP layer has its own lightning indexer (``self_attn.indexer.*``), whose index
    keys, like its latent, live in the pool's extra layer."""

    def __init__(self, target: CausalLM, dtype: torch.dtype):
        from pdserve.models.deepseek import DeepseekV2ForCausalLM

        if not isinstance(target, DeepseekV2ForCausalLM):
            raise ValueError(f"speculative_algorithm: NEXTN drafts with DeepSeek's MTP layer; "
                             f"{type(target).__name__} has none")
        c = target.config
        layer_id = c.num_hidden_layers
        attention = target.attention_class(c, layer_id, SINGLE.attention, dtype)
        super().__init__(attention, target.make_mlp(layer_id, SINGLE, dtype), c.hidden_size, c.rms_norm_eps, dtype)
        self.layer_id = layer_id
        self.embed_tokens = VocabParallelEmbedding(c.vocab_size, c.hidden_size, SINGLE.attention, dtype)
        self.enorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.eh_proj = ReplicatedLinear(2 * c.hidden_size, c.hidden_size, dtype=dtype)
        self.shared_head = _SharedHead(c, dtype)
        self.__dict__["rotary_emb"] = target.model.rotary_emb  # the target's, not a submodule

    def forward(self, fb: ForwardBatch, target_hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        rotation = _rotation(self.rotary_emb, fb)
        x = torch.cat([self.enorm(self.embed_tokens(fb.input_ids)), self.hnorm(target_hidden)], dim=-1)  # [T, 2H]
        x, residual = DecoderLayer.forward(self, self.eh_proj(x), None, rotation, fb)
        return self.shared_head.norm(x, residual)[0]  # [T, H]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.shared_head.head(hidden).float()


class _EagleStack(nn.Module):
    def __init__(self, c, first_layer_id: int, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(c.vocab_size, c.hidden_size, SINGLE.attention, dtype)
        self.fc = ReplicatedLinear(2 * c.hidden_size, c.hidden_size, dtype=dtype)
        layers = []
        for i in range(c.num_hidden_layers):
            attn = GQAAttention(c, first_layer_id + i, SINGLE.attention, dtype, qkv_bias=False, o_bias=False,
                                qk_norm=False)
            from pdserve.layers.mlp import GatedMLP

            layer = DecoderLayer(attn, GatedMLP(c.hidden_size, c.intermediate_size, SINGLE, dtype, c.hidden_act),
                                 c.hidden_size, c.rms_norm_eps, dtype)
            if i == 0:  # EAGLE's first layer reads fc's output un-normed (SGLang's LlamaForCausalLMEagle)
                setattr(layer, "input_layernorm", nn.Identity())  # noqa: B010  (typed RMSNorm on DecoderLayer)
            layers.append(layer)
        self.layers = nn.ModuleList(layers)


class LlamaEagleDraft(DraftModel):
    """SGLang's LlamaForCausalLMEagle: ``model.fc`` [H, 2H] over cat(embed(tok), target_hidden),
    ``model.layers.*`` (Llama layers, the first without input norm), hidden = x + residual (no
    final norm), ``lm_head``. Embeddings and head are the target's when the draft has none."""

    def __init__(self, c, target: CausalLM, dtype: torch.dtype):
        super().__init__()
        self.layer_id = target.config.num_hidden_layers
        self.model = _EagleStack(c, self.layer_id, dtype)
        self.lm_head = ParallelLMHead(c.vocab_size, c.hidden_size, SINGLE.attention, dtype)
        D = head_dim_of(c)
        self.__dict__["rotary_emb"] = get_rope(D, c.max_position_embeddings, rope_parameters_of(c),
                                               interleaved=False, dtype=dtype)

    def forward(self, fb: ForwardBatch, target_hidden: torch.Tensor) -> torch.Tensor:
        rotation = _rotation(self.rotary_emb, fb)
        x = self.model.fc(torch.cat([self.model.embed_tokens(fb.input_ids), target_hidden], dim=-1))  # [T, H]
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, rotation, fb)
        return x + residual  # [T, H]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


def _share(draft: nn.Module, attr_path: str, module: nn.Module) -> None:
    owner_path, _, name = attr_path.rpartition(".")
    owner = draft.get_submodule(owner_path) if owner_path else draft
    setattr(owner, name, module)


def _load(draft: DraftModel, tensors: dict[str, torch.Tensor], shared: Mapping[str, nn.Module]) -> None:
    """Checkpoint tensors (draft-relative names) into ``draft``; modules of ``shared`` whose
    weight the checkpoint lacks become the target's."""
    tensors = dict(tensors)
    for path, module in shared.items():
        if f"{path}.weight" not in tensors:
            _share(draft, path, module)
            weight = module.weight
            assert isinstance(weight, torch.Tensor), path
            tensors[f"{path}.weight"] = weight  # already in place: loads onto itself
    load_into(draft, tensors.items())
    draft.process_weights_after_loading()


def _dummy(draft: DraftModel, seed: int, shared: Mapping[str, nn.Module], quant: Fp8BlockConfig | None = None) -> None:
    """Seeded weights; with an FP8 target, passed through our quantizer as the target's dummy
    weights are (the draft's decoder linears FP8-representable; eh_proj and heads untouched)."""
    from pdserve.models.base import checkpoint_tensors
    from pdserve.models.loader import init_dummy_weights

    init_dummy_weights(draft, seed)
    if quant is not None:
        from pdserve.layers.quant.fp8 import dequantized_checkpoint, quantized_checkpoint

        dtype = next(draft.parameters()).dtype
        tensors = dict(dequantized_checkpoint(quantized_checkpoint(list(checkpoint_tensors(draft)), quant), quant,
                                              dtype))
        load_into(draft, tensors.items())
    for path, module in shared.items():  # after the seeding, which must not touch the target's
        _share(draft, path, module)
    draft.process_weights_after_loading()


def _checkpoint(path: str, prefix: str = "", quant: Fp8BlockConfig | None = None,
                dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The checkpoint tensors under ``prefix`` (prefix stripped); FP8 pairs (``X.weight`` +
    ``X.weight_scale_inv``, block size of ``quant`` or the default) dequantized exactly to ``dtype``."""
    from pdserve.layers.quant.fp8 import SCALE_SUFFIX, dequantized_checkpoint
    from pdserve.models.loader import iter_safetensors

    tensors = [(name, t) for name, t in iter_safetensors(path) if name.startswith(prefix)]
    if any(name.endswith(SCALE_SUFFIX) for name, _ in tensors):
        tensors = list(dequantized_checkpoint(tensors, quant or Fp8BlockConfig(), dtype))
    return {name[len(prefix):]: t for name, t in tensors}


def _draft_dir(source: str, spec: SpeculativeConfig):
    """The directory of ``source`` (a checkpoint directory or preset); errors name the draft flag
    when it came from --speculative-draft-model-path."""
    try:
        return resolve_model_path(source)[0]
    except ValueError as e:
        if spec.draft_model_path is None:
            raise
        raise ValueError(f"speculative_draft_model_path: {e}") from None


def draft_hf_config(path: str):
    """The transformers config of an EAGLE draft directory (or preset): a Llama config whose
    architecture (LlamaForCausalLMEagle) pdserve does not serve as a target."""
    from transformers import CONFIG_MAPPING

    directory, _ = resolve_model_path(path)
    raw = json.loads((directory / "config.json").read_text())
    if raw.get("model_type", "llama") != "llama":
        raise ValueError(f"speculative_draft_model_path: {directory} is a {raw.get('model_type')!r} model; "
                         f"EAGLE drafts are Llama (model_type llama)")
    return CONFIG_MAPPING["llama"].from_dict(raw), directory


def load_draft(model_config: ModelConfig, spec: SpeculativeConfig, target: CausalLM, seed: int) -> DraftModel:
    """The draft ``spec`` asks for, next to ``target`` (whose embeddings/head it may share).
    Dummy weights (seeded from ``seed`` + 1) when the target has dummy weights and no draft
    checkpoint is given, or the draft directory holds no weight files."""
    dtype = model_config.torch_dtype
    c = model_config.hf_config
    with torch.no_grad():
        if spec.algorithm == "NEXTN" and model_config.state_regions:  # DeepSeek-V4
            draft: DraftModel = _v4_mtp(model_config, spec, target, seed)
        elif spec.algorithm == "NEXTN":
            if not model_config.is_mla:
                raise ValueError(f"speculative_algorithm: NEXTN drafts with DeepSeek's MTP layer; "
                                 f"{model_config.architecture} has none (use EAGLE with a draft checkpoint)")
            draft = DeepseekMTP(target, dtype)
            shared = {"embed_tokens": target.model.embed_tokens}
            if spec.draft_model_path is None and model_config.load_format == "dummy":
                _dummy(draft, seed + 1, shared, model_config.quantization)
            else:
                source = spec.draft_model_path or model_config.path
                prefix = f"model.layers.{c.num_hidden_layers}."
                tensors = _checkpoint(str(_draft_dir(source, spec)), prefix, model_config.quantization, dtype)
                if not tensors:
                    raise ValueError(f"speculative_algorithm: NEXTN needs the MTP layer ({prefix}*) in {source} "
                                     f"(num_nextn_predict_layers >= 1)")
                _load(draft, tensors, shared)
        elif spec.algorithm == "EAGLE":
            assert spec.draft_model_path is not None  # SpeculativeConfig requires it
            dc, directory = draft_hf_config(spec.draft_model_path)
            if head_dim_of(dc) != model_config.head_dim or dc.num_key_value_heads != model_config.num_kv_heads \
                    or dc.hidden_size != c.hidden_size:
                raise ValueError(f"speculative_draft_model_path: the draft's hidden_size/KV heads/head_dim "
                                 f"({dc.hidden_size}/{dc.num_key_value_heads}/{head_dim_of(dc)}) must equal the "
                                 f"target's ({c.hidden_size}/{model_config.num_kv_heads}/{model_config.head_dim}): "
                                 f"its KV shares the target's pool")
            draft = LlamaEagleDraft(dc, target, dtype)
            shared = {"model.embed_tokens": target.model.embed_tokens, "lm_head": target.lm_head}
            if has_weight_files(directory):
                _load(draft, _checkpoint(str(directory), dtype=dtype), shared)
            else:
                _dummy(draft, seed + 1, shared)
        else:
            raise ValueError(f"speculative_algorithm: {spec.algorithm!r} has no draft model")
    draft.eval()
    draft.requires_grad_(False)
    return draft


def _v4_mtp(model_config: ModelConfig, spec: SpeculativeConfig, target: CausalLM, seed: int) -> DraftModel:
    """DeepSeek-V4's MTP layer (``mtp.0.*``, models/deepseek_v4_mtp.py); from then on the target hands
    it its n streams."""
    from pdserve.models.deepseek_v4 import DeepseekV4ForCausalLM
    from pdserve.models.deepseek_v4_mtp import PREFIX, DeepseekV4MTP, mtp_key, nextn_shared

    assert isinstance(target, DeepseekV4ForCausalLM)
    draft = DeepseekV4MTP(target, model_config.torch_dtype)
    shared = nextn_shared(target)
    if spec.draft_model_path is None and model_config.load_format == "dummy":
        _dummy(draft, seed + 1, shared, model_config.quantization)
    else:
        source = spec.draft_model_path or model_config.path
        tensors = _checkpoint(str(_draft_dir(source, spec)), PREFIX, model_config.quantization,
                              model_config.torch_dtype)
        if not tensors:
            raise ValueError(f"speculative_algorithm: NEXTN needs the MTP layer ({PREFIX}*) in {source} "
                             f"(num_nextn_predict_layers >= 1)")
        _load(draft, {mtp_key(name): t for name, t in tensors.items()}, shared)
    target.hidden_streams = True
    return draft


def draft_tensors(draft: DraftModel) -> Iterable[tuple[str, torch.Tensor]]:
    """The draft's checkpoint tensors (for tests writing a checkpoint)."""
    from pdserve.models.base import checkpoint_tensors

    return checkpoint_tensors(draft)
