"""Whether this host can run a DeviceConfig: the one place start-up refuses a device, an attention
backend or its packages, with a line naming the flag. Imports torch only for a choice that needs
it (CUDA, packed CPU GEMMs): the HTTP frontend checks here and imports none."""

from __future__ import annotations

import importlib.util
import os

from pdserve.config import DeviceConfig


def require_device(cfg: DeviceConfig) -> None:
    """Raise ValueError naming the field when ``cfg`` cannot run on this host."""
    if cfg.device == "cuda":
        _require_cuda()
    if cfg.attention_backend == "triton":
        _require_triton(cfg)
    if cfg.device == "cpu" and cfg.cpu_gemm == "packed":
        from pdserve.engine.device import CpuFeatures

        if not CpuFeatures.detect().onednn:
            raise ValueError("cpu_gemm: 'packed' needs torch's oneDNN (mkldnn) ops, which this torch build lacks "
                             "(use --cpu-gemm auto or plain)")
    if cfg.attention_backend == "flashinfer" and importlib.util.find_spec("flashinfer") is None:
        raise ValueError("attention_backend: 'flashinfer' needs the flashinfer-python package, which is not "
                         "installed (pip install flashinfer-python, or --attention-backend triton)")


def _require_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        raise ValueError(f"device: 'cuda' was asked for but torch {torch.__version__} sees no CUDA device "
                         "(use --device cpu)")


def _require_triton(cfg: DeviceConfig) -> None:
    if importlib.util.find_spec("triton") is None:
        raise ValueError("attention_backend: 'triton' needs the triton package, which is not installed "
                         "(pip install triton, or --attention-backend torch_native)")
    # Triton compiles for GPUs only; on CPU its kernels run in the (slow) interpreter, which
    # must be switched on before triton is first imported.
    if cfg.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("attention_backend: 'triton' on --device cpu runs only under the Triton interpreter "
                         "(set TRITON_INTERPRET=1; slow, meant for tests), else use torch_native")
