"""DeepSeek-V2 / V3: multi-head latent attention (MLA) + MoE with shared experts.

Legend: T tokens, Hd hidden, H heads on this TP rank, Q q_lora_rank, C kv_lora_rank,
Dn qk_nope_head_dim, R qk_rope_head_dim, Dv v_head_dim.

MLA caches one C+R row per token instead of per-head K and V. The K/V up-projection
``kv_b_proj`` [H (Dn + Dv), C] is split once after loading into w_kc [H, Dn, C] and
w_vc [H, C, Dv], which the attention backend either absorbs into q and o (decode)
or uses to expand the latent (extend).
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.distributed.parallel_state import ParallelState
from pdserve.layers.embedding import VocabParallelEmbedding
from pdserve.layers.forward_batch import ForwardBatch
from pdserve.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from pdserve.layers.mlp import GatedMLP
from pdserve.layers.moe import RoutingConfig, SparseMoE
from pdserve.layers.norm import RMSNorm
from pdserve.layers.rotary import Rotation, get_rope, rope_parameters_of, softmax_scale_correction
from pdserve.models.base import CausalLM
from pdserve.models.decoder import DecoderLayer, DecoderStack, build_lm_head


class MLAAttention(nn.Module):
    def __init__(self, c, layer_id: int, parallel: ParallelState, dtype: torch.dtype):
        super().__init__()
        self.layer_id = layer_id
        lo, hi = parallel.shard(c.num_attention_heads)
        self.num_heads = hi - lo
        self.Dn, self.R, self.Dv, self.C = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
        self.q_lora_rank = c.q_lora_rank
        H_all, bias = c.num_attention_heads, bool(getattr(c, "attention_bias", False))
        q_out = H_all * (self.Dn + self.R)
        if self.q_lora_rank:
            # q_a and kv_a both read the hidden state: one replicated matmul for the two.
            self.fused_qkv_a_proj = ReplicatedLinear(c.hidden_size, [self.q_lora_rank, self.C + self.R], bias,
                                                     dtype, ckpt_names=("q_a_proj", "kv_a_proj_with_mqa"))
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, c.rms_norm_eps, dtype)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, q_out, parallel, dtype=dtype)
        else:
            self.q_proj = ColumnParallelLinear(c.hidden_size, q_out, parallel, dtype=dtype)
            self.kv_a_proj_with_mqa = ReplicatedLinear(c.hidden_size, self.C + self.R, bias, dtype)
        self.kv_a_layernorm = RMSNorm(self.C, c.rms_norm_eps, dtype)
        self.kv_b_proj = ColumnParallelLinear(self.C, H_all * (self.Dn + self.Dv), parallel, dtype=dtype)
        self.kv_b_proj.allow_fp8 = False  # split into w_kc/w_vc after loading: loaded dequantized
        self.o_proj = RowParallelLinear(H_all * self.Dv, c.hidden_size, parallel, bias=bias, dtype=dtype)
        self.scale = (self.Dn + self.R) ** -0.5 * softmax_scale_correction(rope_parameters_of(c))
        self.register_buffer("w_kc", torch.empty(self.num_heads, self.Dn, self.C, dtype=dtype), persistent=False)
        self.register_buffer("w_vc", torch.empty(self.num_heads, self.C, self.Dv, dtype=dtype), persistent=False)

    def process_weights_after_loading(self) -> None:
        w = self.kv_b_proj.weight.view(self.num_heads, self.Dn + self.Dv, self.C)  # [H, Dn + Dv, C]
        self.w_kc = w[:, :self.Dn].contiguous()  # [H, Dn, C]
        self.w_vc = w[:, self.Dn:].transpose(1, 2).contiguous()  # [H, C, Dv]

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, Hd] -> q [T, H (Dn + R)], kv_a [T, C + R]."""
        if not self.q_lora_rank:
            return self.q_proj(x), self.kv_a_proj_with_mqa(x)
        q_lat, kv_a = self.fused_qkv_a_proj(x).split([self.q_lora_rank, self.C + self.R], dim=-1)
        return self.q_b_proj(self.q_a_layernorm(q_lat)), kv_a

    def forward(self, x: torch.Tensor, rotation: Rotation, fb: ForwardBatch) -> torch.Tensor:
        T, H = x.shape[0], self.num_heads
        q, kv_a = self._project(x)
        q_nope, q_pe = q.view(T, H, self.Dn + self.R).split([self.Dn, self.R], dim=-1)  # [T, H, Dn], [T, H, R]
        latent, k_pe = kv_a.split([self.C, self.R], dim=-1)  # [T, C], [T, R]
        latent = self.kv_a_layernorm(latent)
        q_pe, k_pe = rotation.pair(q_pe, k_pe.unsqueeze(1))  # [T, H, R], [T, 1, R]
        k_pe = k_pe.squeeze(1)  # [T, R]
        o = fb.attn_backend.forward_mla(q_nope, q_pe, latent, k_pe, self.w_kc, self.w_vc, self.layer_id,
                                        self.scale, fb)  # [T, H, Dv]
        return self.o_proj(o.reshape(T, H * self.Dv))  # [T, Hd]


def deepseek_layer_is_sparse(c, layer_id: int) -> bool:
    """MoE from layer first_k_dense_replace on, every moe_layer_freq-th layer (DeepSeek's rule)."""
    freq = getattr(c, "moe_layer_freq", 1) or 1
    return bool(c.n_routed_experts) and layer_id >= c.first_k_dense_replace and layer_id % freq == 0


class DeepseekV2ForCausalLM(CausalLM):
    attention_class: type[MLAAttention] = MLAAttention

    def __init__(self, hf_config, parallel: ParallelState, dtype: torch.dtype):
        super().__init__()
        self.config = c = hf_config
        params = rope_parameters_of(c)
        rope = get_rope(c.qk_rope_head_dim, c.max_position_embeddings, params,
                        interleaved=self.rope_interleaved(c), dtype=dtype)
        layers = [DecoderLayer(self.attention_class(c, i, parallel.attention, dtype), self.make_mlp(i, parallel, dtype),
                               c.hidden_size, c.rms_norm_eps, dtype, parallel) for i in range(c.num_hidden_layers)]
        embed = VocabParallelEmbedding(c.vocab_size, c.hidden_size, parallel.attention, dtype)
        self.model = DecoderStack(embed, layers, RMSNorm(c.hidden_size, c.rms_norm_eps, dtype), rope)
        self.lm_head = build_lm_head(c, parallel, dtype, self.model)

    @staticmethod
    def rope_interleaved(c) -> bool:
        return True  # V2 rotates adjacent pairs (its checkpoints' q_pe/k_pe layout)

    @staticmethod
    def routing(c) -> RoutingConfig:
        return RoutingConfig.deepseek_v2(c)

    def make_mlp(self, layer_id: int, parallel: ParallelState, dtype: torch.dtype) -> nn.Module:
        c = self.config
        if not deepseek_layer_is_sparse(c, layer_id):
            return GatedMLP(c.hidden_size, c.intermediate_size, parallel, dtype, c.hidden_act)
        shared = c.moe_intermediate_size * (c.n_shared_experts or 0)
        return SparseMoE(c.hidden_size, c.moe_intermediate_size, self.routing(c), parallel, dtype,
                         shared_intermediate=shared, hidden_act=c.hidden_act)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    @staticmethod
    def rope_interleaved(c) -> bool:
        return bool(getattr(c, "rope_interleave", True))

    @staticmethod
    def routing(c) -> RoutingConfig:
        return RoutingConfig.deepseek_v3(c)
