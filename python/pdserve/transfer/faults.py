"""A fault-injecting wrapper around any TransferBackend, and ``PDSERVE_TRANSFER_FAULTS``.

Failure drills and tests: e.g. ``PDSERVE_TRANSFER_FAULTS="delay_posts=1.5"`` makes a server's KV
writes reach the network 1.5 s late, ``"fail_rate=0.05,delay_rate=0.05,delay_s=2,seed=7"`` fails
one batch in twenty and delays another one in twenty by 2 s, drawn reproducibly (``with_faults``
reads the knobs below from it).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable

from pdserve.transfer import base
from pdserve.transfer.base import TransferBackend, TransferError, WriteHandle, WriteState

logger = logging.getLogger(__name__)

FAULTS_ENV = "PDSERVE_TRANSFER_FAULTS"
FAULT_KNOBS: dict[str, Callable[[str], float | int]] = {
    "delay_posts": float, "hold": float, "fail_after": int,
    "fail_rate": float, "delay_rate": float, "delay_s": float, "seed": int}


class FaultInjectingBackend(TransferBackend):
    """A real backend that breaks on request, for failure tests (no fake engine underneath).

    Knobs, thread-safe and changeable at any time:
    - ``fail_writes_to(peer)``: later writes to ``peer`` fail without reaching the network.
    - ``fail_after(n)``: the next ``n`` writes (counted after merging) go through, later ones
      fail; a batch straddling the limit sends its first writes, so some of its bytes land.
    - ``hold()``: batches report PENDING until ``release()``, whatever their bytes did;
      ``hold(seconds=s)``: each batch posted from now on reports PENDING for ``s`` seconds more.
    - ``drop_notifies()``: ``write_sync`` writes the data but the notify never leaves, as when
      Mooncake's notify RPC fails (it only logs).
    - ``delay_posts(s)``: batches posted from now on reach the real engine only ``s`` seconds
      later (a slow network): their bytes land late, after anything the caller did meanwhile.
    - ``fail_rate(p)``: each batch or synchronous write fails with probability ``p``, nothing of
      it sent (a lossy link whose engine reports the loss, as Mooncake does).
    - ``delay_rate(p)`` with ``delay_s(s)``: each batch reaches the engine ``s`` seconds late
      with probability ``p`` (on top of ``delay_posts``).
    - ``seed(n)``: restarts the draws of the two rates, so a drill repeats exactly.
    ``reset()`` clears them all (the draws restart from seed 0). A failed batch still reports
    FAILED only after its real writes settled, as the contract requires.
    """

    def __init__(self, inner: TransferBackend, clock: Callable[[], float] = time.monotonic):
        self.inner = inner
        self._clock = clock
        self._lock = threading.Lock()
        # handle -> (the real engine's handle or None, injected error, time it may complete)
        self._batches: dict[WriteHandle, tuple[WriteHandle | None, str | None, float]] = {}
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._failing_peers: set[str] = set()
            self._budget: int | None = None
            self._held = False
            self._delay_s = 0.0
            self._drop_notifies = False
            self._post_delay_s = 0.0
            self._fail_rate = 0.0
            self._delay_rate = 0.0
            self._random_delay_s = 0.0
            self._rng = random.Random(0)

    def fail_writes_to(self, peer: str) -> None:
        with self._lock:
            self._failing_peers.add(peer)

    def fail_after(self, n: int | None) -> None:
        with self._lock:
            self._budget = n

    def hold(self, seconds: float | None = None) -> None:
        with self._lock:
            if seconds is None:
                self._held = True
            else:
                self._delay_s = seconds

    def delay_posts(self, seconds: float) -> None:
        with self._lock:
            self._post_delay_s = seconds

    def fail_rate(self, p: float) -> None:
        with self._lock:
            self._fail_rate = _probability("fail_rate", p)

    def delay_rate(self, p: float) -> None:
        with self._lock:
            self._delay_rate = _probability("delay_rate", p)

    def delay_s(self, seconds: float) -> None:
        if not seconds >= 0:
            raise ValueError(f"delay_s: {seconds} is not a duration in seconds")
        with self._lock:
            self._random_delay_s = seconds

    def seed(self, n: int) -> None:
        with self._lock:
            self._rng = random.Random(n)

    def release(self) -> None:
        with self._lock:
            self._held = False
            self._delay_s = 0.0

    def inner_handle(self, handle: WriteHandle) -> WriteHandle | None:
        """The real engine's handle behind ``handle`` (None when nothing was sent), so a test
        can tell "bytes landed" from "reported done"; only until ``handle`` turned terminal."""
        with self._lock:
            return self._batches[handle][0]

    def drop_notifies(self, drop: bool = True) -> None:
        with self._lock:
            self._drop_notifies = drop

    @property
    def session_id(self) -> str:
        return self.inner.session_id

    @property
    def peer_info(self) -> str:
        return self.inner.peer_info

    def connect(self, peer: str, info: str) -> None:
        self.inner.connect(peer, info)

    def register(self, regions) -> None:
        self.inner.register(regions)

    def unregister(self, addrs) -> None:
        self.inner.unregister(addrs)

    def post_writes(self, peer, srcs, dsts, lens) -> WriteHandle:
        base.check_writes(srcs, dsts, lens)
        s, d, n = base.merge_contiguous(srcs, dsts, lens)
        with self._lock:
            keep, error = self._allowed(peer, len(n))
            posted_at = self._clock() + self._delay_s
            post_delay = self._post_delay_s + self._random_delay()
        handle = WriteHandle(peer, len(n), sum(n))
        if keep and post_delay > 0:
            with self._lock:
                self._batches[handle] = (_LATE, error, posted_at)
            timer = threading.Timer(post_delay, self._post_late, (handle, peer, s[:keep], d[:keep], n[:keep]))
            timer.daemon = True
            timer.start()
            return handle
        inner = self.inner.post_writes(peer, s[:keep], d[:keep], n[:keep]) if keep else None
        with self._lock:
            self._batches[handle] = (inner, error, posted_at)
        return handle

    def _post_late(self, handle: WriteHandle, peer, srcs, dsts, lens) -> None:
        inner: WriteHandle | None
        late_error: str | None
        try:
            inner = self.inner.post_writes(peer, srcs, dsts, lens)
        except TransferError as e:  # closed meanwhile: nothing was sent
            inner, late_error = None, str(e)
        else:
            late_error = None
        with self._lock:
            _, error, posted_at = self._batches[handle]
            self._batches[handle] = (inner, error or late_error, posted_at)

    def poll(self, handle: WriteHandle) -> WriteState:
        with self._lock:
            if handle.state is not WriteState.PENDING:
                return handle.state
            inner, error, release_at = self._batches[handle]
            held = self._held or self._clock() < release_at
        if inner is _LATE:
            return WriteState.PENDING
        state = self.inner.poll(inner) if inner is not None else WriteState.DONE
        if state is WriteState.PENDING or held:
            return WriteState.PENDING
        with self._lock:
            # FAILED comes only from the inner engine's poll, so ``inner`` is set then.
            handle.error = error or (inner.error if state is WriteState.FAILED and inner is not None else None)
            handle.state = WriteState.FAILED if handle.error else WriteState.DONE
            del self._batches[handle]
            return handle.state

    def write_sync(self, peer, srcs, dsts, lens, notify=None) -> None:
        base.check_writes(srcs, dsts, lens)
        s, d, n = base.merge_contiguous(srcs, dsts, lens)
        with self._lock:
            keep, error = self._allowed(peer, len(n))
            if self._drop_notifies:
                notify = None
        if keep:
            self.inner.write_sync(peer, s[:keep], d[:keep], n[:keep], None if error else notify)
        if error:
            raise TransferError(error)

    def notifies(self) -> list[base.Notify]:
        return self.inner.notifies()

    def probe(self, peer: str, timeout_s: float = 2.0) -> bool:
        return self.inner.probe(peer, timeout_s)

    def outstanding(self) -> base.Outstanding:
        """The inner backend's, with this wrapper's handles not yet reported terminal (each
        stands for at most one inner batch, so the larger count is the true one)."""
        inner = self.inner.outstanding()
        with self._lock:
            mine = len(self._batches)
        return base.Outstanding(max(mine, inner.batches), inner.regions)

    def close(self) -> None:
        self.inner.close()

    def _allowed(self, peer: str, count: int) -> tuple[int, str | None]:
        """How many of ``count`` writes really go, and the injected error (caller holds the lock)."""
        if peer in self._failing_peers:
            return 0, f"injected failure: writes to {peer} fail"
        if self._fail_rate and self._rng.random() < self._fail_rate:
            return 0, f"injected failure: a write to {peer} dropped (fail_rate={self._fail_rate})"
        if self._budget is None:
            return count, None
        keep = min(count, self._budget)
        self._budget -= keep
        return keep, None if keep == count else f"injected failure: write budget exhausted ({peer})"


    def _random_delay(self) -> float:
        """This batch's extra delay under ``delay_rate`` (caller holds the lock)."""
        if self._delay_rate and self._rng.random() < self._delay_rate:
            return self._random_delay_s
        return 0.0


def _probability(name: str, p: float) -> float:
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"{name}: {p} is not a probability in [0, 1]")
    return p


_LATE = WriteHandle("", 0, 0)  # stands for a delayed batch's real handle until it is posted


def with_faults(backend: TransferBackend, spec: str) -> TransferBackend:
    """``backend`` wrapped to misbehave as ``spec`` ("knob=value,...") says; as is when empty."""
    if not spec:
        return backend
    faulty = FaultInjectingBackend(backend)
    for item in spec.split(","):
        knob, _, value = item.partition("=")
        if knob not in FAULT_KNOBS:
            raise ValueError(f"{FAULTS_ENV}: unknown fault {knob!r} (known: {', '.join(FAULT_KNOBS)})")
        try:
            setting = FAULT_KNOBS[knob](value)
        except ValueError:
            raise ValueError(f"{FAULTS_ENV}: {knob}={value!r} is not a number") from None
        try:
            getattr(faulty, knob)(setting)
        except ValueError as e:
            raise ValueError(f"{FAULTS_ENV}: {e}") from None
    logger.warning("KV transfer faults injected (%s=%s)", FAULTS_ENV, spec)
    return faulty
