"""Linear layers that know how they are split over tensor-parallel ranks.

Legend: T tokens, In/Out full feature dims, p tp_size.

Megatron split: a column-parallel layer owns Out/p output rows and needs no
communication; a row-parallel layer owns In/p input columns and all-reduces its
partial sums. Pairing column -> row (QKV -> O, gate/up -> down) costs one
all-reduce per block. A *merged* layer stacks several checkpoint matrices that
read the same input (q/k/v, gate/up, q_a/kv_a) into one matmul; each part is
sharded on its own so every rank holds its slice of every part.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from pdserve.distributed.parallel_state import ParallelState
from pdserve.layers.cpu_gemm import PackedLinear, PackPolicy, linear
from pdserve.layers.quant.fp8 import SCALE_SUFFIX, block_rows_aligned, fp8_linear, hold_fp8, scale_grid
from pdserve.layers.weights import WeightEntry, check_shape, copy_into, sibling


class _Fp8Capable(nn.Module):
    """A linear whose ``weight`` may be held as block-scaled FP8 (``keep_fp8``, on GPU): then
    ``weight`` is float8_e4m3fn and ``weight_scale_inv`` [So, Si] its block scales."""

    weight: nn.Parameter
    allow_fp8 = True  # False: a layer whose weight other code reads whole (MLA's kv_b_proj)

    def __init__(self):
        super().__init__()
        self.fp8_block: tuple[int, int] | None = None
        self.weight_scale_inv: nn.Parameter | None = None  # becomes a parameter in _hold
        self.packed: PackedLinear | None = None  # CPU: a oneDNN-packed copy of weight (pack_cpu)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.fp8_block is None:
            return linear(x, self.weight, bias, self.packed)
        assert self.weight_scale_inv is not None
        return fp8_linear(x, self.weight, self.weight_scale_inv, self.fp8_block, bias)

    def pack_cpu(self, policy: PackPolicy) -> bool:
        """Keep a oneDNN-packed copy of the loaded weight for the calls ``policy`` picks
        (layers/cpu_gemm.py). Not for FP8-held or non-CPU weights (those keep their GEMMs), nor
        for one no call would take packed (a copy for nothing)."""
        if self.fp8_block is not None or not PackedLinear.worth_it(self.weight, policy):
            return False
        self.packed = PackedLinear(self.weight, policy)
        return True

    def _hold(self, block: tuple[int, int], keys: list[str], quantized: Callable[[str], bool]) -> set[str]:
        if not (self.allow_fp8 and keys and all(quantized(k) for k in keys)):
            return set()
        hold_fp8(self, block)
        self.fp8_block = block
        return set(keys)


@dataclass(frozen=True)
class _Part:
    """One checkpoint matrix inside a merged layer: rows [src_start, src_start+size) of the
    checkpoint tensor land at rows [dst_start, dst_start+size) of the local weight."""

    ckpt_name: str | None  # sibling module name in the checkpoint; None: the layer's own name
    full_rows: int
    src_start: int
    dst_start: int
    size: int


class _OutputSplitLinear(_Fp8Capable):
    """Shared body of replicated and column-parallel layers: y[T, sum(local parts)] = x W^T + b."""

    def __init__(self, in_features: int, parts: Sequence[_Part], bias: bool, dtype: torch.dtype):
        super().__init__()
        self.in_features = in_features
        self.parts = tuple(parts)
        self.out_features = sum(p.size for p in self.parts)  # local
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(self.out_features, dtype=dtype), requires_grad=False)
                     if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)  # [T, Out_local]

    def _base(self, prefix: str, part: _Part) -> str:
        return prefix if part.ckpt_name is None else sibling(prefix, part.ckpt_name)

    def weight_entries(self, prefix: str) -> Iterator[WeightEntry]:
        pnames = ("weight", "bias") + (("weight" + SCALE_SUFFIX,) if self.fp8_block else ())
        for i, part in enumerate(self.parts):
            for pname in pnames:
                if getattr(self, pname) is None:
                    continue
                key = f"{self._base(prefix, part)}.{pname}"
                load = self._load_scale if pname.endswith(SCALE_SUFFIX) else self._load
                yield WeightEntry(key, partial(load, key, pname, part), (f"{prefix}.{pname}#{i}",))

    def keep_fp8(self, block: tuple[int, int], prefix: str, quantized: Callable[[str], bool]) -> set[str]:
        """Hold FP8 when every part's rows on this rank are whole blocks of its checkpoint tensor
        and start on a block of the local weight (else the loader dequantizes this layer)."""
        last = max(self.parts, key=lambda p: p.dst_start)
        if not all(p.dst_start % block[0] == 0
                   and block_rows_aligned(p.src_start, p.size, p.full_rows, block[0], p is last) for p in self.parts):
            return set()
        return self._hold(block, [f"{self._base(prefix, p)}.weight" for p in self.parts], quantized)

    def _load_scale(self, key: str, pname: str, part: _Part, src: torch.Tensor) -> None:
        assert self.fp8_block is not None and self.weight_scale_inv is not None
        bo = self.fp8_block[0]
        check_shape(key, src, scale_grid((part.full_rows, self.in_features), self.fp8_block))
        rows = -(-part.size // bo)  # the part's scale rows; its last block may be partial
        dst = self.weight_scale_inv.data.narrow(0, part.dst_start // bo, rows)
        copy_into(key, dst, src.narrow(0, part.src_start // bo, rows))

    def checkpoint_tensors(self, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
        """Inverse of loading, for an unsharded layer: each checkpoint tensor it holds."""
        for part in self.parts:
            if part.size != part.full_rows:
                raise ValueError(f"{prefix}: a sharded layer holds no whole checkpoint tensor")
            base = prefix if part.ckpt_name is None else sibling(prefix, part.ckpt_name)
            for pname in ("weight", "bias"):
                if getattr(self, pname) is not None:
                    yield f"{base}.{pname}", getattr(self, pname).narrow(0, part.dst_start, part.size)

    def _load(self, key: str, pname: str, part: _Part, src: torch.Tensor) -> None:
        full = (part.full_rows, self.in_features) if pname == "weight" else (part.full_rows,)
        check_shape(key, src, full)
        dst = getattr(self, pname).data.narrow(0, part.dst_start, part.size)
        copy_into(key, dst, src.narrow(0, part.src_start, part.size))


def _stack(sizes: Sequence[int], names: Sequence[str | None], local, start) -> list[_Part]:
    """Lay parts out back to back; ``local(size)`` / ``start(size)`` give this rank's slice."""
    parts, dst = [], 0
    for size, name in zip(sizes, names):
        parts.append(_Part(name, size, start(size), dst, local(size)))
        dst += local(size)
    return parts


class ReplicatedLinear(_OutputSplitLinear):
    """Every rank holds the whole matrix (small projections such as MLA's q_a/kv_a, MoE gates).

    ``output_sizes`` with ``ckpt_names`` merges several checkpoint matrices into one matmul.
    """

    def __init__(self, in_features: int, output_sizes: int | Sequence[int], bias: bool = False,
                 dtype: torch.dtype = torch.float32, ckpt_names: Sequence[str] | None = None):
        sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        names = list(ckpt_names) if ckpt_names else [None] * len(sizes)
        super().__init__(in_features, _stack(sizes, names, lambda n: n, lambda n: 0), bias, dtype)


class ColumnParallelLinear(_OutputSplitLinear):
    """Each rank owns Out/p rows of every part; ``gather_output`` all-gathers the full Out."""

    def __init__(self, in_features: int, output_sizes: int | Sequence[int], parallel: ParallelState,
                 bias: bool = False, dtype: torch.dtype = torch.float32,
                 ckpt_names: Sequence[str] | None = None, gather_output: bool = False):
        sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        names = list(ckpt_names) if ckpt_names else [None] * len(sizes)
        local = lambda n: parallel.shard(n)[1] - parallel.shard(n)[0]  # noqa: E731
        start = lambda n: parallel.shard(n)[0]  # noqa: E731
        super().__init__(in_features, _stack(sizes, names, local, start), bias, dtype)
        self.parallel = parallel
        self.gather_output = gather_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x, self.bias)  # [T, Out/p]
        return self.parallel.tp_all_gather(y, dim=-1) if self.gather_output else y


MergedColumnParallelLinear = ColumnParallelLinear  # same class; the name documents a merged use


class QKVParallelLinear(_OutputSplitLinear):
    """q/k/v projections as one matmul, split by heads over TP.

    With fewer KV heads than ranks, KV heads are replicated: rank r serves KV head
    ``r * Hkv // p`` so each query head still meets its own KV head.
    Output layout per rank: [q (Hq/p*D) | k (Hkv_local*D) | v (Hkv_local*D)].
    """

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 parallel: ParallelState, bias: bool = False, dtype: torch.dtype = torch.float32,
                 ckpt_names: Sequence[str] = ("q_proj", "k_proj", "v_proj")):
        p, r = parallel.tp_size, parallel.tp_rank
        q_lo, q_hi = parallel.shard(num_heads)
        if num_kv_heads >= p:
            kv_lo, kv_hi = parallel.shard(num_kv_heads)
        else:
            kv_lo = r * num_kv_heads // p
            kv_hi = kv_lo + 1
        self.num_heads, self.num_kv_heads = q_hi - q_lo, kv_hi - kv_lo  # local
        self.head_dim = head_dim
        qs, kvs = self.num_heads * head_dim, self.num_kv_heads * head_dim
        parts = [_Part(ckpt_names[0], num_heads * head_dim, q_lo * head_dim, 0, qs),
                 _Part(ckpt_names[1], num_kv_heads * head_dim, kv_lo * head_dim, qs, kvs),
                 _Part(ckpt_names[2], num_kv_heads * head_dim, kv_lo * head_dim, qs + kvs, kvs)]
        super().__init__(hidden, parts, bias, dtype)


class RowParallelLinear(_Fp8Capable):
    """Each rank owns In/p input columns; partial outputs are summed over TP.

    The bias must count once, not p times: it is added after the reduction, or, with
    ``reduce_results=False`` (the caller reduces), by rank 0 only.
    """

    def __init__(self, in_features: int, out_features: int, parallel: ParallelState, bias: bool = False,
                 dtype: torch.dtype = torch.float32, reduce_results: bool = True):
        super().__init__()
        self.parallel = parallel
        self.in_full = in_features
        lo, hi = parallel.shard(in_features)
        self.in_start, self.in_features = lo, hi - lo
        self.out_features = out_features
        self.reduce_results = reduce_results
        self.weight = nn.Parameter(torch.empty(out_features, self.in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x)  # [T, Out] partial sum over this rank's In/p columns
        if self.reduce_results:
            y = self.parallel.tp_all_reduce(y)
        elif self.parallel.tp_rank > 0:
            return y
        return y if self.bias is None else y + self.bias

    def weight_entries(self, prefix: str) -> Iterator[WeightEntry]:
        key = f"{prefix}.weight"
        yield WeightEntry(key, lambda src: self._load_weight(key, src), (key,))
        bias = self.bias
        if bias is not None:
            bkey = f"{prefix}.bias"
            yield WeightEntry(bkey, lambda src: copy_into(bkey, bias.data, src), (bkey,))
        if self.fp8_block is not None:
            skey = key + SCALE_SUFFIX
            yield WeightEntry(skey, lambda src: self._load_scale(skey, src), (skey,))

    def keep_fp8(self, block: tuple[int, int], prefix: str, quantized: Callable[[str], bool]) -> set[str]:
        """Hold FP8 when this rank's input columns are whole blocks (or end the matrix)."""
        if not block_rows_aligned(self.in_start, self.in_features, self.in_full, block[1], last=True):
            return set()
        return self._hold(block, [f"{prefix}.weight"], quantized)

    def _load_scale(self, key: str, src: torch.Tensor) -> None:
        assert self.fp8_block is not None and self.weight_scale_inv is not None
        bi = self.fp8_block[1]
        check_shape(key, src, scale_grid((self.out_features, self.in_full), self.fp8_block))
        cols = self.weight_scale_inv.shape[1]
        copy_into(key, self.weight_scale_inv.data, src.narrow(1, self.in_start // bi, cols))

    def checkpoint_tensors(self, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
        if self.in_features != self.in_full:
            raise ValueError(f"{prefix}: a sharded layer holds no whole checkpoint tensor")
        yield f"{prefix}.weight", self.weight
        if self.bias is not None:
            yield f"{prefix}.bias", self.bias

    def _load_weight(self, key: str, src: torch.Tensor) -> None:
        check_shape(key, src, (self.out_features, self.in_full))
        copy_into(key, self.weight.data, src.narrow(1, self.in_start, self.in_features))
