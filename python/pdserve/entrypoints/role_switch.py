"""``POST /pd_role_switch``: a P/D server turns from prefill to decode or back while it runs.

The frontend drains (its ``/health`` answers 503 "draining", so the router stops sending, while
what still arrives is served in the old role), waits until nothing was admitted for
``quiet_secs`` and nothing is in flight, then asks the scheduler to switch (it refuses while a
room, a transfer or a request is open, and the frontend asks again). A server becoming prefill
opens its bootstrap registry first (the scheduler registers there); one becoming decode closes it,
so decode servers stop finding it. Weights, the KV pool and the transfer engine stay.

Single-rank servers only: a multi-rank server is refused with a message saying so (its ranks
would have to switch in lock step).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.config import ServerArgs
from pdserve.entrypoints.protocol import RoleSwitchRequest
from pdserve.entrypoints.tokenizer_manager import TokenizerManager
from pdserve.obs.metrics import ServerMetrics
from pdserve.web.errors import RequestError, ServerError

logger = logging.getLogger(__name__)

POLL_S = 0.05  # how often a drain looks again at the in-flight count


@dataclass
class RoleSwitcher:
    """One server's switch state. ``start_registry`` opens this server's bootstrap registry (raises
    OSError when its port is taken) and returns a stop function."""

    args: ServerArgs
    tm: TokenizerManager
    metrics: ServerMetrics
    start_registry: Callable[[], Callable[[], None]]
    stop_registry: Callable[[], None] | None = None
    draining: str | None = None  # the target while a switch is under way
    history: list[dict] = field(default_factory=list)  # switches done: role, from, seconds, at

    def refusal(self, req: RoleSwitchRequest) -> RequestError | None:
        """Why the switch cannot start now, or None."""
        if self.tm.role not in ("prefill", "decode"):
            return RequestError("target_role: this server is not in P/D mode (start it with "
                                "--disaggregation-mode prefill or decode)", param="target_role")
        if self.args.parallel_config().world_size > 1:
            return RequestError("target_role: a multi-rank server (tp/dp/ep/pp/nnodes > 1) cannot switch roles at "
                                "run time; restart it with the other --disaggregation-mode", param="target_role")
        if req.target_role == self.tm.role:
            return RequestError(f"target_role: this server is already {req.target_role}", param="target_role")
        if self.draining is not None:
            return RequestError(f"a switch to {self.draining} is under way", param="target_role", status=409)
        if self.tm.num_inflight > req.max_inflight:
            return RequestError(f"busy: {self.tm.num_inflight} requests in flight (max_inflight "
                                f"{req.max_inflight}); retry when the load is lower", param="max_inflight", status=409)
        return None

    async def switch(self, req: RoleSwitchRequest) -> dict:
        refused = self.refusal(req)
        if refused is not None:
            self.metrics.observe_role_switch(req.target_role, "refused")
            raise refused
        source, started = self.tm.role, time.monotonic()
        self.draining = req.target_role
        logger.info("role switch %s -> %s: draining (at most %.0f s)", source, req.target_role, req.timeout_secs)
        try:
            await self._drain_and_switch(req, started)
        except RequestError as e:
            self.metrics.observe_role_switch(req.target_role, "timeout" if e.status == 503 else "refused")
            logger.warning("role switch %s -> %s refused: %s", source, req.target_role, e.message)
            raise
        finally:
            self.draining = None
        seconds = time.monotonic() - started
        self.metrics.observe_role_switch(req.target_role, "done")
        self.history.append({"role": self.tm.role, "from": source, "seconds": seconds, "at": time.time()})
        logger.info("role switch %s -> %s done in %.2f s", source, self.tm.role, seconds)
        return {"success": True, "role": self.tm.role, "previous_role": source, "seconds": round(seconds, 3),
                "message": f"switched from {source} to {self.tm.role}"}

    async def _drain_and_switch(self, req: RoleSwitchRequest, started: float) -> None:
        to_prefill = req.target_role == "prefill"
        if to_prefill:
            self._open_registry()
        try:
            await self._switch_when_idle(req, started)
        except BaseException:
            if to_prefill:
                self.close_registry()
            raise
        if not to_prefill:
            self.close_registry()

    async def _switch_when_idle(self, req: RoleSwitchRequest, started: float) -> None:
        deadline = started + req.timeout_secs
        while True:
            quiet = time.monotonic() - self.tm.last_admit >= req.quiet_secs
            if quiet and self.tm.num_inflight == 0:
                resp = await self.tm.switch_role(req.target_role)
                if resp.success:
                    return
                if not resp.busy:
                    raise RequestError(f"target_role: {resp.message}", param="target_role", status=409)
            if time.monotonic() > deadline:
                raise ServerError(f"still draining after {req.timeout_secs:g} s ({self.tm.num_inflight} requests in "
                                  f"flight); the server stays {self.tm.role}")
            await asyncio.sleep(POLL_S)

    def _open_registry(self) -> None:
        if self.stop_registry is not None:
            return
        try:
            self.stop_registry = self.start_registry()
        except OSError as e:
            raise RequestError(f"disaggregation_bootstrap_port: cannot open the bootstrap registry on port "
                               f"{self.args.disaggregation_bootstrap_port} ({e.strerror or e})",
                               param="target_role", status=409) from None

    def close_registry(self) -> None:
        if self.stop_registry is not None:
            self.stop_registry()
            self.stop_registry = None
