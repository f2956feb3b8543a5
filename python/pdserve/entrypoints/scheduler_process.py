"""The scheduler process: the composition root that builds a ``Scheduler``, plugs in its mode
(colocated, or P/D from ``disagg/``) and runs the loop (``engine/scheduler_loop.py``). One
process per DP x TP rank.

Child side: ``run_scheduler_process`` (the ``spawn`` target) builds the
scheduler, reports ``SchedulerReady`` (or ``SchedulerFailed``) and runs
``SchedulerLoop``. Parent side: ``SchedulerProcess`` starts, watches and stops
the child. The frontend binds both sockets; the child connects, so a restarted
child finds the same endpoints. Every message goes through ``FRONTEND_CODEC`` (typed msgpack,
never pickle); a frame that is not one of its messages is counted and dropped. With
``--nnodes`` > 1 the sockets are TCP on node 0's own address (``engine/node_sockets.py``).

With more than one rank (``--tp-size`` / ``--dp-size`` ...) there is one process per
rank instead (``run_rank_process``, ``RankProcesses``), in lock step through
torch.distributed (``engine/rank_group.py``): rank 0 alone reads the frontend's
socket, every attention group's leader sends outputs, any rank reports its failure.
``scheduler_processes`` picks the one or the other; both handles look the same to
the frontend. The loop's own contract is in ``engine/scheduler_loop.py``.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import multiprocessing as mp
import os
import signal
import traceback

import zmq

from pdserve.config import ServerArgs, default_num_threads
from pdserve.engine.io_struct import SchedulerFailed, SchedulerReady
from pdserve.engine.node_sockets import connect_socket, node_keys
from pdserve.engine.scheduler_loop import SchedulerEndpoints, SchedulerLoop, send_message
from pdserve.engine.thread_tuner import tuned_process_env

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


# -------------------------------------------------------------- child side
def run_scheduler_process(args: ServerArgs, endpoints: SchedulerEndpoints, parent_pid: int) -> None:
    """``spawn`` target. Exits 0 after a ShutdownReq, 1 after any error (reported first)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the parent decides
    _die_with_parent()
    _configure_child_logging(args.log_level)
    ctx = zmq.Context()
    recv = connect_socket(ctx, zmq.PULL, endpoints.to_scheduler)
    send = connect_socket(ctx, zmq.PUSH, endpoints.to_frontend)
    code = 0
    scheduler, roles = None, None
    try:
        with startup_without_gc():
            scheduler, roles = build_server_scheduler(args)
        send_message(send, ready_message(scheduler))
        SchedulerLoop(scheduler, recv, send, parent_pid, roles=roles).run()
    except BaseException as e:  # noqa: BLE001 - report anything, then exit non-zero
        # A ValueError is a user error that names its field (e.g. a tensor missing from the
        # checkpoint): the frontend prints it in one line; a traceback would only bury it.
        level = logging.DEBUG if isinstance(e, ValueError) else logging.ERROR
        logger.log(level, "scheduler failed:\n%s", traceback.format_exc())
        send_message(send, SchedulerFailed(f"{type(e).__name__}: {e}"))
        code = 1
    finally:
        if roles is not None:
            roles.close()
        elif scheduler is not None:
            scheduler.mode.close()
            close_kv_events(scheduler)
            scheduler.close()
        recv.close(linger=0)
        send.close(linger=1000)  # let a final SchedulerFailed reach the frontend
        ctx.term()
    os._exit(code)  # skip interpreter teardown: torch threads can make it slow


def build_scheduler(args: ServerArgs):
    """The scheduler this process drives; torch uses every core (the frontend uses one thread)."""
    return build_server_scheduler(args)[0]


def build_server_scheduler(args: ServerArgs):
    """The scheduler and, on a P/D server, the modes it can switch between (``RoleModes``)."""
    import torch

    from pdserve.engine.model_runner import build_model_runner
    from pdserve.engine.modes import SchedulerMode
    from pdserve.engine.scheduler import Scheduler
    from pdserve.engine.tokenizer import load_tokenizer

    layout = args.thread_layout()
    torch.set_num_threads(layout.torch_threads)
    model_config = args.model_config()  # the one read of config.json in this process
    tokenizer = None
    if not args.skip_tokenizer_init:
        tokenizer = load_tokenizer(args.tokenizer_path or model_config.path)
    cache_config, config = args.cache_config(), args.scheduler_config()
    runner = build_model_runner(args, model_config)
    roles = role_modes(args, model_config, runner)
    mode = roles.mode(roles.role) if roles is not None else SchedulerMode()
    scheduler = Scheduler(model_config, cache_config, config, tokenizer, runner=runner, mode=mode,
                          grammar=args.grammar_config())
    scheduler.use_threads(layout, not args.disable_thread_tuning)
    attach_kv_events(args, scheduler)
    return scheduler, roles


def role_modes(args: ServerArgs, model_config, runner):
    """A P/D server's ``RoleModes``, None on a colocated one: only a P/D server imports ``disagg/``
    (and the transfer backends behind it)."""
    if not args.disagg_config().enabled:
        return None
    from pdserve.disagg.roles import RoleModes

    return RoleModes(args, model_config, runner)


@contextlib.contextmanager
def startup_without_gc():
    """The cyclic collector off while a scheduler process starts, and what the start built kept out of
    its later passes (``gc.freeze``).

    Starting imports torch and transformers and builds the model: hundreds of thousands of objects
    that live as long as the process, and almost no cycles (about 0.6 MB of garbage for tiny-llama).
    With the collector on, its passes walk that growing heap hundreds of times (about 0.5 s of CPU
    of a 3 s start), and every later full pass in the loop walks it again. Frozen, the start's few
    cycles are never freed: a bounded, one-time cost. Only for a process's own start (the spawn
    targets), never in a process that builds schedulers and drops them (tests; the offline Engine freezes
    only what existed before it, and thaws it at shutdown)."""
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


def attach_kv_events(args: ServerArgs, scheduler) -> None:
    """``--kv-events-config``: the scheduler's cache publishes its events (one publisher per server:
    the caller is its only process, or rank 0)."""
    config = args.kv_events()
    if config.enabled:
        from pdserve.obs.kv_event_publisher import KVEventPublisher

        scheduler.attach_kv_events(KVEventPublisher(config, args.host, hash_key=args.cache_config().hash_key))


def close_kv_events(scheduler) -> None:
    if getattr(scheduler, "kv_events", None) is not None:
        scheduler.kv_events.close()


def ready_message(scheduler) -> SchedulerReady:
    return SchedulerReady(os.getpid(), scheduler.context_len, scheduler.model_config.vocab_size,
                          scheduler.allocator.num_pages, scheduler.page_size)


def _die_with_parent() -> None:
    """Linux: the kernel kills this process if the frontend dies (even by SIGKILL)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass  # not Linux: the loop's parent check still ends the process


def _configure_child_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="[%(asctime)s scheduler] %(levelname)s %(name)s: %(message)s")


# ------------------------------------------------------------- parent side
@contextlib.contextmanager
def _child_env(env: dict[str, str]):
    """``env`` in the environment a process spawned inside inherits, and this one's restored after."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class SchedulerProcess:
    """Parent-side handle of one scheduler process (spawned: torch and fork do not mix)."""

    def __init__(self, args: ServerArgs, endpoints: SchedulerEndpoints):
        self.args = args
        self.endpoints = endpoints
        self.process: mp.process.BaseProcess | None = None

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        self.process = ctx.Process(target=run_scheduler_process, name="pdserve-scheduler",
                                   args=(self.args, self.endpoints, os.getpid()), daemon=True)
        layout = self.args.thread_layout()  # the child's, as it will choose it
        tune = not self.args.disable_thread_tuning and layout.source == "cores" and layout.cores > 1
        with _child_env(tuned_process_env(tune, os.environ)):
            self.process.start()

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    @property
    def pids(self) -> list[int]:
        pid = self.pid
        return [pid] if pid is not None else []

    def is_alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    def describe_exit(self) -> str:
        return f"scheduler process exited with code {self.exitcode}"

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode if self.process else None

    def stop(self, send_shutdown=None, timeout: float = 2.0) -> None:
        """Ask politely (``send_shutdown()``; the loop exits after its current step), then
        SIGTERM, then SIGKILL; always reaps the child. Takes at most ``timeout + 2`` s."""
        if self.process is None:
            return
        if self.process.is_alive() and send_shutdown is not None:
            send_shutdown()
            self.process.join(timeout)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(1.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(1.0)


# --------------------------------------------------------- several ranks
def run_rank_process(args: ServerArgs, endpoints: SchedulerEndpoints, rank: int, store_dir: str | None,
                     parent_pid: int) -> None:
    """``spawn`` target of scheduler rank ``rank``. Exits 0 after a ShutdownReq reached every
    rank, 1 after any error (reported to the frontend first, naming the rank)."""
    from pdserve.distributed.rank_layout import RankLayout

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"[%(asctime)s scheduler rank {rank}] %(levelname)s %(name)s: %(message)s")
    layout = RankLayout(args.parallel_config(), rank)
    ctx = zmq.Context()
    keys = node_keys(args)  # several nodes under the cluster token: CURVE
    recv = connect_socket(ctx, zmq.PULL, endpoints.to_scheduler, keys) if layout.is_leader else None
    send = connect_socket(ctx, zmq.PUSH, endpoints.to_frontend, keys)
    code, groups, scheduler = 0, None, None
    try:
        with startup_without_gc():
            groups, scheduler = _start_rank(args, layout, store_dir)
        from pdserve.engine.rank_group import RankSchedulerLoop

        loop = RankSchedulerLoop(scheduler, groups, recv, send, parent_pid)
        scheduler.mode.connect(loop)  # a disaggregation mode's messages go through rank 0 too
        if layout.is_leader:
            send_message(send, ready_message(scheduler))
        loop.run()
    except BaseException as e:  # noqa: BLE001 - report anything, then exit non-zero
        # A ValueError names its field: the frontend prints it in one line (as run_scheduler_process).
        level = logging.DEBUG if isinstance(e, ValueError) else logging.ERROR
        logger.log(level, "scheduler rank %d failed:\n%s", rank, traceback.format_exc())
        send_message(send, SchedulerFailed(f"rank {rank}: {type(e).__name__}: {e}"))
        code = 1
    finally:
        if scheduler is not None:
            scheduler.mode.close()
            close_kv_events(scheduler)
            scheduler.close()
        _close_rank(ctx, recv, send, groups, clean=code == 0)
    os._exit(code)


def _start_rank(args: ServerArgs, layout, store_dir: str | None):
    """Join the process group, build this rank's scheduler, wait for every rank; rank 0 then
    reports the engine ready."""
    import torch

    from pdserve.distributed.groups import backend_for_device, init_method, init_rank_groups
    from pdserve.engine.rank_group import ControlPlane, build_rank_scheduler
    from pdserve.engine.tokenizer import load_tokenizer

    torch.set_num_threads(args.num_threads or max(1, default_num_threads() // len(layout.ranks_on_node())))
    from pdserve.engine.model_runner import rank_device

    device = rank_device(args.device_config().device, layout.ranks_on_node().index(layout.rank))
    if device.startswith("cuda"):
        torch.cuda.set_device(device)  # before NCCL: each rank's communicator on its own GPU
    # Configs first (parallel_state.py says why), then the process group.
    model_config = args.model_config()
    tokenizer = None if args.skip_tokenizer_init else load_tokenizer(args.tokenizer_path or model_config.path)
    groups = init_rank_groups(layout, init_method(store_dir, args.dist_init_addr), backend_for_device(device))
    scheduler = build_rank_scheduler(args, groups, model_config, tokenizer, device,
                                     make_mode=lambda runner: _rank_mode(args, model_config, runner, groups))
    if layout.rank == 0:
        attach_kv_events(args, scheduler)
    ControlPlane(layout, groups.cpu).gather(os.getpid())  # every rank is ready
    return groups, scheduler


def _rank_mode(args: ServerArgs, model_config, runner, groups):
    """This rank's mode; as ``role_modes``, only a P/D server imports ``disagg/``."""
    if not args.disagg_config().enabled:
        from pdserve.engine.modes import SchedulerMode

        return SchedulerMode()
    from pdserve.disagg.roles import build_mode

    return build_mode(args, model_config, runner, groups)


def _close_rank(ctx: zmq.Context, recv, send, groups, clean: bool) -> None:
    if recv is not None:
        recv.close(linger=0)
    send.close(linger=1000)  # let a final SchedulerFailed reach the frontend
    ctx.term()
    if groups is not None and clean:  # after an error a peer may be gone: just exit
        groups.destroy()


class RankProcesses:
    """Parent-side handle of this node's scheduler ranks; the same interface as SchedulerProcess
    (the frontend watches and stops them as one). ``store_dir``: where the ranks rendezvous
    (a fresh directory per engine; unused with ``--dist-init-addr``)."""

    def __init__(self, args: ServerArgs, endpoints: SchedulerEndpoints, store_dir: str | None):
        from pdserve.distributed.rank_layout import layouts_on_node

        self.args = args
        self.endpoints = endpoints
        self.store_dir = store_dir
        self.ranks = [lay.rank for lay in layouts_on_node(args.parallel_config())]
        self.processes: list[mp.process.BaseProcess] = []

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        for rank in self.ranks:
            proc = ctx.Process(target=run_rank_process, name=f"pdserve-scheduler-{rank}", daemon=True,
                               args=(self.args, self.endpoints, rank, self.store_dir, os.getpid()))
            proc.start()
            self.processes.append(proc)

    @property
    def pid(self) -> int | None:
        """The first local rank's (rank 0 on node 0)."""
        return self.processes[0].pid if self.processes else None

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes if p.pid is not None]  # each started when appended

    def is_alive(self) -> bool:
        """True while every rank runs: a lone rank cannot serve."""
        return bool(self.processes) and all(p.is_alive() for p in self.processes)

    @property
    def exitcode(self) -> int | None:
        """The exit code of the first rank that ended (None while all run)."""
        return next((p.exitcode for p in self.processes if p.exitcode is not None), None)

    def describe_exit(self) -> str:
        dead = [(r, p.exitcode) for r, p in zip(self.ranks, self.processes) if p.exitcode is not None]
        return ", ".join(f"scheduler rank {r} exited with code {c}" for r, c in dead) or "all ranks running"

    def stop(self, send_shutdown=None, timeout: float = 2.0) -> None:
        """Ask rank 0 to stop every rank (``send_shutdown()``), then SIGTERM, then SIGKILL;
        always reaps every rank. Takes at most ``timeout + 2`` s."""
        import time

        if not self.processes:
            return
        if send_shutdown is not None and self.is_alive():
            send_shutdown()
        deadline = time.monotonic() + timeout
        for p in self.processes:
            p.join(max(0.0, deadline - time.monotonic()))
        for sig_method, wait in (("terminate", 1.0), ("kill", 1.0)):
            alive = [p for p in self.processes if p.is_alive()]
            for p in alive:
                getattr(p, sig_method)()
            end = time.monotonic() + wait
            for p in alive:
                p.join(max(0.0, end - time.monotonic()))


def scheduler_processes(args: ServerArgs, endpoints: SchedulerEndpoints, store_dir: str):
    """The frontend's handle: one scheduler process, or one process per rank of this node."""
    if args.parallel_config().world_size == 1:
        return SchedulerProcess(args, endpoints)
    return RankProcesses(args, endpoints, store_dir)
