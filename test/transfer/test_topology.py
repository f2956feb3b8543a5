"""topology.py on fake sysfs trees built in tmp_path, and on this machine's real /sys; the
transfer device each scheduler rank opens its engine with (disagg/roles.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pdserve.transfer.topology import discover, local_gpu, nic_for_gpus, transfer_device

MELLANOX, IB_CLASS = "0x15b3", "0x020700"


class FakeSysfs:
    def __init__(self, root: Path):
        self.root = root

    def pci(self, path: str, vendor: str, cls: str, numa: int) -> Path:
        """``path``: host bridge / bridges / device, e.g. "pci0000:00/0000:00:01.0/0000:10:00.0"."""
        d = self.root / "sys" / "devices" / path
        d.mkdir(parents=True)
        for name, value in (("vendor", vendor), ("class", cls), ("numa_node", str(numa))):
            (d / name).write_text(value + "\n")
        link = self.root / "sys" / "bus" / "pci" / "devices" / d.name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(d, link.parent))
        return d

    def gpu(self, path: str, numa: int) -> None:
        self.pci(path, "0x10de", "0x030200", numa)

    def nic(self, name: str, path: str, numa: int) -> None:
        d = self.pci(path, MELLANOX, IB_CLASS, numa)
        ib = self.root / "sys" / "class" / "infiniband" / name
        ib.mkdir(parents=True)
        (ib / "device").symlink_to(os.path.relpath(d, ib))

    def node(self, n: int, cpulist: str) -> None:
        d = self.root / "sys" / "devices" / "system" / "node" / f"node{n}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpulist + "\n")


@pytest.fixture
def two_socket(tmp_path) -> FakeSysfs:
    """2 NUMA nodes, 8 GPUs, 4 NICs; GPU 5 and mlx5_3 share a PCIe switch on node 1."""
    fs = FakeSysfs(tmp_path)
    fs.node(0, "0-15,32-47")
    fs.node(1, "16-31,48-63")
    for i in range(4):  # node 0: GPUs and NICs each on their own root port
        fs.gpu(f"pci0000:00/0000:00:0{i + 1}.0/0000:1{i}:00.0", 0)
    fs.nic("mlx5_0", "pci0000:00/0000:00:05.0/0000:20:00.0", 0)
    fs.nic("mlx5_1", "pci0000:00/0000:00:06.0/0000:21:00.0", 0)
    switch = "pci0000:80/0000:80:02.0/0000:90:00.0"  # root port, switch upstream port
    fs.gpu("pci0000:80/0000:80:01.0/0000:88:00.0", 1)
    fs.gpu(f"{switch}/0000:91:00.0/0000:92:00.0", 1)
    fs.gpu("pci0000:80/0000:80:03.0/0000:a0:00.0", 1)
    fs.gpu("pci0000:80/0000:80:04.0/0000:a1:00.0", 1)
    fs.nic("mlx5_2", "pci0000:80/0000:80:05.0/0000:b0:00.0", 1)
    fs.nic("mlx5_3", f"{switch}/0000:91:04.0/0000:93:00.0", 1)
    # Not GPUs: an NVIDIA audio function and another vendor's VGA card.
    fs.pci("pci0000:00/0000:00:01.0/0000:10:00.1", "0x10de", "0x040300", 0)
    fs.pci("pci0000:00/0000:00:07.0/0000:30:00.0", "0x8086", "0x030000", 0)
    return fs


def test_discovers_gpus_nics_and_numa_nodes(two_socket):
    topo = discover(two_socket.root)
    assert [g.bdf for g in topo.gpus] == ["0000:10:00.0", "0000:11:00.0", "0000:12:00.0", "0000:13:00.0",
                                          "0000:88:00.0", "0000:92:00.0", "0000:a0:00.0", "0000:a1:00.0"]
    assert [g.numa_node for g in topo.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [(n.name, n.bdf, n.numa_node) for n in topo.nics] == [
        ("mlx5_0", "0000:20:00.0", 0), ("mlx5_1", "0000:21:00.0", 0),
        ("mlx5_2", "0000:b0:00.0", 1), ("mlx5_3", "0000:93:00.0", 1)]
    assert topo.gpus[5].bridges == ("0000:80:02.0", "0000:90:00.0", "0000:91:00.0")
    assert [(n.node, len(n.cpus), n.cpus[:2]) for n in topo.numa_nodes] == [(0, 32, (0, 1)), (1, 32, (16, 17))]


def test_switch_first_then_numa_spread_evenly(two_socket):
    assert nic_for_gpus(discover(two_socket.root)) == [
        "mlx5_0", "mlx5_1", "mlx5_0", "mlx5_1",  # node 0: spread over its two NICs
        "mlx5_2", "mlx5_3", "mlx5_2", "mlx5_3"]  # GPU 5 takes its switch's NIC; the rest balance


def test_ib_device_override(two_socket):
    topo = discover(two_socket.root)
    assert nic_for_gpus(topo, "mlx5_1") == ["mlx5_1"] * 8
    # Restricted to node 1's NICs: node 0's GPUs have no close NIC and spread over both.
    assert nic_for_gpus(topo, "mlx5_2, mlx5_3") == [
        "mlx5_2", "mlx5_3", "mlx5_2", "mlx5_3", "mlx5_2", "mlx5_3", "mlx5_2", "mlx5_3"]
    with pytest.raises(ValueError, match=r"disaggregation_ib_device: 'mlx5_9' is not an RDMA device here "
                                         r"\(found: mlx5_0, mlx5_1, mlx5_2, mlx5_3\)"):
        nic_for_gpus(topo, "mlx5_0,mlx5_9")
    with pytest.raises(ValueError, match="no device name"):
        nic_for_gpus(topo, " , ")


def test_numa_node_without_nic_spreads_over_all(tmp_path):
    fs = FakeSysfs(tmp_path)
    for i in range(4):
        fs.gpu(f"pci0000:00/0000:00:0{i + 1}.0/0000:1{i}:00.0", 0)
    for i in range(2):
        fs.gpu(f"pci0000:80/0000:80:0{i + 1}.0/0000:9{i}:00.0", 1)
    fs.nic("mlx5_0", "pci0000:80/0000:80:05.0/0000:a0:00.0", 1)
    fs.nic("mlx5_1", "pci0000:80/0000:80:06.0/0000:a1:00.0", 1)
    # Node-1 GPUs take one NIC each, then node 0's four spread two and two.
    assert nic_for_gpus(discover(tmp_path)) == ["mlx5_0", "mlx5_1", "mlx5_0", "mlx5_1", "mlx5_0", "mlx5_1"]


def test_dgx_like_one_nic_per_switch(tmp_path):
    fs = FakeSysfs(tmp_path)
    for s in range(4):  # 4 switches, each: 2 GPUs + 1 NIC; switches 0-1 on node 0
        host, numa = ("pci0000:00", 0) if s < 2 else ("pci0000:80", 1)
        up = f"{host}/0000:{host[-2:]}:0{s + 1}.0/0000:{s + 1}0:00.0"
        fs.gpu(f"{up}/0000:{s + 1}1:00.0/0000:{s + 1}2:00.0", numa)
        fs.gpu(f"{up}/0000:{s + 1}1:01.0/0000:{s + 1}3:00.0", numa)
        fs.nic(f"mlx5_{3 - s}", f"{up}/0000:{s + 1}1:02.0/0000:{s + 1}4:00.0", numa)  # names reversed
    assert nic_for_gpus(discover(tmp_path)) == ["mlx5_3", "mlx5_3", "mlx5_2", "mlx5_2",
                                                "mlx5_1", "mlx5_1", "mlx5_0", "mlx5_0"]


def test_no_nics_means_tcp_unless_told(tmp_path):
    fs = FakeSysfs(tmp_path)
    fs.gpu("pci0000:00/0000:00:01.0/0000:10:00.0", 0)
    fs.gpu("pci0000:00/0000:00:02.0/0000:11:00.0", 0)
    topo = discover(tmp_path)
    assert nic_for_gpus(topo) == [None, None]
    assert nic_for_gpus(topo, "mlx5_0,mlx5_1") == ["mlx5_0", "mlx5_1"]  # sysfs hidden: trusted


def test_this_machine_and_a_missing_root(tmp_path):
    topo = discover("/")  # never raises, whatever this host is
    if not Path("/proc/driver/nvidia").exists():
        assert topo.gpus == []
    if not Path("/sys/class/infiniband").exists():
        assert topo.nics == [] and nic_for_gpus(topo) == [None] * len(topo.gpus)
    for d in topo.gpus + topo.nics:
        assert Path("/sys/bus/pci/devices", d.bdf).exists()
    empty = discover(tmp_path / "nothing")
    assert (empty.gpus, empty.nics, empty.numa_nodes) == ([], [], [])


def test_each_gpu_rank_sends_through_its_nearest_nic(two_socket):
    root = two_socket.root
    assert [transfer_device(None, gpu, root) for gpu in range(8)] == [("rdma", n) for n in (
        "mlx5_0", "mlx5_1", "mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "mlx5_2", "mlx5_3")]
    assert transfer_device("mlx5_1", 5, root) == ("rdma", "mlx5_1")  # the operator's override
    assert transfer_device("mlx5_2,mlx5_3", 5, root) == ("rdma", "mlx5_3")  # the nearest of those named
    assert transfer_device("mlx5_2,mlx5_3", 0, root) == ("rdma", "mlx5_2")
    with pytest.raises(ValueError, match="'mlx5_9' is not an RDMA device here"):
        transfer_device("mlx5_0,mlx5_9", 0, root)


def test_cpu_ranks_and_hosts_without_nics_use_tcp(tmp_path, two_socket):
    assert transfer_device(None, None, two_socket.root) == ("tcp", "")  # a rank on CPU, NICs or not
    assert transfer_device("mlx5_0,mlx5_1", None, two_socket.root) == ("rdma", "mlx5_0,mlx5_1")  # Mooncake picks
    bare = FakeSysfs(tmp_path / "bare")
    bare.gpu("pci0000:00/0000:00:01.0/0000:10:00.0", 0)
    assert transfer_device(None, 0, bare.root) == ("tcp", "")
    assert transfer_device("mlx5_0,mlx5_1", 3, bare.root) == ("rdma", "mlx5_1")  # sysfs hides them: dealt out
    assert transfer_device(None, None) == ("tcp", "")  # this host's ranks run on CPU


def test_a_ranks_gpu_index_follows_cuda_visible_devices(monkeypatch):
    assert local_gpu("cpu") is None
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert local_gpu("cuda:1") == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    assert (local_gpu("cuda:0"), local_gpu("cuda:1"), local_gpu("cuda")) == (4, 6, 4)
