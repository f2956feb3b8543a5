"""``pdserve serve --node-rank N`` (N > 0): this node's scheduler ranks, without a frontend.

They join node 0's rendezvous at ``--dist-init-addr`` and reach node 0's frontend over
TCP (``SchedulerEndpoints.over_tcp``). The launcher waits until a rank ends or a signal
arrives, then stops every local rank. Exit code: 0 after a signal or a clean stop of
every rank (node 0 shut down), 1 if a rank failed.
"""

from __future__ import annotations

import logging
import signal
import threading

from pdserve.config import ServerArgs, split_host_port
from pdserve.engine.scheduler_loop import SchedulerEndpoints
from pdserve.entrypoints.scheduler_process import RankProcesses

logger = logging.getLogger(__name__)

POLL_S = 0.5


def launch_ranks_only(args: ServerArgs) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"[%(asctime)s node {args.node_rank}] %(levelname)s %(name)s: %(message)s")
    endpoints = SchedulerEndpoints.over_tcp(*split_host_port(args.dist_init_addr, "dist_init_addr"))
    ranks = RankProcesses(args, endpoints, store_dir=None)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    ranks.start()
    logger.info("node %d runs scheduler ranks %s (pids %s)", args.node_rank, ranks.ranks, ranks.pids)
    while not stop.wait(POLL_S) and ranks.is_alive():
        pass
    failed = not stop.is_set() and any(p.exitcode not in (0, None) for p in ranks.processes)
    if failed:
        logger.error("%s", ranks.describe_exit())
    ranks.stop()
    return 1 if failed else 0
