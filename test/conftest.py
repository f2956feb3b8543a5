import os
import sys

# Tiny models on a 2-core box: one thread per process. With two, every small matmul
# pays thread hand-off costs many times its work, and a test's server subprocess and
# the test process fight over the same cores. Subprocesses inherit this.
os.environ.setdefault("OMP_NUM_THREADS", "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# pdserve_kernels (top-level kernels/) from this checkout, here and in the servers tests start.
_KERNELS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels")
sys.path.insert(0, _KERNELS)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_KERNELS, os.environ.get("PYTHONPATH")) if p)

import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Without a GPU, Triton kernels (pdserve_kernels, the triton backend) run in its interpreter,
# which must be on before anything (torch's inductor included) first imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """``gpu``-marked tests need a CUDA device; on a CPU host they are skipped, not failed."""
    if torch.cuda.is_available():
        return
    import pytest

    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
