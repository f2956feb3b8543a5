"""torch.distributed set-up for one scheduler rank: rendezvous, backend, groups, teardown.

Rendezvous: a file store in a directory the launcher created for this engine alone (one
node; no port to pick, so no race for it), or TCP at ``--dist-init-addr`` (several
nodes). Tensors go over NCCL on CUDA and gloo on CPU; the control plane (messages,
step agreement) always goes over a gloo group, since it moves Python objects on CPU.

Which interface gloo uses across nodes (``gloo_interface``): the one this node reaches node 0
by, unless ``GLOO_SOCKET_IFNAME`` says otherwise. Gloo's own default is the address the host
name resolves to, which on many hosts is loopback (``127.0.1.1`` in Debian's ``/etc/hosts``,
``127.0.0.1`` in many containers): its pair sockets then bind there, advertise it, and no
other node can connect ("Gloo connectFullMesh failed ... Connection refused").
"""

from __future__ import annotations

import datetime
import fcntl
import ipaddress
import logging
import os
import socket
import struct
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from pdserve.distributed.parallel_state import ParallelState
from pdserve.distributed.rank_layout import RankLayout

logger = logging.getLogger(__name__)

# A rank that waits longer than this in one collective gives up with an error. The leader
# wakes every rank at least every idle poll, so only a hung or stopped peer can hit it.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"  # torch reads it when it creates a gloo group: interface names
_SIOCGIFADDR = 0x8915  # Linux: an interface's (primary) IPv4 address


def backend_for_device(device: str | torch.device) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_method(store_dir: str | None, dist_init_addr: str | None, name: str = "dist_store") -> str:
    """``tcp://host:port`` when an address is given, else a file store ``name`` in the existing
    directory ``store_dir`` (fresh per engine: a store file left by another run would mix them)."""
    if dist_init_addr:
        return f"tcp://{dist_init_addr}"
    if not store_dir:
        raise ValueError("dist_init_addr: needed when no store directory is shared by the ranks")
    return f"file://{os.path.join(store_dir, name)}"


def route_source(host: str) -> str | None:
    """The local address this node's packets to ``host`` leave from (None: no route, or ``host``
    does not resolve). A UDP connect only asks the routing table: nothing is sent."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(sockaddr)
            return str(s.getsockname()[0])
    except OSError:
        return None


def interface_of(address: str) -> str | None:
    """The name of the interface holding ``address`` (an IPv4 interface's primary address, or
    any IPv6 address), or None."""
    ip = ipaddress.ip_address(address.split("%")[0])
    if ip.version == 6:
        try:
            with open("/proc/net/if_inet6") as f:  # "<32 hex digits> <index> <plen> <scope> <flags> <name>"
                for line in f:
                    fields = line.split()
                    if len(fields) == 6 and ipaddress.ip_address(bytes.fromhex(fields[0])) == ip:
                        return fields[5]
        except OSError:
            return None
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(raw[20:24]) == str(ip):
                return name
    return None


def gloo_interface(method: str) -> str | None:
    """For a ``tcp://host:port`` rendezvous: the interface this node reaches ``host`` (node 0) by,
    for ``GLOO_SOCKET_IFNAME`` (module docstring). None for a file store (one node: gloo's
    default is right) or when no interface could be found."""
    parts = urlsplit(method)
    if parts.scheme != "tcp" or not parts.hostname:
        return None
    source = route_source(parts.hostname)
    return interface_of(source) if source else None


def pin_gloo_interface(method: str) -> None:
    """Set ``GLOO_SOCKET_IFNAME`` in this rank's process to ``gloo_interface(method)``, unless the
    operator set it; a multi-node rank that finds none says so (gloo may then pick loopback)."""
    if os.environ.get(GLOO_IFNAME_ENV) or not method.startswith("tcp://"):
        return
    name = gloo_interface(method)
    if name is None:
        logger.warning("no interface found that reaches %s: gloo picks one from the host name (loopback on many "
                       "hosts, which the other nodes cannot reach); set %s to the interface they reach this node "
                       "by", urlsplit(method).hostname, GLOO_IFNAME_ENV)
        return
    os.environ[GLOO_IFNAME_ENV] = name
    logger.debug("gloo binds interface %s (the route to %s)", name, urlsplit(method).hostname)


@dataclass
class RankGroups:
    """The groups one rank talks over. ``cpu`` spans every rank (gloo); ``attn_tp`` is this
    rank's attention group (None when it has one rank)."""

    layout: RankLayout
    parallel: ParallelState
    cpu: Any
    attn_tp: Any

    def destroy(self) -> None:
        """Leave the process group after a clean stop: every rank meets once more first, so none
        leaves while a peer is still inside a collective with it (the peer would see a closed
        connection and fail)."""
        if dist.is_initialized():
            dist.barrier(group=self.cpu)
            dist.destroy_process_group()


def init_rank_groups(layout: RankLayout, method: str, backend: str = "gloo",
                     timeout: datetime.timedelta = COLLECTIVE_TIMEOUT) -> RankGroups:
    """Join the engine's process group and build every group; all ranks must call this."""
    # Imported now, while no group exists: its functions default to ``group=group.WORLD``,
    # evaluated at import. Imported later (transformers does on the first config lookup) they
    # would hold the world group, destroy_process_group could not free it, and gloo's threads
    # would outlive main() (an abort at exit, now and then).
    import torch.distributed.nn.functional  # noqa: F401

    pin_gloo_interface(method)
    dist.init_process_group(backend, init_method=method, rank=layout.rank, world_size=layout.world_size,
                            timeout=timeout)
    cpu = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    made = _new_groups(layout, backend, timeout)
    return RankGroups(layout, parallel_state(layout, made), cpu, made.get("attn_tp"))


def _new_groups(layout: RankLayout, backend: str, timeout) -> dict[str, Any]:
    """Create every group of every kind (torch needs all ranks to create all groups, in the same
    order) and keep this rank's: {"tp", "attn_tp", "attn_dp"} (absent: size 1 / not used)."""
    mine: dict[str, Any] = {}
    kinds = [("tp", layout.tp_groups())]
    if layout.attn_tp_size != layout.tp_size:
        kinds.append(("attn_tp", layout.attn_tp_groups()))
    kinds.append(("attn_dp", layout.attn_dp_groups()))
    for name, rank_lists in kinds:
        for ranks in rank_lists:
            if len(ranks) == 1:
                continue
            group = dist.new_group(ranks, backend=backend, timeout=timeout)
            if layout.rank in ranks:
                mine[name] = group
    if layout.attn_tp_size == layout.tp_size and "tp" in mine:
        mine["attn_tp"] = mine["tp"]
    return mine


def parallel_state(layout: RankLayout, groups: dict[str, Any]) -> ParallelState:
    """The ParallelState layers are built with, from this rank's groups."""
    tp = groups.get("tp")
    ep = tp if layout.ep_size > 1 else None
    a2a = layout.config.moe_a2a_backend
    if not layout.dp_attention:
        return ParallelState(layout.tp_rank, layout.tp_size, layout.ep_rank, layout.ep_size, tp, ep,
                             moe_a2a_backend=a2a, deepep_mode=layout.config.deepep_mode)
    attn = ParallelState(layout.attn_tp_rank, layout.attn_tp_size, tp_group=groups.get("attn_tp"))
    return ParallelState(layout.tp_rank, layout.tp_size, layout.ep_rank, layout.ep_size, tp, ep, attn,
                         layout.dp_rank, layout.dp_size, groups.get("attn_dp"), a2a, layout.config.deepep_mode)
