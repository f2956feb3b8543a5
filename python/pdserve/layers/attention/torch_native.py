"""Reference paged attention in plain torch (CPU and GPU), batched with padding + masks.

Legend: T tokens, B requests, Q longest new-token run, L longest KV length,
Hq query heads, Hkv kv heads, D head dim, Dn/R/Dv MLA nope/rope/value dims, C kv_lora_rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.layers.attention.base import AttentionBackend
from pdserve.layers.forward_batch import ForwardBatch


def _metadata(fb: ForwardBatch) -> dict:
    """Padding maps between the T flat tokens and a [B, Q] grid, plus the causal mask."""
    md = fb.attn_metadata
    if "mask" in md:
        return md
    ext, pre, seq = fb.extend_lens, fb.prefix_lens, fb.seq_lens
    S = fb.kv_pool.page_size
    # A request's position p sits at offset p % S of its (p // S)-th page, so the page
    # table is every S-th slot divided by S; KV is gathered page by page.
    md["pages"] = torch.div(fb.kv_slots[:, ::S], S, rounding_mode="floor")  # [B, Lp]
    B, L = fb.kv_slots.shape[0], md["pages"].shape[1] * S
    Q = int(ext.max()) if B else 0
    qi = torch.arange(Q)  # [Q]
    starts = torch.cumsum(ext, 0) - ext  # [B]
    valid = qi[None, :] < ext[:, None]  # [B, Q]
    md["q_index"] = (starts[:, None] + qi[None, :]).clamp(max=max(fb.num_tokens - 1, 0))  # [B, Q]
    md["q_valid"] = valid
    kj = torch.arange(L)  # [L]
    # key j visible to new token i iff j <= prefix + i (causal) and j < seq_len (not padding)
    mask = (kj[None, None, :] <= (pre[:, None, None] + qi[None, :, None])) & (kj[None, None, :] < seq[:, None, None])
    md["mask"] = mask[:, None]  # [B, 1, Q, L]
    md["single"] = B == 1
    return md


def _pad_q(x: torch.Tensor, md: dict) -> torch.Tensor:
    """[T, H, X] -> [B, H, Q, X]."""
    if md["single"]:
        return x.unsqueeze(0).transpose(1, 2)
    return x[md["q_index"]].transpose(1, 2)


def _unpad(o: torch.Tensor, md: dict) -> torch.Tensor:
    """[B, H, Q, X] -> [T, H, X]."""
    o = o.transpose(1, 2)  # [B, Q, H, X]
    if md["single"]:
        return o[0]
    return o[md["q_valid"]]


class _DecodeStage:
    """A contiguous copy of the running decode batch's KV, kept across steps.

    On CPU, gathering every request's pages each step costs as much as the
    matmuls. While the decode batch is unchanged (same requests by Req.uid, each one token
    longer), a step only appends one row per request here; any change of the
    batch rebuilds it from the pool, which stays the source of truth.
    Legend: B requests, H kv heads, X row width, L used length, K capacity.
    """

    MARGIN = 64  # decode steps between rebuilds caused by growth

    def __init__(self):
        self.req_uids: tuple | None = None
        self.seq_lens: torch.Tensor | None = None
        self.capacity = 0
        self.length = 0  # this step's longest sequence
        self.rows = self.pos = None  # this step's append coordinates, [B] each
        self.bufs: dict[int, tuple[torch.Tensor, ...]] = {}  # layer -> [B, H, K, X] each

    def plan(self, fb: ForwardBatch) -> str:
        """Per step, once: "append" when this is the staged batch one token later, else "rebuild"."""
        L = self.length = int(fb.seq_lens.max())
        same = (fb.req_uids is not None and fb.req_uids == self.req_uids and L <= self.capacity
                and torch.equal(self.seq_lens + 1, fb.seq_lens))
        self.req_uids, self.seq_lens = fb.req_uids, fb.seq_lens
        self.rows, self.pos = torch.arange(fb.batch_size), fb.seq_lens - 1
        if same:
            return "append"
        self.capacity = L + self.MARGIN
        self.bufs = {}
        return "rebuild"

    def get(self, layer: int, plan: str, new: tuple, gather) -> tuple[torch.Tensor, ...]:
        """new: this step's rows, each [B, H, X]; gather() -> the pool's [B, H, L', X] tensors."""
        L = self.length
        if plan == "rebuild" or layer not in self.bufs:
            bufs = []
            for t in gather():
                buf = t.new_zeros(t.shape[0], t.shape[1], self.capacity, t.shape[3])
                buf[:, :, :L] = t[:, :, :L]
                bufs.append(buf)
            self.bufs[layer] = tuple(bufs)
        else:
            for buf, t in zip(self.bufs[layer], new):
                buf[self.rows, :, self.pos] = t
        return tuple(buf[:, :, :L] for buf in self.bufs[layer])


class TorchNativeBackend(AttentionBackend):
    name = "torch_native"

    def __init__(self):
        self.stage = _DecodeStage()

    def _stage_plan(self, fb: ForwardBatch, md: dict) -> str | None:
        if not fb.is_decode or fb.req_uids is None:
            return None
        if "stage" not in md:
            md["stage"] = self.stage.plan(fb)
        return md["stage"]

    def _kv(self, layer_id: int, fb: ForwardBatch, md: dict, new: tuple, gather) -> tuple:
        """This layer's KV for the whole batch, [B, H, L, X] each: staged in decode, else gathered."""
        if not fb.is_decode or fb.req_uids is None:
            return gather()
        if "stage" not in md:
            md["stage"] = self.stage.plan(fb)
        return self.stage.get(layer_id, md["stage"], new, gather)

    def forward_gqa(self, q, k, v, layer_id, scale, fb):
        pool = fb.kv_pool
        pool.set_kv(layer_id, fb.out_cache_loc, k, v)
        fb.kv_written(layer_id)
        md = _metadata(fb)
        k_all, v_all = self._kv(layer_id, fb, md, (k, v),
                                lambda: pool.get_kv_pages(layer_id, md["pages"]))  # [B, Hkv, L, D]
        qp = _pad_q(q, md)  # [B, Hq, Q, D]
        o = F.scaled_dot_product_attention(
            qp, k_all.to(q.dtype), v_all.to(q.dtype), attn_mask=md["mask"][..., :k_all.shape[2]],
            scale=scale, enable_gqa=qp.shape[1] != k_all.shape[1])
        return _unpad(o, md)  # [T, Hq, D]

    def forward_mla(self, q_nope, q_pe, latent, k_pe, w_kc, w_vc, layer_id, scale, fb, absorbed=None):
        pool = fb.kv_pool
        new = torch.cat([latent, k_pe], dim=-1)  # [T, C+R]
        pool.set_latent(layer_id, fb.out_cache_loc, new)
        fb.kv_written(layer_id)
        md = _metadata(fb)
        (cache,) = self._kv(layer_id, fb, md, (new.unsqueeze(1),),
                            lambda: (pool.get_latent_pages(layer_id, md["pages"]).unsqueeze(1),))
        cache = cache[:, 0].to(q_nope.dtype)  # [B, L, C+R]
        md = {**md, "mask": md["mask"][..., :cache.shape[1]]}
        C = latent.shape[-1]
        if absorbed is None:
            absorbed = fb.is_decode
        if absorbed:
            o = self._mla_absorbed(q_nope, q_pe, cache, C, w_kc, w_vc, scale, md)
        else:
            o = self._mla_expanded(q_nope, q_pe, cache, C, w_kc, w_vc, scale, md)
        return _unpad(o, md)  # [T, H, Dv]

    @staticmethod
    def _mla_absorbed(q_nope, q_pe, cache, C, w_kc, w_vc, scale, md):
        # W_UK folds into the query, so attention runs in the C-wide latent space
        # against one shared "head": cheap per token, ideal for decode.
        q_lat = torch.einsum("thd,hdc->thc", q_nope, w_kc)  # [T, H, C]
        qp = _pad_q(torch.cat([q_lat, q_pe], dim=-1), md)  # [B, H, Q, C+R]
        kv = cache.unsqueeze(1)  # [B, 1, L, C+R]
        o_lat = F.scaled_dot_product_attention(qp, kv, kv[..., :C], attn_mask=md["mask"],
                                               scale=scale, enable_gqa=True)  # [B, H, Q, C]
        return torch.einsum("bhqc,hcv->bhqv", o_lat, w_vc)  # [B, H, Q, Dv]

    @staticmethod
    def _mla_expanded(q_nope, q_pe, cache, C, w_kc, w_vc, scale, md):
        # Up-project the latent into per-head K and V: more FLOPs per key, fewer
        # per query, which suits long extends.
        H = q_nope.shape[1]
        c, kpe = cache[..., :C], cache[..., C:]  # [B, L, C], [B, L, R]
        k_nope = torch.einsum("blc,hdc->bhld", c, w_kc)  # [B, H, L, Dn]
        v = torch.einsum("blc,hcv->bhlv", c, w_vc)  # [B, H, L, Dv]
        k = torch.cat([k_nope, kpe.unsqueeze(1).expand(-1, H, -1, -1)], dim=-1)  # [B, H, L, Dn+R]
        qp = _pad_q(torch.cat([q_nope, q_pe], dim=-1), md)  # [B, H, Q, Dn+R]
        return F.scaled_dot_product_attention(qp, k, v, attn_mask=md["mask"], scale=scale)
