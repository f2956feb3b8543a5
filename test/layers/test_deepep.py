"""DeepEP behind the dispatch interface: refused with one line where it cannot run; the
receiver's per-token weighting agrees with the per-pair twin."""

from __future__ import annotations

import pytest
import torch

from pdserve.layers.moe.deepep import _weighted_local
from pdserve.layers.moe.dispatch import require_backend


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this host could run DeepEP")
def test_deepep_refused_with_fewer_than_two_gpus():
    want = "runs on CUDA GPUs only" if not torch.cuda.is_available() else "needs 2 or more"
    with pytest.raises(ValueError, match=f"^moe_a2a_backend: 'deepep' .*{want}"):
        require_backend("deepep")


def test_received_tokens_are_weighted_and_summed_per_token():
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(5, 8, generator=g)
    local_ids = torch.tensor([[0, -1], [1, 0], [-1, -1], [2, 2], [-1, 1]])
    weights = torch.rand(5, 2, generator=g)
    scale = torch.tensor([1.0, -2.0, 0.5])
    out = _weighted_local(rows, local_ids, weights, lambda r, e: r * scale[e].unsqueeze(-1))
    want = torch.stack([sum((weights[m, k] * scale[e] * rows[m] for k, e in enumerate(local_ids[m].tolist())
                             if e >= 0), torch.zeros(8)) for m in range(5)])
    torch.testing.assert_close(out, want)
