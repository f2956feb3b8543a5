"""How a disaggregation mode plugs into the scheduler loop (modes are objects, not branches in the loop).

The colocated scheduler loop stays the core; a mode sees it only at these fixed points:

- ``take`` (intake): a new request may go to the mode's own queues instead of ``waiting``;
- ``poll`` (start of every step): control messages, transfer progress, timeouts; the mode may
  hand requests back to the scheduler (``Scheduler.enqueue``) or make them runnable
  (``Scheduler.activate``);
- ``before_extend`` / ``after_prefill`` (around an extend forward): prefill streams KV, and
  takes the requests whose prompt is done instead of letting them sample;
- ``abort`` / ``on_finish`` (release): a request the mode holds, and any request that ends.

The base class is the colocated server: every hook does nothing.

With several scheduler ranks, every rank runs the same mode on the same inputs; a mode's I/O
(``disagg/mode_io.py``) makes its messages, clock and rank-local facts the same on every rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pdserve.engine.io_struct import BootstrapRef
    from pdserve.engine.request import Req
    from pdserve.engine.scheduler import Scheduler


class RoleSwitchRefused(ValueError):
    """A role switch that cannot happen now; the message says why (the frontend answers 4xx with it).
    ``busy``: only because something is still in flight (asking again later may succeed)."""

    def __init__(self, message: str, busy: bool = False):
        super().__init__(message)
        self.busy = busy


class SwitchableRoles(Protocol):
    """What the scheduler loop asks of a server that can change its P/D role at run time
    (``disagg/roles.py``'s ``RoleModes``); the loop knows no more of disaggregation than this."""

    @property
    def role(self) -> str: ...

    def switch(self, scheduler: Scheduler, target: str) -> None:
        """Make ``target`` the scheduler's mode, or raise ``RoleSwitchRefused``."""

    def close(self) -> None: ...


class SchedulerMode:
    """Contract between the scheduler and a mode.

    Memory: a mode never touches the allocator, the table or the radix cache; it asks
    ``scheduler.kv_manager`` (``mem.cache_manager.KVCacheManager``: admit, grow, release, drop,
    quarantine) and hands requests to the loop with ``scheduler.enqueue`` / ``activate``, never
    by editing ``waiting`` or ``running``. A request in the scheduler's ``running`` or
    ``chunked`` is accounted by the scheduler; one the mode holds elsewhere (parked, waiting for
    KV, draining writes) is listed by ``held_reqs``. Pages the mode took out of a request with
    ``kv_manager.quarantine`` stay the manager's until the mode gives them back with
    ``free_quarantined``; ``quarantined_pages`` must count exactly those still out (the
    ``Scheduler.check_memory`` cross-check).
    """

    name = "null"
    rank_counters: tuple[str, ...] = ()  # stats each rank counts for itself: a server reports their sum
    samples = True  # whether this server samples tokens (a disaggregated prefill never does: no grammars)

    def attach(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def take(self, req: Req, bootstrap: BootstrapRef | None) -> bool:
        """True: the mode owns the new request from now on (not queued in ``waiting``)."""
        return False

    def poll(self) -> None:
        """Called at the start of every step."""

    def before_extend(self, reqs: list[Req], lens: list[int]) -> None:
        """An extend forward of ``lens[i]`` tokens of each ``reqs[i]`` is about to run."""

    def after_prefill(self, reqs: list[Req], done: list[int]) -> list[int]:
        """``reqs[i]`` for ``i`` in ``done`` just finished their prompt; returns the indices the
        scheduler should go on with (sample, or finish a prefill-only request)."""
        return done

    def abort(self, req: Req, message: str) -> bool:
        """Abort a request the mode holds; False if it is not the mode's."""
        return False

    def refused(self, bootstrap: BootstrapRef, message: str) -> None:
        """The frontend refused a request routed with ``bootstrap`` before it reached the scheduler
        (``message``: why): its other half, if the mode has one, must not wait for it."""

    def prefill_lost(self, room: int, reason: str) -> bool:
        """The other half of ``room`` will never come (the router saw it break): serve the request
        without it now; False if the mode holds no such room."""
        return False

    def on_finish(self, req: Req) -> None:
        """``req`` is finishing (any reason, any state), before its pages are released."""

    def has_work(self) -> bool:
        """Something in flight that needs ``poll`` calls (rooms, transfers, quarantine)."""
        return False

    def poll_interval_ms(self) -> int | None:
        """How soon the loop should call ``step`` again when nothing is runnable (None: only
        when a message arrives)."""
        return None

    def held_reqs(self) -> list[Req]:
        return []

    def quarantined_pages(self) -> int:
        return 0

    def check_resources(self, idle: bool) -> None:
        """Raise naming the resource when the mode's books do not balance: what it holds must be
        what its live rooms account for, and with ``idle`` (no request anywhere, nothing in
        flight) every table, slot, pending list and transfer batch must be empty. Called by
        ``Scheduler.check_memory`` so a leak fails the test that caused it."""

    def sockets(self) -> list:
        """ZMQ sockets whose messages this mode reads in ``poll`` (the loop wakes on them)."""
        return []

    def wants_agreement(self) -> bool:
        """Several ranks: this rank has a fact the others must learn in the next ``poll`` (asked
        before the loop's exchange, so every rank knows a round is due). Implies ``has_work``."""
        return False

    def connect(self, loop) -> None:
        """Several ranks: ``loop`` (engine/rank_group.py) is about to run; route I/O through it."""

    def stats(self) -> dict:
        return {"disaggregation_mode": self.name}

    @classmethod
    def merge_stats(cls, per_dp: list[dict]) -> dict:
        """The mode's part of one server's stats, from each attention group's."""
        return {}

    def detach(self) -> None:
        """A role switch is replacing this mode while the server is idle: undo what ``attach`` hooked
        into the scheduler and stop background work, keeping the transfer engine and the channel
        (the mode may be attached again later)."""

    def close(self) -> None:
        """Stop threads and release transfer resources (the process is ending)."""


def balance(what: str, have: int, want: int) -> None:
    """``check_resources``' one assertion: ``what`` must count ``want``."""
    if have != want:
        raise RuntimeError(f"resource accounting broken: {what}: {have}, expected {want}")
