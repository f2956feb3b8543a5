"""flashinfer attention over pdserve's pools in place: GQA paged prefill/decode on the per-layer
K and V pools (``kv_layout="HND"``, pdserve's layout), MLA through flashinfer's MLA paged
wrapper on the latent pool with absorbed weights (compressed and rope parts as views of one
[P, S, C+R] tensor).

Legend: T tokens, B requests, Hq/Hkv query/kv heads, H MLA heads, D head dim, C kv_lora_rank,
R rope dim, S page size, Np pages used by the batch.

The plan (CSR page table: indptr, indices, last-page lengths; int32) is plain torch and built
once per forward in ``prepare``; flashinfer's ``plan`` needs the heads and scale only a layer
knows, so it runs at the forward's first layer and is reused by the rest. flashinfer is
imported when this backend is built, never by ``import pdserve``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.layers.attention.base import AttentionBackend, AttentionMetadata
from pdserve.layers.forward_batch import ForwardBatch

WORKSPACE_BYTES = 128 << 20  # flashinfer's float workspace (split-KV partials), per backend


@dataclass(frozen=True)
class PagedPlan(AttentionMetadata):
    """flashinfer's view of one batch. ``planned`` records which wrapper was planned for which
    (heads, dims, scale) during this forward (filled by the first layer)."""

    qo_indptr: torch.Tensor  # [B+1] int32 first new token of each request in the T tokens
    kv_indptr: torch.Tensor  # [B+1] int32 first page of each request in kv_indices
    kv_indices: torch.Tensor  # [Np] int32 page ids, each request's in position order
    kv_last_page_len: torch.Tensor  # [B] int32 tokens in each request's last page (1..S)
    kv_lens: torch.Tensor  # [B] int32 keys of each request (prefix + new)
    page_size: int
    planned: dict = field(default_factory=dict, compare=False)


def build_plan(fb: ForwardBatch) -> PagedPlan:
    """The CSR page table of ``fb`` (plain torch, on fb's device): a request's position p lives at
    offset p % S of page kv_slots[b, p - p % S] // S, the page table's promise (forward_batch.py)."""
    S = fb.kv_pool.page_size
    seq, ext = fb.seq_lens, fb.extend_lens
    num_pages = torch.div(seq + S - 1, S, rounding_mode="floor")  # [B]
    pages = torch.div(fb.kv_slots[:, ::S], S, rounding_mode="floor")  # [B, Lp]
    used = torch.arange(pages.shape[1], device=pages.device)[None, :] < num_pages[:, None]  # [B, Lp]
    zero = torch.zeros(1, dtype=torch.int64, device=seq.device)
    i32 = torch.int32
    return PagedPlan(qo_indptr=torch.cat([zero, torch.cumsum(ext, 0)]).to(i32),
                     kv_indptr=torch.cat([zero, torch.cumsum(num_pages, 0)]).to(i32),
                     kv_indices=pages[used].to(i32),
                     kv_last_page_len=(seq - (num_pages - 1) * S).to(i32),
                     kv_lens=seq.to(i32), page_size=S)


def import_flashinfer():
    try:
        import flashinfer
    except ImportError as e:
        raise ValueError(f"attention_backend: 'flashinfer' needs the flashinfer-python package ({e}); "
                         "pip install flashinfer-python, or --attention-backend triton") from None
    return flashinfer


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"

    def __init__(self):
        self.fi = import_flashinfer()
        self._wrappers: dict[str, object] = {}
        self._workspace: torch.Tensor | None = None

    def _wrapper(self, kind: str, device: torch.device):
        """One wrapper per kind, sharing one workspace, built on first use on the pool's device."""
        if kind not in self._wrappers:
            if self._workspace is None:
                self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            ws = self._workspace
            self._wrappers[kind] = {
                "prefill": lambda: self.fi.BatchPrefillWithPagedKVCacheWrapper(ws, kv_layout="HND"),
                "decode": lambda: self.fi.BatchDecodeWithPagedKVCacheWrapper(ws, kv_layout="HND",
                                                                             use_tensor_cores=True),
                "mla": lambda: self.fi.mla.BatchMLAPagedAttentionWrapper(ws),
            }[kind]()
        return self._wrappers[kind]

    def prepare(self, fb: ForwardBatch) -> PagedPlan:
        return build_plan(fb)

    def forward_gqa(self, q, k, v, layer_id, scale, fb):
        pool = fb.kv_pool
        pool.set_kv(layer_id, fb.out_cache_loc, k, v)
        fb.kv_written(layer_id)
        md = self.metadata_of(fb, PagedPlan)
        kind = "decode" if fb.is_decode else "prefill"
        wrapper = self._wrapper(kind, q.device)
        key = (kind, q.shape[1], k.shape[1], q.shape[2], scale)
        if key not in md.planned:
            self._plan_gqa(wrapper, kind, md, q, pool, scale)
            md.planned[key] = True
        return wrapper.run(q.contiguous(), (pool.k[layer_id], pool.v[layer_id]))  # [T, Hq, D]

    @staticmethod
    def _plan_gqa(wrapper, kind, md: PagedPlan, q, pool, scale) -> None:
        Hq, D, Hkv = q.shape[1], q.shape[2], pool.num_kv_heads
        common = dict(q_data_type=q.dtype, kv_data_type=pool.dtype, sm_scale=scale)
        if kind == "decode":
            wrapper.plan(md.kv_indptr, md.kv_indices, md.kv_last_page_len, Hq, Hkv, D, md.page_size, **common)
        else:
            wrapper.plan(md.qo_indptr, md.kv_indptr, md.kv_indices, md.kv_last_page_len, Hq, Hkv, D,
                         md.page_size, causal=True, **common)

    def forward_mla(self, q_nope, q_pe, latent, k_pe, w_kc, w_vc, layer_id, scale, fb, absorbed=None):
        pool = fb.kv_pool
        pool.set_latent(layer_id, fb.out_cache_loc, torch.cat([latent, k_pe], dim=-1))  # [T, C+R]
        fb.kv_written(layer_id)
        md = self.metadata_of(fb, PagedPlan)
        C, R, H = latent.shape[-1], k_pe.shape[-1], q_nope.shape[1]
        wrapper = self._wrapper("mla", q_nope.device)
        key = ("mla", H, C, R, scale)
        if key not in md.planned:
            # causal: a request's new tokens sit at the end of its keys (flashinfer's append rule)
            wrapper.plan(md.qo_indptr, md.kv_indptr, md.kv_indices, md.kv_lens, H, C, R, md.page_size, True,
                         scale, q_nope.dtype, pool.dtype)
            md.planned[key] = True
        q_lat = torch.einsum("thd,hdc->thc", q_nope, w_kc).contiguous()  # [T, H, C]
        lat = pool.latent[layer_id]  # [P, S, C+R]: compressed and rope parts are views of it
        o_lat = wrapper.run(q_lat, q_pe.contiguous(), lat[..., :C], lat[..., C:])  # [T, H, C]
        return torch.einsum("thc,hcv->thv", o_lat, w_vc)  # [T, H, Dv]
