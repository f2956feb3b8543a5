"""HF architecture name -> pdserve model class, imported only when asked for.

The list of architectures is ``pdserve.config.ARCHITECTURES``; this module only finds the class.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from pdserve.config import ARCHITECTURES, supported_architecture

if TYPE_CHECKING:
    from pdserve.models.base import CausalLM


def supported_architectures() -> list[str]:
    return sorted(ARCHITECTURES)


def get_model_class(architecture: str) -> type[CausalLM]:
    arch = supported_architecture(architecture)
    return getattr(importlib.import_module(f"pdserve.models.{arch.module}"), arch.name)
