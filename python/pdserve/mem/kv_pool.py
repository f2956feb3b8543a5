"""KV-cache pools: paged device memory the attention backends read and write.

Slots: token slot ``s`` lives at page ``s // page_size``, offset ``s % page_size``.
Legend: P pages, S page_size, H kv heads (local to this TP rank), D head dim,
C kv_lora_rank, R qk_rope_head_dim, N layers, T tokens.

FP8 pages (``--kv-cache-dtype fp8_e4m3``): the buffers hold ``float8_e4m3fn`` and the pool has
per-tensor scales (``k_scale``/``v_scale`` for GQA, ``latent_scale`` for MLA), 1.0 unless
given, as SGLang runs without calibrated scales. Stored = clamp(x / scale, -448, 448) in e4m3
(values beyond e4m3's range saturate instead of becoming NaN); read = stored * scale in the
compute dtype. Per-tensor, not per-page, because then a page is bytes only: P/D transfer,
host and storage tiers move it with no side buffer of scales, a half-filled page never has to
be requantized when a later token is larger, and kernels fold the scale into the softmax scale
(K) and the output (V) instead of scaling every element (docs/kv-cache.md). Every reader
(``get_*``, ``round_trip_*``, the Triton and flashinfer backends reading the buffers in place)
applies the same scale the writer divided by.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from pdserve.transfer.base import BufferDescriptor

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448: e4m3fn has no inf, so anything larger must saturate


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's element type for ``--kv-cache-dtype`` (auto: the model's)."""
    if kv_cache_dtype == "fp8_e4m3":
        return FP8_DTYPE
    if kv_cache_dtype != "auto":
        raise ValueError(f"kv_cache_dtype: {kv_cache_dtype!r} is not one of ('auto', 'fp8_e4m3')")
    return model_dtype


INDEX_BLOCK = 128  # values of an index key sharing one scale (DeepSeek-V3.2's reference)
INDEX_AMAX_FLOOR = 1e-4  # the reference's floor on a block's amax: an all-zero block gets a finite scale


def index_key_block(index_head_dim: int) -> int:
    """Values per scale of an FP8 index key: 128, or the whole key when it is smaller."""
    block = min(INDEX_BLOCK, index_head_dim)
    if index_head_dim % block:
        raise ValueError(f"index_head_dim: an FP8 index cache needs a multiple of {INDEX_BLOCK} (or at most "
                         f"{INDEX_BLOCK}), got {index_head_dim}")
    return block


def quantize_index_keys(k: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k [..., Di] -> (e4m3 [..., Di], float32 scales [..., Di / block]): each block of ``block``
    values divided by its scale ``max(amax, 1e-4) / 448``, so its largest value lands on 448."""
    kb = k.float().unflatten(-1, (-1, block))  # [..., Di / block, block]
    scale = kb.abs().amax(-1).clamp_min(INDEX_AMAX_FLOOR) / FP8_MAX  # [..., Di / block]
    q = (kb / scale.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.flatten(-2), scale


def dequantize_index_keys(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of ``quantize_index_keys`` (up to its rounding): e4m3 times its block's scale."""
    blocks = scale.shape[-1]
    return (q.float().unflatten(-1, (blocks, -1)) * scale.unsqueeze(-1)).flatten(-2).to(dtype)


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """x in ``dtype`` as the pool stores it: fp8 is x / scale saturated to +-448; else a cast."""
    if dtype != FP8_DTYPE:
        return x.to(dtype)
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(dtype)


def dequantize(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Stored ``x`` read back in ``dtype`` (the inverse of ``quantize`` up to its rounding)."""
    if x.dtype != FP8_DTYPE:
        return x.to(dtype)
    if scale == 1.0:
        return x.to(dtype)  # e4m3 values are exact in every compute dtype
    return (x.float() * scale).to(dtype)


class KVPool(ABC):
    """Owns the KV tensors; knows nothing of requests or who owns which page.

    Writers pass slot indices handed out by the page allocator; the pool never
    checks ownership (the allocator and page table do).
    """

    def __init__(self, num_pages: int, page_size: int, num_layers: int, dtype: torch.dtype,
                 device: str | torch.device = "cpu", compute_dtype: torch.dtype | None = None):
        """``dtype``: what the buffers hold (float8_e4m3fn for an FP8 pool); ``compute_dtype``:
        what reads return (the model's; defaults to ``dtype``, which an FP8 pool cannot)."""
        if num_pages < 1 or page_size < 1 or num_layers < 1:
            raise ValueError(f"num_pages, page_size, num_layers must be >= 1, got "
                             f"{num_pages}, {page_size}, {num_layers}")
        compute_dtype = compute_dtype or dtype
        if compute_dtype == FP8_DTYPE:
            raise ValueError("compute_dtype: an fp8 pool needs the model dtype to dequantize to")
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_layers = num_layers
        self.dtype = dtype  # storage
        self.compute_dtype = compute_dtype
        self.device = torch.device(device)

    @property
    def is_fp8(self) -> bool:
        return self.dtype == FP8_DTYPE

    @property
    def reuse_tokens(self) -> int:
        """A cached prefix is reusable at multiples of this many tokens (a page for a pool whose
        every page boundary restores the whole state; more where state is kept only at
        boundaries, mem/region_pool.py)."""
        return self.page_size

    def take_row(self, row: int) -> None:
        """Request-table row ``row`` changed hands (the cache manager calls this at admission): a pool
        keeping a per-request record there forgets what it held for the last owner. None here."""
        return None

    def record_buffers(self) -> list[tuple[str, torch.Tensor]]:
        """Per-request records, each ``[N, slots, ...]`` (layer row, record slot = request-table row, then
        one slot's shape), outside the pages: what P/D moves whole for a request beside its pages
        (DeepSeek-V4's bounded layout, mem/region_pool.py). None here."""
        return []

    def record_layers(self) -> dict[str, tuple[int, ...]]:
        """The model layers each record buffer keeps, by name (row ``i`` holds the ``i``-th)."""
        return {}

    def record_descriptors(self) -> list[BufferDescriptor]:
        """The record buffers to register with a transfer engine: a "page" is one record slot of one layer."""
        out = []
        for name, buf in self.record_buffers():
            item = buf.element_size()
            out.append(BufferDescriptor(name, buf.data_ptr(), buf.stride(1) * item, buf.stride(0) * item,
                                        buf.shape[0], buf.shape[1]))
        return out

    def record_filled(self, row: int, upto: int) -> None:
        """Row ``row``'s record was written from outside (P/D: prefill's record of the same request):
        it holds the state of positions before ``upto`` on every layer. A pool without records has
        nothing to hold it and raises."""
        raise RuntimeError(f"record_filled: {type(self).__name__} keeps no per-request records")

    def _check_scales(self, **scales: float) -> None:
        for name, value in scales.items():
            if not value > 0:
                raise ValueError(f"{name}: must be > 0, got {value}")
            if value != 1.0 and not self.is_fp8:
                raise ValueError(f"{name}: scales apply to fp8 pools only, got {value} for {self.dtype}")

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @abstractmethod
    def buffer_descriptors(self) -> list[BufferDescriptor]:
        """Buffers to register with a transfer engine, in a fixed order."""

    @abstractmethod
    def page_buffers(self) -> list[tuple[str, torch.Tensor]]:
        """The KV tensors, each ``[N, P, ...]`` (layer, page, then one page's shape), in the
        order of ``buffer_descriptors``: what a host copy of a page must hold."""

    def buffer_layers(self) -> dict[str, tuple[int, ...]]:
        """The model layers each page buffer keeps, by name: row ``i`` of its ``[N, ...]`` holds the
        ``i``-th. Every layer here; a pool whose buffers skip layers (``RegionKVPool``) says which."""
        return {name: tuple(range(self.num_layers)) for name, _ in self.page_buffers()}

    def _split(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.div(slots, self.page_size, rounding_mode="floor"), slots % self.page_size


class GQAKVPool(KVPool):
    """K and V per layer in HND layout ``[P, H, S, D]``.

    HND keeps one head's slice of one page contiguous, so a page sharded by
    heads over TP ranks moves in one write per head range, not one per token.
    """

    def __init__(self, num_pages, page_size, num_layers, num_kv_heads, head_dim, dtype, device="cpu",
                 compute_dtype=None, k_scale: float = 1.0, v_scale: float = 1.0):
        super().__init__(num_pages, page_size, num_layers, dtype, device, compute_dtype)
        self._check_scales(k_scale=k_scale, v_scale=v_scale)
        self.k_scale, self.v_scale = float(k_scale), float(v_scale)
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        shape = (num_layers, num_pages, num_kv_heads, page_size, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=self.device)  # [N, P, H, S, D]
        self.v = torch.zeros(shape, dtype=dtype, device=self.device)

    def set_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """loc [T]; k, v [T, H, D], quantized to the pool's dtype."""
        page, off = self._split(loc)
        self.k[layer][page, :, off] = quantize(k, self.dtype, self.k_scale)
        self.v[layer][page, :, off] = quantize(v, self.dtype, self.v_scale)

    def round_trip_kv(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [..., D] as a read of them after ``set_kv`` returns them (the decode stage's rows)."""
        return (dequantize(quantize(k, self.dtype, self.k_scale), self.compute_dtype, self.k_scale),
                dequantize(quantize(v, self.dtype, self.v_scale), self.compute_dtype, self.v_scale))

    def get_kv_pages(self, layer: int, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """pages [B, Lp]; returns k, v [B, H, Lp * S, D] in the compute dtype, token j of row b at column j.

        Gathers whole pages (one contiguous H*S*D block each) rather than single
        tokens: far fewer, larger copies, which is what bounds decode on CPU.
        """
        B, Lp = pages.shape
        out = []
        for buf, scale in ((self.k[layer], self.k_scale), (self.v[layer], self.v_scale)):
            g = dequantize(buf[pages], self.compute_dtype, scale)  # [B, Lp, H, S, D]
            out.append(g.transpose(1, 2).reshape(B, self.num_kv_heads, Lp * self.page_size, self.head_dim))
        return out[0], out[1]

    def page_buffers(self) -> list[tuple[str, torch.Tensor]]:
        return [("k", self.k), ("v", self.v)]

    def buffer_descriptors(self) -> list[BufferDescriptor]:
        out = []
        for name, buf in (("k", self.k), ("v", self.v)):
            item = buf.element_size()
            out.append(BufferDescriptor(name, buf.data_ptr(), buf.stride(1) * item,
                                        buf.stride(0) * item, self.num_layers, self.num_pages))
        return out


class MLAKVPool(KVPool):
    """One latent row per token per layer ``[P, S, C + R]``, the same on every attention-TP rank.

    DeepSeek-V3.2 (``index_head_dim`` Di > 0) adds its indexer's keys as a second region of the
    same pages, ``index_k`` ``[N, P, S, Di]``: slot ``s`` holds both the latent and the index key
    of one token, so the allocator, page table and radix cache carry them with no branch of their
    own (docs/kv-cache.md, "One layout, many kinds of state"). ``index_cache_dtype`` "model" keeps them
    in the compute dtype; "fp8_e4m3" stores them as DeepSeek's reference does on GPU: e4m3 with one
    float32 scale per block of 128 values (``quantize_index_keys``), the scales a third region
    ``index_k_scale`` ``[N, P, S, Di / block]`` of the same pages.
    """

    def __init__(self, num_pages, page_size, num_layers, kv_lora_rank, rope_dim, dtype, device="cpu",
                 compute_dtype=None, latent_scale: float = 1.0, index_head_dim: int = 0,
                 index_cache_dtype: str = "model"):
        super().__init__(num_pages, page_size, num_layers, dtype, device, compute_dtype)
        self._check_scales(latent_scale=latent_scale)
        if index_head_dim < 0:
            raise ValueError(f"index_head_dim: must be >= 0, got {index_head_dim}")
        self.latent_scale = float(latent_scale)  # one scale: the latent is both K and V
        self.kv_lora_rank = kv_lora_rank
        self.rope_dim = rope_dim
        self.latent = torch.zeros((num_layers, num_pages, page_size, kv_lora_rank + rope_dim),
                                  dtype=dtype, device=self.device)  # [N, P, S, C+R]
        self.index_head_dim = index_head_dim
        if index_cache_dtype not in ("model", "fp8_e4m3"):
            raise ValueError(f"index_cache_dtype: {index_cache_dtype!r} is not one of ('model', 'fp8_e4m3')")
        self.index_fp8 = bool(index_head_dim) and index_cache_dtype == "fp8_e4m3"
        self.index_k: torch.Tensor | None = None  # [N, P, S, Di] for DeepSeek-V3.2
        self.index_k_scale: torch.Tensor | None = None  # [N, P, S, Di / block] float32 when index_fp8
        if index_head_dim:
            shape = (num_layers, num_pages, page_size, index_head_dim)
            self.index_k = torch.zeros(shape, dtype=FP8_DTYPE if self.index_fp8 else self.compute_dtype,
                                       device=self.device)
        if self.index_fp8:
            self.index_block = index_key_block(index_head_dim)
            self.index_k_scale = torch.zeros((num_layers, num_pages, page_size, index_head_dim // self.index_block),
                                             dtype=torch.float32, device=self.device)

    def _flat(self, layer: int) -> torch.Tensor:
        return self.latent[layer].view(self.num_slots, -1)  # [P*S, C+R]

    def set_latent(self, layer: int, loc: torch.Tensor, latent: torch.Tensor) -> None:
        """loc [T]; latent [T, C + R] (compressed KV then rotated k_pe), quantized to the pool's dtype."""
        self._flat(layer)[loc] = quantize(latent, self.dtype, self.latent_scale)

    def round_trip_latent(self, latent: torch.Tensor) -> torch.Tensor:
        """latent [..., C + R] as a read of it after ``set_latent`` returns it."""
        return dequantize(quantize(latent, self.dtype, self.latent_scale), self.compute_dtype, self.latent_scale)

    def get_latent_pages(self, layer: int, pages: torch.Tensor) -> torch.Tensor:
        """pages [B, Lp]; returns [B, Lp * S, C + R] in the compute dtype, token j of row b at column j."""
        B, Lp = pages.shape
        g = dequantize(self.latent[layer][pages], self.compute_dtype, self.latent_scale)  # [B, Lp, S, C+R]
        return g.view(B, Lp * self.page_size, -1)

    def _index_k(self) -> torch.Tensor:
        if self.index_k is None:
            raise RuntimeError("index_k: this MLA pool was built without index keys (index_head_dim 0)")
        return self.index_k

    def set_index_k(self, layer: int, loc: torch.Tensor, k: torch.Tensor) -> None:
        """loc [T]; k [T, Di]: the indexer's keys of the tokens whose latent goes to the same slots
        (quantized per block, the scales beside them, in an FP8 index cache)."""
        keys = self._index_k()[layer].view(self.num_slots, -1)
        if self.index_k_scale is None:
            keys[loc] = k.to(self.compute_dtype)
            return
        q, scale = quantize_index_keys(k, self.index_block)
        keys[loc] = q
        self.index_k_scale[layer].view(self.num_slots, -1)[loc] = scale

    def round_trip_index_k(self, k: torch.Tensor) -> torch.Tensor:
        """k [..., Di] as a read of it after ``set_index_k`` returns it."""
        if self.index_k_scale is None:
            return k.to(self.compute_dtype)
        return dequantize_index_keys(*quantize_index_keys(k, self.index_block), self.compute_dtype)

    def _read_index_k(self, keys: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        return keys if scales is None else dequantize_index_keys(keys, scales, self.compute_dtype)

    def get_index_k_pages(self, layer: int, pages: torch.Tensor) -> torch.Tensor:
        """pages [B, Lp] -> [B, Lp * S, Di] in the compute dtype, token j of row b at column j (whole
        pages: few, large copies)."""
        B, Lp = pages.shape
        scales = None if self.index_k_scale is None else self.index_k_scale[layer][pages]
        return self._read_index_k(self._index_k()[layer][pages], scales).view(B, Lp * self.page_size, -1)

    def get_index_k_slots(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """slots [...] -> the index keys stored there, [..., Di] in the compute dtype."""
        scales = None if self.index_k_scale is None else self.index_k_scale[layer].view(self.num_slots, -1)[slots]
        return self._read_index_k(self._index_k()[layer].view(self.num_slots, -1)[slots], scales)

    def get_latent_slots(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """slots [...] -> the latent rows stored there, [..., C + R] in the compute dtype (sparse reads)."""
        # index_select copies whole rows; advanced indexing copies element by element (2-4x slower on CPU)
        rows = self._flat(layer).index_select(0, slots.reshape(-1)).view(*slots.shape, -1)
        return dequantize(rows, self.compute_dtype, self.latent_scale)

    def page_buffers(self) -> list[tuple[str, torch.Tensor]]:
        regions = [("latent", self.latent)]
        if self.index_k is not None:
            regions.append(("index_k", self.index_k))
        if self.index_k_scale is not None:
            regions.append(("index_k_scale", self.index_k_scale))
        return regions

    def buffer_descriptors(self) -> list[BufferDescriptor]:
        out = []
        for name, buf in self.page_buffers():
            item = buf.element_size()
            out.append(BufferDescriptor(name, buf.data_ptr(), buf.stride(1) * item,
                                        buf.stride(0) * item, self.num_layers, self.num_pages))
        return out
