"""DeepSeek-V3.2's sparse attention (DSA) over the paged pools in place: the lightning indexer's
score + top-k over the index keys (``index_topk``), then absorbed MLA of each query over only
the latent rows it chose (``sparse_mla``). Twins: ``sparse_mla_ref``.

Legend: T query tokens, B requests, L longest sequence (kv_slots' width), Hi index heads,
Di index head dim, k picks per query (index_topk, at most L), H heads, C kv_lora_rank,
R rope dim, P pages, S page size.

Queries are flat: token t belongs to row ``req[t]`` of kv_slots and sees that request's first
``vis[t]`` tokens (prefix + its offset in the extend + 1), so one launch serves decode and
extend alike. A pick is a pool slot; -1 marks a padding pick (a query seeing fewer than k tokens).

``attend`` is what a backend calls: FlashMLA's sparse kernel (``flash_mla.flash_mla_sparse_fwd``,
imported only there) where it is installed and the shapes are DeepSeek's (bf16 latent, C 512,
R 64, on CUDA), else ``sparse_mla``. Both read the pool in place by slot.
"""

from __future__ import annotations

import importlib.util

import torch
import triton
import triton.language as tl

from pdserve_kernels.sparse_mla_ref import topk_first_on_ties

# Queries per index_topk launch: bounds the [rows, L] float32 score buffer (256 MiB).
SCORE_ELEMENTS = 1 << 26


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _index_score_kernel(Q, W, K, KS, Slots, Req, Vis, Out, sq_t, sq_h, sw_t, sk_p, sk_s, sks_p, sks_s, ss_b, so_t,
                        scale, page_size, width,
                        HI: tl.constexpr, DI: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_N: tl.constexpr, IEEE: tl.constexpr, KBLOCK: tl.constexpr):
    # One program: one query against one block of its request's tokens, read by slot from the
    # paged index keys. score_j = sum_h w[h] * relu(scale * q[h] . k_j); -inf past what it sees.
    # KBLOCK > 0: the keys are e4m3 and KS holds a float32 scale per KBLOCK values of each key.
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    b = tl.load(Req + t)
    vis = tl.load(Vis + t)
    valid = offs < vis
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    q = tl.load(Q + t * sq_t + h[:, None] * sq_h + d[None, :], mask=(h[:, None] < HI) & (d[None, :] < DI),
                other=0.0)  # [BH, BD]
    w = tl.load(W + t * sw_t + h, mask=h < HI, other=0.0)  # [BH] float32; padded heads weigh 0
    slot = tl.load(Slots + b * ss_b + offs, mask=valid, other=0)
    kmask = valid[:, None] & (d[None, :] < DI)
    k = tl.load(K + ((slot // page_size) * sk_p + (slot % page_size) * sk_s)[:, None] + d[None, :],
                mask=kmask, other=0.0)  # [BN, BD]
    if KBLOCK > 0:
        ks = tl.load(KS + ((slot // page_size) * sks_p + (slot % page_size) * sks_s)[:, None] + (d // KBLOCK)[None, :],
                     mask=kmask, other=0.0)  # [BN, BD] each value's block scale
        k = k.to(tl.float32) * ks
    k = k.to(Q.dtype.element_ty)
    s = tl.maximum(_dot(q, tl.trans(k), IEEE) * scale, 0.0)  # [BH, BN]
    score = tl.sum(s * w[:, None], 0)  # [BN]
    tl.store(Out + t * so_t + offs, tl.where(valid, score, float("-inf")), mask=offs < width)


@triton.jit
def _sparse_mla_kernel(Q, Lat, Sel, O, sq_t, sq_h, sl_p, sl_s, ss_t, so_t, so_h,
                       scale, v_scale, page_size, num_heads, num_picks,
                       C: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    # One program: one query token, a block of heads, online softmax over its picks. The latent
    # is both key ([C | R] columns) and value (its first C), read once per pick.
    t = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < num_heads
    c = tl.arange(0, BLOCK_C)
    r = C + tl.arange(0, BLOCK_R)
    q_row = Q + t * sq_t + h[:, None] * sq_h
    q1 = tl.load(q_row + c[None, :], mask=hmask[:, None] & (c[None, :] < C), other=0.0)  # [BH, BC]
    q2 = tl.load(q_row + r[None, :], mask=hmask[:, None] & (r[None, :] < C + R), other=0.0)  # [BH, BR]
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    for n0 in range(0, num_picks, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        slot = tl.load(Sel + t * ss_t + offs, mask=offs < num_picks, other=-1)
        valid = slot >= 0
        row = Lat + ((slot // page_size) * sl_p + (slot % page_size) * sl_s)[:, None]
        k1 = tl.load(row + c[None, :], mask=valid[:, None] & (c[None, :] < C), other=0.0).to(Q.dtype.element_ty)
        k2 = tl.load(row + r[None, :], mask=valid[:, None] & (r[None, :] < C + R), other=0.0).to(Q.dtype.element_ty)
        s = _dot(q1, tl.trans(k1), IEEE) + _dot(q2, tl.trans(k2), IEEE)  # [BH, BN]
        s = tl.where(valid[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        # Picks come unordered, so a block may hold only padding: keep exp() off -inf - -inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        acc = acc * alpha[:, None] + _dot(p.to(k1.dtype), k1, IEEE)
        l_sum = l_sum * alpha + tl.sum(p, 1)
        m = m_new
    out = acc * v_scale / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    tl.store(O + t * so_t + h[:, None] * so_h + c[None, :], out.to(O.dtype.element_ty),
             mask=hmask[:, None] & (c[None, :] < C))


def _f32_dot(x: torch.Tensor) -> bool:
    """IEEE float32 dots for float32 inputs and always under the CPU interpreter (as decode_attention)."""
    return x.dtype == torch.float32 or x.device.type == "cpu"


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(n))


def token_rows(prefix_lens: torch.Tensor, extend_lens: torch.Tensor, num_tokens: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat queries' (req [T], vis [T]): each token's row of kv_slots and how many of its
    request's tokens it sees. ``num_tokens`` (T, a host int) keeps this free of a device sync."""
    B = prefix_lens.shape[0]
    req = torch.repeat_interleave(torch.arange(B, device=prefix_lens.device), extend_lens, output_size=num_tokens)
    starts = torch.cumsum(extend_lens, 0) - extend_lens  # [B]
    vis = prefix_lens[req] + torch.arange(num_tokens, device=req.device) - starts[req] + 1
    return req, vis


def index_scores(q: torch.Tensor, weights: torch.Tensor, index_k: torch.Tensor, kv_slots: torch.Tensor,
                 req: torch.Tensor, vis: torch.Tensor, scale: float,
                 index_k_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, Hi, Di], weights [T, Hi] float32, index_k one layer [P, S, Di], kv_slots [B, L]
    -> [T, L] float32: token j's index score for query t, -inf where t does not see j.
    ``index_k_scale`` [P, S, Di / block] float32: index_k is e4m3, each block of its keys times its scale."""
    T, Hi, Di = q.shape
    L = kv_slots.shape[1]
    out = torch.empty(T, L, dtype=torch.float32, device=q.device)
    if T == 0 or L == 0:
        return out
    block_n = 64
    ks = index_k_scale if index_k_scale is not None else out  # a placeholder pointer, never read
    kblock = Di // index_k_scale.shape[-1] if index_k_scale is not None else 0
    _index_score_kernel[(T, triton.cdiv(L, block_n))](
        q, weights, index_k, ks, kv_slots, req, vis, out, q.stride(0), q.stride(1), weights.stride(0),
        index_k.stride(0), index_k.stride(1), ks.stride(0), ks.stride(1), kv_slots.stride(0), out.stride(0), scale,
        index_k.shape[1], L,
        HI=Hi, DI=Di, BLOCK_H=_pow2(Hi), BLOCK_D=_pow2(Di), BLOCK_N=block_n, IEEE=_f32_dot(q), KBLOCK=kblock)
    return out


def index_topk(q: torch.Tensor, weights: torch.Tensor, index_k: torch.Tensor, kv_slots: torch.Tensor,
               req: torch.Tensor, vis: torch.Tensor, scale: float, topk: int,
               index_k_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The indexer's selection: -> [T, k] pool slots of each query's ``k = min(topk, L)`` best
    visible tokens (unordered), -1 for padding picks. Scores come from ``index_scores``, in
    blocks of queries so the score buffer stays bounded; the top-k takes ties at its cut from the
    lowest position (``topk_first_on_ties``). ``index_k_scale``: as ``index_scores``."""
    T, L = q.shape[0], kv_slots.shape[1]
    k = min(topk, L)
    step = max(1, SCORE_ELEMENTS // max(1, L))
    picks = []
    for t0 in range(0, T, step):
        rows = slice(t0, t0 + step)
        score = index_scores(q[rows], weights[rows], index_k, kv_slots, req[rows], vis[rows], scale,
                             index_k_scale)  # [t, L]
        pos = topk_first_on_ties(score, k)  # [t, k]
        slots = kv_slots[req[rows, None], pos]  # [t, k]
        picks.append(torch.where(pos < vis[rows, None], slots, -1))
    return torch.cat(picks) if len(picks) != 1 else picks[0]


def sparse_mla(q: torch.Tensor, latent_pool: torch.Tensor, kv_lora_rank: int, picks: torch.Tensor,
               scale: float, latent_scale: float = 1.0) -> torch.Tensor:
    """Absorbed MLA over the picked rows only: q [T, H, C+R] (q_nope @ W_UK, then q_pe), latent_pool
    one layer [P, S, C+R], picks [T, k] slots (-1: none) -> [T, H, C] (the latent output, before
    W_UV). ``latent_scale``: an fp8 pool's scale (keys and values)."""
    T, H, _ = q.shape
    C, R = kv_lora_rank, latent_pool.shape[-1] - kv_lora_rank
    out = torch.empty(T, H, C, dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    block_h = 16  # tl.dot's least M; more heads per program would hold [BH, C] accumulators past the registers
    _sparse_mla_kernel[(T, triton.cdiv(H, block_h))](
        q, latent_pool, picks, out, q.stride(0), q.stride(1), latent_pool.stride(0), latent_pool.stride(1),
        picks.stride(0), out.stride(0), out.stride(1), scale * latent_scale, latent_scale, latent_pool.shape[1],
        H, picks.shape[1], C=C, R=R, BLOCK_H=block_h, BLOCK_C=_pow2(C), BLOCK_R=_pow2(R), BLOCK_N=32,
        IEEE=_f32_dot(q))
    return out


FLASHMLA_C, FLASHMLA_DQK = 512, 576  # the only latent and key widths FlashMLA's sparse kernels take


def flashmla_usable(q: torch.Tensor, latent_pool: torch.Tensor, kv_lora_rank: int, latent_scale: float) -> bool:
    """FlashMLA's sparse prefill kernel serves these inputs: CUDA, bf16 query and pool, DeepSeek's widths."""
    return (q.is_cuda and q.dtype == latent_pool.dtype == torch.bfloat16 and kv_lora_rank == FLASHMLA_C
            and q.shape[-1] == latent_pool.shape[-1] == FLASHMLA_DQK and latent_scale == 1.0
            and importlib.util.find_spec("flash_mla") is not None)


def sparse_mla_flashmla(q: torch.Tensor, latent_pool: torch.Tensor, kv_lora_rank: int, picks: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """``sparse_mla`` through FlashMLA's ``flash_mla_sparse_fwd`` (the pool seen as [P*S, 1, C+R];
    -1 picks are what it ignores). It takes whole blocks of heads and picks, so both are padded:
    heads with zeros (their rows dropped), picks with -1."""
    from flash_mla import flash_mla_sparse_fwd  # imported only when this path runs

    T, H, D = q.shape
    head_block = 128 if torch.cuda.get_device_capability(q.device)[0] >= 10 else 64
    Hp, k = triton.cdiv(H, head_block) * head_block, picks.shape[1]
    qp = q if Hp == H else torch.cat([q, q.new_zeros(T, Hp - H, D)], dim=1)
    idx = torch.full((T, 1, triton.cdiv(k, 64) * 64), -1, dtype=torch.int32, device=q.device)
    idx[:, 0, :k] = picks.to(torch.int32)
    kv = latent_pool.view(-1, 1, latent_pool.shape[-1])  # [P*S, 1, C+R]: a slot is a row
    out = flash_mla_sparse_fwd(qp.contiguous(), kv, idx, scale, kv_lora_rank)[0]  # [T, Hp, C]
    return out[:, :H]


def attend(q: torch.Tensor, latent_pool: torch.Tensor, kv_lora_rank: int, picks: torch.Tensor, scale: float,
           latent_scale: float = 1.0) -> torch.Tensor:
    """Absorbed MLA over each query's picks (``sparse_mla``'s contract): FlashMLA where usable, else Triton."""
    if flashmla_usable(q, latent_pool, kv_lora_rank, latent_scale):
        return sparse_mla_flashmla(q, latent_pool, kv_lora_rank, picks, scale)
    return sparse_mla(q, latent_pool, kv_lora_rank, picks, scale, latent_scale)
