"""GPUs, RDMA NICs and NUMA nodes from sysfs, and the NIC each GPU should send through.

Read from (under an injectable ``root``, so tests build fake trees):
- ``sys/bus/pci/devices/<bdf>``: links into ``sys/devices/pci<domain:bus>/<bridge>/.../<bdf>``;
  ``vendor`` 0x10de with ``class`` 0x0300xx (VGA) or 0x0302xx (3D controller) is an NVIDIA GPU;
  ``numa_node`` is the device's node (-1: unknown).
- ``sys/class/infiniband/<nic>/device``: link to the NIC's PCI device.
- ``sys/devices/system/node/node<N>/cpulist``: NUMA nodes and their CPUs.

The resolved device path lists the PCI bridges above a device; two devices sharing a bridge
below the host bridge sit under one PCIe switch and talk without crossing the CPU. GPU index
``i`` is the i-th GPU in PCI bus order (``CUDA_DEVICE_ORDER=PCI_BUS_ID``); mapping through
``CUDA_VISIBLE_DEVICES`` is the caller's business.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

NVIDIA_VENDOR = "0x10de"
GPU_CLASSES = ("0x0300", "0x0302")  # VGA compatible, 3D controller
_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


@dataclass(frozen=True)
class PciDevice:
    """A GPU (``name`` = its BDF) or an RDMA NIC (``name`` = its IB device, e.g. mlx5_0)."""

    name: str
    bdf: str
    numa_node: int  # -1 when the platform does not say
    bridges: tuple[str, ...]  # PCI bridges above the device, host side first


@dataclass(frozen=True)
class NumaNode:
    node: int
    cpus: tuple[int, ...]


@dataclass(frozen=True)
class Topology:
    gpus: list[PciDevice]  # in PCI bus order: index = CUDA device index under PCI_BUS_ID
    nics: list[PciDevice]  # by name
    numa_nodes: list[NumaNode]


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _device(pci_dir: Path, name: str) -> PciDevice | None:
    """The PCI device at ``pci_dir`` (a link or its target), or None if it is not one."""
    real = Path(os.path.realpath(pci_dir))
    if not _BDF.match(real.name):
        return None
    bridges = tuple(p for p in real.parent.parts if _BDF.match(p))
    node = _read(real / "numa_node")
    return PciDevice(name, real.name, int(node) if node and node.lstrip("-").isdigit() else -1, bridges)


def _is_nvidia_gpu(dev_dir: Path) -> bool:
    cls = _read(dev_dir / "class") or ""
    return _read(dev_dir / "vendor") == NVIDIA_VENDOR and cls.startswith(GPU_CLASSES)


def _cpus(cpulist: str) -> tuple[int, ...]:
    """``"0-3,8,10-11"`` -> (0, 1, 2, 3, 8, 10, 11)."""
    out: list[int] = []
    for part in filter(None, cpulist.split(",")):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(out)


def discover(root: str | os.PathLike = "/") -> Topology:
    """Everything sysfs under ``root`` shows; empty lists (no error) where it shows nothing."""
    sys_dir = Path(root) / "sys"
    pci = sys_dir / "bus" / "pci" / "devices"
    gpus = [d for p in sorted(pci.glob("*")) if _is_nvidia_gpu(p) and (d := _device(p, p.name))]
    ib = sys_dir / "class" / "infiniband"
    nics = [d for p in sorted(ib.glob("*")) if (d := _device(p / "device", p.name))]
    nodes = []
    for p in sorted((sys_dir / "devices" / "system" / "node").glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        nodes.append(NumaNode(int(p.name[4:]), _cpus(_read(p / "cpulist") or "")))
    return Topology(gpus, nics, nodes)


def affinity(gpu: PciDevice, nic: PciDevice) -> tuple[int, bool]:
    """(PCI bridges shared, same NUMA node): higher is closer; > 0 bridges = same PCIe switch."""
    shared = 0
    for a, b in zip(gpu.bridges, nic.bridges):
        if a != b:
            break
        shared += 1
    return shared, gpu.numa_node == nic.numa_node and gpu.numa_node >= 0


def nic_for_gpus(topo: Topology, ib_device: str | None = None) -> list[str | None]:
    """The NIC for each GPU (by index): same PCIe switch first, then same NUMA node, then any,
    spreading GPUs evenly over equally close NICs. None where there is no NIC (TCP).

    ``ib_device`` is ``--disaggregation-ib-device``: one name for every GPU, or a comma list to
    choose among. Names must exist when sysfs shows NICs; when it shows none (a container
    without /sys/class/infiniband), they are trusted and dealt out in GPU order.
    """
    names = [n.strip() for n in ib_device.split(",") if n.strip()] if ib_device else []
    if ib_device is not None and not names:
        raise ValueError(f"disaggregation_ib_device: no device name in {ib_device!r}")
    if names and not topo.nics:
        return [names[i % len(names)] for i in range(len(topo.gpus))]
    known = {n.name: n for n in topo.nics}
    for n in names:
        if n not in known:
            raise ValueError(f"disaggregation_ib_device: {n!r} is not an RDMA device here "
                             f"(found: {', '.join(known) or 'none'})")
    nics = [known[n] for n in names] if names else topo.nics
    if not nics:
        return [None] * len(topo.gpus)
    chosen: list[str | None] = list(_assign(topo.gpus, nics))
    return chosen


def _assign(gpus: list[PciDevice], nics: list[PciDevice]) -> list[str]:
    """GPUs with a NIC under their own switch choose first, so the rest spread over what is left."""
    load: Counter = Counter()
    out: list[str] = [""] * len(gpus)
    best = [max(affinity(g, n) for n in nics) for g in gpus]
    for i in sorted(range(len(gpus)), key=lambda i: (-best[i][0], not best[i][1], i)):
        nic = min(nics, key=lambda n: (tuple(-x for x in affinity(gpus[i], n)), load[n.name], n.name))
        load[nic.name] += 1
        out[i] = nic.name
    return out


def transfer_device(ib_device: str | None, gpu: int | None, root: str | os.PathLike = "/") -> tuple[str, str]:
    """``(protocol, device_name)`` for the transfer engine of the rank driving GPU ``gpu`` (its
    PCI-ordered index; None: the rank runs on CPU).

    - ``ib_device`` (``--disaggregation-ib-device``) one name: that NIC, whatever the topology;
      a comma list: the nearest of them to the GPU (a CPU rank hands Mooncake the whole list);
    - none named: a GPU rank sends through the RDMA NIC nearest its GPU (PCIe switch, then NUMA
      node); TCP when sysfs shows no NIC, or the rank runs on CPU.
    """
    names = [n.strip() for n in ib_device.split(",") if n.strip()] if ib_device is not None else []
    if ib_device is not None and not names:
        raise ValueError(f"disaggregation_ib_device: no device name in {ib_device!r}")
    if len(names) == 1 or (names and gpu is None):
        return "rdma", ",".join(names)
    if gpu is None:
        return "tcp", ""
    choice = nic_for_gpus(discover(root), ib_device)
    nic = choice[gpu] if gpu < len(choice) else None
    if nic:
        return "rdma", nic
    if names:  # sysfs shows fewer GPUs than CUDA does (a container): deal the names out
        return "rdma", names[gpu % len(names)]
    return "tcp", ""


def local_gpu(device: object) -> int | None:
    """The PCI-ordered index of the GPU ``device`` (a torch device or its name, e.g. ``"cuda:1"``) runs
    on, through CUDA_VISIBLE_DEVICES; None on CPU. ``discover`` reads GPUs in PCI bus order, as CUDA
    does under CUDA_DEVICE_ORDER=PCI_BUS_ID."""
    kind, _, index_text = str(device).partition(":")
    if kind != "cuda":
        return None
    index = int(index_text or 0)
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if index < len(visible) and visible[index].isdigit():
        return int(visible[index])
    return index
