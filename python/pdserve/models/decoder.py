"""Decoder pieces the model families share: the pre-norm decoder layer and stack, the LM head
builder, and the GQA attention block with the causal LM built on it (Llama, Qwen2/3, Qwen3-MoE).

Each family's file only states how it differs (biases, q/k norm, which layers are MoE).
Legend: T tokens, H hidden, Hq / Hkv query / kv heads on this TP rank, D head dim.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.distributed.parallel_state import ParallelState
from pdserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pdserve.layers.forward_batch import ForwardBatch
from pdserve.layers.linear import QKVParallelLinear, RowParallelLinear
from pdserve.layers.mlp import GatedMLP
from pdserve.layers.norm import RMSNorm
from pdserve.layers.rotary import Rotation, get_rope, rope_parameters_of
from pdserve.models.base import CausalLM
from pdserve.models.fused_decode import FusedDecode


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.)); the residual add is fused into
    the following norm.

    With DP attention (``parallel.dp_attention``) the attention groups hold different tokens
    and the MLP spans them all: it runs on every group's tokens gathered (Ta rows) and each
    group keeps its own rows. Every group takes part in every layer, even one with no tokens
    (``idle``), so the collectives line up.
    """

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, hidden: int, eps: float, dtype: torch.dtype,
                 parallel: ParallelState | None = None):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden, eps, dtype)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype)
        self.dp = parallel if parallel is not None and parallel.dp_attention else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rotation: Rotation, fb: ForwardBatch):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rotation, fb)
        x, residual = self.post_attention_layernorm(x, residual)
        return self._mlp(x, fb), residual

    def idle(self, x: torch.Tensor, fb: ForwardBatch) -> None:
        """No tokens in this attention group (x [0, H]): take part in the MLP's gather only."""
        if self.dp is not None:
            self._mlp(x, fb)

    def _mlp(self, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        if self.dp is None:
            return self.mlp(x)  # [T, H]
        counts = fb.dp_num_tokens
        if counts is None:
            raise RuntimeError("DP attention: the forward batch carries no per-group token counts")
        return self.dp.dp_slice(self.mlp(self.dp.dp_gather(x, counts)), counts)  # [T, H] of [Ta, H]


class DecoderStack(nn.Module):
    """embed_tokens -> layers -> norm, with the pre-norm residual stream threaded through.

    Each layer is called as ``layer(hidden, residual, rotation, fb) -> (hidden, residual)``;
    the rotation for ``fb.positions`` is gathered once here instead of once per layer.
    """

    def __init__(self, embed_tokens: VocabParallelEmbedding, layers: list[DecoderLayer], norm: nn.Module, rope):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.rotary_emb = rope
        self.fused_decode: FusedDecode | None = None  # set by pack_cpu: decode steps' layers in one C call

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        if fb.num_tokens == 0:
            return self._idle(fb)
        # Growing the table reads the positions on the host, which a CUDA graph capture cannot;
        # the graph runner grows it to the context length before capturing.
        if not (fb.positions.is_cuda and torch.cuda.is_current_stream_capturing()):
            self.rotary_emb.ensure_capacity(int(fb.positions.max()) + 1)
        rotation = self.rotary_emb.rotation(fb.positions)
        return self.layers_forward(self.embed_tokens(fb.input_ids), rotation, fb)  # [T, H]

    def layers_forward(self, hidden: torch.Tensor, rotation: Rotation, fb: ForwardBatch) -> torch.Tensor:
        """The embedded tokens [T, H] through every layer and the final norm -> [T, H]; what
        ``--enable-torch-compile`` compiles whole (engine/torch_compile.py)."""
        residual = None
        fused = None if torch.compiler.is_compiling() else self.fused_decode  # compiled: the layers, traced
        out = fused.forward(hidden, rotation, fb) if fused is not None else None
        if out is not None:
            hidden, residual = out  # [T, H] each, after the last layer
        else:
            for layer in self.layers:
                hidden, residual = layer(hidden, residual, rotation, fb)
        hidden, _ = self.norm(hidden, residual)
        return hidden  # [T, H]

    def pack_cpu(self, policy) -> bool:
        """The runner packed the CPU linears (layers/cpu_gemm.py: not ``--cpu-gemm plain``): decode steps
        may then run every layer in one plain-C call (models/fused_decode.py). Packs no linear itself."""
        self.fused_decode = FusedDecode(self)
        return False

    def _idle(self, fb: ForwardBatch) -> torch.Tensor:
        """An empty step: nothing to embed or attend to, but layers that span attention groups
        still take part (DecoderLayer.idle). Returns [0, H]."""
        w = self.embed_tokens.weight
        hidden = w.new_zeros(0, w.shape[-1])
        for layer in self.layers:
            if not isinstance(layer, DecoderLayer):  # ModuleList iterates as nn.Module
                raise TypeError(f"DecoderStack holds a {type(layer).__name__}, not a DecoderLayer")
            layer.idle(hidden, fb)
        return hidden


def build_lm_head(c, parallel: ParallelState, dtype: torch.dtype, stack: DecoderStack) -> ParallelLMHead:
    """The LM head splits like attention (each attention group scores its own tokens)."""
    tie = stack.embed_tokens if getattr(c, "tie_word_embeddings", False) else None
    return ParallelLMHead(c.vocab_size, c.hidden_size, parallel.attention, dtype, tie_to=tie)


def head_dim_of(c) -> int:
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def reject_sliding_window(c) -> None:
    """pdserve attends over the full prefix; a sliding-window layer would silently differ."""
    if "sliding_attention" in (getattr(c, "layer_types", None) or []) or getattr(c, "use_sliding_window", False):
        raise ValueError("use_sliding_window: sliding-window attention is not supported")


class GQAAttention(nn.Module):
    """qkv projection -> [per-head q/k norm] -> RoPE -> paged attention -> o projection."""

    def __init__(self, c, layer_id: int, parallel: ParallelState, dtype: torch.dtype,
                 qkv_bias: bool, o_bias: bool, qk_norm: bool):
        super().__init__()
        self.layer_id = layer_id
        D = head_dim_of(c)
        self.qkv_proj = QKVParallelLinear(c.hidden_size, D, c.num_attention_heads, c.num_key_value_heads,
                                          parallel, bias=qkv_bias, dtype=dtype)
        self.num_heads, self.num_kv_heads, self.head_dim = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, D
        self.o_proj = RowParallelLinear(c.num_attention_heads * D, c.hidden_size, parallel, bias=o_bias, dtype=dtype)
        self.q_norm = RMSNorm(D, c.rms_norm_eps, dtype) if qk_norm else None
        self.k_norm = RMSNorm(D, c.rms_norm_eps, dtype) if qk_norm else None
        self.scale = D ** -0.5

    def forward(self, x: torch.Tensor, rotation: Rotation, fb: ForwardBatch) -> torch.Tensor:
        T, Hq, Hkv, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hkv) D]
        v = qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D)
        if self.q_norm is None or self.k_norm is None:  # set together (qk_norm)
            # q and k side by side in one tensor: one rotation call for both.
            qk = rotation(qkv[:, :(Hq + Hkv) * D].view(T, Hq + Hkv, D))  # [T, Hq + Hkv, D]
            q, k = qk[:, :Hq], qk[:, Hq:]
        else:
            q = rotation(self.q_norm(qkv[:, :Hq * D].view(T, Hq, D)))  # [T, Hq, D]
            k = rotation(self.k_norm(qkv[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D)))  # [T, Hkv, D]
        o = fb.attn_backend.forward_gqa(q, k, v, self.layer_id, self.scale, fb)  # [T, Hq, D]
        return self.o_proj(o.reshape(T, Hq * D))  # [T, H]


def build_gqa_stack(c, parallel: ParallelState, dtype: torch.dtype, make_layer) -> DecoderStack:
    """``make_layer(layer_id) -> DecoderLayer``; rope and embeddings come from the config.
    The embedding splits like attention."""
    reject_sliding_window(c)
    params = rope_parameters_of(c)
    D = head_dim_of(c)
    rotary_dim = int(D * params.get("partial_rotary_factor", 1.0))
    rope = get_rope(rotary_dim, c.max_position_embeddings, params, interleaved=False, dtype=dtype)
    embed = VocabParallelEmbedding(c.vocab_size, c.hidden_size, parallel.attention, dtype)
    layers = [make_layer(i) for i in range(c.num_hidden_layers)]
    return DecoderStack(embed, layers, RMSNorm(c.hidden_size, c.rms_norm_eps, dtype), rope)


class GQACausalLM(CausalLM):
    """A GQA decoder LM (Llama's shape). Families override the hooks below, nothing else:
    ``qk_norm`` (per-head q/k RMSNorm), ``qkv_bias`` / ``o_bias``, and ``make_mlp``."""

    qk_norm = False

    def __init__(self, hf_config, parallel: ParallelState, dtype: torch.dtype):
        super().__init__()
        self.config = c = hf_config
        if getattr(c, "mlp_bias", False):
            raise ValueError("mlp_bias: biased MLP projections are not supported")
        self.model = build_gqa_stack(c, parallel, dtype, lambda i: DecoderLayer(
            self.make_attention(i, parallel.attention, dtype), self.make_mlp(i, parallel, dtype),
            c.hidden_size, c.rms_norm_eps, dtype, parallel))
        self.lm_head = build_lm_head(c, parallel, dtype, self.model)

    def make_attention(self, layer_id: int, parallel: ParallelState, dtype: torch.dtype) -> nn.Module:
        c = self.config
        return GQAAttention(c, layer_id, parallel, dtype, qkv_bias=self.qkv_bias(c), o_bias=self.o_bias(c),
                            qk_norm=self.qk_norm)

    @staticmethod
    def qkv_bias(c) -> bool:
        return bool(getattr(c, "attention_bias", False))

    @staticmethod
    def o_bias(c) -> bool:
        return bool(getattr(c, "attention_bias", False))

    def make_mlp(self, layer_id: int, parallel: ParallelState, dtype: torch.dtype) -> nn.Module:
        c = self.config
        return GatedMLP(c.hidden_size, c.intermediate_size, parallel, dtype, c.hidden_act)
