"""DeepSeek-V3.2: DeepSeek-V3's MLA and MoE, with DSA sparse attention chosen by a lightning indexer.

Legend: T tokens, Hd hidden, H heads, Q q_lora_rank, Hi index heads, Di index head dim,
R qk_rope_head_dim (the rotated part of an index head, its first R dims).

Per layer the indexer projects index queries from the q_lora latent (``wq_b``) and one index
key per token from the hidden state (``wk``, a LayerNorm, rope on the first R dims: half-split,
unlike MLA's interleaved rope); a query scores every earlier token as the weighted
(``weights_proj``) sum over index heads of ReLU(q . k) and MLA attends to its ``index_topk``
best only. The index keys are a second region of the latent's pages (``MLAKVPool.index_k``).
Checkpoint names and config fields follow transformers' ``DeepseekV32ForCausalLM``.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.distributed.parallel_state import ParallelState
from pdserve.layers.attention.base import SparseIndex
from pdserve.layers.forward_batch import ForwardBatch
from pdserve.layers.linear import ReplicatedLinear
from pdserve.layers.rotary import Rotation
from pdserve.models.deepseek import DeepseekV3ForCausalLM, MLAAttention


def rotate_half_split(x: torch.Tensor, rotation: Rotation, R: int) -> torch.Tensor:
    """x [T, Hx, D]: the first R dims rotated in (x[i], x[i + R/2]) pairs (the indexer's rope),
    with the frequencies of ``rotation`` (MLA's, whose own layout is interleaved)."""
    x1, x2, rest = x[..., :R // 2], x[..., R // 2:R], x[..., R:]
    cos, sin = rotation.cos, rotation.sin  # [T, 1, R/2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


class Indexer(nn.Module):
    """DeepSeek-V3.2's lightning indexer (transformers' ``DeepseekV32Indexer``), replicated on every rank."""

    def __init__(self, c, dtype: torch.dtype):
        super().__init__()
        self.n_heads, self.head_dim, self.R = c.index_n_heads, c.index_head_dim, c.qk_rope_head_dim
        self.topk = int(c.index_topk)
        if self.topk < 1:
            raise ValueError(f"index_topk: must be >= 1, got {self.topk}")
        if not 0 < self.R <= self.head_dim:
            raise ValueError(f"index_head_dim: must be >= qk_rope_head_dim ({self.R}), got {self.head_dim}")
        self.wq_b = ReplicatedLinear(c.q_lora_rank, self.n_heads * self.head_dim, False, dtype)
        self.wk = ReplicatedLinear(c.hidden_size, self.head_dim, False, dtype)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6, dtype=dtype)
        self.weights_proj = ReplicatedLinear(c.hidden_size, self.n_heads, False, torch.float32)  # fp32, as HF keeps it

    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, rotation: Rotation) -> SparseIndex:
        """x [T, Hd], q_resid [T, Q] (normed q_lora latent)."""
        T = x.shape[0]
        q = rotate_half_split(self.wq_b(q_resid).view(T, self.n_heads, self.head_dim), rotation, self.R)  # [T, Hi, Di]
        k = rotate_half_split(self.k_norm(self.wk(x)).unsqueeze(1), rotation, self.R).squeeze(1)  # [T, Di]
        weights = self.weights_proj(x.float()) * self.n_heads ** -0.5  # [T, Hi]
        return SparseIndex(q, weights, k, self.head_dim ** -0.5, self.topk)


class MLASparseAttention(MLAAttention):
    """MLA whose every query attends only to the tokens its layer's indexer selects."""

    def __init__(self, c, layer_id: int, parallel: ParallelState, dtype: torch.dtype):
        if not c.q_lora_rank:
            raise ValueError("q_lora_rank: DeepSeek-V3.2's indexer reads the q_lora latent; a config without "
                             "one is not supported")
        super().__init__(c, layer_id, parallel, dtype)
        self.indexer = Indexer(c, dtype)

    def forward(self, x: torch.Tensor, rotation: Rotation, fb: ForwardBatch) -> torch.Tensor:
        T, H = x.shape[0], self.num_heads
        q_lat, kv_a = self.fused_qkv_a_proj(x).split([self.q_lora_rank, self.C + self.R], dim=-1)
        q_resid = self.q_a_layernorm(q_lat)  # [T, Q]
        q = self.q_b_proj(q_resid)
        q_nope, q_pe = q.view(T, H, self.Dn + self.R).split([self.Dn, self.R], dim=-1)  # [T, H, Dn], [T, H, R]
        latent, k_pe = kv_a.split([self.C, self.R], dim=-1)  # [T, C], [T, R]
        latent = self.kv_a_layernorm(latent)
        q_pe, k_pe = rotation.pair(q_pe, k_pe.unsqueeze(1))  # [T, H, R], [T, 1, R]
        k_pe = k_pe.squeeze(1)  # [T, R]
        index = self.indexer(x, q_resid, rotation)
        o = fb.attn_backend.forward_mla_sparse(q_nope, q_pe, latent, k_pe, self.w_kc, self.w_vc, self.layer_id,
                                               self.scale, index, fb)  # [T, H, Dv]
        return self.o_proj(o.reshape(T, H * self.Dv))  # [T, Hd]


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    attention_class = MLASparseAttention

    @staticmethod
    def rope_interleaved(c) -> bool:
        return True  # transformers' V3.2 always rotates MLA's rope dims interleaved (rope_interleave unread)
