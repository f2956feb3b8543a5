"""The narrow interface pdserve keeps in front of a KV transfer engine (one small contract, one backend per module).

Peers are named by their transfer session id (``"host:rpc_port"``). Addresses are raw ints
(``tensor.data_ptr()``); sources must lie in memory this backend registered, destinations in
memory the peer registered.

What "done" means (measured on Mooncake's TCP transport, 127.0.0.1; the tests in
``test/disagg/test_transfer.py`` reproduce it, on every backend):

* **DONE means landed.** When ``poll(handle)`` reports ``DONE`` on the sender, every byte of
  the batch is already in the receiver's memory: a sender that polls DONE and at once tells the
  receiver over another channel (a pipe) never lets the receiver see stale bytes (hundreds of
  rounds, 1 B to 6 MiB, split over 1-4 writes). ``mooncake.py`` says why Mooncake keeps this
  (TCP protocol v2's status frame) and how the legacy framing breaks it.
* **A notify cannot overtake its data.** A notify attached to ``write_sync`` is appended to the
  peer's ``notifies()`` only after the data landed (checked: a receiver reading the region a
  notify names as soon as it sees it saw no stale byte). But a notify can be **lost silently**:
  when Mooncake's notify RPC fails it logs an error and the write still reports success.
* **Consequence for decode's completion:** prefill waits until every posted write of a room
  polls DONE, then sends the completion message (with its write count) over its control
  channel; decode may trust the bytes when that message arrives. Counting notifies alone
  could wait forever on a lost notify, so they are never the only signal.
"""

from __future__ import annotations

import bisect
import enum
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass


class TransferError(RuntimeError):
    """A transfer failed, or the engine could not be set up; the message names the peer."""


class WriteState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@dataclass(eq=False)
class WriteHandle:
    """Ticket for one ``post_writes`` batch; only the backend that issued it may poll it.

    ``num_writes`` counts writes after merging; ``error`` says why, once FAILED.
    """

    peer: str
    num_writes: int
    nbytes: int
    state: WriteState = WriteState.PENDING
    error: str | None = None


Notify = tuple[str, str]  # (name, msg)


@dataclass(frozen=True)
class Outstanding:
    """What a backend holds right now: ``batches`` posted and not yet terminal, ``regions``
    registered. A process that is idle holds no batch, and its regions are the ones it
    registered at set-up (KV pool, aux rows): more means a leak."""

    batches: int
    regions: int


def merge_contiguous(srcs: Sequence[int], dsts: Sequence[int],
                     lens: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
    """Merge each write into the previous one when both its source and its destination
    continue the previous write's exactly (order kept): one network write per contiguous run."""
    out_s: list[int] = []
    out_d: list[int] = []
    out_n: list[int] = []
    for s, d, n in zip(srcs, dsts, lens):
        if out_n and out_s[-1] + out_n[-1] == s and out_d[-1] + out_n[-1] == d:
            out_n[-1] += n
        else:
            out_s.append(s)
            out_d.append(d)
            out_n.append(n)
    return out_s, out_d, out_n


def check_writes(srcs: Sequence[int], dsts: Sequence[int], lens: Sequence[int]) -> None:
    """Reject malformed batches before they reach the engine (lengths must match, bytes >= 1)."""
    if not (len(srcs) == len(dsts) == len(lens)):
        raise ValueError(f"srcs, dsts, lens: lengths differ ({len(srcs)}, {len(dsts)}, {len(lens)})")
    if not srcs:
        raise ValueError("srcs: a batch needs at least one write")
    for i, n in enumerate(lens):
        if n < 1:
            raise ValueError(f"lens[{i}]: must be >= 1 byte, got {n}")


def check_regions(regions: Sequence[tuple[int, int]]) -> None:
    for i, (addr, n) in enumerate(regions):
        if addr <= 0 or n < 1:
            raise ValueError(f"regions[{i}]: need addr > 0 and nbytes >= 1, got ({addr}, {n})")


class Regions:
    """Registered ``[addr, addr + n)`` regions, kept sorted; not thread-safe (the owner locks)."""

    def __init__(self):
        self._starts: list[int] = []
        self._ends: list[int] = []

    def add(self, addr: int, n: int) -> None:
        i = bisect.bisect(self._starts, addr)
        self._starts.insert(i, addr)
        self._ends.insert(i, addr + n)

    def contains(self, addr: int, n: int) -> bool:
        i = bisect.bisect(self._starts, addr) - 1
        return i >= 0 and addr + n <= self._ends[i]

    def check_sources(self, srcs: Sequence[int], lens: Sequence[int]) -> None:
        """ValueError naming the first write whose source is not inside one registered region."""
        for i, (s, n) in enumerate(zip(srcs, lens)):
            if not self.contains(s, n):
                raise ValueError(f"srcs[{i}]: [{s:#x}, +{n}) is not inside a region registered with this backend")

    def overlaps(self, addr: int, n: int) -> bool:
        i = bisect.bisect(self._starts, addr)
        return (i > 0 and self._ends[i - 1] > addr) or (i < len(self._starts) and self._starts[i] < addr + n)

    def remove(self, addr: int) -> None:
        i = bisect.bisect_left(self._starts, addr)
        if i == len(self._starts) or self._starts[i] != addr:
            raise ValueError(f"addrs: {addr:#x} is not the start of a registered region")
        del self._starts[i], self._ends[i]

    def all(self) -> list[int]:
        return list(self._starts)

    def __len__(self) -> int:
        return len(self._starts)


@dataclass(frozen=True)
class BufferDescriptor:
    """One registrable buffer (a KV pool publishes one per tensor): layer ``l``'s page ``p`` starts at
    ``base_addr + l * layer_stride + p * page_bytes`` and is ``page_bytes`` long."""

    name: str  # "k", "v" or "latent"
    base_addr: int
    page_bytes: int
    layer_stride: int
    num_layers: int
    num_pages: int

    @property
    def total_bytes(self) -> int:
        return self.layer_stride * self.num_layers

    def page_addr(self, layer: int, page: int) -> int:
        return self.base_addr + layer * self.layer_stride + page * self.page_bytes


class TransferBackend(ABC):
    """One process's endpoint of the KV transfer fabric.

    Contracts every implementation keeps:
    - ``register`` before any write reads from (or a peer writes into) a region; a source
      outside the registered regions is a ``ValueError`` at post time, on every transport; a
      region overlapping a registered one is refused (``TransferError``).
    - ``post_writes`` never blocks on the network; it merges contiguous runs (see
      ``merge_contiguous``) and returns a handle. The caller keeps sources unchanged and
      alive until the handle is terminal.
    - ``poll`` is non-blocking. A handle turns DONE once every byte is in the peer's memory
      (see the module docstring for the evidence), FAILED once any write failed and *no write
      of the batch is still in flight* (so no byte of it can land later). It never goes back.
      A destination outside what the peer registered, an unknown or closed peer: FAILED, the
      message naming the peer.
    - ``write_sync`` blocks until the batch is done or failed (raising ``TransferError``); the
      optional notify reaches the peer's ``notifies()`` after the data, or is lost (never early).
    - ``notifies`` drains what arrived since the last call, oldest first.
    - ``probe`` answers within ``timeout_s``; False means "did not answer", not "dead".
    - ``outstanding`` counts what the backend holds (batches not yet terminal, regions).
    - ``close`` is idempotent; it waits (bounded) for in-flight writes, then frees the engine;
      later calls but ``poll`` and ``outstanding`` raise ``TransferError``.
    """

    @property
    @abstractmethod
    def session_id(self) -> str:
        """This endpoint's peer name, ``"host:rpc_port"``."""

    @property
    def peer_info(self) -> str:
        """What a peer needs besides ``session_id`` to exchange writes with this endpoint, for
        this side's bootstrap record (signed, as the rest); "" when the session id is enough
        (Mooncake, memory). NIXL's names its registered regions: read it after ``register``."""
        return ""

    def connect(self, peer: str, info: str) -> None:
        """Learn ``peer`` from its record (``session``, ``peer_info``) before writing to it or
        answering its writes; a no-op for the same info again, and for backends whose session
        id is enough. Raises TransferError when ``info`` does not describe ``peer``."""
        return None

    @abstractmethod
    def register(self, regions: Sequence[tuple[int, int]]) -> None:
        """Register ``(addr, nbytes)`` regions (one batch call). Raises TransferError."""

    @abstractmethod
    def unregister(self, addrs: Sequence[int]) -> None:
        """Forget regions registered at ``addrs`` (before their memory is freed or reused: a new
        region overlapping a registered one is refused)."""

    @abstractmethod
    def post_writes(self, peer: str, srcs: Sequence[int], dsts: Sequence[int],
                    lens: Sequence[int]) -> WriteHandle:
        """Queue writes ``srcs[i] -> peer:dsts[i]`` of ``lens[i]`` bytes."""

    @abstractmethod
    def poll(self, handle: WriteHandle) -> WriteState:
        """Current state of a posted batch."""

    @abstractmethod
    def write_sync(self, peer: str, srcs: Sequence[int], dsts: Sequence[int], lens: Sequence[int],
                   notify: Notify | None = None) -> None:
        """Write and wait; then, if given, deliver ``notify`` to the peer."""

    @abstractmethod
    def notifies(self) -> list[Notify]:
        """Notifies received since the last call."""

    @abstractmethod
    def probe(self, peer: str, timeout_s: float = 2.0) -> bool:
        """Whether the peer's transfer engine answered within ``timeout_s``."""

    @abstractmethod
    def outstanding(self) -> Outstanding:
        """Batches posted and not yet terminal, and regions registered (leak checks)."""

    @abstractmethod
    def close(self) -> None:
        """Stop, wait for in-flight writes (bounded), unregister and free the engine."""

    def wait(self, handle: WriteHandle, timeout_s: float, interval_s: float = 0.0005) -> WriteState:
        """Poll until terminal or ``timeout_s`` passed; returns the last state (maybe PENDING)."""
        deadline = time.monotonic() + timeout_s
        while (state := self.poll(handle)) is WriteState.PENDING and time.monotonic() < deadline:
            time.sleep(interval_s)
        return state
