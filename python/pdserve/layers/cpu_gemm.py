"""CPU GEMMs on weights packed once for oneDNN, used per call where they pay; F.linear otherwise.

Legend: M rows (tokens) of a call, K in features, N out features.

``F.linear`` hands the plain [N, K] weight to the BLAS on every call, which may copy it into its
kernel's blocked layout each time. oneDNN through torch's mkldnn ops (``mkldnn._reorder_linear_weight`` once,
``mkldnn._linear_pointwise`` per call: what inductor emits for a frozen CPU linear) reads a
weight reordered once into its blocked layout. That pays on decode shapes from a few rows up,
and for big weights from one row; a small weight at one row loses to F.linear (oneDNN's fixed
cost per call is ~10 us). ``PackPolicy`` states where the line lies, as measured by
``benchmark/bench_cpu_ops.py``; the runner chooses the policy per device and dtype
(``engine.device.cpu_pack_policy``).

The packed copy sits beside the plain weight, which stays the layer's parameter: loading,
fingerprints, tied embeddings and the small-M fallback read it. Packing happens after loading
(after the TP split and FP8 dequantization), so nothing about the weights' meaning changes.
Results differ from F.linear's by float rounding only (another summation order).

Under ``torch.compile`` (``--enable-torch-compile``) the packed call is the custom op
``pdserve::packed_linear``: inductor cannot take the oneDNN tensor as a graph input (it has no
strides to fake), so the op takes the plain weight, which is a graph input like any parameter,
and finds its packed copy through it. Inductor then fuses the element-wise ops around an opaque
GEMM instead of falling back to F.linear.

Decode calls (float32, up to ``SMALL_M_MAX_ROWS`` rows, eager) take the plain-C small-M GEMM instead
(``pdserve_kernels.gemm_cpu``) on a third copy of the weight packed into its 32-column panels: on one
thread it runs as fast as oneDNN, and its own helper threads (``gemm_cpu.set_threads``, which the
scheduler sets from its thread layout) take the second core, where torch's OpenMP team loses to its
wake-ups at decode sizes. Prefill keeps oneDNN (torch runs it on every thread there); so does the
compiled step (``pdserve::packed_linear``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from pdserve_kernels import gemm_cpu


@dataclass(frozen=True)
class PackPolicy:
    """Which calls of a packed weight [N, K] take the oneDNN path: those with at least
    ``min_rows`` rows and N*K >= ``min_weight``, and any call once N*K >= ``big_weight``."""

    min_rows: int
    min_weight: int
    big_weight: int

    def __post_init__(self):
        if min(self.min_rows, self.min_weight, self.big_weight) < 0:
            raise ValueError(f"PackPolicy: thresholds must be >= 0, got {self}")

    def pays(self, rows: int, weight_numel: int) -> bool:
        return weight_numel >= self.big_weight or (rows >= self.min_rows and weight_numel >= self.min_weight)

    def ever_pays(self, weight_numel: int) -> bool:
        """False: no call of this weight would take the packed path, so packing it only costs memory."""
        return weight_numel >= min(self.min_weight, self.big_weight)


# Every call packed (tests, --cpu-gemm packed).
PACK_ALWAYS = PackPolicy(min_rows=0, min_weight=0, big_weight=0)

# Calls of at most this many rows take the C small-M GEMM (where it built): at 1-64 rows it matches
# or beats oneDNN on one thread (benchmark/bench_small_gemm.py: M=32, 2.29 ms vs 2.37 ms over the
# tiny models' eight decode shapes); past that oneDNN's larger blocking wins.
SMALL_M_MAX_ROWS = 64


class PackedLinear:
    """A weight [N, K] reordered once into oneDNN's layout (float32: also into the C small-M GEMM's
    panels, which eager decode calls take). Not a module or a parameter: state_dict, ``.to()`` and
    the loader never see it (CPU only)."""

    DTYPES = (torch.float32, torch.bfloat16)

    def __init__(self, weight: torch.Tensor, policy: PackPolicy):
        if not self.supports(weight):
            raise ValueError(f"PackedLinear: needs a 2-D CPU weight in {self.DTYPES}, got {tuple(weight.shape)} "
                             f"{weight.dtype} on {weight.device}")
        self.policy = policy
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        self.numel = weight.numel()
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach())  # [N, K] opaque layout
        self.panels: torch.Tensor | None = None  # [ceil(N / 32), K, 32]: the C small-M GEMM's copy
        self._c_gemm = gemm_cpu.load() if weight.dtype == torch.float32 else None
        if self._c_gemm is not None:
            self.panels = gemm_cpu.pack(weight.detach())
        self.plain = weight  # the compiled call's handle on the packed copy (packed_linear)
        _PACKED[weight] = self.weight

    @classmethod
    def supports(cls, weight: torch.Tensor) -> bool:
        return weight.dim() == 2 and weight.device.type == "cpu" and weight.dtype in cls.DTYPES

    @classmethod
    def worth_it(cls, weight: torch.Tensor, policy: PackPolicy) -> bool:
        """Supported, and some call would take the packed path (else a copy for nothing)."""
        return cls.supports(weight) and policy.ever_pays(weight.numel())

    def pays(self, x: torch.Tensor) -> bool:
        rows = x.numel() // self.in_features  # M: all leading dims
        return self.policy.pays(rows, self.numel)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return packed_linear(x, self.plain, bias)  # [..., N]
        lib, panels = self._c_gemm, self.panels
        if lib is not None and panels is not None and self._small_m(x, bias):
            rows = x.reshape(-1, self.in_features)  # [M, K]
            if not rows.is_contiguous():
                rows = rows.contiguous()
            out = gemm_cpu.run(lib, rows, panels, self.out_features, bias, gemm_cpu.threads())  # [M, N]
            return out.view(*x.shape[:-1], self.out_features)  # [..., N]
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, bias, "none", [], "")  # [..., N]

    def _small_m(self, x: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """A call the C small-M GEMM takes: float32 throughout, at most SMALL_M_MAX_ROWS rows of this
        layer's width (anything else goes to oneDNN, which names what is wrong)."""
        return (x.dtype == torch.float32 and x.shape[-1] == self.in_features
                and x.numel() <= SMALL_M_MAX_ROWS * self.in_features and x.device.type == "cpu"
                and (bias is None or (bias.dtype == torch.float32 and bias.shape == (self.out_features,)
                                      and bias.is_contiguous())))


# plain weight -> its packed copy, for packed_linear. Keyed by the parameter object (a compiled graph
# hands the op the very parameter it was given); weak, so a dropped model takes its copies along.
_PACKED: WeakIdKeyDictionary = WeakIdKeyDictionary()


@torch.library.custom_op("pdserve::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] -> [..., N] on the packed copy of ``weight`` [N, K] (a weight PackedLinear packed)."""
    packed = _PACKED.get(weight)
    if packed is None:
        raise RuntimeError(f"pdserve::packed_linear: the weight {tuple(weight.shape)} was never packed")
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@packed_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def set_small_m_threads(n: int) -> None:
    """The threads (caller and helpers) a C small-M GEMM call may use from now on, process-wide:
    the scheduler's thread layout. Calls share them only where big enough (gemm_cpu.PARALLEL_MIN_WORK)."""
    gemm_cpu.set_threads(n)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: PackedLinear | None) -> torch.Tensor:
    """x [..., K] -> [..., N]: the packed GEMM where the policy says it pays, else F.linear."""
    if packed is not None and packed.pays(x):
        return packed(x, bias)
    return F.linear(x, weight, bias)


def pack_linears(model: nn.Module, policy: PackPolicy) -> int:
    """Pack every layer of ``model`` that can and whose weight the policy would ever use packed
    (``pack_cpu(policy) -> bool``); returns how many did."""
    count = 0
    for module in model.modules():
        pack = getattr(module, "pack_cpu", None)
        if pack is not None and pack(policy):
            count += 1
    return count
