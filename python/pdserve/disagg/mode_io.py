"""How a disaggregation mode talks to the world: one object, so the modes read the same with one
scheduler rank or many.

The rule with several ranks (every rank runs the same scheduler on the same inputs):
anything that depends on time or on a thread (a control message arriving, a bootstrap fetch
ending, a heartbeat verdict, a timeout, "my writes have landed") may change scheduler state only
as an event every rank applies at the same loop iteration. So:

- rank 0 alone reads the control channel (every peer sends to rank 0's ``endpoint``) and the
  mailbox (rank 0 alone runs the helper threads: bootstrap fetches, the heartbeat), and the rank
  loop hands what arrived to every rank (``recv_all``);
- the clock is rank 0's, read at the loop's exchange (``now``);
- a fact only one rank can see (its own writes settled, a peer it needs) is gathered from every
  rank in an agreement round (``agree``) before anyone acts on it; a mode asks for a round
  before the exchange (``SchedulerMode.wants_agreement``), so every rank knows whether there is one;
- sends that change nothing locally stay per rank (``send``: a rank's own KV request, its own
  completions and acknowledgements), server-level ones go once (``send_once``: from the first
  rank of the attention group that holds the request).

``DirectIO`` is the single scheduler process: it reads its channel and mailbox itself, its clock
is its own, and its facts need no agreement. ``LockStepIO`` is one rank of several.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from pdserve.disagg.channel import ControlChannel, Mailbox
from pdserve.disagg.protocol import Message

if TYPE_CHECKING:
    from pdserve.engine.rank_group import Inbound, RankSchedulerLoop


class ModeIO:
    """The contract. ``endpoint``: where this server's peers send (rank 0's channel).
    ``is_fetcher``: this rank runs the helper threads (bootstrap fetches, heartbeat) and posts
    their verdicts. Everything but ``post`` runs on the scheduler thread."""

    endpoint: str
    is_fetcher: bool = True

    def __init__(self, channel: ControlChannel, mailbox: Mailbox | None):
        self.channel = channel
        self.mailbox = mailbox

    def now(self) -> float:
        """The clock timeouts and leases are measured with (monotonic seconds)."""
        raise NotImplementedError

    def recv_all(self) -> list:
        """Control messages and helper verdicts that arrived since the last call."""
        raise NotImplementedError

    def agree(self, fact) -> list | None:
        """Every rank's ``fact`` in rank order, or None when no round is due this iteration (then
        act on nothing). Called at most once per ``poll``, by every rank alike."""
        raise NotImplementedError

    def send(self, endpoint: str, msg: Message) -> None:
        """From this rank (its own part of the protocol)."""
        self.channel.send(endpoint, msg)

    def send_once(self, endpoint: str, msg: Message) -> None:
        """Once for the server (every rank calls it with the same message)."""
        self.channel.send(endpoint, msg)

    def post(self, msg) -> None:
        """From a helper thread: ``msg`` reaches ``recv_all`` on every rank."""
        self.own_mailbox.post(msg)

    @property
    def own_mailbox(self) -> Mailbox:
        """The mailbox; only the fetching rank (rank 0) has one, and only it runs helper threads."""
        if self.mailbox is None:
            raise RuntimeError("this rank has no mailbox: only rank 0 runs the helper threads that post")
        return self.mailbox

    def from_leader(self, value):
        """Rank 0's ``value`` on every rank (a collective at set-up: every rank calls it)."""
        return value

    def sockets(self) -> list:
        """Sockets the single-process loop should wake on."""
        return []

    def refused(self) -> int:
        """Control frames this rank refused (unauthenticated, malformed) so far."""
        return sum(self.channel.gate.refused.values())

    def connect(self, loop) -> None:
        """A multi-rank server's loop is about to run (``LockStepIO`` only)."""

    def close(self) -> None:
        if self.mailbox is not None:
            self.mailbox.close()
        self.channel.close()


class DirectIO(ModeIO):
    """One scheduler process: it reads, times and decides alone."""

    def __init__(self, channel: ControlChannel, mailbox: Mailbox):
        super().__init__(channel, mailbox)
        if channel.endpoint is None:
            raise ValueError("channel: a single scheduler process needs a listening control channel")
        self.endpoint = channel.endpoint

    def now(self) -> float:
        return time.monotonic()

    def recv_all(self) -> list:
        return self.channel.recv_all() + self.own_mailbox.recv_all()

    def agree(self, fact) -> list:
        return [fact]

    def sockets(self) -> list:
        return [self.channel.socket, self.own_mailbox.socket]


class LockStepIO(ModeIO):
    """One rank of a multi-rank server (module docstring). ``endpoint``: rank 0's channel,
    learned at start-up; ``channel`` listens on rank 0 only, ``mailbox`` exists there only."""

    def __init__(self, channel: ControlChannel, mailbox: Mailbox | None, layout, control, endpoint: str,
                 message_types: Iterable[type]):
        """``layout``: this rank's RankLayout; ``control``: the rank group's ControlPlane;
        ``message_types``: what the channel and the mailbox carry."""
        super().__init__(channel, mailbox)
        self.layout = layout
        self.control = control
        self.endpoint = endpoint
        self.is_fetcher = layout.is_leader
        self.message_types = tuple(message_types)
        self.loop: RankSchedulerLoop | None = None
        self._inbox: list = []

    def connect(self, loop: RankSchedulerLoop) -> None:
        self.loop = loop
        if self.layout.is_leader:
            if self.channel.socket is None:
                raise RuntimeError("LockStepIO: rank 0's control channel must listen")
            loop.add_inbox(self.channel.socket, decode=self.channel.gate.accept)
            loop.add_inbox(self.own_mailbox.socket, decode=self.own_mailbox.take)
        for t in self.message_types:
            loop.on(t, self._deliver, wakes=True)

    def _deliver(self, msg) -> None:
        self._inbox.append(msg)

    def _inbound(self) -> Inbound:
        """The rank loop's latest exchange; the modes run only after the loop's first one."""
        if self.loop is None or self.loop.inbound is None:
            raise RuntimeError("LockStepIO: read before the rank loop's first exchange")
        return self.loop.inbound

    def now(self) -> float:
        return self._inbound().now

    def recv_all(self) -> list:
        out, self._inbox = self._inbox, []
        return out

    def agree(self, fact) -> list | None:
        return self.control.gather(fact) if self._inbound().agreement_due else None

    def from_leader(self, value):
        return self.control.gather(value)[0]

    def send_once(self, endpoint: str, msg: Message) -> None:
        if self.layout.is_dp_leader:
            self.channel.send(endpoint, msg)

    def post(self, msg) -> None:
        if self.mailbox is None:
            raise RuntimeError(f"rank {self.layout.rank}: only rank 0 runs the helper threads that post")
        self.mailbox.post(msg)
