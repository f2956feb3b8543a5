"""Builds a scheduler rank's disaggregation mode: the transfer engine with the KV pool registered
once (through the NIC nearest the rank's GPU), the mode's I/O, and (prefill) the rank's records
in the bootstrap registry.

With several ranks every rank has its own transfer engine over its own pool (GQA: its head
range; MLA: the whole latent), and its own RankRecord; every peer sends its control messages to
rank 0's channel, which all records name (``disagg/mode_io.py``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from pdserve.config import DisaggConfig, ModelConfig, ServerArgs, resolve_index_cache_dtype, split_host_port
from pdserve.disagg import protocol
from pdserve.disagg.auth import PeerAuth, peer_auth
from pdserve.disagg.bootstrap import BootstrapClient, CompatRecord, RankRecord
from pdserve.disagg.channel import ControlChannel, Mailbox, advertised_host
from pdserve.disagg.layout import KVLayout
from pdserve.disagg.mode_io import DirectIO, LockStepIO, ModeIO
from pdserve.disagg.protocol import BufferRange, DecodeRecord
from pdserve.disagg.receiver import PeerDirectory, PeerFetched, PeersDead, PeersGone
from pdserve.disagg.sender import KVSender
from pdserve.disagg.staging import StagingPool, pool_tensors
from pdserve.engine.modes import RoleSwitchRefused, SchedulerMode
from pdserve.obs.role import LiveRole
from pdserve.transfer import FAULTS_ENV, TransferBackend, create_transfer_backend, with_faults
from pdserve.transfer.topology import local_gpu, transfer_device

if TYPE_CHECKING:
    from pdserve.engine.scheduler import Scheduler

logger = logging.getLogger(__name__)

BOOTSTRAP_FETCH_TIMEOUT_S = 10.0  # decode's bound on reaching a prefill's bootstrap registry
# What a mode's channel and mailbox carry (the rank loop shares these with every rank).
MESSAGE_TYPES = (*protocol.MESSAGES.values(), PeerFetched, PeersDead, PeersGone)


def compat_record(args: ServerArgs, model_config: ModelConfig, pool=None) -> CompatRecord:
    """``pool``: the side's KV pool, whose per-request records (none: every state in pages) the record names."""
    return CompatRecord.from_model(model_config, args.page_size, model=args.served_model_name or args.model_path,
                                   seed=args.random_seed, transfer_backend=args.disaggregation_transfer_backend,
                                   kv_cache_dtype=args.kv_cache_dtype, speculative=args.speculative_algorithm,
                                   state_records=state_records(pool) if pool is not None else "none",
                                   index_cache_dtype=resolve_index_cache_dtype(args.index_cache_dtype,
                                                                               args.device_config().device))


def kv_layout(model_config: ModelConfig, pool, tp_size: int = 1, dp_size: int = 1) -> KVLayout:
    """The KV layout a side publishes: ``tp_size`` the attention-TP ranks sharing a request's KV,
    ``dp_size`` the attention groups (each owning whole requests)."""
    kind = "regions" if model_config.state_regions else "mla" if model_config.is_mla else "gqa"
    heads = model_config.num_kv_heads if kind == "gqa" else 1  # V4's one K=V head is replicated like a latent
    dtype = str(pool.dtype).removeprefix("torch.")  # what the pages hold: float8_e4m3fn for an fp8 pool
    # every buffer's own dtype: regions beside the latent (V3.2's index keys) keep the model's
    dtypes = {name: str(buf.dtype).removeprefix("torch.") for name, buf in pool.page_buffers()}
    dtypes |= {name: str(buf.dtype).removeprefix("torch.") for name, buf in pool.record_buffers()}
    layers = {**pool.buffer_layers(), **pool.record_layers()}
    return KVLayout.from_descriptors(kind, tp_size, heads, pool.page_size, dtype, pool.buffer_descriptors(), dp_size,
                                     region_dtypes=dtypes, region_layers=layers, num_layers=pool.num_layers,
                                     records=pool.record_descriptors())


def transfer_backend(cfg: DisaggConfig, host: str, gpu: int | None = None) -> TransferBackend:
    """The rank's transfer engine: RDMA through the NIC nearest its GPU when there is one
    (``--disaggregation-ib-device`` overrides or narrows the choice), else TCP."""
    protocol_name, device = transfer_device(cfg.ib_device, gpu)
    if device:
        logger.info("KV transfer over %s through %s (GPU %s)", protocol_name, device, gpu)
    backend = create_transfer_backend(cfg.transfer_backend, hostname=advertised_host(host), protocol=protocol_name,
                                      device_name=device)
    return with_faults(backend, os.environ.get(FAULTS_ENV, ""))


def mode_io(host: str, groups=None, auth: PeerAuth | None = None) -> ModeIO:
    """A single scheduler's I/O, or (``groups``: this rank's RankGroups) one lock-step rank's,
    whose peers reach rank 0's channel (every rank learns its endpoint here: a collective)."""
    if groups is None:
        return DirectIO(ControlChannel(host, auth=auth), Mailbox())
    from pdserve.engine.rank_group import ControlPlane

    lay = groups.layout
    channel = ControlChannel(host, listen=lay.is_leader, auth=auth)
    control = ControlPlane(lay, groups.cpu)
    endpoint = control.gather(channel.endpoint)[0]
    return LockStepIO(channel, Mailbox() if lay.is_leader else None, lay, control, endpoint, MESSAGE_TYPES)


def build_mode(args: ServerArgs, model_config: ModelConfig, runner, groups=None) -> SchedulerMode:
    """The mode for ``args.disaggregation_mode`` over ``runner``'s KV pool (colocated: the base);
    ``groups``: this rank's RankGroups when the server has several ranks (all call this together)."""
    cfg = args.disagg_config()
    if not cfg.enabled:
        return SchedulerMode()
    return RoleModes(args, model_config, runner, groups).mode(cfg.mode)


ROLES = ("prefill", "decode")


class RoleModes:
    """A P/D rank's transfer engine, registered pool and aux rows, and the modes built over them
    (each at most once, when first needed): a runtime role switch (``switch``) replaces the
    scheduler's mode without reloading weights or registering memory again.

    The aux rows are sized for decode (two per running request) whatever the starting role, so
    either mode can use them. Each mode keeps its own control channel: a late message for the
    other role lands in a socket nobody reads instead of confusing the active mode.
    """

    def __init__(self, args: ServerArgs, model_config: ModelConfig, runner, groups=None):
        self.args, self.model_config, self.groups = args, model_config, groups
        self.cfg = args.disagg_config()
        self.rank = groups.layout.rank if groups is not None else 0
        self.backend = transfer_backend(self.cfg, args.host, local_gpu(runner.device))
        self.pool = runner.pool
        # pages, then per-request records (DeepSeek-V4's bounded layout): the order of layout.buffers
        self.descriptors = runner.pool.buffer_descriptors() + runner.pool.record_descriptors()
        # A row of what the model's forward returns (the model declares its width: DeepSeek-V4 with a
        # draft hands on all hc_mult streams), so the last prefilled position's row fits whole.
        width = runner.model.hidden_width
        self.aux = torch.zeros(2 * args.max_running_requests, width, dtype=torch.float32)  # [slots, width]
        # Packed transfers' staging buffer (either role uses it: prefill packs into it, decode lends
        # ranges of it), registered with the pool once.
        self.staging = staging_pool(self.cfg, model_config, runner.device)
        self.pools = pool_tensors(runner.pool)
        self.backend.register([(d.base_addr, d.total_bytes) for d in self.descriptors]
                              + [(self.aux.data_ptr(), self.aux.numel() * self.aux.element_size())]
                              + ([(self.staging.addr, self.staging.nbytes)] if self.staging is not None else []))
        par = args.parallel_config()
        self.layout = kv_layout(model_config, runner.pool, par.attn_tp_size, par.dp_size)
        self.auth = peer_auth(self.cfg)
        self.server_id = f"{advertised_host(args.host)}:{args.port}"
        self.live_role = LiveRole(self.cfg.mode)  # the scheduler side's one record of its role
        self.modes: dict[str, SchedulerMode] = {}

    @property
    def role(self) -> str:
        return self.live_role.value

    def mode(self, role: str) -> SchedulerMode:
        """``role``'s mode, built on first use; a prefill mode (re-)registers this rank in the
        server's bootstrap registry, which must be listening."""
        if role not in self.modes:
            self.modes[role] = self._prefill() if role == "prefill" else self._decode()
        elif role == "prefill":
            from pdserve.disagg.prefill import PrefillMode

            mode = self.modes[role]
            assert isinstance(mode, PrefillMode)
            self._register(mode.io.endpoint)
        return self.modes[role]

    def switch(self, scheduler: Scheduler, target: str) -> None:
        """Make ``target`` the scheduler's mode. Refused (RoleSwitchRefused) unless the scheduler
        is idle: no request, nothing in flight, so no room, transfer or page changes hands."""
        if target not in ROLES:
            raise RoleSwitchRefused(f"target_role: must be one of {ROLES}, got {target!r}")
        if target == self.role:
            raise RoleSwitchRefused(f"target_role: this server is already {target}")
        if scheduler.reqs or scheduler.has_work():
            raise RoleSwitchRefused(f"busy: {len(scheduler.reqs)} requests and the {self.role} mode's transfers "
                                    f"are still in flight", busy=True)
        scheduler.mode.detach()
        new = self.mode(target)
        scheduler.mode = new
        new.attach(scheduler)
        self.live_role.set(target)
        scheduler.check_memory()  # pages balance across the switch, or the switch fails loudly
        logger.info("switched to %s (rank %d)", target, self.rank)

    def _io(self) -> ModeIO:
        return mode_io(self.args.host, self.groups, self.auth)

    def _prefill(self) -> SchedulerMode:
        from pdserve.disagg.prefill import PrefillMode

        io = self._io()
        bases = {d.name: d.base_addr for d in self.descriptors}
        sender = KVSender(self.backend, self.layout, self.rank, bases, self.aux, seed=self.args.random_seed,
                          pools=self.pools, staging=self.staging)
        self._register(io.endpoint)
        return PrefillMode(replace(self.cfg, mode="prefill"), io, sender, self.server_id)

    def _register(self, endpoint: str) -> None:
        client, here = BootstrapClient(auth=self.auth), registry_host(self.args)
        port = self.args.disaggregation_bootstrap_port
        if self.rank == 0:
            client.register_compat(here, port, compat_record(self.args, self.model_config, self.pool))
        client.register_rank(here, port, RankRecord(self.rank, self.backend.session_id, self.descriptors, endpoint,
                                                    self.layout, self.args.random_seed, self.backend.peer_info))
        logger.info("prefill: rank %d registered (transfer %s, control %s)", self.rank, self.backend.session_id,
                    endpoint)

    def _decode(self) -> SchedulerMode:
        from pdserve.disagg.decode import DecodeMode

        io = self._io()
        directory = PeerDirectory(compat_record(self.args, self.model_config, self.pool), self.layout,
                                  min(self.cfg.timeout_s, BOOTSTRAP_FETCH_TIMEOUT_S), io.post, self.auth)
        record = decode_record(self.server_id, self.rank, self.backend.session_id, self.descriptors, self.layout,
                               self.aux, io.endpoint, self.staging, self.backend.peer_info)
        salt = io.from_leader(os.urandom(16))
        cfg = replace(self.cfg, mode="decode")
        return DecodeMode(cfg, io, self.backend, self.layout, [d.base_addr for d in self.descriptors], self.aux,
                          directory, self.server_id, self.rank, record=record, nonce_salt=salt,
                          staging=self.staging, pools=self.pools)

    def close(self) -> None:
        for mode in self.modes.values():
            mode.close()


def state_records(pool) -> str:
    """A pool's per-request records as the compatibility record names them, each with its rows x width,
    dtype and layers (``window_kv[7x512]:bfloat16@0,1,2+...``); "none" when every state is in pages."""
    layers = pool.record_layers()
    return "+".join(f"{name}[{'x'.join(map(str, buf.shape[2:]))}]:{str(buf.dtype).removeprefix('torch.')}"
                    f"@{','.join(map(str, layers[name]))}" for name, buf in pool.record_buffers()) or "none"


def staging_pool(cfg: DisaggConfig, model_config: ModelConfig, device: str | torch.device) -> StagingPool | None:
    """The rank's staging buffer for packed transfers (GQA only; none with a size of 0 or with
    decode's ``--disaggregation-transfer-pack off``), on the pool's device."""
    replicated = model_config.is_mla or bool(model_config.state_regions)  # whole pages: nothing to pack
    if replicated or cfg.pack_staging_mb == 0 or (cfg.mode == "decode" and cfg.transfer_pack == "off"):
        return None
    return StagingPool(cfg.pack_staging_mb * 2**20, device)


def decode_record(server_id: str, rank: int, session: str, descriptors, layout: KVLayout, aux: torch.Tensor,
                  endpoint: str, staging: StagingPool | None = None, transfer_info: str = "") -> DecodeRecord:
    """What a decode rank publishes to prefill: its KV buffers, aux rows and staging buffer, whole."""
    row_bytes = aux.shape[1] * aux.element_size()
    lent = [BufferRange(staging.addr, staging.nbytes)] if staging is not None else []
    return DecodeRecord(server_id, rank, session, [BufferRange(d.base_addr, d.total_bytes) for d in descriptors],
                        layout, BufferRange(aux.data_ptr(), aux.shape[0] * row_bytes), row_bytes, endpoint, lent,
                        transfer_info)


def registry_host(args: ServerArgs) -> str:
    """Where this rank reaches its server's bootstrap registry: it runs in the frontend, on node 0,
    bound where the HTTP server is."""
    if args.node_rank > 0:
        return split_host_port(args.dist_init_addr, "dist_init_addr")[0]
    return "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
