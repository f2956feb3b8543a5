"""A prefill scheduler and a decode scheduler in one test process, wired as two servers would be:
real transfer engines (Mooncake over TCP loopback, or the in-memory backend), real ZMQ control
channels, a real bootstrap registry. Tests step both schedulers by hand, so every state of the protocol can be reached
and inspected without HTTP or subprocesses."""

from __future__ import annotations

import random
import time

from entrypoints.server_utils import free_port
from pdserve.config import ServerArgs
from pdserve.disagg.auth import PeerAuth
from pdserve.disagg.bootstrap import BootstrapServer
from pdserve.engine.io_struct import BootstrapRef
from pdserve.engine.request import SamplingParams
from pdserve.entrypoints.scheduler_process import build_scheduler
from pdserve.transfer import Outstanding

RUN_TIMEOUT_S = 120.0
# Each side's KV pool unless the flags set one: test requests are at most a few hundred tokens, and the
# default budget (256 MiB per scheduler, zeroed and registered with the transfer engine) cost a pair more
# CPU than most tests here (test_pd_flow: 85 s -> 46 s of CPU for its 80 tests).
POOL_TOKENS = 4096


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, **kw).validate()


class PDPair:
    """``prefill`` and ``decode``: Schedulers in their modes, moving KV through ``backend``;
    ``flags`` go to both sides, and ``prefill_flags`` / ``decode_flags`` to one."""

    def __init__(self, model: str, prefill_flags: dict | None = None, decode_flags: dict | None = None,
                 backend: str = "mooncake", **flags):
        # The registry holds the deployment's token, as a prefill server's frontend would.
        token = {**flags, **(prefill_flags or {})}.get("disaggregation_auth_token")
        self.bootstrap = BootstrapServer("127.0.0.1", free_port(), PeerAuth(token)).start()
        base = {"model_path": model, "disaggregation_bootstrap_port": self.bootstrap.port, "num_threads": 1,
                "disaggregation_transfer_backend": backend, "max_total_tokens": POOL_TOKENS, **flags}
        # a side's own flags win over the shared ones (model_path too: two copies of one model)
        self.prefill = build_scheduler(ServerArgs(**{**base, **(prefill_flags or {})}, disaggregation_mode="prefill",
                                                  port=free_port()))
        self.decode = build_scheduler(ServerArgs(**{**base, **(decode_flags or {})}, disaggregation_mode="decode",
                                                 port=free_port()))
        self.outputs: dict[str, dict] = {}
        self.prefill_outputs: list = []  # what prefill emitted in the latest step
        self.prefill_finals: dict[str, object] = {}  # rid -> how prefill's half ended
        # The engines as built (tests may wrap the sender's later), and what set-up registered.
        self.engines = (self.prefill.mode.sender.backend, self.decode.mode.backend)
        self.registered = [e.outstanding().regions for e in self.engines]

    def ref(self, room: int) -> BootstrapRef:
        return BootstrapRef("127.0.0.1", self.bootstrap.port, room)

    def submit(self, rid: str, ids: list[int], sampling: SamplingParams, to_prefill: bool = True,
               room: int | None = None) -> int:
        """Both halves, as a router sends them (``to_prefill`` False: the prefill half is lost)."""
        room = random.getrandbits(63) if room is None else room
        self.outputs[rid] = {"ids": [], "final": None}
        if to_prefill:
            self.prefill.add_request(rid, ids, sampling, bootstrap=self.ref(room))
        self.decode.add_request(rid, ids, sampling, bootstrap=self.ref(room))
        return room

    def submit_local(self, rid: str, ids: list[int], sampling: SamplingParams) -> None:
        """A request sent to decode alone, with no router in front (a colocated request)."""
        self.outputs[rid] = {"ids": [], "final": None}
        self.decode.add_request(rid, ids, sampling)

    def step(self) -> None:
        self.prefill_outputs = self.prefill.step()
        self.prefill_finals.update((o.rid, o) for o in self.prefill_outputs if o.finished)
        for o in self.decode.step():
            acc = self.outputs.setdefault(o.rid, {"ids": [], "final": None})
            acc["ids"] += o.new_token_ids
            if o.finished:
                acc["final"] = o
        if not (self.prefill.runnable() or self.decode.runnable()):
            time.sleep(0.001)  # both wait on the network

    def run(self, until=None, timeout_s: float = RUN_TIMEOUT_S) -> None:
        """Step until ``until()`` (default: both sides idle, quarantine included)."""
        done = until or (lambda: not (self.prefill.has_work() or self.decode.has_work()))
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline:
                raise AssertionError(f"not done after {timeout_s} s: prefill {self.prefill.stats()}, "
                                     f"decode {self.decode.stats()}")
            self.step()

    def assert_idle_and_accounted(self) -> None:
        for s in (self.prefill, self.decode):
            s.check_memory()
            st = s.stats()
            assert st["free_pages"] + st["cached_pages"] == st["total_pages"], st
        # No batch left in flight, no region registered beyond the pool and aux rows.
        now = (self.prefill.mode.sender.backend, *self.engines)  # a wrapper counts its own handles
        for engine, regions in zip(now, (self.registered[0], *self.registered)):
            assert engine.outstanding() == Outstanding(0, regions), (engine, engine.outstanding())

    def close(self) -> None:
        for s in (self.prefill, self.decode):
            s.mode.close()
        for engine in self.engines:  # the modes leave their transfer engine to the process's end
            engine.close()
        self.bootstrap.stop()
