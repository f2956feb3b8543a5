import collections
import gc
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

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Without a GPU, Triton kernels (pdserve_kernels, the triton backend) run in its interpreter,
# which must be on before anything (torch's inductor included) first imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Modules that take minutes in CI (seconds from CI's log). Under `-n 2 --dist loadfile` each file
# goes to one worker; these go out first, so that neither worker is left running one of them alone
# at the end while the other idles. The other files follow in xdist's own order (most tests first).
HEAVY_MODULES = (
    "test/entrypoints/test_up.py",  # 170 s: three `pdserve up` deployments
    "test/engine/test_compile.py",  # 143 s: torch.compile
    "test/disagg/test_pd_ranks.py",  # 86 s
    "test/entrypoints/test_no_pickle.py",  # 62 s: two-node servers
)


# An engine or scheduler is a reference cycle (a scheduler and its mode point at each other) that holds
# its KV pool, so what a test built is freed only by the cyclic collector, which runs rarely: a module
# that builds a P/D pair per test held 14 GB of such garbage by its end and starved the other worker.
# A test that leaves this process above the bound is followed by a collection. A full collection walks
# the whole heap (a quarter second and more once torch, transformers and triton are in), and the RSS of
# a worker that once passed the bound seldom falls back under it, so after each collection what
# survived it (live now: imports, module fixtures) is frozen out of the next ones, which then walk what
# later tests built. A frozen object that dies later is freed by its reference count as ever; a frozen
# cycle waits for the next thaw (an Engine's shutdown thaws the whole heap).
COLLECT_ABOVE_BYTES = 3 << 29  # 1.5 GiB
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE_BYTES


@pytest.fixture(autouse=True)
def _collect_garbage_above_the_bound():
    yield
    if _rss_bytes() > COLLECT_ABOVE_BYTES:
        gc.collect()
        gc.freeze()


@pytest.fixture(autouse=True, scope="module")
def _thaw_after_the_module():
    """A module's fixtures were live when the tests froze them; once the module ends they may be
    cycles holding engines and KV pools: above the bound, thaw and collect them before the next module."""
    yield
    if _rss_bytes() > COLLECT_ABOVE_BYTES:
        gc.unfreeze()
        gc.collect()
        gc.freeze()


def pytest_configure(config):
    # xdist would send files by descending test count, whatever order the collection has.
    if getattr(config.option, "loadscopereorder", False):
        config.option.loadscopereorder = False


@pytest.hookimpl(trylast=True)  # after pytest's own fixture-based ordering
def pytest_collection_modifyitems(config, items):
    """Heavy modules first (``HEAVY_MODULES``), then by descending test count; a file's own tests keep
    their order. ``gpu``-marked tests need a CUDA device; on a CPU host they are skipped, not failed."""
    files = [item.nodeid.split("::")[0] for item in items]
    count = collections.Counter(files)
    rank = {f: (HEAVY_MODULES.index(f) if f in HEAVY_MODULES else len(HEAVY_MODULES), -count[f]) for f in count}
    order = {f: i for i, f in enumerate(sorted(dict.fromkeys(files), key=rank.__getitem__))}
    items[:] = [item for _, _, item in sorted((order[f], i, item) for i, (f, item) in enumerate(zip(files, items)))]
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
