"""KV transfer backends behind one contract (``base.py``), one module each, chosen by name.

``mooncake`` (``mooncake.py``): Mooncake's Transfer Engine, TCP or RDMA, what servers use.
``memory`` (``memory.py``): memcpy between schedulers built in one process (tests).
``nixl`` (``nixl.py``): NVIDIA's NIXL over UCX (TCP here, RDMA in clusters), the alternative.
``faults.py`` wraps any of them to misbehave on request. A new backend is a new module and one
line in ``_BACKENDS``; its library is imported only when it is chosen.
"""

from __future__ import annotations

import importlib

from pdserve.transfer.base import (
    Notify,
    Outstanding,
    TransferBackend,
    TransferError,
    WriteHandle,
    WriteState,
    check_writes,
    merge_contiguous,
)
from pdserve.transfer.faults import FAULTS_ENV, FaultInjectingBackend, with_faults
from pdserve.transfer.memory import MemoryFabric, MemoryTransferBackend
from pdserve.transfer.mooncake import (
    MOONCAKE_INSTALL_HINT,
    PROTOCOLS,
    MooncakeTransferBackend,
    import_mooncake,
    mooncake_available,
)
from pdserve.transfer.nixl import NIXL_INSTALL_HINT, NixlTransferBackend, import_nixl, nixl_available

# name -> (module, class); the module is imported, and its engine library loaded, on first use.
_BACKENDS = {
    "mooncake": ("pdserve.transfer.mooncake", "MooncakeTransferBackend"),
    "memory": ("pdserve.transfer.memory", "MemoryTransferBackend"),
    "nixl": ("pdserve.transfer.nixl", "NixlTransferBackend"),
}
BACKEND_NAMES = tuple(_BACKENDS)


def create_transfer_backend(name: str, **kwargs) -> TransferBackend:
    """Backend by its ``--disaggregation-transfer-backend`` name."""
    if name not in _BACKENDS:
        raise ValueError(f"disaggregation_transfer_backend: {name!r} is not one of {sorted(_BACKENDS)}")
    module, cls = _BACKENDS[name]
    return getattr(importlib.import_module(module), cls)(**kwargs)


__all__ = [
    "BACKEND_NAMES",
    "FAULTS_ENV",
    "MOONCAKE_INSTALL_HINT",
    "NIXL_INSTALL_HINT",
    "PROTOCOLS",
    "FaultInjectingBackend",
    "MemoryFabric",
    "MemoryTransferBackend",
    "MooncakeTransferBackend",
    "NixlTransferBackend",
    "Notify",
    "Outstanding",
    "TransferBackend",
    "TransferError",
    "WriteHandle",
    "WriteState",
    "check_writes",
    "create_transfer_backend",
    "import_mooncake",
    "import_nixl",
    "merge_contiguous",
    "mooncake_available",
    "nixl_available",
    "with_faults",
]
