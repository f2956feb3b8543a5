"""Token embedding and LM head, both split over TP by vocabulary rows.

Legend: T tokens, N rows to score, V vocab, Vp vocab padded to a multiple of p, H hidden.

The vocab is padded so each of the p ranks owns Vp/p rows; padded rows are
never looked up and their logits are cut off before anyone sees them.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.distributed.parallel_state import ParallelState
from pdserve.layers.cpu_gemm import PackedLinear, PackPolicy, linear
from pdserve.layers.weights import WeightEntry, check_shape, copy_into


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, parallel: ParallelState, dtype: torch.dtype):
        super().__init__()
        self.parallel = parallel
        self.vocab_size, self.hidden = vocab_size, hidden
        padded = -(-vocab_size // parallel.tp_size) * parallel.tp_size
        self.vocab_start, self.vocab_end = parallel.shard(padded)
        self.weight = nn.Parameter(torch.empty(self.vocab_end - self.vocab_start, hidden, dtype=dtype),
                                   requires_grad=False)  # [Vp/p, H]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return F.embedding(ids, self.weight)  # [T, H]
        # Ids owned by another rank look up row 0 and are zeroed; the all-reduce fills them in.
        mine = (ids >= self.vocab_start) & (ids < self.vocab_end)  # [T]
        out = F.embedding((ids - self.vocab_start) * mine, self.weight) * mine.unsqueeze(-1)
        return self.parallel.tp_all_reduce(out)

    def weight_entries(self, prefix: str) -> Iterator[WeightEntry]:
        key = f"{prefix}.weight"
        yield WeightEntry(key, lambda src: self._load(key, src), (key,))

    def checkpoint_tensors(self, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
        """Inverse of loading, for an unsplit table."""
        if self.parallel.tp_size != 1:
            raise ValueError(f"{prefix}: a sharded layer holds no whole checkpoint tensor")
        yield f"{prefix}.weight", self.weight[:self.vocab_size]

    def _load(self, key: str, src: torch.Tensor) -> None:
        check_shape(key, src, (self.vocab_size, self.hidden))
        end = min(self.vocab_end, self.vocab_size)
        rows = max(0, end - self.vocab_start)
        copy_into(key, self.weight.data[:rows], src[self.vocab_start:self.vocab_start + rows])
        self.weight.data[rows:].zero_()


class ParallelLMHead(VocabParallelEmbedding):
    """Logits = hidden @ W^T over the vocab shard, gathered to the full vocab in float32.

    With ``tie_to`` the head reuses the embedding's parameter (same vocab split),
    and a checkpoint's ``lm_head.weight`` is accepted but not required.
    """

    def __init__(self, vocab_size: int, hidden: int, parallel: ParallelState, dtype: torch.dtype,
                 tie_to: VocabParallelEmbedding | None = None):
        super().__init__(vocab_size, hidden, parallel, dtype)
        self.tied = tie_to is not None
        if tie_to is not None:
            self.weight = tie_to.weight
        self.packed: PackedLinear | None = None  # CPU: a oneDNN-packed copy of weight (pack_cpu)

    def pack_cpu(self, policy: PackPolicy) -> bool:
        """Keep a oneDNN-packed copy of the loaded table for scoring (layers/cpu_gemm.py); the
        embedding (tied or not) keeps looking rows up in the plain one."""
        if not PackedLinear.worth_it(self.weight, policy):
            return False
        self.packed = PackedLinear(self.weight, policy)
        return True

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.weight, None, self.packed)  # [N, Vp/p]
        logits = self.parallel.tp_all_gather(logits, dim=-1)[:, :self.vocab_size]  # [N, V]
        return logits.float()

    def checkpoint_tensors(self, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
        if not self.tied:  # a tied head's table is the embedding's
            yield from super().checkpoint_tensors(prefix)

    def weight_entries(self, prefix: str) -> Iterator[WeightEntry]:
        if not self.tied:
            yield from super().weight_entries(prefix)
            return
        key = f"{prefix}.weight"
        yield WeightEntry(key, lambda src: check_shape(key, src, (self.vocab_size, self.hidden)), ())
