"""DeepSeek-V4 attention over pdserve's paged memory: one shared K=V head (MQA) in a sliding window,
plus, on compressed layers, entries pooled from the source tokens by a gated compressor (CSA: every
m tokens over two overlapping series, a lightning indexer picking each query's top-k entries; HCA:
every m' tokens, all attended). Checkpoint names as transformers' ``DeepseekV4Attention``.

Legend: T tokens, Hd hidden, H heads (on this TP rank), D head_dim, R rope dims (the trailing R of a row),
Q q_lora_rank, m compression rate, W sliding window, Hi/Di index heads/head dim, E compressed entries, K keys read,
G o_groups (on this TP rank), Ro o_lora_rank, n series (2 for CSA's overlap, 1 for HCA).

Tensor parallelism splits the query heads (``q_b_proj`` column-parallel, the sinks) and with them
the output groups: group g projects heads g H/G .. (g + 1) H/G, so a rank holding whole groups holds
exactly its heads' ``o_a_proj`` blocks and the matching ``o_b_proj`` input columns (row-parallel, one
all-reduce). The single K=V head, q_a, the compressors and the indexer stay replicated: every rank
writes the same state, like MLA's latent, so P/D moves it from any one rank.

State (docs/kv-cache.md, "What is built for DeepSeek-V4") in a RegionKVPool: ``window_kv`` the raw
K=V rows; ``{csa,hca}_src`` the compressor's projected source rows and gates; ``{csa,hca}_kv``
compressed entry w, kept with the window's last token (position (w + 1) m - 1) when that token is
computed, one row per m tokens of the pages; for CSA ``csa_index_src`` and ``csa_index_k`` the
indexer's. The rows before a step (the window's, the open windows' sources and CSA's overlap
slice: the reference's open-window record) come from the pool's ``request_state``: every token's
slot in the page layout, the request's record ring (or a reusable boundary's tails) in the bounded
one. A step joins them to its own rows, pools the windows it closes, then keeps its rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import torch
from torch import nn

from pdserve.distributed.parallel_state import SINGLE, ParallelState
from pdserve.layers.forward_batch import ForwardBatch
from pdserve.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from pdserve.layers.norm import RMSNorm
from pdserve.layers.rotary import RotaryEmbedding
from pdserve.layers.weights import WeightEntry, check_shape, copy_into
from pdserve.mem.region_pool import RegionKVPool, RequestState

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) with the statistics in float32, in x's dtype (transformers' UnweightedRMSNorm)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def rotate_tail(x: torch.Tensor, rope: RotaryEmbedding, positions: torch.Tensor, inverse: bool = False
                ) -> torch.Tensor:
    """x [T, ..., X]: its trailing R dims rotated in interleaved pairs at ``positions`` [T]
    (``inverse``: by minus the angle, which undoes the rotation V carries as a key)."""
    R = rope.rotary_dim
    cos, sin = rope.lookup(positions)  # [T, 1, R/2]
    if x.dim() == 2:
        cos, sin = cos[:, 0], sin[:, 0]
    if inverse:
        sin = -sin
    # Pairs stay where they are (RotaryEmbedding.rotate de-interleaves them, harmless for q . k only):
    # V4's values are its keys, so the output's rope dims must come back in place to be rotated back.
    x1, x2 = x[..., -R::2], x[..., -R + 1::2]  # [..., R/2] each
    rotated = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    return torch.cat([x[..., :-R], rotated], dim=-1)


class Compressor(nn.Module):
    """Gated pooling of every ``rate`` source tokens into one entry of width X (HCA: n = 1; CSA and its
    indexer: n = 2, entry w pooling window w-1's first series with window w's second)."""

    def __init__(self, hidden: int, width: int, rate: int, overlap: bool, eps: float, dtype: torch.dtype):
        super().__init__()
        self.width, self.rate, self.n = width, rate, 2 if overlap else 1
        self.kv_proj = ReplicatedLinear(hidden, self.n * width, False, dtype)
        self.gate_proj = ReplicatedLinear(hidden, self.n * width, False, dtype)
        self.position_bias = nn.Parameter(torch.zeros(rate, self.n * width, dtype=torch.float32),
                                          requires_grad=False)
        self.kv_norm = RMSNorm(width, eps, torch.float32)

    def sources(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, Hd] -> [T, 2 n X]: each token's projected rows then gates, as the pool keeps them."""
        return torch.cat([self.kv_proj(x), self.gate_proj(x)], dim=-1)

    def pool(self, src: torch.Tensor, prev: torch.Tensor, has_prev: torch.Tensor) -> torch.Tensor:
        """src [E, m, 2 n X] of each closing window, prev [E, m, 2 n X] of the window before it (read only
        where ``has_prev`` [E]) -> entries [E, X] (normed, not yet rotated)."""
        X, nX = self.width, self.n * self.width
        kv, gate = src[..., :nX], src[..., nX:] + self.position_bias  # [E, m, nX], gate float32
        if self.n == 2:
            pkv, pgate = prev[..., :X], prev[..., nX:nX + X] + self.position_bias[:, :X]  # [E, m, X]
            pgate = pgate.masked_fill(~has_prev[:, None, None], float("-inf"))
            pkv = pkv.masked_fill(~has_prev[:, None, None], 0.0)
            kv = torch.cat([pkv, kv[..., X:]], dim=1)  # [E, 2m, X]
            gate = torch.cat([pgate, gate[..., X:]], dim=1)
        pooled = (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)  # [E, X]
        return self.kv_norm(pooled.float()).to(kv.dtype)


class IndexScorer(nn.Module):
    """Per-token weights of the index heads (transformers' ``DeepseekV4IndexerScorer`` holds them)."""

    def __init__(self, hidden: int, n_heads: int, dtype: torch.dtype):
        super().__init__()
        self.weights_proj = ReplicatedLinear(hidden, n_heads, False, dtype)


class Indexer(Compressor):
    """CSA's lightning indexer: its own compressor at Di, and per query the weighted sum over index
    heads of ReLU(q . k) against every closed entry (transformers' ``DeepseekV4Indexer``)."""

    def __init__(self, c, rate: int, dtype: torch.dtype):
        super().__init__(c.hidden_size, c.index_head_dim, rate, True, c.rms_norm_eps, dtype)
        self.n_heads, self.topk = c.index_n_heads, int(c.index_topk)
        if self.topk < 1:
            raise ValueError(f"index_topk: must be >= 1, got {self.topk}")
        self.q_b_proj = ReplicatedLinear(c.q_lora_rank, self.n_heads * c.index_head_dim, False, dtype)
        self.scorer = IndexScorer(c.hidden_size, self.n_heads, dtype)

    def queries(self, x: torch.Tensor, q_resid: torch.Tensor, rope: RotaryEmbedding, positions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> q [T, Hi, Di] (rotated), weights [T, Hi] float32."""
        q = rotate_tail(self.q_b_proj(q_resid).view(x.shape[0], self.n_heads, self.width), rope, positions)
        return q, self.scorer.weights_proj(x).float() * self.n_heads ** -0.5

    def select(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """q [Tq, Hi, Di], w [Tq, Hi], keys [E, Di], visible [Tq, E] -> chosen [Tq, E]: the top ``index_topk``
        visible entries of each query (every visible one when it sees fewer)."""
        s = torch.einsum("qhd,ed->qhe", q.float(), keys.float()).relu_()  # [Tq, Hi, E]
        # the scale folded into the [Tq, Hi] weights: one pass less over the [Tq, Hi, E] scores
        score = torch.einsum("qh,qhe->qe", w * self.width ** -0.5, s).masked_fill_(~visible, float("-inf"))  # [Tq, E]
        top = score.topk(min(self.topk, keys.shape[0]), dim=-1).indices  # [Tq, k]
        chosen = torch.zeros_like(visible).scatter_(1, top, True)
        return chosen & visible


class CSACompressor(Compressor):
    """CSA's compressor (two overlapping series) with its lightning indexer beside it."""

    def __init__(self, c, rate: int, dtype: torch.dtype):
        super().__init__(c.hidden_size, c.head_dim, rate, True, c.rms_norm_eps, dtype)
        self.indexer = Indexer(c, rate, dtype)


class GroupedLinear(nn.Module):
    """``o_a_proj``: G independent blocks, weight [G Ro, In / G] with group g's rows at g Ro..(g+1) Ro;
    under TP each rank holds its G / p groups' rows."""

    def __init__(self, in_features: int, out_features: int, groups: int, dtype: torch.dtype,
                 parallel: ParallelState = SINGLE):
        super().__init__()
        if in_features % groups or out_features % groups:
            raise ValueError(f"o_groups: {groups} must divide num_attention_heads * head_dim ({in_features}) "
                             f"and o_groups * o_lora_rank ({out_features})")
        if groups % parallel.tp_size:
            raise ValueError(f"o_groups: {groups} is not divisible by tp_size={parallel.tp_size} "
                             f"(each rank projects whole output groups)")
        self.full = (out_features, in_features // groups)  # the checkpoint tensor's shape
        lo, hi = parallel.shard(out_features)
        self.row_start, self.groups = lo, groups // parallel.tp_size
        self.weight = nn.Parameter(torch.empty(hi - lo, in_features // groups, dtype=dtype), requires_grad=False)

    def weight_entries(self, prefix: str) -> Iterator[WeightEntry]:
        key = f"{prefix}.weight"
        yield WeightEntry(key, partial(self._load, key), (key,))

    def _load(self, key: str, src: torch.Tensor) -> None:
        check_shape(key, src, self.full)
        copy_into(key, self.weight.data, src.narrow(0, self.row_start, self.weight.shape[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, G, In / G] -> [T, G Ro]."""
        w = self.weight.view(self.groups, -1, x.shape[-1])  # [G, Ro, In / G]
        return torch.einsum("tgi,gri->tgr", x, w).flatten(1)


class DeepseekV4Attention(nn.Module):
    """q_a -> norm -> q_b -> per-head norm -> rope; kv -> norm -> rope (K = V); attention with sinks over
    the window's rows and the visible compressed entries; inverse rope on the output; grouped low-rank
    output projection."""

    # Queries attended at once: bounds a long prefill chunk's score tensors to QUERY_BLOCK rows
    # (window + compressed entries wide) instead of the chunk's length squared.
    QUERY_BLOCK = 256

    def __init__(self, c, layer_id: int, rope: RotaryEmbedding, dtype: torch.dtype, kind: str | None = None,
                 parallel: ParallelState = SINGLE):
        """``kind``: the attention kind of a layer outside ``layer_types`` (the MTP layer's, sliding);
        ``parallel``: the attention's TP split (query heads and output groups)."""
        super().__init__()
        self.layer_id, self.kind = layer_id, kind or c.layer_types[layer_id]
        H_all, self.D, self.W = c.num_attention_heads, c.head_dim, c.sliding_window
        self.head_start, head_end = parallel.shard(H_all)
        self.H, self.H_all = head_end - self.head_start, H_all
        self.eps = c.rms_norm_eps
        self.rope = rope  # "main" for sliding layers, "compress" for CSA/HCA (shared, not a checkpoint tensor)
        self.q_a_proj = ReplicatedLinear(c.hidden_size, c.q_lora_rank, False, dtype)
        self.q_a_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps, dtype)
        self.q_b_proj = ColumnParallelLinear(c.q_lora_rank, H_all * self.D, parallel, dtype=dtype)
        self.kv_proj = ReplicatedLinear(c.hidden_size, self.D, False, dtype)
        self.kv_norm = RMSNorm(self.D, c.rms_norm_eps, dtype)
        self.o_a_proj = GroupedLinear(H_all * self.D, c.o_groups * c.o_lora_rank, c.o_groups, dtype, parallel)
        self.G = self.o_a_proj.groups
        self.o_b_proj = RowParallelLinear(c.o_groups * c.o_lora_rank, c.hidden_size, parallel, dtype=dtype)
        self.sinks = nn.Parameter(torch.zeros(self.H, dtype=torch.float32), requires_grad=False)
        self.compressor: Compressor | None = None
        if self.kind != SLIDING:
            rate = int(c.compress_rates[self.kind])
            self.compressor = (CSACompressor(c, rate, dtype) if self.kind == CSA
                               else Compressor(c.hidden_size, self.D, rate, False, c.rms_norm_eps, dtype))
        self.region = {CSA: "csa", HCA: "hca"}.get(self.kind, "")

    def weight_entries(self, prefix: str) -> Iterator[WeightEntry]:
        """The sinks, one per head: this rank's heads' (the submodules list their own tensors)."""
        key = f"{prefix}.sinks"
        yield WeightEntry(key, partial(self._load_sinks, key), (key,))

    def _load_sinks(self, key: str, src: torch.Tensor) -> None:
        check_shape(key, src, (self.H_all,))
        copy_into(key, self.sinks.data, src.narrow(0, self.head_start, self.H))

    def forward(self, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """x [T, Hd] -> [T, Hd]; writes this step's rows of every region of the layer, then attends."""
        T, pos = x.shape[0], fb.positions
        q_resid = self.q_a_norm(self.q_a_proj(x))  # [T, Q]
        q = unweighted_rms_norm(self.q_b_proj(q_resid).view(T, self.H, self.D), self.eps)
        q = rotate_tail(q, self.rope, pos)  # [T, H, D]
        kv = rotate_tail(self.kv_norm(self.kv_proj(x)), self.rope, pos)  # [T, D]
        pool = fb.kv_pool
        assert isinstance(pool, RegionKVPool), "DeepSeek-V4 runs over a RegionKVPool (engine/model_runner.py)"
        index_q = None
        if isinstance(self.compressor, CSACompressor):
            index_q = self.compressor.indexer.queries(x, q_resid, self.rope, pos)
        window = [self._write_request(b, x, kv, fb) for b in range(fb.batch_size)]  # [Kb, D] each
        fb.kv_written(self.layer_id)
        o = torch.cat([self._attend_request(b, q, index_q, window[b], fb) for b in range(fb.batch_size)])  # [T, H, D]
        o = rotate_tail(o, self.rope, pos, inverse=True)
        return self.o_b_proj(self.o_a_proj(o.reshape(T, self.G, -1)))  # [T, Hd]

    def _write_request(self, b: int, x: torch.Tensor, kv: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """Request b's step: pool every compressor window one of its tokens closes (entries into the
        pages), keep its window and source rows (pages, or the record and boundary tails), and return
        its window rows [Kb, D] of positions max(0, p0 - W + 1)..p0 + n - 1, read before they were kept."""
        pool = fb.kv_pool
        assert isinstance(pool, RegionKVPool)
        t0, n, p0 = int(fb.extend_lens[:b].sum()), int(fb.extend_lens[b]), int(fb.prefix_lens[b])
        row = fb.req_rows[b] if fb.req_rows is not None else None
        io = pool.request_state(self.layer_id, fb.kv_slots[b], p0, n, row)
        window = torch.cat([io.prior("window_kv", max(0, p0 - self.W + 1)), kv[t0:t0 + n]])
        io.keep("window_kv", kv[t0:t0 + n])
        if self.compressor is not None:
            self._compress(self.compressor, self.region, x[t0:t0 + n], io, fb, b)
            if isinstance(self.compressor, CSACompressor):
                self._compress(self.compressor.indexer, "csa_index", x[t0:t0 + n], io, fb, b)
        io.done()
        return window

    def _compress(self, comp: Compressor, region: str, x: torch.Tensor, io: RequestState, fb: ForwardBatch,
                  b: int) -> None:
        """x [n, Hd] request b's step: its source rows joined to the open windows' earlier ones (and, for
        CSA, the previous window's), every window a token of the step closes pooled into its entry, kept
        in the slot of that window's last token; then the step's source rows kept."""
        m, p0, n = comp.rate, io.p0, x.shape[0]
        dev = x.device
        start0 = max(0, p0 // m * m - (m if comp.n == 2 else 0))  # first source position still needed
        src = comp.sources(x)  # [n, 2 n X]
        rows = torch.cat([io.prior(f"{region}_src", start0), src])  # [p0 + n - start0, 2 n X]
        io.keep(f"{region}_src", src)
        pos = torch.arange(p0, p0 + n, device=dev)
        closing = pos[(pos + 1) % m == 0]  # [E] positions closing a window
        if closing.numel() == 0:
            return
        start = closing + 1 - m  # [E] first position of each closing window
        offs = torch.arange(m, device=dev)
        src_w = rows[(start - start0)[:, None] + offs]  # [E, m, 2 n X]
        prev_w = rows[(start - m - start0).clamp(min=0)[:, None] + offs]  # [E, m, 2 n X] (read where start > 0)
        has_prev = start > 0
        entries = rotate_tail(comp.pool(src_w, prev_w, has_prev), self.rope, start)  # rope at the window's start
        name = "csa_index_k" if region == "csa_index" else f"{region}_kv"
        io.pool.set_rows(name, self.layer_id, fb.kv_slots[b, closing], entries)

    def _attend_request(self, b: int, q: torch.Tensor, index_q: tuple[torch.Tensor, torch.Tensor] | None,
                        window: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """Request b's queries -> [Tb, H, D], in blocks of QUERY_BLOCK queries."""
        start = int(fb.extend_lens[:b].sum())
        ext, pre = int(fb.extend_lens[b]), int(fb.prefix_lens[b])
        first = max(0, pre - self.W + 1)  # position of window[0]
        return torch.cat([self._attend_block(b, start + lo, pre + lo, min(self.QUERY_BLOCK, ext - lo), q, index_q,
                                             window[max(0, pre + lo - self.W + 1) - first:], fb)
                          for lo in range(0, ext, self.QUERY_BLOCK)])

    def _attend_block(self, b: int, t0: int, p0: int, n: int, q: torch.Tensor,
                      index_q: tuple[torch.Tensor, torch.Tensor] | None, window: torch.Tensor,
                      fb: ForwardBatch) -> torch.Tensor:
        """Tokens t0..t0+n-1 of the step (request b's positions p0..p0+n-1) over their window rows
        (``window`` [>= Kw, D] from position max(0, p0 - W + 1)) and visible compressed entries -> [n, H, D]."""
        pool = fb.kv_pool
        assert isinstance(pool, RegionKVPool)
        dev, end = q.device, p0 + n
        qpos = torch.arange(p0, end, device=dev)  # [n]
        first = max(0, p0 - self.W + 1)
        kpos = torch.arange(first, end, device=dev)  # [Kw]
        keys = window[:end - first]  # [Kw, D]
        allowed = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] > qpos[:, None] - self.W)  # [n, Kw]
        if self.compressor is not None and end // self.compressor.rate:
            m, n_entries = self.compressor.rate, end // self.compressor.rate
            slots = fb.kv_slots[b, (torch.arange(n_entries, device=dev) + 1) * m - 1]  # [E]
            entries = pool.get_rows(f"{self.region}_kv", self.layer_id, slots)  # [E, D]
            visible = torch.arange(n_entries, device=dev)[None, :] < ((qpos + 1) // m)[:, None]  # [n, E]
            if index_q is not None and isinstance(self.compressor, CSACompressor):
                index_k = pool.get_rows("csa_index_k", self.layer_id, slots)  # [E, Di]
                visible = self.compressor.indexer.select(index_q[0][t0:t0 + n], index_q[1][t0:t0 + n], index_k,
                                                         visible)
                # only the entries some query of the block chose (at most n x index_topk, not all E):
                # a long prompt's attention then grows with its length, not its square
                chosen = visible.any(dim=0).nonzero().squeeze(1)  # [E']
                entries, visible = entries[chosen], visible[:, chosen]
            keys = torch.cat([keys, entries])  # [K, D]
            allowed = torch.cat([allowed, visible], dim=1)  # [n, K]
        return self._sink_attention(q[t0:t0 + n], keys.to(q.dtype), allowed)

    def _sink_attention(self, q: torch.Tensor, kv: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """q [Tb, H, D], kv [K, D] (keys and values), allowed [Tb, K] -> [Tb, H, D]; each head's softmax
        also spends mass on its learned sink, which then contributes nothing."""
        scores = torch.einsum("qhd,kd->qhk", q, kv).float() * self.D ** -0.5  # [Tb, H, K]
        scores = scores.masked_fill(~allowed[:, None, :], float("-inf"))
        sinks = self.sinks.float()[None, :, None].expand(q.shape[0], -1, 1)  # [Tb, H, 1]
        p = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]  # [Tb, H, K]
        return torch.einsum("qhk,kd->qhd", p.to(kv.dtype), kv)
