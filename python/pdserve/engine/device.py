"""What this CPU offers the layers (``CpuFeatures``) and the CPU GEMM policy chosen from it
(``cpu_pack_policy``). Whether this host can run a DeviceConfig at all: ``require_device``
(engine/device_check.py, which imports no torch for a CPU server; named here too)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.config import DeviceConfig
from pdserve.engine.device_check import require_device as require_device
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
