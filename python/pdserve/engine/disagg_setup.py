"""Builds a scheduler rank's disaggregation mode: the transfer engine with the KV pool registered
once (through the NIC nearest the rank's GPU), the mode's I/O, and (prefill) the rank's records
in the bootstrap registry.

With several ranks every rank has its own transfer engine over its own pool (GQA: its head
range; MLA: the whole latent), and its own RankRecord; every peer sends its control messages to
rank 0's channel, which all records name (``engine/mode_io.py``).
"""

from __future__ import annotations

import logging
import os

import torch

from pdserve.config import DisaggConfig, ModelConfig, ServerArgs, split_host_port
from pdserve.disagg import protocol
from pdserve.disagg.auth import PeerAuth, peer_auth
from pdserve.disagg.bootstrap import BootstrapClient, CompatRecord, RankRecord
from pdserve.disagg.channel import ControlChannel, Mailbox, advertised_host
from pdserve.disagg.layout import KVLayout
from pdserve.disagg.protocol import BufferRange, DecodeRecord
from pdserve.disagg.receiver import PeerDirectory, PeerFetched, PeersDead, PeersGone
from pdserve.disagg.sender import KVSender
from pdserve.disagg.staging import StagingPool, pool_tensors
from pdserve.disagg.topology import transfer_device
from pdserve.disagg.transfer import FAULTS_ENV, TransferBackend, create_transfer_backend, with_faults
from pdserve.engine.mode_io import DirectIO, LockStepIO, ModeIO
from pdserve.engine.modes import SchedulerMode

logger = logging.getLogger(__name__)

BOOTSTRAP_FETCH_TIMEOUT_S = 10.0  # decode's bound on reaching a prefill's bootstrap registry
# What a mode's channel and mailbox carry (the rank loop shares these with every rank).
MESSAGE_TYPES = (*protocol.MESSAGES.values(), PeerFetched, PeersDead, PeersGone)


def compat_record(args: ServerArgs, model_config: ModelConfig) -> CompatRecord:
    return CompatRecord.from_model(model_config, args.page_size, model=args.served_model_name or args.model_path,
                                   seed=args.random_seed)


def kv_layout(model_config: ModelConfig, pool, tp_size: int = 1, dp_size: int = 1) -> KVLayout:
    """The KV layout a side publishes: ``tp_size`` the attention-TP ranks sharing a request's KV,
    ``dp_size`` the attention groups (each owning whole requests)."""
    kind = "mla" if model_config.is_mla else "gqa"
    return KVLayout.from_descriptors(kind, tp_size, model_config.num_kv_heads, pool.page_size, model_config.dtype,
                                     pool.buffer_descriptors(), dp_size)


def local_gpu(device: str | torch.device) -> int | None:
    """The PCI-ordered index of the GPU ``device`` runs on (through CUDA_VISIBLE_DEVICES); None
    on CPU. topology.py reads GPUs in PCI bus order, as CUDA does under CUDA_DEVICE_ORDER=PCI_BUS_ID."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    index = device.index or 0
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if index < len(visible) and visible[index].isdigit():
        return int(visible[index])
    return index


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
    rank = groups.layout.rank if groups is not None else 0
    backend = transfer_backend(cfg, args.host, local_gpu(runner.device))
    pool = runner.pool
    descriptors = pool.buffer_descriptors()
    hidden = model_config.hf_config.hidden_size
    slots = args.max_running_requests * (2 if cfg.mode == "decode" else 1)
    aux = torch.zeros(slots, hidden, dtype=torch.float32)  # [slots, hidden]: one request's aux row each
    staging = staging_pool(cfg, model_config, runner.device)
    backend.register([(d.base_addr, d.total_bytes) for d in descriptors]
                     + [(aux.data_ptr(), aux.numel() * aux.element_size())]
                     + ([(staging.addr, staging.nbytes)] if staging is not None else []))
    par = args.parallel_config()
    layout = kv_layout(model_config, pool, par.attn_tp_size, par.dp_size)
    auth = peer_auth(cfg)
    io = mode_io(args.host, groups, auth)
    server_id = f"{advertised_host(args.host)}:{args.port}"
    if cfg.mode == "prefill":
        return _prefill_mode(args, cfg, model_config, backend, layout, io, aux, server_id, descriptors, rank, auth,
                             staging, pool_tensors(pool))
    from pdserve.engine.decode_mode import DecodeMode

    directory = PeerDirectory(compat_record(args, model_config), layout,
                              min(cfg.timeout_s, BOOTSTRAP_FETCH_TIMEOUT_S), io.post, auth)
    record = decode_record(server_id, rank, backend.session_id, descriptors, layout, aux, io.endpoint, staging)
    salt = io.from_leader(os.urandom(16))
    return DecodeMode(cfg, io, backend, layout, [d.base_addr for d in descriptors], aux, directory, server_id, rank,
                      record=record, nonce_salt=salt, staging=staging, pools=pool_tensors(pool))


def staging_pool(cfg: DisaggConfig, model_config: ModelConfig, device: str | torch.device) -> StagingPool | None:
    """The rank's staging buffer for packed transfers (GQA only; none with a size of 0 or with
    decode's ``--disaggregation-transfer-pack off``), on the pool's device."""
    if model_config.is_mla or cfg.pack_staging_mb == 0 or (cfg.mode == "decode" and cfg.transfer_pack == "off"):
        return None
    return StagingPool(cfg.pack_staging_mb * 2**20, device)


def decode_record(server_id: str, rank: int, session: str, descriptors, layout: KVLayout, aux: torch.Tensor,
                  endpoint: str, staging: StagingPool | None = None) -> DecodeRecord:
    """What a decode rank publishes to prefill: its KV buffers, aux rows and staging buffer, whole."""
    row_bytes = aux.shape[1] * aux.element_size()
    lent = [BufferRange(staging.addr, staging.nbytes)] if staging is not None else []
    return DecodeRecord(server_id, rank, session, [BufferRange(d.base_addr, d.total_bytes) for d in descriptors],
                        layout, BufferRange(aux.data_ptr(), aux.shape[0] * row_bytes), row_bytes, endpoint, lent)


def registry_host(args: ServerArgs) -> str:
    """Where this rank reaches its server's bootstrap registry: it runs in the frontend, on node 0,
    bound where the HTTP server is."""
    if args.node_rank > 0:
        return split_host_port(args.dist_init_addr, "dist_init_addr")[0]
    return "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host


def _prefill_mode(args, cfg, model_config, backend, layout, io, aux, server_id, descriptors, rank, auth, staging,
                  pools):
    from pdserve.engine.prefill_mode import PrefillMode

    bases = {d.name: d.base_addr for d in descriptors}
    sender = KVSender(backend, layout, rank, bases, aux, seed=args.random_seed, pools=pools, staging=staging)
    client, here = BootstrapClient(auth=auth), registry_host(args)
    if rank == 0:
        client.register_compat(here, cfg.bootstrap_port, compat_record(args, model_config))
    client.register_rank(here, cfg.bootstrap_port,
                         RankRecord(rank, backend.session_id, descriptors, io.endpoint, layout, args.random_seed))
    logger.info("prefill: rank %d registered (transfer %s, control %s)", rank, backend.session_id, io.endpoint)
    return PrefillMode(cfg, io, sender, server_id)
