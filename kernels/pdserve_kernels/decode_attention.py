"""Paged decode attention reading the KV pool in place: GQA over the HND pool, MLA over the
latent pool. Each program takes one request, one KV head's block of query heads and one split
of the keys, and writes a partial output with its log-sum-exp; ``merge_partials`` combines the
splits. Splitting the keys keeps the GPU busy when batch x heads is small and contexts long.

Legend: B requests, Hq query heads, Hkv kv heads, G = Hq / Hkv, L keys, Ns splits,
DK key width (D, or C+R for MLA), DV value width (D, or C), P pages, S page size.

One kernel serves both pools through strides: the GQA pool's layer is [P, Hkv, S, D]
(head stride S*D); the latent pool's layer is [P, S, C+R] seen as one KV head (head stride 0)
whose values are the first C columns of its keys.

FP8 pools (float8_e4m3fn, per-tensor scales, mem/kv_pool.py): keys and values are loaded as
stored and upcast to the query's type; the key scale is folded into the softmax scale and the
value scale into the output (``k_scale``/``v_scale``), which is the same as dequantizing every
element first, since a per-tensor scale factors out of both dot products.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _decode_partial_kernel(Q, K, V, Slots, SeqLens, O, Lse,
                           sq_b, sq_h, sk_p, sk_h, sk_s, sv_p, sv_h, sv_s, ss_b,
                           so_b, so_h, so_s, sl_b, sl_h,
                           scale, v_scale, page_size, group, hblocks, split_len,
                           DK1: tl.constexpr, DK2: tl.constexpr, DV: tl.constexpr, BLOCK_H: tl.constexpr,
                           BLOCK_DK1: tl.constexpr, BLOCK_DK2: tl.constexpr, BLOCK_DV: tl.constexpr,
                           BLOCK_N: tl.constexpr, SHARED_KV: tl.constexpr, IEEE: tl.constexpr):
    # Keys are [main DK1 | tail DK2] (MLA: latent C | rope R), each a power-of-two block, so
    # 576-wide MLA keys are not padded to 1024. SHARED_KV: values are the main part of the keys
    # (MLA's latent), taken from the tile already loaded instead of read twice.
    b = tl.program_id(0)
    kvh = tl.program_id(1) // hblocks
    heads = (tl.program_id(1) % hblocks) * BLOCK_H + tl.arange(0, BLOCK_H)  # within the group
    hmask = heads < group
    h = kvh * group + heads  # [BH] query heads
    split = tl.program_id(2)
    seq = tl.load(SeqLens + b)
    start = split * split_len
    end = tl.minimum(start + split_len, seq)
    d1 = tl.arange(0, BLOCK_DK1)
    d2 = DK1 + tl.arange(0, BLOCK_DK2)
    dv = tl.arange(0, BLOCK_DV)
    q_row = Q + b * sq_b + h[:, None] * sq_h
    q1 = tl.load(q_row + d1[None, :], mask=hmask[:, None] & (d1[None, :] < DK1), other=0.0)  # [BH, BDK1]
    if DK2 > 0:
        q2 = tl.load(q_row + d2[None, :], mask=hmask[:, None] & (d2[None, :] < DK1 + DK2), other=0.0)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        valid = offs < end
        slot = tl.load(Slots + b * ss_b + offs, mask=valid, other=0)
        page = slot // page_size
        off = slot % page_size
        k_row = K + (page * sk_p + kvh * sk_h + off * sk_s)[:, None]
        k1 = tl.load(k_row + d1[None, :], mask=valid[:, None] & (d1[None, :] < DK1),
                     other=0.0).to(Q.dtype.element_ty)  # [BN, BDK1]; an fp8 pool upcast
        s = _dot(q1, tl.trans(k1), IEEE)  # [BH, BN]
        if DK2 > 0:
            k2 = tl.load(k_row + d2[None, :], mask=valid[:, None] & (d2[None, :] < DK1 + DK2),
                         other=0.0).to(Q.dtype.element_ty)
            s += _dot(q2, tl.trans(k2), IEEE)
        s = tl.where(valid[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        if SHARED_KV:
            v = k1  # [BN, BDV]
        else:
            v = tl.load(V + (page * sv_p + kvh * sv_h + off * sv_s)[:, None] + dv[None, :],
                        mask=valid[:, None] & (dv[None, :] < DV), other=0.0).to(Q.dtype.element_ty)  # [BN, BDV]
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        l_sum = l_sum * alpha + tl.sum(p, 1)
        m = m_new
    has = l_sum > 0  # an empty split (past the request's end) contributes nothing to the merge
    lse = tl.where(has, m + tl.log(tl.where(has, l_sum, 1.0)), float("-inf"))
    out = acc * v_scale / tl.where(has, l_sum, 1.0)[:, None]
    o_ptr = O + b * so_b + h[:, None] * so_h + split * so_s + dv[None, :]
    tl.store(o_ptr, out, mask=hmask[:, None] & (dv[None, :] < DV))
    tl.store(Lse + b * sl_b + h * sl_h + split, lse, mask=hmask)


@triton.jit
def _merge_kernel(O, Lse, Out, so_b, so_h, so_s, sl_b, sl_h, sout_b, sout_h, num_splits,
                  DV: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    dv = tl.arange(0, BLOCK_DV)
    smask = s < num_splits
    lse = tl.load(Lse + b * sl_b + h * sl_h + s, mask=smask, other=float("-inf"))  # [BS]
    m = tl.max(lse, 0)
    w = tl.where(smask & (lse > float("-inf")), tl.exp(lse - m), 0.0)  # [BS]
    o = tl.load(O + b * so_b + h * so_h + s[:, None] * so_s + dv[None, :],
                mask=smask[:, None] & (dv[None, :] < DV), other=0.0)  # [BS, BDV]
    out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(Out + b * sout_b + h * sout_h + dv, out.to(Out.dtype.element_ty), mask=dv < DV)


def _f32_dot(x: torch.Tensor) -> bool:
    """Dots in float32 (IEEE, not TF32) for float32 inputs, so fp32 results match torch tightly,
    and always under the CPU interpreter, whose dots on bfloat16 operands are not exact."""
    return x.dtype == torch.float32 or x.device.type == "cpu"


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(n))


def default_num_splits(max_len: int, batch_heads: int, min_split: int = 256, target_programs: int = 264) -> int:
    """Enough splits to fill ~2 waves of a large GPU's SMs, none shorter than ``min_split`` keys."""
    want = max(1, target_programs // max(1, batch_heads))
    return max(1, min(want, triton.cdiv(max_len, min_split)))


def decode_partials(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_slots: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float, page_size: int, num_kv_heads: int, dv: int,
                    kv_strides: tuple[int, int, int], num_splits: int, max_len: int,
                    tail: int = 0, shared_kv: bool = False, block_n: int = 32, k_scale: float = 1.0,
                    v_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Hq, DK]; k/v a pool layer addressed by (page, head, slot) ``kv_strides`` (the same
    for k and v); kv_slots [B, L]; seq_lens [B] -> partial outputs [B, Hq, Ns, DV] (float32) and
    their log-sum-exp [B, Hq, Ns] (-inf for an empty split). ``tail``: the last DK columns taken
    as a second block (MLA's rope part); ``shared_kv``: values are the first DV key columns;
    ``k_scale``/``v_scale``: an fp8 pool's per-tensor scales (stored * scale = value)."""
    B, Hq, DK = q.shape
    G = Hq // num_kv_heads
    split_len = triton.cdiv(max(max_len, 1), num_splits)
    o = torch.empty(B, Hq, num_splits, dv, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, Hq, num_splits, dtype=torch.float32, device=q.device)
    block_h = _pow2(G)
    hblocks = triton.cdiv(G, block_h)
    if B == 0:
        return o, lse
    assert not shared_kv or dv == DK - tail, "shared_kv: values are the keys' main part"
    sp, sh, ss = kv_strides
    _decode_partial_kernel[(B, num_kv_heads * hblocks, num_splits)](
        q, k, v, kv_slots, seq_lens, o, lse,
        q.stride(0), q.stride(1), sp, sh, ss, sp, sh, ss, kv_slots.stride(0),
        o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1),
        scale * k_scale, v_scale, page_size, G, hblocks, split_len,
        DK1=DK - tail, DK2=tail, DV=dv, BLOCK_H=block_h, BLOCK_DK1=_pow2(DK - tail), BLOCK_DK2=_pow2(tail),
        BLOCK_DV=_pow2(dv), BLOCK_N=block_n, SHARED_KV=shared_kv, IEEE=_f32_dot(q))
    return o, lse


def merge_partials(o: torch.Tensor, lse: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """o [B, H, Ns, DV], lse [B, H, Ns] -> [B, H, DV]: each split weighted by exp(lse)."""
    B, H, Ns, DV = o.shape
    out = torch.empty(B, H, DV, dtype=out_dtype, device=o.device)
    if B:
        _merge_kernel[(B, H)](o, lse, out, o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1),
                              out.stride(0), out.stride(1), Ns, DV=DV, BLOCK_S=_pow2(Ns, 1),
                              BLOCK_DV=_pow2(DV, 1))
    return out


def _max_len(seq_lens: torch.Tensor, max_len: int | None) -> int:
    """The longest sequence (a bound is passed by callers that cannot sync, e.g. CUDA graphs)."""
    if max_len is not None:
        return max_len
    return int(seq_lens.max()) if seq_lens.numel() else 0


def decode_gqa(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, kv_slots: torch.Tensor,
               seq_lens: torch.Tensor, scale: float, num_splits: int | None = None,
               max_len: int | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """q [B, Hq, D]; k_pool/v_pool one layer of the HND pool [P, Hkv, S, D] -> [B, Hq, D]."""
    _, Hkv, S, D = k_pool.shape
    max_len = _max_len(seq_lens, max_len)
    ns = num_splits or default_num_splits(max_len, q.shape[0] * Hkv)
    o, lse = decode_partials(q, k_pool, v_pool, kv_slots, seq_lens, scale, S, Hkv, D,
                             (k_pool.stride(0), k_pool.stride(1), k_pool.stride(2)), ns, max_len,
                             k_scale=k_scale, v_scale=v_scale)
    return merge_partials(o, lse, q.dtype)


def decode_mla(q: torch.Tensor, latent_pool: torch.Tensor, kv_lora_rank: int, kv_slots: torch.Tensor,
               seq_lens: torch.Tensor, scale: float, num_splits: int | None = None,
               max_len: int | None = None, latent_scale: float = 1.0) -> torch.Tensor:
    """Absorbed MLA: q [B, H, C+R] (q_nope @ W_UK, then q_pe); latent_pool one layer [P, S, C+R]
    -> [B, H, C] (the latent output, before W_UV). ``latent_scale``: an fp8 pool's scale (keys and values)."""
    _, S, _ = latent_pool.shape
    max_len = _max_len(seq_lens, max_len)
    ns = num_splits or default_num_splits(max_len, q.shape[0])
    # One KV head (head stride 0) shared by all H query heads; values are the first C columns.
    o, lse = decode_partials(q, latent_pool, latent_pool, kv_slots, seq_lens, scale, S, 1, kv_lora_rank,
                             (latent_pool.stride(0), 0, latent_pool.stride(1)), ns, max_len,
                             tail=latent_pool.shape[-1] - kv_lora_rank, shared_kv=True,
                             k_scale=latent_scale, v_scale=latent_scale)
    return merge_partials(o, lse, q.dtype)


# ------------------------------------------------------------------ torch twins
def gather_tokens(pool_layer: torch.Tensor, slots: torch.Tensor, page_size: int, hnd: bool) -> torch.Tensor:
    """slots [n] -> the tokens' rows: [Hkv, n, D] from an HND layer, [n, C+R] from a latent layer."""
    page, off = torch.div(slots, page_size, rounding_mode="floor"), slots % page_size
    return pool_layer[page, :, off].transpose(0, 1) if hnd else pool_layer[page, off]


def _attend_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, k_scale: float = 1.0,
                v_scale: float = 1.0) -> torch.Tensor:
    """q [Hq, DK], k [Hkv, n, DK], v [Hkv, n, DV] (as stored; dequantized here) -> [Hq, DV] in float32."""
    G = q.shape[0] // k.shape[0]
    k, v = (k.float() * k_scale).repeat_interleave(G, 0), (v.float() * v_scale).repeat_interleave(G, 0)
    p = torch.softmax(torch.einsum("hd,hnd->hn", q.float(), k) * scale, dim=-1)
    return torch.einsum("hn,hnd->hd", p, v)


def decode_gqa_ref(q, k_pool, v_pool, kv_slots, seq_lens, scale, k_scale=1.0, v_scale=1.0) -> torch.Tensor:
    S = k_pool.shape[2]
    out = [_attend_ref(q[b], gather_tokens(k_pool, kv_slots[b, :n], S, True),
                       gather_tokens(v_pool, kv_slots[b, :n], S, True), scale, k_scale, v_scale)
           for b, n in enumerate(seq_lens.tolist())]
    return torch.stack(out).to(q.dtype) if out else q.new_empty(q.shape)


def decode_mla_ref(q, latent_pool, kv_lora_rank, kv_slots, seq_lens, scale, latent_scale=1.0) -> torch.Tensor:
    S = latent_pool.shape[1]
    out = []
    for b, n in enumerate(seq_lens.tolist()):
        kv = gather_tokens(latent_pool, kv_slots[b, :n], S, False)[None]  # [1, n, C+R]
        out.append(_attend_ref(q[b], kv, kv[..., :kv_lora_rank], scale, latent_scale, latent_scale))
    return torch.stack(out).to(q.dtype)


def merge_partials_ref(o: torch.Tensor, lse: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    w = torch.softmax(lse, dim=-1)  # [B, H, Ns]; an empty split's -inf weighs 0
    return torch.einsum("bhs,bhsd->bhd", w, o).to(out_dtype)
