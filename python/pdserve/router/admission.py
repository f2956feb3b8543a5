"""The router's concurrency cap: at most ``--max-concurrent-requests`` generation requests in
flight, up to ``--queue-size`` more waiting in arrival order for a slot.

A request that finds the queue full is refused at once with 429 and a ``Retry-After`` header (the
seconds the queue ahead of it should take, from how long requests have held their slots lately);
one that waits longer than ``--queue-timeout-secs`` gets 408 (sgl-model-gateway's answers). A
slot is held until the response has ended: the whole stream, or the client leaving.

Everything runs on the router's event loop. A slot freed goes straight to the longest waiting
request, so a newcomer never overtakes the queue.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable, Collection

from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.web.errors import RequestError, error_response

SERVICE_EWMA = 0.2  # weight of the newest slot-holding time in the running mean
FIRST_GUESS_S = 1.0  # the mean before any request has finished


class Refused(RequestError):
    """429 (queue full) or 408 (waited too long), with the seconds to wait before trying again."""

    def __init__(self, message: str, status: int, code: str, retry_after_s: int):
        super().__init__(message, param=None, status=status, code=code)
        self.retry_after_s = retry_after_s


class Admission:
    """Slots and the queue. ``limit`` None: no cap (every request is admitted at once, still counted)."""

    def __init__(self, limit: int | None, queue_size: int, queue_timeout_s: float,
                 clock: Callable[[], float] = time.monotonic, on_refuse: Callable[[str], None] | None = None):
        self.limit = limit
        self.queue_size = queue_size
        self.queue_timeout_s = queue_timeout_s
        self.clock = clock
        self.active = 0
        self.waiters: deque[asyncio.Future] = deque()
        self.mean_hold_s = FIRST_GUESS_S
        self.on_refuse = on_refuse  # called with "queue_full" or "queue_timeout" (the router's metrics)

    @property
    def queued(self) -> int:
        return sum(1 for f in self.waiters if not f.done())

    async def acquire(self) -> float:
        """Wait for a slot; returns the time it was granted (for ``release``). Raises Refused."""
        if self.limit is None or (self.active < self.limit and not self.queued):
            self.active += 1
            return self.clock()
        if self.queued >= self.queue_size:
            self._refused("queue_full")
            raise Refused(f"max_concurrent_requests: {self.active} requests in flight (the cap) and {self.queued} "
                          f"waiting (queue_size {self.queue_size}): try again later", 429, "rate_limit_exceeded",
                          self.retry_after())
        await self._wait()
        return self.clock()

    async def _wait(self) -> None:
        """Until ``release`` hands this request a slot. ``asyncio.wait``, not ``wait_for``: a request
        cancelled as its slot arrives must see the cancellation, and pass the slot on."""
        slot = asyncio.get_running_loop().create_future()
        self.waiters.append(slot)
        try:
            await asyncio.wait({slot}, timeout=self.queue_timeout_s)
        except BaseException:
            self._give_up(slot)
            raise
        if not slot.done():
            self._give_up(slot)
            self._refused("queue_timeout")
            raise Refused(f"queue_timeout_secs: no slot within {self.queue_timeout_s:g} s "
                          f"({self.limit} requests in flight)", 408, "queue_timeout", self.retry_after())

    def _give_up(self, slot: asyncio.Future) -> None:
        if slot.done() and not slot.cancelled():
            self.release(None)  # granted as it gave up: the next in line gets it
            return
        slot.cancel()
        self.waiters.remove(slot)

    def _refused(self, reason: str) -> None:
        if self.on_refuse is not None:
            self.on_refuse(reason)

    def release(self, granted_at: float | None) -> None:
        """A request ended: its slot goes to the longest waiting request, else back to the pool."""
        if granted_at is not None:
            held = max(0.0, self.clock() - granted_at)
            self.mean_hold_s += SERVICE_EWMA * (held - self.mean_hold_s)
        while self.waiters:
            slot = self.waiters.popleft()
            if not slot.done():
                slot.set_result(None)  # the slot changes hands: ``active`` stays
                return
        self.active -= 1
        assert self.active >= 0, "admission: more slots released than granted"

    def retry_after(self) -> int:
        """Whole seconds until the requests ahead should have gone through (at least 1)."""
        ahead = self.queued + 1
        slots = self.limit or 1
        return max(1, math.ceil(self.mean_hold_s * ahead / slots))


class AdmissionMiddleware:
    """Generation requests (``paths``, POST) hold a slot for as long as their response runs."""

    def __init__(self, app: ASGIApp, admission: Admission, paths: Collection[str]):
        self.app = app
        self.admission = admission
        self.paths = frozenset(paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        try:
            granted_at = await self.admission.acquire()
        except Refused as e:
            response = error_response(e)
            response.headers["Retry-After"] = str(e.retry_after_s)
            await response(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.admission.release(granted_at)
