"""Builds a scheduler rank's disaggregation mode: the transfer engine with the KV pool registered
once, the control channel, and (prefill) its records in the bootstrap registry."""

from __future__ import annotations

import logging
import os

import torch

from pdserve.config import DisaggConfig, ModelConfig, ServerArgs
from pdserve.disagg.bootstrap import BootstrapClient, CompatRecord, RankRecord
from pdserve.disagg.channel import ControlChannel, advertised_host
from pdserve.disagg.layout import KVLayout
from pdserve.disagg.receiver import PeerDirectory
from pdserve.disagg.sender import KVSender
from pdserve.disagg.transfer import FaultInjectingBackend, TransferBackend, create_transfer_backend
from pdserve.engine.modes import SchedulerMode

logger = logging.getLogger(__name__)

BOOTSTRAP_FETCH_TIMEOUT_S = 10.0  # decode's bound on reaching a prefill's bootstrap registry
# Failure drills and tests: e.g. PDSERVE_TRANSFER_FAULTS="delay_posts=1.5" makes this server's KV
# writes reach the network 1.5 s late (disagg.transfer.FaultInjectingBackend's knobs).
FAULTS_ENV = "PDSERVE_TRANSFER_FAULTS"
_FAULT_KNOBS = {"delay_posts": float, "hold": float, "fail_after": int}


def compat_record(args: ServerArgs, model_config: ModelConfig) -> CompatRecord:
    return CompatRecord.from_model(model_config, args.page_size, model=args.served_model_name or args.model_path)


def kv_layout(model_config: ModelConfig, pool, tp_size: int = 1, dp_size: int = 1) -> KVLayout:
    kind = "mla" if model_config.is_mla else "gqa"
    return KVLayout.from_descriptors(kind, tp_size, model_config.num_kv_heads, pool.page_size, model_config.dtype,
                                     pool.buffer_descriptors(), dp_size)


def transfer_backend(cfg: DisaggConfig, host: str) -> TransferBackend:
    """TCP unless an RDMA device is named (``--disaggregation-ib-device``)."""
    protocol = "rdma" if cfg.ib_device else "tcp"
    backend = create_transfer_backend(cfg.transfer_backend, hostname=advertised_host(host), protocol=protocol,
                                      device_name=cfg.ib_device or "")
    return with_faults(backend, os.environ.get(FAULTS_ENV, ""))


def with_faults(backend: TransferBackend, spec: str) -> TransferBackend:
    """``backend`` wrapped to misbehave as ``spec`` ("knob=value,...") says; as is when empty."""
    if not spec:
        return backend
    faulty = FaultInjectingBackend(backend)
    for item in spec.split(","):
        knob, _, value = item.partition("=")
        if knob not in _FAULT_KNOBS:
            raise ValueError(f"{FAULTS_ENV}: unknown fault {knob!r} (known: {', '.join(_FAULT_KNOBS)})")
        getattr(faulty, knob)(_FAULT_KNOBS[knob](value))
    logger.warning("KV transfer faults injected (%s=%s)", FAULTS_ENV, spec)
    return faulty


def build_mode(args: ServerArgs, model_config: ModelConfig, runner) -> SchedulerMode:
    """The mode for ``args.disaggregation_mode`` over ``runner``'s KV pool (colocated: the base)."""
    cfg = args.disagg_config()
    if not cfg.enabled:
        return SchedulerMode()
    backend = transfer_backend(cfg, args.host)
    pool = runner.pool
    descriptors = pool.buffer_descriptors()
    hidden = model_config.hf_config.hidden_size
    slots = args.max_running_requests * (2 if cfg.mode == "decode" else 1)
    aux = torch.zeros(slots, hidden, dtype=torch.float32)  # [slots, hidden]: one request's aux row each
    backend.register([(d.base_addr, d.total_bytes) for d in descriptors]
                     + [(aux.data_ptr(), aux.numel() * aux.element_size())])
    layout = kv_layout(model_config, pool)
    channel = ControlChannel(args.host)
    server_id = f"{advertised_host(args.host)}:{args.port}"
    if cfg.mode == "prefill":
        return _prefill_mode(args, cfg, model_config, backend, layout, channel, aux, server_id, descriptors)
    from pdserve.engine.decode_mode import DecodeMode

    directory = PeerDirectory(compat_record(args, model_config), min(cfg.timeout_s, BOOTSTRAP_FETCH_TIMEOUT_S))
    return DecodeMode(cfg, channel, backend, layout, [d.base_addr for d in descriptors], aux, directory, server_id)


def _prefill_mode(args, cfg, model_config, backend, layout, channel, aux, server_id, descriptors):
    from pdserve.engine.prefill_mode import PrefillMode

    bases = {d.name: d.base_addr for d in descriptors}
    sender = KVSender(backend, layout, 0, bases, aux, seed=args.random_seed)
    client = BootstrapClient()
    # The registry runs in this server's frontend, bound where the HTTP server is.
    here = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    client.register_compat(here, cfg.bootstrap_port, compat_record(args, model_config))
    client.register_rank(here, cfg.bootstrap_port,
                         RankRecord(0, backend.session_id, descriptors, channel.endpoint, layout, args.random_seed))
    logger.info("prefill: rank 0 registered (transfer %s, control %s)", backend.session_id, channel.endpoint)
    return PrefillMode(cfg, channel, sender, server_id)
