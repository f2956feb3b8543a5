"""DeepSeek-V4: hybrid compressed attention (models/deepseek_v4_attention.py), mHC hyper-connections
instead of plain residuals, and MoE with sqrtsoftplus scoring whose first layers route by token hash.
Config fields and module names follow transformers' ``DeepseekV4ForCausalLM``; checkpoints carry
DeepSeek's names (``layers.N.attn.wq_a``, ``ffn.experts.E.w1`` …, which transformers also saves), renamed
on load by ``module_key``. The checkpoint's MTP layer (``mtp.0.*``) is loaded only as NEXTN's draft
(models/deepseek_v4_mtp.py).

Legend: T tokens, Hd hidden, n hc_mult (residual streams), E routed experts (El on this EP rank), k experts
per token, I moe_intermediate_size (on this TP rank), V vocab.

Under TP/EP the attention splits its query heads (models/deepseek_v4_attention.py); the MoE splits as
DeepSeek-V3's (layers/moe): without EP every rank holds every expert's I / p slice, with EP (ep_size =
tp_size) each rank holds E / ep experts whole; the shared expert is TP-split either way, and one
all-reduce sums both. Router (hash table included), hyper-connections, norms and the embedding's
replicated work stay whole on every rank, so the n streams are identical everywhere.

Every layer keeps n streams [T, n, Hd]. A hyper-connection computes from them (flattened, normed)
three mixes: ``pre`` [T, n] collapses the streams into the block's input, ``post`` [T, n] spreads the
block's output back over them, and ``comb`` [T, n, n] (made doubly stochastic by Sinkhorn-Knopp)
mixes the incoming streams into the outgoing ones: out = post * block(pre . h) + comb^T h.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.distributed.parallel_state import SINGLE, ParallelState
from pdserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pdserve.layers.forward_batch import ForwardBatch
from pdserve.layers.linear import ColumnParallelLinear, RowParallelLinear
from pdserve.layers.norm import RMSNorm
from pdserve.layers.rotary import RotaryEmbedding, get_rope
from pdserve.layers.weights import WeightEntry, check_shape, copy_into
from pdserve.models.base import CausalLM, load_into
from pdserve.models.deepseek_v4_attention import SLIDING, DeepseekV4Attention, unweighted_rms_norm

SCORING = {
    "sqrtsoftplus": lambda x: F.softplus(x).sqrt(),
    "sigmoid": torch.sigmoid,
    "softmax": lambda x: torch.softmax(x, dim=-1),
}


class HyperConnection(nn.Module):
    """mHC weights from the n streams (transformers' ``DeepseekV4HyperConnection``), float32 throughout."""

    def __init__(self, c):
        super().__init__()
        self.n, self.iters, self.hc_eps, self.eps = c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps
        width = (2 + self.n) * self.n
        self.fn = nn.Parameter(torch.empty(width, self.n * c.hidden_size, dtype=torch.float32), requires_grad=False)
        self.base = nn.Parameter(torch.zeros(width, dtype=torch.float32), requires_grad=False)
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32), requires_grad=False)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [T, n, Hd] -> post [T, n], comb [T, n, n] (float32), collapsed [T, Hd] (h's dtype)."""
        n = self.n
        mixes = F.linear(unweighted_rms_norm(h.flatten(1).float(), self.eps), self.fn)  # [T, (2 + n) n]
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre = torch.sigmoid(pre_w * self.scale[0] + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * self.scale[1] + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * self.scale[2] + comb_b.view(n, n), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):  # Sinkhorn-Knopp: rows, then columns, sum to 1
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * h).sum(dim=1).to(h.dtype)  # [T, Hd]
        return post, comb, collapsed


def hc_merge(h: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """h [T, n, Hd] streams in, out [T, Hd] the block's output -> streams out [T, n, Hd]."""
    return post.to(h.dtype).unsqueeze(-1) * out.unsqueeze(1) + torch.matmul(comb.to(h.dtype).transpose(-1, -2), h)


class HyperHead(nn.Module):
    """The final collapse of the n streams before the last norm (``DeepseekV4HyperHead``)."""

    def __init__(self, c):
        super().__init__()
        self.n, self.hc_eps, self.eps = c.hc_mult, c.hc_eps, c.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.empty(self.n, self.n * c.hidden_size, dtype=torch.float32),
                                  requires_grad=False)
        self.hc_base = nn.Parameter(torch.zeros(self.n, dtype=torch.float32), requires_grad=False)
        self.hc_scale = nn.Parameter(torch.ones(1, dtype=torch.float32), requires_grad=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, n, Hd] -> [T, Hd]."""
        mixes = F.linear(unweighted_rms_norm(h.flatten(1).float(), self.eps), self.hc_fn)  # [T, n]
        pre = torch.sigmoid(mixes * self.hc_scale + self.hc_base) + self.hc_eps
        return (pre.unsqueeze(-1) * h).sum(dim=1).to(h.dtype)


class ClampedMLP(nn.Module):
    """The shared expert: SwiGLU with gate <= limit and |up| <= limit (``swiglu_limit``). Under TP each
    rank holds I / p of it and returns its partial sum (the MoE block reduces)."""

    def __init__(self, hidden: int, inter: int, limit: float, dtype: torch.dtype, parallel: ParallelState = SINGLE):
        super().__init__()
        self.limit = limit
        self.gate_proj = ColumnParallelLinear(hidden, inter, parallel, dtype=dtype)
        self.up_proj = ColumnParallelLinear(hidden, inter, parallel, dtype=dtype)
        self.down_proj = RowParallelLinear(inter, hidden, parallel, dtype=dtype, reduce_results=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class Router(nn.Module):
    """Scores every expert (``scoring_func``); picks k by score + correction bias, or (hash layers)
    by the frozen ``tid2eid[token]`` table. Weights: the picked scores normalised, times
    ``routed_scaling_factor``."""

    tid2eid: torch.Tensor  # [V, k] hash layers
    e_score_correction_bias: torch.Tensor  # [E] float32, top-k layers

    def __init__(self, c, is_hash: bool, dtype: torch.dtype):
        super().__init__()
        if c.scoring_func not in SCORING:
            raise ValueError(f"scoring_func: {c.scoring_func!r} is not one of {tuple(SCORING)}")
        self.score, self.k, self.scaling = SCORING[c.scoring_func], c.num_experts_per_tok, c.routed_scaling_factor
        self.is_hash = is_hash
        E = c.n_routed_experts
        self.weight = nn.Parameter(torch.empty(E, c.hidden_size, dtype=dtype), requires_grad=False)
        if is_hash:
            # The checkpoint's table replaces this; seeded dummy weights keep a spread of experts.
            table = (torch.arange(c.vocab_size)[:, None] * self.k + torch.arange(self.k)[None, :]) % E
            self.register_buffer("tid2eid", table)  # [V, k]
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(E, dtype=torch.float32))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, Hd] -> weights [T, k], experts [T, k]."""
        scores = self.score(F.linear(x, self.weight))  # [T, E]
        if self.is_hash:
            experts = self.tid2eid[input_ids].long()
        else:
            experts = torch.topk(scores + self.e_score_correction_bias, self.k, dim=-1, sorted=False).indices
        w = scores.gather(1, experts)
        return w / (w.sum(dim=-1, keepdim=True) + 1e-20) * self.scaling, experts


class Experts(nn.Module):
    """Routed experts as transformers stores them: ``gate_up_proj`` [El, 2I, Hd], ``down_proj`` [El, Hd, I]
    (rank r of EP holds experts r El .. (r + 1) El whole; without EP, TP rank r holds rows i_start.. of I)."""

    gate_up_proj_scale: torch.Tensor  # held FP4 only (keep_fp4): uint8 [E, 2I, Hd / 32]
    down_proj_scale: torch.Tensor  # held FP4 only: uint8 [E, Hd, I / 32]

    def __init__(self, c, dtype: torch.dtype, parallel: ParallelState = SINGLE):
        super().__init__()
        E, I, Hd = c.n_routed_experts, c.moe_intermediate_size, c.hidden_size
        if E % parallel.ep_size:
            raise ValueError(f"n_routed_experts: {E} is not divisible by ep_size={parallel.ep_size}")
        self.limit, self.num_experts, self.full_i = c.swiglu_limit, E, I
        El = E // parallel.ep_size
        self.expert_start = parallel.ep_rank * El
        i_lo, i_hi = parallel.shard(I) if parallel.ep_size == 1 else (0, I)  # under EP an expert lives whole
        self.i_start, Il = i_lo, i_hi - i_lo
        self.gate_up_proj = nn.Parameter(torch.empty(El, 2 * Il, Hd, dtype=dtype), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(El, Hd, Il, dtype=dtype), requires_grad=False)
        self.is_split = El != E or Il != I

    def weight_entries(self, prefix: str) -> Iterator[WeightEntry]:
        """DeepSeek's per-expert ``{e}.w1`` (gate), ``w3`` (up), ``w2`` (down), as shipped; or the fused
        tensors transformers holds in memory (our dummy weights). Another EP rank's experts are
        accepted and dropped."""
        if self.gate_up_proj.dtype != torch.int8:
            yield from self._split_entries(prefix)
            return
        # held FP4 (keep_fp4, never split): the packed pairs and their ue8m0 scales, copied whole
        E, I = self.gate_up_proj.shape[0], self.gate_up_proj.shape[1] // 2
        pieces = {"w1": lambda e: self.gate_up_proj[e, :I], "w3": lambda e: self.gate_up_proj[e, I:],
                  "w2": lambda e: self.down_proj[e]}
        scales = {"w1": lambda e: self.gate_up_proj_scale[e, :I], "w3": lambda e: self.gate_up_proj_scale[e, I:],
                  "w2": lambda e: self.down_proj_scale[e]}
        for suffix, dsts in (("weight", pieces), ("weight_scale_inv", scales)):
            for e in range(E):
                for name, dst in dsts.items():
                    key = f"{prefix}.{e}.{name}.{suffix}"
                    yield WeightEntry(key, partial(copy_into, key, dst(e)), (key,))

    def _split_entries(self, prefix: str) -> Iterator[WeightEntry]:
        El = self.gate_up_proj.shape[0]
        mine = range(self.expert_start, self.expert_start + El)
        for e in range(self.num_experts):
            for name in ("w1", "w3", "w2"):
                key = f"{prefix}.{e}.{name}.weight"
                yield WeightEntry(key, partial(self._load_one, key, e, name), (key,) if e in mine else ())
        for fused, names in (("gate_up_proj", ("w1", "w3")), ("down_proj", ("w2",))):
            key = f"{prefix}.{fused}"
            units = tuple(f"{prefix}.{e}.{n}.weight" for e in mine for n in names)
            yield WeightEntry(key, partial(self._load_fused, key, names), units, canonical=False)

    def _load_one(self, key: str, expert: int, name: str, src: torch.Tensor) -> None:
        """One expert's w1/w3 [I, Hd] or w2 [Hd, I], whole: this rank's slice of I, if the expert is its."""
        e, Il, i0 = expert - self.expert_start, self.down_proj.shape[-1], self.i_start
        if not 0 <= e < self.gate_up_proj.shape[0]:
            return  # another EP rank's expert
        Hd = self.down_proj.shape[1]
        if name == "w2":
            check_shape(key, src, (Hd, self.full_i))
            copy_into(key, self.down_proj.data[e], src[:, i0:i0 + Il])
        else:
            check_shape(key, src, (self.full_i, Hd))
            row = 0 if name == "w1" else Il
            copy_into(key, self.gate_up_proj.data[e, row:row + Il], src[i0:i0 + Il])

    def _load_fused(self, key: str, names: tuple[str, ...], src: torch.Tensor) -> None:
        """transformers' fused ``gate_up_proj`` [E, 2I, Hd] (gate rows, then up) or ``down_proj`` [E, Hd, I]."""
        E, I, Hd = self.num_experts, self.full_i, self.down_proj.shape[1]
        check_shape(key, src, (E, 2 * I, Hd) if len(names) == 2 else (E, Hd, I))
        for e in range(E):
            for j, name in enumerate(names):
                self._load_one(key, e, name, src[e, j * I:(j + 1) * I] if len(names) == 2 else src[e])

    def keep_fp4(self, prefix: str) -> set[str]:
        """Hold the experts as an FP4 checkpoint ships them (GPU: layers/quant/fp4.fused_moe_fp4 runs them);
        returns the (module-named) checkpoint keys to load as packed pairs. Split experts (TP, EP) are
        not held: fused_moe_fp4 takes every expert whole, so they load dequantized."""
        from pdserve.layers.quant.fp4 import hold_fp4

        if self.is_split:
            return set()
        hold_fp4(self, "gate_up_proj")
        hold_fp4(self, "down_proj")
        return {f"{prefix}.{e}.{n}.weight" for e in range(self.gate_up_proj.shape[0]) for n in ("w1", "w2", "w3")}

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x [T, Hd], weights/experts [T, k] -> [T, Hd], one expert at a time over its tokens."""
        if self.gate_up_proj.dtype == torch.int8:
            from pdserve.layers.quant.fp4 import fused_moe_fp4

            return fused_moe_fp4(x, self.gate_up_proj, self.gate_up_proj_scale, self.down_proj, self.down_proj_scale,
                                 weights.float(), experts, self.limit)
        out = torch.zeros_like(x)
        El = self.gate_up_proj.shape[0]
        for e in experts.unique().tolist():
            if not 0 <= e - self.expert_start < El:
                continue  # another EP rank's expert
            tok, slot = (experts == e).nonzero(as_tuple=True)
            gate, up = F.linear(x[tok], self.gate_up_proj[e - self.expert_start]).chunk(2, dim=-1)
            y = F.linear(clamped_swiglu(gate, up, self.limit), self.down_proj[e - self.expert_start]) \
                * weights[tok, slot, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out


class SparseMoE(nn.Module):
    """Input x [T, Hd], the same on every rank; each rank's routed experts (its slice of I, or its EP
    experts) and shared-expert slice give partial sums, reduced by one all-reduce (two when the EP
    group is not the TP group)."""

    def __init__(self, c, layer_id: int, dtype: torch.dtype, kind: str | None = None, parallel: ParallelState = SINGLE):
        super().__init__()
        self.parallel = parallel
        self.gate = Router(c, (kind or c.mlp_layer_types[layer_id]) == "hash_moe", dtype)
        self.experts = Experts(c, dtype, parallel)
        self.shared_experts = ClampedMLP(c.hidden_size, c.moe_intermediate_size, c.swiglu_limit, dtype, parallel)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        weights, experts = self.gate(x, input_ids)
        routed, shared = self.experts(x, weights, experts), self.shared_experts(x)  # [T, Hd] partial sums each
        par = self.parallel
        if par.ep_size == 1:
            return par.tp_all_reduce(routed + shared)
        if par.ep_is_tp:
            return par.ep_all_reduce(routed + shared)
        return par.ep_all_reduce(routed) + par.tp_all_reduce(shared)


class DeepseekV4DecoderLayer(nn.Module):
    def __init__(self, c, layer_id: int, ropes: nn.ModuleDict, dtype: torch.dtype,
                 kinds: tuple[str, str] | None = None, parallel: ParallelState = SINGLE):
        """``kinds``: (attention kind, MLP kind) of a layer outside ``layer_types`` (the MTP layer)."""
        super().__init__()
        attn_kind, mlp_kind = kinds or (c.layer_types[layer_id], c.mlp_layer_types[layer_id])
        rope = ropes["main" if attn_kind == SLIDING else "compress"]
        assert isinstance(rope, RotaryEmbedding)
        self.self_attn = DeepseekV4Attention(c, layer_id, rope, dtype, attn_kind, parallel.attention)
        self.mlp = SparseMoE(c, layer_id, dtype, mlp_kind, parallel)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.attn_hc = HyperConnection(c)
        self.ffn_hc = HyperConnection(c)

    def forward(self, h: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """h [T, n, Hd] -> [T, n, Hd]."""
        post, comb, x = self.attn_hc(h)
        h = hc_merge(h, self.self_attn(self.input_layernorm(x), fb), post, comb)
        post, comb, x = self.ffn_hc(h)
        return hc_merge(h, self.mlp(self.post_attention_layernorm(x), fb.input_ids), post, comb)


class DeepseekV4Model(nn.Module):
    def __init__(self, c, parallel: ParallelState, dtype: torch.dtype):
        super().__init__()
        self.n = c.hc_mult
        R = int(c.qk_rope_head_dim)
        table = min(int(c.max_position_embeddings), 4096)  # grown on demand (ensure_capacity)
        self.ropes = nn.ModuleDict({name: get_rope(R, table, c.rope_parameters[name], interleaved=True, dtype=dtype)
                                    for name in ("main", "compress")})
        self.embed_tokens = VocabParallelEmbedding(c.vocab_size, c.hidden_size, parallel.attention, dtype)
        self.layers = nn.ModuleList(DeepseekV4DecoderLayer(c, i, self.ropes, dtype, parallel=parallel)
                                    for i in range(c.num_hidden_layers))
        self.hc_head = HyperHead(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)

    def forward(self, fb: ForwardBatch, streams: bool = False) -> torch.Tensor:
        """-> [T, Hd] final-normed; with ``streams`` the last layer's n streams flattened [T, n Hd]."""
        if fb.num_tokens == 0:
            width = self.embed_tokens.weight.shape[-1] * (self.n if streams else 1)
            return self.embed_tokens.weight.new_zeros(0, width)
        for rope in self.ropes.values():
            assert isinstance(rope, RotaryEmbedding)
            rope.ensure_capacity(int(fb.positions.max()) + 1)
        x = self.embed_tokens(fb.input_ids)  # [T, Hd]
        h = x.unsqueeze(1).expand(-1, self.n, -1).contiguous()  # [T, n, Hd]
        for layer in self.layers:
            h = layer(h, fb)
        return h.flatten(1) if streams else self.norm(self.hc_head(h))  # [T, n Hd] or [T, Hd]

    def collapse(self, streams: torch.Tensor) -> torch.Tensor:
        """[N, n Hd] -> [N, Hd] final-normed, what forward returns without ``streams``."""
        return self.norm(self.hc_head(streams.view(streams.shape[0], self.n, -1)))


class DeepseekV4ForCausalLM(CausalLM):
    def __init__(self, hf_config, parallel: ParallelState, dtype: torch.dtype):
        super().__init__()
        self.config = c = hf_config
        check_config(c)
        self.model = DeepseekV4Model(c, parallel, dtype)  # type: ignore[assignment]
        tie = self.model.embed_tokens if getattr(c, "tie_word_embeddings", False) else None
        self.lm_head = ParallelLMHead(c.vocab_size, c.hidden_size, parallel.attention, dtype, tie_to=tie)
        # With NEXTN the MTP layer reads the target's n streams, not their collapse: forward then
        # hands them over flattened [T, n Hd] and compute_logits collapses them (models/deepseek_v4_mtp.py).
        self.hidden_streams = False

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        return self.model(fb, streams=self.hidden_streams)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        model = self.model
        assert isinstance(model, DeepseekV4Model)
        return self.lm_head(model.collapse(hidden) if self.hidden_streams else hidden)

    @property
    def hidden_width(self) -> int:
        """n Hd while a draft reads the streams (so a P/D aux row carries every stream), else Hd."""
        c = self.config
        return int(c.hidden_size) * (int(c.hc_mult) if self.hidden_streams else 1)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_into(self, ((module_key(name), tensor) for name, tensor in weights))
        self.process_weights_after_loading()


# DeepSeek's names as shipped (and as transformers saves them) -> the module names transformers and
# this model use, in order; a name already in module form passes through unchanged.
_RENAMES = [(re.compile(a), b) for a, b in (
    (r"^embed\.", "model.embed_tokens."), (r"^head\.", "lm_head."), (r"^model\.head\.", "lm_head."),
    (r"^(norm\.|layers\.)", r"model.\1"), (r"^hc_head_(fn|base|scale)$", r"model.hc_head.hc_\1"),
    (r"\.embed\.weight$", ".embed_tokens.weight"), (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."),
    (r"\.attn_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"), (r"\.attn_sink$", ".sinks"),
    (r"\.self_attn\.indexer\.compressor\.", ".self_attn.compressor.indexer."),
    (r"\.self_attn\.indexer\.weights_proj\.", ".self_attn.compressor.indexer.scorer.weights_proj."),
    (r"\.self_attn\.indexer\.wq_b\.", ".self_attn.compressor.indexer.q_b_proj."),
    (r"\.(self_attn|compressor|indexer)\.norm\.", r".\1.kv_norm."), (r"\.ape$", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."), (r"\.wq_b\.", ".q_b_proj."), (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."), (r"\.wo_a\.", ".o_a_proj."), (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."), (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
)]


def module_key(name: str) -> str:
    """A checkpoint tensor's name in this model's (transformers') module naming."""
    if name.startswith("mtp."):
        return name  # the MTP layer: accepted, not loaded
    for pattern, repl in _RENAMES:
        name = pattern.sub(repl, name)
    return name


def check_config(c) -> None:
    """The fields this implementation reads, checked so a config it would misread is refused by name."""
    kinds = list(c.layer_types)
    for kind in set(kinds) - {SLIDING}:
        if int(c.compress_rates.get(kind, 0)) < 1:
            raise ValueError(f"compress_rates.{kind}: must be >= 1, got {c.compress_rates.get(kind)}")
    R = int(c.qk_rope_head_dim)
    if not 0 < R <= c.head_dim or R % 2:
        raise ValueError(f"partial_rotary_factor: gives {R} rope dims of head_dim {c.head_dim} (need even, 1..D)")
    if "compressed_sparse_attention" in kinds and R > c.index_head_dim:
        raise ValueError(f"index_head_dim: must be >= the rope dims ({R}), got {c.index_head_dim}")
    if not c.q_lora_rank:
        raise ValueError("q_lora_rank: DeepSeek-V4's queries go through q_lora; a config without one is not supported")
    if c.sliding_window < 1:
        raise ValueError(f"sliding_window: must be >= 1, got {c.sliding_window}")
