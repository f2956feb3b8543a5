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

FP8 pools (``--kv-cache-dtype fp8_e4m3``): the plans name the pool's storage dtype as
``kv_data_type`` and the query's as ``q_data_type``; GQA runs pass the pool's per-tensor
``k_scale``/``v_scale`` to ``run`` (flashinfer folds them into the softmax scale and output);
the MLA wrapper takes no scales, so the latent scale is folded here: into ``sm_scale`` at plan
time and into the latent output after ``run``.

Under CUDA graphs (engine/cuda_graph.py) a decode graph of Bg rows runs wrappers built in
flashinfer's CUDA-graph mode over fixed int32 plan buffers (``GraphPlanBuffers``, sized for the
largest graph), one wrapper per graph size: their kernels read those buffers' addresses, so
before each replay the runner's padded batch is planned afresh, copied into them
(``refill``) and the wrappers re-planned with the arguments their first layer recorded during
the warm-up (flashinfer's plan syncs with the host, which a capture cannot contain).
"""

from __future__ import annotations

from collections.abc import Callable
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
    graph_bs: int = 0  # a CUDA graph's batch size: its wrappers read GraphPlanBuffers (0: eager)


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


class GraphPlanBuffers:
    """Fixed int32 plan buffers for decode graphs of up to ``max_bs`` rows and ``max_pages`` pages
    in all; ``refill`` copies a batch's plan into them and returns it as views of them."""

    def __init__(self, max_bs: int, max_pages: int, device: str | torch.device = "cpu"):
        i32 = torch.int32
        self.max_bs, self.max_pages = max_bs, max_pages
        self.qo_indptr = torch.arange(max_bs + 1, dtype=i32, device=device)  # [Bmax+1] decode: a token per request
        self.kv_indptr = torch.zeros(max_bs + 1, dtype=i32, device=device)  # [Bmax+1]
        self.kv_indices = torch.zeros(max_pages, dtype=i32, device=device)  # [Np max]
        self.kv_last_page_len = torch.ones(max_bs, dtype=i32, device=device)  # [Bmax]
        self.kv_lens = torch.ones(max_bs, dtype=i32, device=device)  # [Bmax]

    def refill(self, plan: PagedPlan, bs: int) -> PagedPlan:
        """``plan`` (of a padded decode batch of ``bs`` rows) written into the buffers, in place."""
        nnz = plan.kv_indices.shape[0]
        if plan.kv_last_page_len.shape[0] != bs or bs > self.max_bs or nnz > self.max_pages:
            raise ValueError(f"cuda graph plan: {plan.kv_last_page_len.shape[0]} rows and {nnz} pages do not fit "
                             f"a graph of {bs} rows (at most {self.max_bs} rows, {self.max_pages} pages)")
        self.qo_indptr[:bs + 1].copy_(plan.qo_indptr)
        self.kv_indptr[:bs + 1].copy_(plan.kv_indptr)
        self.kv_indices[:nnz].copy_(plan.kv_indices)
        self.kv_last_page_len[:bs].copy_(plan.kv_last_page_len)
        self.kv_lens[:bs].copy_(plan.kv_lens)
        return PagedPlan(self.qo_indptr[:bs + 1], self.kv_indptr[:bs + 1], self.kv_indices[:nnz],
                         self.kv_last_page_len[:bs], self.kv_lens[:bs], plan.page_size, graph_bs=bs)


def import_flashinfer():
    try:
        import flashinfer
    except ImportError as e:
        raise ValueError(f"attention_backend: 'flashinfer' needs the flashinfer-python package ({e}); "
                         "pip install flashinfer-python, or --attention-backend triton") from None
    return flashinfer


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"
    supports_cuda_graph = True  # through GraphPlanBuffers and before_replay (module docstring)

    def __init__(self):
        self.fi = import_flashinfer()
        self._wrappers: dict[str, object] = {}
        self._workspace: torch.Tensor | None = None
        self._graph: GraphPlanBuffers | None = None
        self._graph_wrappers: dict[tuple[str, int], object] = {}  # (kind, Bg) -> CUDA-graph-mode wrapper
        self._replans: dict[int, dict[tuple, Callable[[PagedPlan], None]]] = {}  # Bg -> plan calls to redo

    # ------------------------------------------------------------- CUDA graphs
    def init_cuda_graph(self, max_bs: int, max_pages: int, device: torch.device) -> None:
        self._graph = GraphPlanBuffers(max_bs, max_pages, device)

    def graph_metadata(self, fb: ForwardBatch, bs: int) -> PagedPlan:
        if self._graph is None:
            raise RuntimeError("flashinfer: init_cuda_graph was not called before capture")
        return self._graph.refill(build_plan(fb), bs)

    def before_replay(self, fb: ForwardBatch, bs: int) -> None:
        plan = self.graph_metadata(fb, bs)
        for replan in self._replans.get(bs, {}).values():
            replan(plan)

    def _graph_wrapper(self, kind: str, bs: int, device: torch.device):
        """A CUDA-graph-mode wrapper for graphs of ``bs`` rows over the fixed plan buffers."""
        g = self._graph
        if g is None:
            raise RuntimeError("flashinfer: a graph plan without init_cuda_graph")
        if (kind, bs) not in self._graph_wrappers:
            ws = self._workspace_on(device)
            if kind == "decode":
                w = self.fi.BatchDecodeWithPagedKVCacheWrapper(
                    ws, kv_layout="HND", use_cuda_graph=True, use_tensor_cores=True,
                    paged_kv_indptr_buffer=g.kv_indptr[:bs + 1], paged_kv_indices_buffer=g.kv_indices,
                    paged_kv_last_page_len_buffer=g.kv_last_page_len[:bs])
            else:
                w = self.fi.mla.BatchMLAPagedAttentionWrapper(
                    ws, use_cuda_graph=True, qo_indptr=g.qo_indptr[:bs + 1], kv_indptr=g.kv_indptr[:bs + 1],
                    kv_indices=g.kv_indices, kv_len_arr=g.kv_lens[:bs])
            self._graph_wrappers[(kind, bs)] = w
        return self._graph_wrappers[(kind, bs)]

    def _workspace_on(self, device: torch.device) -> torch.Tensor:
        if self._workspace is None:
            self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        return self._workspace

    def _plan_once(self, md: PagedPlan, key: tuple, plan: Callable[[PagedPlan], None]) -> None:
        """Plan for ``key`` at the forward's first layer; a graph's plan is also recorded, to be
        redone with each replay's batch (``before_replay``)."""
        if key in md.planned:
            return
        plan(md)
        md.planned[key] = True
        if md.graph_bs:
            self._replans.setdefault(md.graph_bs, {})[key] = plan

    def _wrapper(self, kind: str, device: torch.device, md: PagedPlan | None = None):
        """One wrapper per kind, sharing one workspace, built on first use on the pool's device
        (a graph's plan: that graph's CUDA-graph-mode wrapper)."""
        if md is not None and md.graph_bs and kind in ("decode", "mla"):
            return self._graph_wrapper(kind, md.graph_bs, device)
        if kind not in self._wrappers:
            ws = self._workspace_on(device)
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
        wrapper = self._wrapper(kind, q.device, md)
        key = (kind, q.shape[1], k.shape[1], q.shape[2], scale)
        q_dtype = q.dtype
        Hq, D = q.shape[1], q.shape[2]
        self._plan_once(md, key, lambda m: self._plan_gqa(wrapper, kind, m, Hq, D, q_dtype, pool, scale))
        return wrapper.run(q.contiguous(), (pool.k[layer_id], pool.v[layer_id]),
                           k_scale=pool.k_scale, v_scale=pool.v_scale)  # [T, Hq, D]

    @staticmethod
    def _plan_gqa(wrapper, kind, md: PagedPlan, Hq: int, D: int, q_dtype: torch.dtype, pool, scale) -> None:
        Hkv = pool.num_kv_heads
        common = dict(q_data_type=q_dtype, kv_data_type=pool.dtype, sm_scale=scale)
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
        wrapper = self._wrapper("mla", q_nope.device, md)
        key = ("mla", H, C, R, scale)
        q_dtype = q_nope.dtype
        sm_scale = scale * pool.latent_scale  # stored keys are latent / latent_scale
        # causal: a request's new tokens sit at the end of its keys (flashinfer's append rule)
        self._plan_once(md, key, lambda m: wrapper.plan(m.qo_indptr, m.kv_indptr, m.kv_indices, m.kv_lens, H, C, R,
                                                        m.page_size, True, sm_scale, q_dtype, pool.dtype))
        q_lat = torch.einsum("thd,hdc->thc", q_nope, w_kc).contiguous()  # [T, H, C]
        lat = pool.latent[layer_id]  # [P, S, C+R]: compressed and rope parts are views of it
        o_lat = wrapper.run(q_lat, q_pe.contiguous(), lat[..., :C], lat[..., C:])  # [T, H, C]
        if pool.latent_scale != 1.0:
            o_lat = o_lat * pool.latent_scale  # stored values are latent / latent_scale
        return torch.einsum("thc,hcv->thv", o_lat, w_vc)  # [T, H, Dv]
