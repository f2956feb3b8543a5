"""Extend (prefill) attention over the paged pool with a cached prefix, causal within the new
tokens. The new tokens' KV is already in the pool (backends write it first), so every key comes
from the pool in place: no contiguous copy of a request's KV is ever built.

Legend: T new tokens (all requests), B requests, Hq query heads, Hkv kv heads, G = Hq / Hkv,
DK key width, DV value width, L keys of a request (prefix + new), S page size.
Query i of request b (absolute position prefix_b + i) sees keys j <= prefix_b + i.
An fp8 pool's keys and values are upcast on load, their per-tensor scales folded into the
softmax scale (K) and the output (V), as in decode_attention.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve_kernels.decode_attention import _attend_ref, _f32_dot, _pow2, gather_tokens


@triton.jit
def _extend_kernel(Q, K, V, Slots, QStart, Prefix, Ext, O,
                   sq_t, sq_h, sk_p, sk_h, sk_s, ss_b, so_t, so_h,
                   scale, v_scale, page_size, group,
                   DK: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, IEEE: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // group
    n_new = tl.load(Ext + b)
    m0 = tl.program_id(2) * BLOCK_M
    if m0 < n_new:
        prefix = tl.load(Prefix + b)
        q0 = tl.load(QStart + b)
        rows = m0 + tl.arange(0, BLOCK_M)
        rmask = rows < n_new
        dk = tl.arange(0, BLOCK_DK)
        dv = tl.arange(0, BLOCK_DV)
        q = tl.load(Q + (q0 + rows)[:, None] * sq_t + h * sq_h + dk[None, :],
                    mask=rmask[:, None] & (dk[None, :] < DK), other=0.0)  # [BM, BDK]
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        end = prefix + tl.minimum(m0 + BLOCK_M, n_new)  # keys the block's last query sees, + 1
        for n0 in range(0, end, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            cmask = cols < end
            slot = tl.load(Slots + b * ss_b + cols, mask=cmask, other=0)
            base = (slot // page_size) * sk_p + kvh * sk_h + (slot % page_size) * sk_s
            k = tl.load(K + base[:, None] + dk[None, :], mask=cmask[:, None] & (dk[None, :] < DK),
                        other=0.0).to(Q.dtype.element_ty)  # an fp8 pool upcast
            if IEEE:
                s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            visible = cmask[None, :] & (cols[None, :] <= prefix + rows[:, None])
            s = tl.where(visible, s * scale, float("-inf"))  # [BM, BN]
            m_new = tl.maximum(m, tl.max(s, 1))
            m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # padded query rows see nothing
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m - m_safe)
            v = tl.load(V + base[:, None] + dv[None, :], mask=cmask[:, None] & (dv[None, :] < DV),
                        other=0.0).to(Q.dtype.element_ty)
            if IEEE:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            l_sum = l_sum * alpha + tl.sum(p, 1)
            m = m_new
        out = acc * v_scale / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
        tl.store(O + (q0 + rows)[:, None] * so_t + h * so_h + dv[None, :], out.to(O.dtype.element_ty),
                 mask=rmask[:, None] & (dv[None, :] < DV))


def extend_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_slots: torch.Tensor,
                     prefix_lens: torch.Tensor, extend_lens: torch.Tensor, scale: float, page_size: int,
                     num_kv_heads: int, dv: int, kv_strides: tuple[int, int, int],
                     max_extend: int | None = None, block_m: int = 16, block_n: int = 32,
                     k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """q [T, Hq, DK] (requests' new tokens back to back); k/v a pool layer addressed by
    (page, head, slot) ``kv_strides``; kv_slots [B, L] -> [T, Hq, DV]. ``k_scale``/``v_scale``:
    an fp8 pool's per-tensor scales."""
    T, Hq, DK = q.shape
    out = torch.empty(T, Hq, dv, dtype=q.dtype, device=q.device)
    B = extend_lens.shape[0]
    if T == 0:
        return out
    if max_extend is None:
        max_extend = int(extend_lens.max())
    q_start = torch.cumsum(extend_lens, 0) - extend_lens  # [B]
    sp, sh, ss = kv_strides
    grid = (B, Hq, triton.cdiv(max_extend, block_m))
    _extend_kernel[grid](q, k, v, kv_slots, q_start, prefix_lens, extend_lens, out,
                         q.stride(0), q.stride(1), sp, sh, ss, kv_slots.stride(0), out.stride(0), out.stride(1),
                         scale * k_scale, v_scale, page_size, Hq // num_kv_heads,
                         DK=DK, DV=dv, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_DK=_pow2(DK), BLOCK_DV=_pow2(dv),
                         IEEE=_f32_dot(q))
    return out


def extend_gqa(q, k_pool, v_pool, kv_slots, prefix_lens, extend_lens, scale, max_extend=None,
               k_scale=1.0, v_scale=1.0) -> torch.Tensor:
    """q [T, Hq, D]; k_pool/v_pool one HND layer [P, Hkv, S, D] -> [T, Hq, D]."""
    _, Hkv, S, D = k_pool.shape
    return extend_attention(q, k_pool, v_pool, kv_slots, prefix_lens, extend_lens, scale, S, Hkv, D,
                            (k_pool.stride(0), k_pool.stride(1), k_pool.stride(2)), max_extend,
                            k_scale=k_scale, v_scale=v_scale)


def extend_mla(q, latent_pool, kv_lora_rank, kv_slots, prefix_lens, extend_lens, scale,
               max_extend=None, latent_scale=1.0) -> torch.Tensor:
    """Absorbed MLA extend: q [T, H, C+R]; latent_pool one layer [P, S, C+R] -> [T, H, C]."""
    S = latent_pool.shape[1]
    return extend_attention(q, latent_pool, latent_pool, kv_slots, prefix_lens, extend_lens, scale, S, 1,
                            kv_lora_rank, (latent_pool.stride(0), 0, latent_pool.stride(1)), max_extend,
                            k_scale=latent_scale, v_scale=latent_scale)


# ------------------------------------------------------------------ torch twins
def _causal_ref(q, k, v, prefix: int, scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """q [n, Hq, DK], k [Hkv, L, DK], v [Hkv, L, DV] -> [n, Hq, DV] in float32."""
    out = [_attend_ref(q[i], k[:, :prefix + i + 1], v[:, :prefix + i + 1], scale, k_scale, v_scale)
           for i in range(q.shape[0])]
    return torch.stack(out)


def extend_gqa_ref(q, k_pool, v_pool, kv_slots, prefix_lens, extend_lens, scale, k_scale=1.0,
                   v_scale=1.0) -> torch.Tensor:
    S = k_pool.shape[2]
    out, t = [], 0
    for b, (pre, n) in enumerate(zip(prefix_lens.tolist(), extend_lens.tolist())):
        slots = kv_slots[b, :pre + n]
        out.append(_causal_ref(q[t:t + n], gather_tokens(k_pool, slots, S, True),
                               gather_tokens(v_pool, slots, S, True), pre, scale, k_scale, v_scale))
        t += n
    return torch.cat(out).to(q.dtype)


def extend_mla_ref(q, latent_pool, kv_lora_rank, kv_slots, prefix_lens, extend_lens, scale,
                   latent_scale=1.0) -> torch.Tensor:
    S = latent_pool.shape[1]
    out, t = [], 0
    for b, (pre, n) in enumerate(zip(prefix_lens.tolist(), extend_lens.tolist())):
        kv = gather_tokens(latent_pool, kv_slots[b, :pre + n], S, False)[None]  # [1, L, C+R]
        out.append(_causal_ref(q[t:t + n], kv, kv[..., :kv_lora_rank], pre, scale, latent_scale, latent_scale))
        t += n
    return torch.cat(out).to(q.dtype)
