"""DeepSeek-V4's MTP layer as NEXTN's draft. transformers' ``DeepseekV4ForCausalLM`` drops the
checkpoint's ``mtp.*`` tensors; the block is DeepSeek's own (``MTPBlock`` of the released inference
code): a full V4 decoder layer with its own hyper-connections, fed the target's n residual streams.

Legend: T tokens, N rows to score, n hc_mult (streams), Hd hidden, V vocab.

  e = enorm(embed(token one ahead))                          [T, Hd]  (embed: the target's)
  h = e_proj(e) + h_proj(hnorm(streams))                     [T, n, Hd]  (e added to every stream)
  h = layer(h)                                               the V4 block: attn_hc, attention, ffn_hc, MoE
  logits = head(norm(hc_head(h)))                            hc_head its own; head: the target's

``streams`` is the target's last layer output before its hyper head (the target hands it over
flattened, ``DeepseekV4ForCausalLM.hidden_streams``); the layer's own output streams feed the next
draft step. Its attention is a sliding-window one (the checkpoint carries no compressor or indexer
for it: ``mtp.0.attn.{wq_a,wq_b,wkv,wo_a,wo_b,q_norm,kv_norm,attn_sink}``), so its state is one
region, ``window_kv``, at the pool's extra layer (index ``num_hidden_layers``). Its MoE routes by
score (``ffn.gate.bias``), never by token hash.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from pdserve.distributed.parallel_state import SINGLE
from pdserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pdserve.layers.forward_batch import ForwardBatch
from pdserve.layers.linear import ReplicatedLinear
from pdserve.layers.norm import RMSNorm
from pdserve.layers.rotary import RotaryEmbedding
from pdserve.models.deepseek_v4 import (
    DeepseekV4DecoderLayer,
    DeepseekV4ForCausalLM,
    DeepseekV4Model,
    HyperHead,
    module_key,
)
from pdserve.models.deepseek_v4_attention import SLIDING
from pdserve.models.draft import DraftModel

PREFIX = "mtp.0."  # DeepSeek's name of the (first) MTP layer in a V4 checkpoint


def mtp_key(name: str) -> str:
    """A ``mtp.0.*`` checkpoint name (prefix stripped) -> this module's parameter name."""
    m = re.fullmatch(r"hc_head_(fn|base|scale)", name)
    if m:
        return f"hc_head.hc_{m.group(1)}"
    as_layer = "model.layers.0."  # renamed as a decoder layer's tensor (the target skips ``mtp.*`` itself)
    return module_key(as_layer + name)[len(as_layer):]


class DeepseekV4MTP(DeepseekV4DecoderLayer, DraftModel):
    """``forward(fb, streams [T, n Hd]) -> streams [T, n Hd]``; ``compute_logits([N, n Hd]) -> [N, V]``."""

    n: int
    hidden: int
    embed_tokens: VocabParallelEmbedding
    head: ParallelLMHead
    enorm: RMSNorm
    hnorm: RMSNorm
    e_proj: ReplicatedLinear
    h_proj: ReplicatedLinear
    norm: RMSNorm
    hc_head: HyperHead

    def __init__(self, target: DeepseekV4ForCausalLM, dtype: torch.dtype):
        c = target.config
        layer_id = c.num_hidden_layers
        model = target.model
        assert isinstance(model, DeepseekV4Model)
        super().__init__(c, layer_id, model.ropes, dtype, kinds=(SLIDING, "moe"))
        self.layer_id, self.n, self.hidden = layer_id, c.hc_mult, c.hidden_size
        H = c.hidden_size
        self.embed_tokens = VocabParallelEmbedding(c.vocab_size, H, SINGLE.attention, dtype)  # the target's on load
        self.head = ParallelLMHead(c.vocab_size, H, SINGLE.attention, dtype)  # the target's on load
        self.enorm = RMSNorm(H, c.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(H, c.rms_norm_eps, dtype)
        self.e_proj = ReplicatedLinear(H, H, False, dtype)
        self.h_proj = ReplicatedLinear(H, H, False, dtype)
        self.norm = RMSNorm(H, c.rms_norm_eps, dtype)
        self.hc_head = HyperHead(c)

    def forward(self, fb: ForwardBatch, target_hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        rope = self.self_attn.rope
        assert isinstance(rope, RotaryEmbedding)
        rope.ensure_capacity(int(fb.positions.max()) + 1)
        streams = target_hidden.view(-1, self.n, self.hidden)  # [T, n, Hd]
        e = self.e_proj(self.enorm(self.embed_tokens(fb.input_ids)))  # [T, Hd]
        h = e.unsqueeze(1) + self.h_proj(self.hnorm(streams))  # [T, n, Hd]
        return DeepseekV4DecoderLayer.forward(self, h, fb).flatten(1)  # [T, n Hd]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.hc_head(hidden.view(-1, self.n, self.hidden)))).float()


def nextn_shared(target: DeepseekV4ForCausalLM) -> dict[str, nn.Module]:
    """What the MTP layer takes from the target (the checkpoint carries no embedding or head for it)."""
    return {"embed_tokens": target.model.embed_tokens, "head": target.lm_head}
