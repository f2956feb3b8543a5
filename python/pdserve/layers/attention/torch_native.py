"""Reference paged attention in plain torch (CPU and GPU), batched with padding + masks; an extend
of unequal requests runs request by request instead (``TorchNativeMetadata.spans``).

Legend: T tokens, B requests, Q longest new-token run, L longest KV length, Lp pages per row,
k tokens a sparse (DeepSeek-V3.2) query keeps, Hi/Di index heads and head dim,
K keys attention reads (L from the decode stage, Lp * S when gathering whole pages),
S page size, Hq query heads, Hkv kv heads, D head dim, Dn/R/Dv MLA nope/rope/value dims, C kv_lora_rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from pdserve.layers.attention.base import AttentionBackend, AttentionMetadata
from pdserve.layers.forward_batch import ForwardBatch
from pdserve.mem.kv_pool import GQAKVPool, MLAKVPool
from pdserve_kernels.sparse_mla_ref import topk_first_on_ties


@dataclass(frozen=True)
class StagePlan:
    """What one decode step does to the staged KV (decided once per step by ``_DecodeStage.plan``).

    Request i's KV is in staged row ``rows[i]``, a permutation of [0, B): attention runs in row order
    (queries, masks and outputs, all [B, ...], are permuted; ``order`` maps back). Rows of a changed
    batch: a request that stays (same Req.uid, one token longer) keeps its row, unless the batch
    shrank below it, then it moves (``move_src`` to ``move_dst``) into a hole a leaver left; the others
    (joiners, or every request on a ``rebuild``) are ``fill``ed from the pool into the remaining holes,
    and the pool already holds this step's token; only the staying requests (``keep``) append it."""

    append: bool  # True: the staged batch one token later, so append; False: the batch changed
    length: int  # L, this step's longest sequence
    rows: torch.Tensor  # [B] staged row of each request, a permutation of [0, B)
    pos: torch.Tensor  # [B] position of each request's new token
    order: torch.Tensor | None = None  # [B] the request in each row (rows' inverse); None: rows is the identity
    rebuild: bool = False  # every row from the pool into new buffers (first step, or capacity outgrown)
    keep: torch.Tensor | None = None  # [k] requests that append their new token (None: all B) ...
    keep_rows: torch.Tensor | None = None  # [k] ... into these rows
    move_src: torch.Tensor | None = None  # [m] staged rows (>= B) moved ...
    move_dst: torch.Tensor | None = None  # [m] ... to these holes (< B) (None: none move)
    fill: torch.Tensor | None = None  # [f] requests read from the pool (None: none) ...
    fill_rows: torch.Tensor | None = None  # [f] ... into these rows


@dataclass(frozen=True)
class TorchNativeMetadata(AttentionMetadata):
    """Padding maps between the T flat tokens and a [B, Q] grid, the causal mask, and the stage plan.

    ``mask`` is sized to exactly the K keys attention reads: L (the longest sequence) when the
    step reads the decode stage, Lp * S (whole gathered pages) when it gathers from the pool. It is
    built on first use: a sparse decode step that sees every key (``sees_all``) never needs it.
    """

    pages: torch.Tensor  # [B, Lp] page ids of each request's KV, in position order
    q_index: torch.Tensor  # [B, Q] flat token index of each padded query (clamped)
    q_valid: torch.Tensor  # [B, Q] True where the padded query is a real token
    seen: torch.Tensor  # [B, Q] how many keys each padded query sees: key j iff j < seen
    num_keys: int  # K
    uniform: bool  # every request has exactly Q new tokens (decode, one request): pad and unpad by reshaping
    sees_all: bool  # one query per request and all of length L (a decode step of equal lengths): mask all True
    stage: StagePlan | None  # set for a decode step that reads the stage; None: gather pages
    # No request has a prefix: ``mask`` is plain causal on every real query row (each row's padded
    # keys lie past its last real query), so SDPA may take is_causal instead and skip the blocks
    # above the diagonal. Rows past a request's tokens differ, and are dropped by _unpad.
    causal: bool = False
    # Set for an extend whose padding would be most of the work (one long prompt among short ones):
    # attention then runs request by request, each over its own pages, so a request's output has the
    # same bits as if it ran alone. Empty: the padded batch.
    spans: tuple[RequestSpan, ...] = ()
    # A decode step the CPU kernel serves (pdserve_kernels.decode_attention_cpu): each request's KV is
    # read by slot from the pool, so no stage is planned (``stage`` None) and nothing is gathered.
    decode_kernel: bool = False
    # An extend the CPU kernel serves (pdserve_kernels.extend_attention_cpu): every request's keys are
    # read by slot from the pool, causal over prefix + new tokens, nothing gathered or padded.
    extend_kernel: bool = False

    @cached_property
    def mask(self) -> torch.Tensor:
        """[B, 1, Q, K] key k visible to query q."""
        kj = torch.arange(self.num_keys, device=self.seen.device)  # [K]
        return (kj < self.seen[:, :, None])[:, None]

    @cached_property
    def row_mask(self) -> torch.Tensor:
        """``mask`` in the order of the KV attention reads: the decode stage's rows, else the batch's."""
        return _to_rows(self.mask, self)


def _to_rows(x: torch.Tensor, md: TorchNativeMetadata) -> torch.Tensor:
    """[B, ...] in batch order -> the order of the KV attention reads (the decode stage's rows)."""
    order = md.stage.order if md.stage is not None else None
    return x if order is None else x[order]


def _to_batch(x: torch.Tensor, md: TorchNativeMetadata) -> torch.Tensor:
    """``_to_rows``' inverse: [B, ...] in the stage's row order -> batch order."""
    st = md.stage
    return x if st is None or st.order is None else x[st.rows]


@dataclass(frozen=True)
class RequestSpan:
    """One request of a ragged extend: its new tokens are T[start : start + ext], its keys its first
    ``seq`` positions (prefix + ext), on its first ``pages`` pages."""

    start: int
    ext: int
    prefix: int
    seq: int
    pages: int


# A ragged extend runs request by request when the padded batch's scores (B * Q * L) exceed the real
# ones (sum of ext * seq) by this factor (one long prompt beside a short one: about 2); below it one
# batched call beats B small ones.
RAGGED_PADDING_FACTOR = 1.5


def _ragged_spans(ext: torch.Tensor, pre: torch.Tensor, seq: torch.Tensor, S: int) -> tuple[RequestSpan, ...]:
    """The per-request spans of an extend worth running request by request, else ()."""
    B = ext.shape[0]
    if B < 2:
        return ()
    padded = B * int(ext.max()) * int(seq.max())
    if padded <= RAGGED_PADDING_FACTOR * int((ext * seq).sum()):
        return ()
    starts = (torch.cumsum(ext, 0) - ext).tolist()
    return tuple(RequestSpan(st, e, p, s, -(-s // S))
                 for st, e, p, s in zip(starts, ext.tolist(), pre.tolist(), seq.tolist()))


def _span_mask(md: TorchNativeMetadata, i: int, r: RequestSpan) -> torch.Tensor | None:
    """Request i's [1, 1, ext, seq] causal mask, or None where it has no prefix (then is_causal)."""
    return md.mask[i:i + 1, :, :r.ext, :r.seq] if r.prefix else None


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
          enable_gqa: bool = False) -> torch.Tensor:
    """SDPA with ``mask`` or, where it is None, is_causal. Values narrower than the keys (MLA's
    Dv < Dn + R) are zero-padded to the key width and the output sliced back: SDPA's flash kernels
    need one head dim for q, k and v and otherwise fall back to the math path (several times slower
    on CPU); the zero columns add nothing to the real ones."""
    Dk, Dv = k.shape[-1], v.shape[-1]
    if Dv < Dk:
        v = F.pad(v, (0, Dk - Dv))
    if mask is None:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa)
    else:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    return o[..., :Dv] if Dv < Dk else o


def _pad_q(x: torch.Tensor, md: TorchNativeMetadata) -> torch.Tensor:
    """[T, H, X] -> [B, H, Q, X]."""
    if md.uniform:
        B, Q = md.q_index.shape
        return x.view(B, Q, *x.shape[1:]).transpose(1, 2)
    return x[md.q_index].transpose(1, 2)


def _unpad(o: torch.Tensor, md: TorchNativeMetadata) -> torch.Tensor:
    """[B, H, Q, X] -> [T, H, X]."""
    o = o.transpose(1, 2)  # [B, Q, H, X]
    if md.uniform:
        return o.reshape(-1, *o.shape[2:])
    return o[md.q_valid]


def _attend_grouped(qp: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Masked softmax attention with each KV head shared by a group of query heads, without
    expanding K/V: qp [B, Hq, Q, D], k [B, Hkv, K, D], v [B, Hkv, K, X] -> [B, Hq, Q, X].

    MLA's absorbed attention (one latent "head", values the first C of its C+R columns) is two
    batched matmuls here. SDPA, given values narrower than keys, takes its math path, which
    expands the latent to every head and scales a transposed copy of it: several times slower
    on CPU. Query head h reads KV head h // G, as SDPA's enable_gqa does.
    """
    B, Hq, Q, D = qp.shape
    Hkv, K = k.shape[1], k.shape[2]
    G = Hq // Hkv
    scores = torch.matmul(qp.reshape(B, Hkv, G * Q, D), k.transpose(-1, -2))  # [B, Hkv, G Q, K]
    scores = scores.float().mul_(scale).view(B, Hkv, G, Q, K)
    scores.masked_fill_(mask.logical_not()[:, :, None], float("-inf"))  # mask [B, 1, 1, Q, K]
    p = torch.softmax(scores, dim=-1).to(v.dtype).view(B, Hkv, G * Q, K)
    return torch.matmul(p, v).view(B, Hq, Q, v.shape[-1])  # [B, Hq, Q, X]


def _grouped_decode_pays(qp: torch.Tensor) -> bool:
    """One query row per request in a low-precision dtype on CPU: SDPA's CPU flash kernel runs
    bf16 several times slower than float32 there (benchmark/bench_cpu_ops.py), while the two
    batched matmuls of ``_attend_grouped`` take oneDNN's bf16 GEMMs. Float32 keeps SDPA (no clear
    winner in our runs), and so its exact numerics; prefill keeps SDPA, whose tiling wins at long Q."""
    return qp.device.type == "cpu" and qp.dtype != torch.float32 and qp.shape[2] == 1


class _DecodeStage:
    """A contiguous copy of the running decode batch's KV, kept across steps.

    On CPU, gathering every request's pages each step costs as much as the matmuls. So a step
    appends one row per request here, and a change of the batch costs what changed: a request that
    stays (same Req.uid, one token longer) keeps its staged row, a joiner's row is read from the
    pool (which stays the source of truth) into a row a leaver freed. Rows are stable, so the batch's
    order is not the rows' order: ``StagePlan.rows`` maps requests to rows and attention permutes its
    small per-request tensors (queries, masks, outputs) instead of moving KV. Only when the batch
    shrinks does a request in a row >= B move, one row copy into a hole below B. Buffers are rebuilt
    from the pool (rows then in batch order) only when the batch outgrows their rows or the longest
    sequence their capacity.

    Invariant: rows [0, B) hold the B requests, request i in row ``rows[i]``, and every position
    [0, capacity) of them holds a finite value (pool KV, a padded slot's pool KV, or zero), so a
    masked key adds exactly 0 to attention (0 x finite); buffers come from ``new_empty`` and rows
    past B are never read (a request moved out of one leaves a stale copy there).
    Legend: B requests, H kv heads, X row width, L used length, K capacity, N row capacity.
    """

    MARGIN = 64  # decode steps between rebuilds caused by growth
    ROW_MARGIN = 8  # spare rows, so joiners up to this many past the largest batch do not rebuild

    def __init__(self):
        self.req_uids: tuple | None = None
        self.seq_lens: torch.Tensor | None = None
        self.rows: list[int] = []  # staged row of each request of req_uids
        self.row_map: tuple[torch.Tensor, torch.Tensor | None] | None = None  # (rows, order) as StagePlan's
        self.capacity = 0  # K
        self.row_capacity = 0  # N
        self.bufs: dict[tuple[str, int], tuple[torch.Tensor, ...]] = {}  # (region, layer) -> [N, H, K, X] each

    def plan(self, fb: ForwardBatch) -> StagePlan:
        """Once per decode step: append when this is the staged batch one token later, else
        keep the staying requests' rows and fill the rest (all of them on a rebuild)."""
        L, B = int(fb.seq_lens.max()), fb.batch_size
        dev = fb.seq_lens.device
        old_uids, old_lens = self.req_uids, self.seq_lens
        self.req_uids, self.seq_lens = fb.req_uids, fb.seq_lens
        if L > self.capacity or B > self.row_capacity or old_uids is None or old_lens is None:
            self.capacity, self.row_capacity, self.bufs = L + self.MARGIN, B + self.ROW_MARGIN, {}
            self.rows, self.row_map = list(range(B)), (torch.arange(B, device=dev), None)
            return StagePlan(False, L, self.row_map[0], fb.seq_lens - 1, rebuild=True, fill=self.row_map[0],
                             fill_rows=self.row_map[0])
        assert self.row_map is not None
        if fb.req_uids == old_uids and torch.equal(old_lens + 1, fb.seq_lens):
            return StagePlan(True, L, self.row_map[0], fb.seq_lens - 1, order=self.row_map[1])
        return self._plan_change(old_uids, old_lens.tolist(), fb, L)

    def _plan_change(self, old_uids: tuple, old_lens: list[int], fb: ForwardBatch, L: int) -> StagePlan:
        """Stayers keep their rows below B; the holes below B (leavers' rows, or free ones) take first
        the stayers whose rows lie past B (one row copy each), then the joiners (read from the pool)."""
        B = fb.batch_size
        old = {u: (r, n) for u, r, n in zip(old_uids, self.rows, old_lens)}
        rows, keep, moving, fill = [-1] * B, [], [], []
        for i, (u, n) in enumerate(zip(fb.req_uids or (), fb.seq_lens.tolist())):
            r, m = old.get(u, (-1, -1))
            if r < 0 or m + 1 != n:  # a joiner, or a request whose length jumped: its pages are the truth
                fill.append(i)
                continue
            keep.append(i)
            if r < B:
                rows[i] = r
            else:
                moving.append((i, r))
        taken = set(rows)
        holes = iter([r for r in range(B) if r not in taken])
        for i, _ in moving:
            rows[i] = next(holes)
        for i in fill:
            rows[i] = next(holes)
        self.rows = rows
        dev = fb.seq_lens.device
        t = lambda xs: torch.tensor(xs, dtype=torch.long, device=dev)  # noqa: E731
        order = [0] * B
        for i, r in enumerate(rows):
            order[r] = i
        self.row_map = (t(rows), None if rows == list(range(B)) else t(order))
        return StagePlan(False, L, self.row_map[0], fb.seq_lens - 1, order=self.row_map[1],
                         keep=t(keep), keep_rows=t([rows[i] for i in keep]),
                         move_src=t([r for _, r in moving]) if moving else None,
                         move_dst=t([rows[i] for i, _ in moving]) if moving else None,
                         fill=t(fill) if fill else None, fill_rows=t([rows[i] for i in fill]) if fill else None)

    def get(self, layer: int, plan: StagePlan, new: tuple, gather, region: str = "kv") -> tuple[torch.Tensor, ...]:
        """``get_rows`` in batch order, [B, H, L, X] each: a copy where the rows are permuted (the
        slow twin attention does not take; tests compare it with a fresh stage)."""
        staged = self.get_rows(layer, plan, new, gather, region)
        return staged if plan.order is None else tuple(t.index_select(0, plan.rows) for t in staged)

    def get_rows(self, layer: int, plan: StagePlan, new: tuple, gather,
                 region: str = "kv") -> tuple[torch.Tensor, ...]:
        """This step's staged KV in row order, [B, H, L, X] each (request i in row ``plan.rows[i]``):
        views, no copy. new: this step's rows in batch order, each [B, H, X]; gather(requests) -> the
        pool's [b, H, L', X] tensors of those batch rows (L' >= L). ``region``: which of the layer's pool
        regions these are (DeepSeek-V3.2 stages its index keys too)."""
        L, B = plan.length, plan.rows.shape[0]
        key = (region, layer)
        bufs = self.bufs.get(key)
        if bufs is None:  # first step of these buffers: every row from the pool
            everyone = torch.arange(B, device=plan.rows.device)
            pooled = gather(everyone if plan.order is None else plan.order)  # [B, H, L', X] each, row order
            bufs = self.bufs[key] = self._allocate(pooled, L)
        elif plan.append:
            for buf, t in zip(bufs, new):
                buf[plan.rows, :, plan.pos] = t
        else:
            self._change(bufs, plan, new, gather)
        return tuple(buf[:B, :, :L] for buf in bufs)

    def _allocate(self, pooled: tuple, L: int) -> tuple[torch.Tensor, ...]:
        """New [N, H, K, X] buffers holding ``pooled`` ([B, H, L', X] each, row order) in rows [0, B)."""
        bufs = []
        for t in pooled:
            B, H, _, X = t.shape
            buf = t.new_empty(self.row_capacity, H, self.capacity, X)
            buf[:B, :, :L] = t[:, :, :L]
            buf[:B, :, L:].zero_()
            bufs.append(buf)
        return tuple(bufs)

    @staticmethod
    def _change(bufs: tuple, plan: StagePlan, new: tuple, gather) -> None:
        """Stayers past B move into holes, stayers append their token; joiners' rows come from the pool."""
        L = plan.length
        pooled = gather(plan.fill) if plan.fill is not None else (None,) * len(bufs)
        for buf, t, p in zip(bufs, new, pooled):
            if plan.move_src is not None:  # sources >= B, holes < B: disjoint
                buf.index_copy_(0, plan.move_dst, buf.index_select(0, plan.move_src))
            if plan.keep is not None and plan.keep.numel():
                buf[plan.keep_rows, :, plan.pos[plan.keep]] = t[plan.keep]
            if p is not None:
                buf[plan.fill_rows, :, :L] = p[:, :, :L]
                buf[plan.fill_rows, :, L:] = 0


class TorchNativeBackend(AttentionBackend):
    name = "torch_native"

    def __init__(self):
        self.stage = _DecodeStage()
        # How the indexer's score + top-k runs, fixed at the first sparse step by the pool it reads
        # (``_index_kernel_for``): "cpu_kernel" (pdserve_kernels.index_topk_cpu, keys read by slot)
        # or "torch" (select_top_tokens over the staged keys). None before any sparse step.
        self.index_topk_impl: str | None = None
        # How decode attention runs, fixed at the first decode step by the pool (``_decode_kernel_for``):
        # "cpu_kernel" (pdserve_kernels.decode_attention_cpu, KV read by slot, no decode stage) or
        # "torch" (the decode stage and SDPA or grouped matmuls). None before any decode step.
        self.decode_attention_impl: str | None = None
        # Threads the CPU decode kernel may use (its own helpers beside the forward's thread): the
        # cores the forward may use, set by the scheduler from its thread layout (1 until then).
        self.decode_threads = 1
        # How the latest decode step ran its decoder layers: "cpu_kernel" (all in one plain-C call,
        # pdserve.models.fused_decode) or "layers" (one by one); the model says (note_decode_stack).
        self.decode_stack_impl: str | None = None
        self.decode_stack_steps = 0  # decode steps that ran through the one call
        # How a float32 GQA extend's attention runs, fixed at the first extend by the pool
        # (``_extend_kernel_for``): "cpu_kernel" (pdserve_kernels.extend_attention_cpu on the decode
        # kernel's threads: a prefill forward's torch threads idle while it runs) or "sdpa". None before.
        self.extend_attention_impl: str | None = None

    def describe(self) -> dict:
        info: dict[str, str | int] = {"attention_backend": self.name,
                                      "index_topk": self.index_topk_impl or "not chosen yet",
                                      "decode_attention": self.decode_attention_impl or "not chosen yet",
                                      "decode_stack": self.decode_stack_impl or "layers"}
        info["extend_attention"] = self.extend_attention_impl or "not chosen yet"
        if self.decode_attention_impl == "cpu_kernel":
            info["decode_attention_threads"] = self.decode_threads
        return info

    def note_decode_stack(self, impl: str) -> None:
        """A decode step ran its layers as ``impl`` ("cpu_kernel" or "layers")."""
        self.decode_stack_impl = impl
        self.decode_stack_steps += impl == "cpu_kernel"

    def _decode_kernel_for(self, pool) -> bool:
        """True where the CPU kernel runs this pool's decode attention: a float32 GQA pool, or a
        float32 MLA pool without DeepSeek-V3.2's index keys (sparse attention keeps its own path),
        on CPU, the kernel built. Decided once, so the decode stage is either always kept or never."""
        if self.decode_attention_impl is None:
            usable = (isinstance(pool, (GQAKVPool, MLAKVPool)) and pool.device.type == "cpu"
                      and pool.dtype == pool.compute_dtype == torch.float32
                      and getattr(pool, "index_k", None) is None)
            if usable:
                from pdserve_kernels import decode_attention_cpu  # plain C through ctypes: no triton

                usable = decode_attention_cpu.load() is not None
            self.decode_attention_impl = "cpu_kernel" if usable else "torch"
        return self.decode_attention_impl == "cpu_kernel"

    def _extend_kernel_for(self, pool) -> bool:
        """True where the CPU kernel runs this pool's extend attention: a float32 GQA pool on CPU, the
        kernel built (its mask is ``mask``'s: causal over each request's prefix and new tokens)."""
        if self.extend_attention_impl is None:
            usable = (isinstance(pool, GQAKVPool) and pool.device.type == "cpu"
                      and pool.dtype == pool.compute_dtype == torch.float32)
            if usable:
                from pdserve_kernels import extend_attention_cpu  # plain C through ctypes: no triton

                usable = extend_attention_cpu.load() is not None
            self.extend_attention_impl = "cpu_kernel" if usable else "sdpa"
        return self.extend_attention_impl == "cpu_kernel"

    def _index_kernel_for(self, pool) -> bool:
        """True where the CPU kernel scores this pool's index keys (float32 on CPU, the kernel built);
        decided once, so the decode stage's index-key copy is either always kept or never."""
        if self.index_topk_impl is None:
            keys = pool.index_k
            usable = keys is not None and keys.device.type == "cpu" and keys.dtype == torch.float32
            if usable:
                from pdserve_kernels import index_topk_cpu  # plain C through ctypes: no triton

                usable = index_topk_cpu.load() is not None
            self.index_topk_impl = "cpu_kernel" if usable else "torch"
        return self.index_topk_impl == "cpu_kernel"

    def prepare(self, fb: ForwardBatch) -> TorchNativeMetadata:
        ext, pre, seq = fb.extend_lens, fb.prefix_lens, fb.seq_lens
        S = fb.kv_pool.page_size
        # A request's position p sits at offset p % S of its (p // S)-th page, so the page
        # table is every S-th slot divided by S; KV is gathered page by page.
        pages = torch.div(fb.kv_slots[:, ::S], S, rounding_mode="floor")  # [B, Lp]
        B = fb.batch_size
        # Decode steps the CPU kernel serves read the pool by slot; other decode steps of identified
        # requests read the stage (length L), others whole pages.
        kernel = fb.is_decode and self._decode_kernel_for(fb.kv_pool)
        stage = self.stage.plan(fb) if fb.is_decode and fb.req_uids is not None and not kernel else None
        K = stage.length if stage is not None else pages.shape[1] * S
        Q = int(ext.max()) if B else 0
        dev = seq.device
        qi = torch.arange(Q, device=dev)  # [Q]
        starts = torch.cumsum(ext, 0) - ext  # [B]
        q_index = (starts[:, None] + qi[None, :]).clamp(max=max(fb.num_tokens - 1, 0))  # [B, Q]
        # key j visible to new token i iff j <= prefix + i (causal) and j < seq_len (not padding)
        seen = torch.minimum(pre[:, None] + qi[None, :] + 1, seq[:, None])  # [B, Q]
        uniform = B * Q == fb.num_tokens  # every ext == Q, since none exceeds it
        sees_all = Q == 1 and bool(seq.min() == fb.kv_slots.shape[1])  # kv_slots: L = the longest sequence wide
        causal = stage is None and Q > 1 and not bool(pre.any())
        extend = not fb.is_decode and self._extend_kernel_for(fb.kv_pool)  # the kernel needs no spans
        spans = _ragged_spans(ext, pre, seq, S) if stage is None and Q > 1 and not extend else ()
        return TorchNativeMetadata(pages, q_index, qi[None, :] < ext[:, None], seen, K, uniform, sees_all, stage,
                                   causal, spans, kernel, extend)

    def forward_gqa(self, q, k, v, layer_id, scale, fb):
        pool = fb.kv_pool
        pool.set_kv(layer_id, fb.out_cache_loc, k, v)
        fb.kv_written(layer_id)
        md = self.metadata_of(fb, TorchNativeMetadata)
        if md.decode_kernel and q.dtype == torch.float32:
            from pdserve_kernels.decode_attention_cpu import decode_attention

            return decode_attention(q.contiguous(), pool.k[layer_id], pool.v[layer_id], fb.kv_slots, fb.seq_lens,
                                    scale, threads=self.decode_threads)  # [T = B, Hq, D]
        if md.extend_kernel and q.dtype == torch.float32:
            from pdserve_kernels.extend_attention_cpu import extend_attention

            return extend_attention(q.contiguous(), pool.k[layer_id], pool.v[layer_id], fb.kv_slots, fb.prefix_lens,
                                    fb.extend_lens, scale, threads=self.decode_threads)  # [T, Hq, D]
        if md.spans:
            return self._gqa_ragged(q, layer_id, scale, fb, md, pool.round_trip_kv(k, v))
        # The stage appends this step's rows as the pool holds them (quantized, for an fp8 pool), so
        # an appended step and a rebuilt one read the same keys.
        staged = pool.round_trip_kv(k, v) if md.stage is not None else (k, v)
        gather = lambda pages: pool.get_kv_pages(layer_id, pages)  # noqa: E731
        k_all, v_all = self._kv(layer_id, md, staged, gather)  # [B, Hkv, K, D], in row order
        qp = _to_rows(_pad_q(q, md), md)  # [B, Hq, Q, D]
        k_all, v_all = k_all.to(q.dtype), v_all.to(q.dtype)
        if _grouped_decode_pays(qp):
            return _unpad(_to_batch(_attend_grouped(qp, k_all, v_all, md.row_mask, scale), md), md)  # [T, Hq, D]
        gqa = qp.shape[1] != k_all.shape[1]
        # is_causal: the same scores and sums on real rows as the mask's (test_attention checks the bits)
        o = _sdpa(qp, k_all, v_all, None if md.causal else md.row_mask, scale, gqa)
        return _unpad(_to_batch(o, md), md)  # [T, Hq, D]

    @staticmethod
    def _gqa_ragged(q, layer_id, scale, fb, md, new):
        """Each request's [1, Hq, ext, D] queries over its own pages' keys, none padded. ``new``: this
        step's K and V rows [T, Hkv, D] as the pool holds them; a request with no prefix attends
        over its own rows of them, without gathering its pages back."""
        outs = []
        for i, r in enumerate(md.spans):
            if r.prefix == 0:
                k, v = (t[r.start:r.start + r.ext].transpose(0, 1).unsqueeze(0).to(q.dtype) for t in new)
            else:
                k, v = fb.kv_pool.get_kv_pages(layer_id, md.pages[i:i + 1, :r.pages])  # [1, Hkv, pages S, D]
                k, v = k[:, :, :r.seq].to(q.dtype), v[:, :, :r.seq].to(q.dtype)
            qi = q[r.start:r.start + r.ext].transpose(0, 1).unsqueeze(0)  # [1, Hq, ext, D]
            o = _sdpa(qi, k, v, _span_mask(md, i, r), scale, qi.shape[1] != k.shape[1])
            outs.append(o[0].transpose(0, 1))  # [ext, Hq, D]
        return torch.cat(outs)  # [T, Hq, D]

    def forward_mla(self, q_nope, q_pe, latent, k_pe, w_kc, w_vc, layer_id, scale, fb, absorbed=None):
        pool = fb.kv_pool
        new = torch.cat([latent, k_pe], dim=-1)  # [T, C+R]
        pool.set_latent(layer_id, fb.out_cache_loc, new)
        fb.kv_written(layer_id)
        md = self.metadata_of(fb, TorchNativeMetadata)
        if absorbed is None:
            absorbed = fb.is_decode
        if md.decode_kernel and absorbed and q_nope.dtype == torch.float32:
            return self._mla_kernel(q_nope, q_pe, latent.shape[-1], w_kc, w_vc, layer_id, scale, fb,
                                    self.decode_threads)
        if md.spans:
            return self._mla_ragged(q_nope, q_pe, latent.shape[-1], w_kc, w_vc, layer_id, scale, fb, md, absorbed)
        staged = pool.round_trip_latent(new) if md.stage is not None else new  # as the pool holds it
        (cache,) = self._kv(layer_id, md, (staged.unsqueeze(1),),
                            lambda pages: (pool.get_latent_pages(layer_id, pages).unsqueeze(1),))
        cache = cache[:, 0].to(q_nope.dtype)  # [B, K, C+R], in row order
        C = latent.shape[-1]
        if absorbed:  # attention in row order, the up-projection back in batch order
            o = self._mla_absorbed(q_nope, q_pe, cache, C, w_kc, w_vc, scale, md.row_mask,
                                   lambda x: _to_rows(_pad_q(x, md), md), lambda o: _to_batch(o, md))
        else:  # its up-projection costs more than a batch-order copy of the cache
            cache = _to_batch(cache, md)
            o = self._mla_expanded(q_nope, q_pe, cache, C, w_kc, w_vc, scale, None if md.causal else md.mask,
                                   lambda x: _pad_q(x, md))
        return _unpad(o, md)  # [T, H, Dv]

    def _mla_ragged(self, q_nope, q_pe, C, w_kc, w_vc, layer_id, scale, fb, md, absorbed):
        """Each request's queries over its own pages' latent rows, none padded (nor up-projected)."""
        grid = lambda x: x.transpose(0, 1).unsqueeze(0)  # noqa: E731  [ext, H, X] -> [1, H, ext, X]
        outs = []
        for i, r in enumerate(md.spans):
            cache = fb.kv_pool.get_latent_pages(layer_id, md.pages[i:i + 1, :r.pages])[:, :r.seq]  # [1, seq, C+R]
            cache = cache.to(q_nope.dtype)
            rows = slice(r.start, r.start + r.ext)
            if absorbed:  # the mask even without a prefix: _attend_grouped has no causal shortcut
                o = self._mla_absorbed(q_nope[rows], q_pe[rows], cache, C, w_kc, w_vc, scale,
                                       md.mask[i:i + 1, :, :r.ext, :r.seq], grid)
            else:
                o = self._mla_expanded(q_nope[rows], q_pe[rows], cache, C, w_kc, w_vc, scale, _span_mask(md, i, r),
                                       grid)
            outs.append(o[0].transpose(0, 1))  # [ext, H, Dv]
        return torch.cat(outs)  # [T, H, Dv]

    @staticmethod
    def _mla_kernel(q_nope, q_pe, C, w_kc, w_vc, layer_id, scale, fb, threads=1):
        """Absorbed decode through the CPU kernel: the latent rows, read by slot, are one KV head of
        width C+R whose first C columns are the values."""
        from pdserve_kernels.decode_attention_cpu import decode_attention

        q_lat = torch.einsum("thd,hdc->thc", q_nope, w_kc)  # [T, H, C]
        qc = torch.cat([q_lat, q_pe], dim=-1)  # [T, H, C+R]
        kv = fb.kv_pool.latent[layer_id].unsqueeze(1)  # [P, 1, S, C+R]
        o_lat = decode_attention(qc, kv, kv, fb.kv_slots, fb.seq_lens, scale, v_width=C, threads=threads)  # [T, H, C]
        return torch.einsum("thc,hcv->thv", o_lat, w_vc)  # [T, H, Dv]

    @staticmethod
    def _mla_absorbed(q_nope, q_pe, cache, C, w_kc, w_vc, scale, mask, grid, ungrid=None):
        # W_UK folds into the query, so attention runs in the C-wide latent space
        # against one shared "head": cheap per token, ideal for decode. grid: [T, H, X] -> [B, H, Q, X]
        # in the cache's order; ungrid: that order back to the batch's (None: they are one).
        q_lat = torch.einsum("thd,hdc->thc", q_nope, w_kc)  # [T, H, C]
        qp = grid(torch.cat([q_lat, q_pe], dim=-1))  # [B, H, Q, C+R]
        kv = cache.unsqueeze(1)  # [B, 1, K, C+R]
        o_lat = _attend_grouped(qp, kv, kv[..., :C], mask, scale)  # [B, H, Q, C]
        if ungrid is not None:
            o_lat = ungrid(o_lat)
        return torch.einsum("bhqc,hcv->bhqv", o_lat, w_vc)  # [B, H, Q, Dv]

    @staticmethod
    def _mla_expanded(q_nope, q_pe, cache, C, w_kc, w_vc, scale, mask, grid):
        # Up-project the latent into per-head K and V: more FLOPs per key, fewer
        # per query, which suits long extends. mask None: causal (no request has a prefix).
        H = q_nope.shape[1]
        c, kpe = cache[..., :C], cache[..., C:]  # [B, K, C], [B, K, R]
        k_nope = torch.einsum("blc,hdc->bhld", c, w_kc)  # [B, H, K, Dn]
        v = torch.einsum("blc,hcv->bhlv", c, w_vc)  # [B, H, K, Dv]
        k = torch.cat([k_nope, kpe.unsqueeze(1).expand(-1, H, -1, -1)], dim=-1)  # [B, H, K, Dn+R]
        qp = grid(torch.cat([q_nope, q_pe], dim=-1))  # [B, H, Q, Dn+R]
        return _sdpa(qp, k, v, mask, scale)  # [B, H, Q, Dv]

    def forward_mla_sparse(self, q_nope, q_pe, latent, k_pe, w_kc, w_vc, layer_id, scale, index, fb):
        pool = fb.kv_pool
        pool.set_latent(layer_id, fb.out_cache_loc, torch.cat([latent, k_pe], dim=-1))
        pool.set_index_k(layer_id, fb.out_cache_loc, index.k)
        fb.kv_written(layer_id)
        md = self.metadata_of(fb, TorchNativeMetadata)
        L = fb.kv_slots.shape[1]
        # Every earlier token's index key is scored (the indexer's inherent O(L) part, Di wide and
        # cheap). The CPU kernel reads them by slot from the pool; the torch twin from the decode
        # stage in decode (one row appended per step), else from the pool's pages.
        kernel = self._index_kernel_for(pool)
        keys = None
        if not kernel:
            # the new rows as the pool reads them back (an FP8 index cache's rounding included)
            (keys,) = self._kv(layer_id, md, (pool.round_trip_index_k(index.k).unsqueeze(1),),
                               lambda pages: (pool.get_index_k_pages(layer_id, pages).unsqueeze(1),),
                               region="index_k")
            keys = keys[:, 0, :L]  # [B, L, Di], in row order
        q_lat = torch.einsum("thd,hdc->thc", q_nope, w_kc)  # [T, H, C]
        qp = _pad_q(torch.cat([q_lat, q_pe], dim=-1), md).transpose(1, 2)  # [B, Q, H, C+R]
        iq = _pad_q(index.q, md).transpose(1, 2)  # [B, Q, Hi, Di]
        iw = _pad_q(index.weights.unsqueeze(-1), md)[..., 0].transpose(1, 2)  # [B, Q, Hi]
        C, Q = latent.shape[-1], qp.shape[1]
        step = _query_chunk(Q, L, index.q.shape[1], index.topk, qp.shape[-1])
        parts = []
        for q0 in range(0, Q, step):  # a long extend in query blocks: scores and gathered rows stay bounded
            if keys is None:
                chosen, valid = select_top_tokens_paged(iq[:, q0:q0 + step], iw[:, q0:q0 + step],
                                                        pool.index_k[layer_id], fb.kv_slots, md.seen[:, q0:q0 + step],
                                                        index.scale, index.topk)
            else:  # in the staged keys' row order, the picks back in batch order
                visible = None if md.sees_all else md.row_mask[:, 0, q0:q0 + step, :L]  # [B, q, L]
                chosen, valid = select_top_tokens(_to_rows(iq[:, q0:q0 + step], md), _to_rows(iw[:, q0:q0 + step], md),
                                                  keys, visible, index.scale, index.topk)  # [B, q, k]
                chosen, valid = _to_batch(chosen, md), _to_batch(valid, md)
            # Only the chosen tokens' latent rows are read: gathered by slot, not a masked dense pass.
            rows = pool.get_latent_slots(layer_id, fb.kv_slots.gather(1, chosen.flatten(1)).view(chosen.shape))
            parts.append(_mla_sparse(qp[:, q0:q0 + step], rows.to(qp.dtype), valid, C, scale))  # [B, q, H, C]
        o_lat = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]  # [B, Q, H, C]
        o = torch.einsum("bqhc,hcv->bhqv", o_lat, w_vc)  # [B, H, Q, Dv]
        return _unpad(o, md)  # [T, H, Dv]

    def _kv(self, layer_id: int, md: TorchNativeMetadata, new: tuple, gather, region: str = "kv") -> tuple:
        """This layer's KV for the whole batch, [B, H, K, X] each: staged in decode (in the stage's row
        order: ``_to_rows`` puts the queries there), else gathered. gather(pages) -> the pool's KV of
        those [b, Lp] page ids."""
        if md.stage is None:
            return gather(md.pages)
        return self.stage.get_rows(layer_id, md.stage, new, lambda reqs: gather(md.pages[reqs]), region)


SPARSE_CHUNK_ELEMENTS = 1 << 24  # bound on a query block's [B, q, Hi, L] scores and [B, q, k, C+R] rows


def _query_chunk(Q: int, L: int, Hi: int, k: int, X: int) -> int:
    """Queries per block so neither the block's index scores nor its gathered rows pass the bound."""
    return max(1, min(Q, SPARSE_CHUNK_ELEMENTS // max(1, Hi * L, k * X)))


def select_top_tokens(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor | None,
                      scale: float, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer's top-k over every visible token: q [B, Q, Hi, Di], weights [B, Q, Hi], keys [B, L, Di],
    visible [B, Q, L] (None: every query sees all L) -> chosen [B, Q, k] token positions and valid [B, Q, k]
    (False for padding picks where a query sees fewer than ``topk`` tokens). Two batched matmuls, then the
    top-k (``topk_first_on_ties``); a query that sees at most ``topk`` tokens keeps them all unscored."""
    B, Q, Hi, Di = q.shape
    L = keys.shape[1]
    if L <= topk:
        chosen = torch.arange(L, device=q.device).expand(B, Q, L)  # [B, Q, L]
    else:
        s = torch.matmul(q.reshape(B, Q * Hi, Di).float(), keys.float().transpose(1, 2))  # [B, Q Hi, L]
        s = torch.relu_(s).view(B, Q, Hi, L)
        # relu(scale * x) = scale * relu(x) for scale > 0: the scale goes on the Hi weights, not the Hi*L scores
        score = torch.matmul(weights.float().mul(scale).unsqueeze(2), s).squeeze(2)  # [B, Q, L]: sum_h w[h] s[h]
        if visible is not None:
            score.masked_fill_(visible.logical_not(), float("-inf"))
        chosen = topk_first_on_ties(score, min(topk, L))  # [B, Q, k], ties at the cut from the lowest position
    if visible is None:
        return chosen, torch.ones(chosen.shape, dtype=torch.bool, device=chosen.device)
    return chosen, visible.gather(-1, chosen)


def select_top_tokens_paged(q: torch.Tensor, weights: torch.Tensor, index_k: torch.Tensor, kv_slots: torch.Tensor,
                            seen: torch.Tensor, scale: float, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``select_top_tokens`` (its twin: the same picks, in the same order) through the CPU kernel, which
    reads each visible key by slot from one layer's pool: q [B, Q, Hi, Di], weights [B, Q, Hi],
    index_k [P, S, Di], kv_slots [B, L], seen [B, Q] (query sees positions j < seen) -> chosen [B, Q, k],
    valid [B, Q, k]. Where a score is NaN or infinite the twin runs instead (its rule for those)."""
    from pdserve_kernels import index_topk_cpu

    B, Q, Hi, Di = q.shape
    L = kv_slots.shape[1]
    if L <= topk:  # as the twin: every token kept, unscored
        chosen = torch.arange(L, device=q.device).expand(B, Q, L)  # [B, Q, L]
    else:
        req = torch.arange(B, device=q.device).repeat_interleave(Q)  # [B Q]
        try:
            pos = index_topk_cpu.index_topk(q.reshape(B * Q, Hi, Di).float().contiguous(),
                                            weights.reshape(B * Q, Hi).float().contiguous(), index_k,
                                            kv_slots.contiguous(), req, seen.reshape(B * Q).contiguous(), scale,
                                            topk)  # [B Q, k]
        except index_topk_cpu.KernelUnavailable:
            keys = index_k.view(-1, Di)[kv_slots]  # [B, L, Di]
            visible = torch.arange(L, device=q.device) < seen[..., None]  # [B, Q, L]
            return select_top_tokens(q, weights, keys, visible, scale, topk)
        chosen = pos.view(B, Q, -1)
    return chosen, chosen < seen[..., None]


def _mla_sparse(qp, rows, valid, C, scale):
    """Absorbed MLA of each query over its own k gathered latent rows: qp [B, Q, H, C+R],
    rows [B, Q, k, C+R], valid [B, Q, k] -> [B, Q, H, C] (the latent output, before W_UV)."""
    scores = torch.matmul(qp, rows.transpose(-1, -2)).float().mul_(scale)  # [B, Q, H, k]
    scores.masked_fill_(valid.logical_not()[:, :, None], float("-inf"))
    p = torch.softmax(scores, dim=-1).to(rows.dtype)
    return torch.matmul(p, rows[..., :C])  # [B, Q, H, C]
