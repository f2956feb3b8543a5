"""Triton attention over the paged pools in place (kernels in pdserve_kernels).

Legend: T tokens, B requests, Hq query heads, H MLA heads, D head dim, Dn/R/Dv MLA nope/rope/value
dims, C kv_lora_rank, L longest sequence.

Decode reads each request's keys through its slot row (split-KV partials, then an LSE merge);
extend runs causal attention over prefix + new keys. MLA always runs absorbed (attention in the
C-wide latent space against one shared head), for extend too: it is the same function as the
expanded form (test_attention checks the twins agree) and reads the latent pool in place,
where the expanded form would materialise per-head K and V. On CPU the kernels run only under
the Triton interpreter (engine/device.py refuses otherwise). An fp8 pool is read in place too:
the kernels upcast its bytes and apply the pool's per-tensor scales.

DeepSeek-V3.2 (``forward_mla_sparse``): every query token, decode or extend, scores its
request's index keys in place (``sparse_mla.index_topk``: a Triton score kernel, then top-k)
and attends to the latent rows of its picks only (``sparse_mla.attend``: FlashMLA's sparse kernel
where it is installed and the shapes are DeepSeek's, else the Triton ``sparse_mla``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.layers.attention.base import AttentionBackend, AttentionMetadata
from pdserve.layers.forward_batch import ForwardBatch


@dataclass(frozen=True)
class TritonMetadata(AttentionMetadata):
    """The batch as the kernels read it; the bounds are host ints, so no layer syncs."""

    kv_slots: torch.Tensor  # [B, L] pool slot of each request's token, in position order
    prefix_lens: torch.Tensor  # [B]
    extend_lens: torch.Tensor  # [B]
    seq_lens: torch.Tensor  # [B]
    max_len: int  # L
    max_extend: int  # longest run of new tokens
    num_splits: int  # decode: key splits per request (1 for extend)
    token_req: torch.Tensor  # [T] row of kv_slots each token belongs to (sparse attention's flat queries)
    token_vis: torch.Tensor  # [T] how many of its request's tokens each token sees (causal)


class TritonBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graph = True  # prepare reads kv_slots' width, never its values

    def __init__(self):
        # Imported here, not at module load: triton is needed only once this backend is chosen.
        from pdserve_kernels import decode_attention, extend_attention, sparse_mla

        self.decode = decode_attention
        self.extend = extend_attention
        self.sparse = sparse_mla

    def prepare(self, fb: ForwardBatch) -> TritonMetadata:
        B = fb.batch_size
        max_len = int(fb.kv_slots.shape[1])
        max_extend = 1 if fb.is_decode else (int(fb.extend_lens.max()) if B else 0)
        heads = getattr(fb.kv_pool, "num_kv_heads", 1)
        splits = self.decode.default_num_splits(max_len, B * heads) if fb.is_decode else 1
        if fb.is_decode:  # one token per request, which sees all of it
            req, vis = torch.arange(B, device=fb.seq_lens.device), fb.seq_lens
        else:
            req, vis = self.sparse.token_rows(fb.prefix_lens, fb.extend_lens, fb.num_tokens)
        return TritonMetadata(fb.kv_slots, fb.prefix_lens, fb.extend_lens, fb.seq_lens, max_len, max_extend, splits,
                              req, vis)

    def forward_gqa(self, q, k, v, layer_id, scale, fb):
        pool = fb.kv_pool
        pool.set_kv(layer_id, fb.out_cache_loc, k, v)
        fb.kv_written(layer_id)
        md = self.metadata_of(fb, TritonMetadata)
        q = q.contiguous()  # [T, Hq, D]
        kp, vp = pool.k[layer_id], pool.v[layer_id]  # [P, Hkv, S, D] each, read in place
        if fb.is_decode:
            return self.decode.decode_gqa(q, kp, vp, md.kv_slots, md.seq_lens, scale, md.num_splits, md.max_len,
                                          k_scale=pool.k_scale, v_scale=pool.v_scale)
        return self.extend.extend_gqa(q, kp, vp, md.kv_slots, md.prefix_lens, md.extend_lens, scale,
                                      md.max_extend, k_scale=pool.k_scale, v_scale=pool.v_scale)  # [T, Hq, D]

    def forward_mla(self, q_nope, q_pe, latent, k_pe, w_kc, w_vc, layer_id, scale, fb, absorbed=None):
        pool = fb.kv_pool
        pool.set_latent(layer_id, fb.out_cache_loc, torch.cat([latent, k_pe], dim=-1))  # [T, C+R]
        fb.kv_written(layer_id)
        md = self.metadata_of(fb, TritonMetadata)
        C = latent.shape[-1]
        q_lat = torch.einsum("thd,hdc->thc", q_nope, w_kc)  # [T, H, C]
        q = torch.cat([q_lat, q_pe], dim=-1).contiguous()  # [T, H, C+R]
        lat = pool.latent[layer_id]  # [P, S, C+R], read in place
        if fb.is_decode:
            o_lat = self.decode.decode_mla(q, lat, C, md.kv_slots, md.seq_lens, scale, md.num_splits, md.max_len,
                                           latent_scale=pool.latent_scale)
        else:
            o_lat = self.extend.extend_mla(q, lat, C, md.kv_slots, md.prefix_lens, md.extend_lens, scale,
                                           md.max_extend, latent_scale=pool.latent_scale)
        return torch.einsum("thc,hcv->thv", o_lat, w_vc)  # [T, H, Dv]

    def forward_mla_sparse(self, q_nope, q_pe, latent, k_pe, w_kc, w_vc, layer_id, scale, index, fb):
        pool = fb.kv_pool
        pool.set_latent(layer_id, fb.out_cache_loc, torch.cat([latent, k_pe], dim=-1))  # [T, C+R]
        pool.set_index_k(layer_id, fb.out_cache_loc, index.k)
        fb.kv_written(layer_id)
        md = self.metadata_of(fb, TritonMetadata)
        key_scale = None if pool.index_k_scale is None else pool.index_k_scale[layer_id]  # FP8 index keys' scales
        picks = self.sparse.index_topk(index.q.contiguous(), index.weights.float().contiguous(), pool.index_k[layer_id],
                                       md.kv_slots, md.token_req, md.token_vis, index.scale, index.topk,
                                       index_k_scale=key_scale)  # [T, k]
        q_lat = torch.einsum("thd,hdc->thc", q_nope, w_kc)  # [T, H, C]
        q = torch.cat([q_lat, q_pe], dim=-1).contiguous()  # [T, H, C+R]
        o_lat = self.sparse.attend(q, pool.latent[layer_id], latent.shape[-1], picks, scale,
                                   latent_scale=pool.latent_scale)  # [T, H, C]; FlashMLA where usable
        return torch.einsum("thc,hcv->thv", o_lat, w_vc)  # [T, H, Dv]
