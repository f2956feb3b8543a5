"""Whether this host can run a DeviceConfig: the one place start-up refuses a device, an attention
backend or its packages, with a line naming the flag. Also what this CPU offers the layers
(``CpuFeatures``) and the CPU GEMM policy chosen from it (``cpu_pack_policy``)."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.config import DeviceConfig
from pdserve.layers.cpu_gemm import PACK_ALWAYS, PackPolicy

# Where packed oneDNN GEMMs beat F.linear on decode shapes (benchmark/bench_cpu_ops.py, one thread,
# avx512 host): float32 from 4 rows on weights of 2^17+ elements (1.1-2.3x), and from one row
# on 2^20+ (~1.2x); below that oneDNN's fixed cost per call loses. bfloat16 with native bf16
# dot products: packed wins on every measured shape (1.1-4x over bf16 F.linear).
PACK_FLOAT32 = PackPolicy(min_rows=4, min_weight=1 << 17, big_weight=1 << 20)
PACK_BFLOAT16 = PACK_ALWAYS


@dataclass(frozen=True)
class CpuFeatures:
    """What this CPU and torch build offer the CPU path."""

    onednn: bool  # torch's mkldnn ops (packed linear weights)
    native_bf16: bool  # bf16 dot products in hardware (avx512_bf16 or AMX)

    @classmethod
    def detect(cls, cpuinfo: Path = Path("/proc/cpuinfo")) -> CpuFeatures:
        flags = _cpu_flags(cpuinfo)
        onednn = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        return cls(onednn=onednn, native_bf16=bool(flags & {"avx512_bf16", "amx_bf16"}))


def _cpu_flags(cpuinfo: Path) -> set[str]:
    """The first processor's flags (Linux); empty where the file is absent."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def cpu_pack_policy(cfg: DeviceConfig, features: CpuFeatures) -> PackPolicy | None:
    """The CPU linears' policy for ``--cpu-gemm`` on this host (None: F.linear everywhere).
    ``auto`` packs float32, and bfloat16 where the CPU has native bf16 (else oneDNN emulates
    it no faster than F.linear); float16 stays on F.linear unless ``packed`` asks."""
    if cfg.device != "cpu" or cfg.cpu_gemm == "plain" or not features.onednn:
        return None
    if cfg.cpu_gemm == "packed":
        return PACK_ALWAYS
    if cfg.dtype == "float32":
        return PACK_FLOAT32
    if cfg.dtype == "bfloat16" and features.native_bf16:
        return PACK_BFLOAT16
    return None


def require_device(cfg: DeviceConfig) -> None:
    """Raise ValueError naming the field when ``cfg`` cannot run on this host."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: 'cuda' was asked for but torch {torch.__version__} sees no CUDA device "
                         "(use --device cpu)")
    if cfg.attention_backend == "triton":
        _require_triton(cfg)
    if cfg.device == "cpu" and cfg.cpu_gemm == "packed" and not CpuFeatures.detect().onednn:
        raise ValueError("cpu_gemm: 'packed' needs torch's oneDNN (mkldnn) ops, which this torch build lacks "
                         "(use --cpu-gemm auto or plain)")
    if cfg.attention_backend == "flashinfer" and importlib.util.find_spec("flashinfer") is None:
        raise ValueError("attention_backend: 'flashinfer' needs the flashinfer-python package, which is not "
                         "installed (pip install flashinfer-python, or --attention-backend triton)")


def _require_triton(cfg: DeviceConfig) -> None:
    if importlib.util.find_spec("triton") is None:
        raise ValueError("attention_backend: 'triton' needs the triton package, which is not installed "
                         "(pip install triton, or --attention-backend torch_native)")
    # Triton compiles for GPUs only; on CPU its kernels run in the (slow) interpreter, which
    # must be switched on before triton is first imported.
    if cfg.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("attention_backend: 'triton' on --device cpu runs only under the Triton interpreter "
                         "(set TRITON_INTERPRET=1; slow, meant for tests), else use torch_native")
