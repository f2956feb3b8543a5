"""What every causal LM in pdserve shares: the API the model runner calls, and weight loading.

The decoder building blocks the families share live in ``models/decoder.py``.
Legend: T tokens, N rows to score, H hidden, V vocab.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pdserve.layers.embedding import ParallelLMHead
from pdserve.layers.forward_batch import ForwardBatch
from pdserve.layers.weights import WeightEntry, direct_entries, direct_tensors

if TYPE_CHECKING:
    from pdserve.models.decoder import DecoderStack

logger = logging.getLogger(__name__)


def weight_spec(model: nn.Module) -> dict[str, WeightEntry]:
    """Every checkpoint tensor the model accepts, by checkpoint name.

    A module describes its own tensors through ``weight_entries(prefix)`` (fused or sharded
    layers); any other module's direct parameters map one to one onto ``prefix.name``.
    """
    spec: dict[str, WeightEntry] = {}
    for path, module in model.named_modules():
        entries: Iterator[WeightEntry] = (module.weight_entries(path) if hasattr(module, "weight_entries")
                                          else direct_entries(module, path))
        for entry in entries:
            spec[entry.key] = entry
    return spec


def load_into(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy checkpoint tensors into ``model``.

    Tensors the model has no use for (e.g. DeepSeek's multi-token-prediction layers,
    stale rotary buffers) are skipped. Raises ValueError naming every required
    checkpoint tensor that never arrived, or a tensor whose shape is wrong.
    """
    spec = weight_spec(model)
    required: dict[str, str] = {}  # unit -> canonical checkpoint key
    for spec_entry in spec.values():
        if spec_entry.canonical:
            required.update({u: spec_entry.key for u in spec_entry.units})
    filled: set[str] = set()
    skipped = 0
    for name, tensor in weights:
        entry = spec.get(name)
        if entry is None:
            skipped += 1
            continue
        entry.load(tensor)
        filled.update(entry.units)
    missing = list(dict.fromkeys(key for unit, key in required.items() if unit not in filled))
    if missing:
        shown = ", ".join(missing[:8]) + (f", … ({len(missing) - 8} more)" if len(missing) > 8 else "")
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")
    if skipped:
        logger.debug("skipped %d checkpoint tensors the model does not use", skipped)


def checkpoint_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The inverse of ``load_into`` for an unsharded model: every checkpoint tensor (HF names)
    that would load it back as it is. Lets a sharded model take its slices of weights that
    exist only in memory (seeded dummy weights) through the checkpoint path."""
    for path, module in model.named_modules():
        export = getattr(module, "checkpoint_tensors", None)
        yield from export(path) if export is not None else direct_tensors(module, path)


class CausalLM(nn.Module):
    """Base of every ``XForCausalLM``. Subclasses build ``self.model`` (embed_tokens, layers,
    norm: HF names, so checkpoint keys map one to one) and ``self.lm_head``.

    Contract with the model runner:
    - ``forward(fb)`` -> final-normed hidden states [T, H]; it writes this step's KV into
      ``fb.kv_pool`` through ``fb.attn_backend`` (one write per layer) and nothing else.
    - ``compute_logits(hidden [N, H])`` -> [N, V] float32.
    - ``hidden_width``: H, the width of a row ``forward`` returns (what a disaggregated prefill
      sends as a request's aux row); ``hidden_size`` unless the model hands on more.
    - ``load_weights(weights)`` fills every parameter from HF-named tensors, then derives
      whatever the layers precompute (``process_weights_after_loading``).
    """

    model: DecoderStack
    lm_head: ParallelLMHead
    config: Any  # the transformers config the model was built from

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        return self.model(fb)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @property
    def hidden_width(self) -> int:
        return int(self.config.hidden_size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_into(self, weights)
        self.process_weights_after_loading()

    def process_weights_after_loading(self) -> None:
        """Recompute derived tensors (e.g. MLA's w_kc/w_vc) from the loaded parameters."""
        for module in self.modules():
            derive = getattr(module, "process_weights_after_loading", None)
            if module is not self and derive is not None:
                derive()
