"""constrained/service.py: compiles run on the service's threads (never the caller's), the same
constraint compiles once (later requests hit the cache, even while it still compiles), failures
are cached as failures, the cache is bounded (least recently used dropped), a compile past the
timeout raises GrammarTimeout naming the field; clients take turns, each with a bounded queue,
and a compile nobody waits for is dropped before it starts (issue 33)."""

from __future__ import annotations

import threading
import time

import pytest

from pdserve.config import GrammarConfig
from pdserve.constrained import Grammar, GrammarBackend, GrammarError, GrammarTimeout
from pdserve.constrained.service import CompileBusy, CompileService


class CountingBackend(GrammarBackend):
    """Compiles ``regex`` texts to themselves; ``gate`` holds a compile until set; "bad" fails."""

    def __init__(self):
        super().__init__(None, 32, [0], GrammarConfig())
        self.calls: list[tuple[str, str, str]] = []
        self.gate = threading.Event()
        self.gate.set()

    def compile(self, kind, text):
        self.calls.append((kind, text, threading.current_thread().name))
        self.gate.wait(10)
        if text == "bad":
            raise GrammarError(kind, "does not compile")
        return text

    def matcher(self, compiled) -> Grammar:
        raise NotImplementedError


def _service(backend, **kw):
    return CompileService(lambda: backend, GrammarConfig(**kw))


def test_compiles_once_on_its_own_threads_and_caches():
    b = CountingBackend()
    s = _service(b)
    try:
        assert s.compile("regex", "a+") == "a+"
        assert s.compile("regex", "a+") == "a+"
        assert s.compile("json_schema", "a+") == "a+"  # the kind is part of the key
        assert [c[:2] for c in b.calls] == [("regex", "a+"), ("json_schema", "a+")]
        assert all(c[2].startswith("pdserve-grammar") for c in b.calls)
        st = s.stats.to_dict()
        assert (st["cache_hits"], st["cache_misses"], st["compile_seconds"]["count"]) == (1, 2, 2)
    finally:
        s.close()


def test_a_compile_in_flight_is_shared_and_failures_are_cached():
    b = CountingBackend()
    b.gate.clear()
    s = _service(b)
    try:
        f1, f2 = s.submit("regex", "x"), s.submit("regex", "x")
        assert f1 is f2 and not f1.done()
        b.gate.set()
        assert f1.result(10) == "x"
        for _ in range(2):
            with pytest.raises(GrammarError, match="^sampling_params.regex: does not compile"):
                s.compile("regex", "bad")
        assert [c[1] for c in b.calls] == ["x", "bad"]
        assert s.stats.to_dict()["compile_failures"] == 1
    finally:
        s.close()


def test_the_cache_is_bounded_least_recently_used_first():
    b = CountingBackend()
    s = _service(b, cache_size=2)
    try:
        for text in ("a", "b", "a", "c"):  # "b" is the least recently used when "c" arrives
            s.compile("regex", text)
        assert len(s) == 2
        s.compile("regex", "a")
        s.compile("regex", "b")
        assert [c[1] for c in b.calls] == ["a", "b", "c", "b"]
    finally:
        s.close()


def test_a_slow_compile_times_out_naming_the_field():
    b = CountingBackend()
    b.gate.clear()
    s = _service(b, compile_timeout_s=0.2)
    try:
        with pytest.raises(GrammarTimeout, match="^sampling_params.ebnf: compiling the grammar took longer"):
            s.compile("ebnf", "slow")
        assert s.stats.to_dict()["timeouts"] == 1
        b.gate.set()
        assert s.compile("ebnf", "slow") == "slow"  # it finished later: cached for the next request
    finally:
        s.close()


def test_the_cache_keys_on_the_exact_constraint_text():
    """Constraints that differ only in whitespace are different constraints (a space in a regex is a
    character the output must contain; JSON schemas may carry literal strings): each compiles on its
    own and each request gets its own grammar, never another's."""
    b = CountingBackend()
    s = _service(b)
    try:
        texts = ["a b", "ab", "a  b", " ab", "ab\n"]
        assert [s.compile("regex", t) for t in texts] == texts
        assert [s.compile("regex", t) for t in texts] == texts  # and each is its own cache entry
        assert [c[1] for c in b.calls] == texts and len(s) == len(texts)
    finally:
        s.close()


class GatedBackend(CountingBackend):
    """Each text compiles once its own gate is opened ("slow*" texts wait; others pass at once)."""

    def __init__(self):
        super().__init__()
        self.gates: dict[str, threading.Event] = {}
        self.started: list[str] = []
        self.all_open = threading.Event()

    def compile(self, kind, text):
        gate = self.gates.setdefault(text, threading.Event())
        self.started.append(text)
        deadline = time.monotonic() + 10
        while text.startswith("slow") and not (gate.is_set() or self.all_open.is_set()) \
                and time.monotonic() < deadline:
            gate.wait(0.01)
        return text

    def open_all(self):
        self.all_open.set()


def _wait_started(b: GatedBackend, n: int) -> None:
    deadline = time.monotonic() + 10
    while len(b.started) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(b.started) >= n, b.started


def test_one_client_cannot_queue_more_than_its_share():
    """Issue 33: a client gets at most max_compiles_per_client new compiles queued or running; one more is
    refused at once (CompileBusy), while another client and cached or shared constraints still go."""
    b = GatedBackend()
    s = _service(b, compile_threads=1, max_compiles_per_client=2)
    try:
        s.submit("regex", "slow-1", "mallory")
        s.submit("regex", "slow-2", "mallory")
        with pytest.raises(CompileBusy, match="^sampling_params.regex: this client already has 2 grammars"):
            s.submit("regex", "slow-3", "mallory")
        assert s.submit("regex", "slow-1", "mallory") is not None  # the same constraint is shared, not new
        assert s.queued("mallory") == 2 and s.stats.to_dict()["busy"] == 1
        alice = s.submit("regex", "a+", "alice")
        _wait_started(b, 1)
        b.open_all()
        assert alice.result(10) == "a+"
    finally:
        b.open_all()
        s.close()


def test_owners_take_turns_not_arrival_order():
    """Ten queued compiles of one client do not hold a later client's compile behind them all."""
    b = GatedBackend()
    s = _service(b, compile_threads=1, max_compiles_per_client=10)
    try:
        hostile = [s.submit("regex", f"slow-{i}", "mallory") for i in range(10)]
        _wait_started(b, 1)  # mallory's first holds the only thread
        alice = s.submit("regex", "a+", "alice")
        b.gates["slow-0"].set()
        assert alice.result(10) == "a+"
        assert b.started[:2] == ["slow-0", "a+"]  # alice's went next, before mallory's nine others
    finally:
        b.open_all()
        for f in hostile:
            f.cancel()
        s.close()


def test_a_compile_nobody_waits_for_is_dropped_before_it_starts():
    """Clients that sent a schema and left: their queued compiles never run, nothing is cached for them,
    and a compile still wanted by a second caller is kept."""
    b = GatedBackend()
    s = _service(b, compile_threads=1)
    try:
        s.submit("regex", "slow-running", "a")
        _wait_started(b, 1)
        gone = s.submit("regex", "slow-gone", "b")
        shared = s.submit("regex", "slow-shared", "c")
        assert s.submit("regex", "slow-shared", "d") is shared
        s.release("regex", "slow-gone")
        s.release("regex", "slow-shared")  # "d" still waits for it
        assert gone.cancelled() and not shared.cancelled()
        assert s.queued("b") == 0 and s.stats.to_dict()["abandoned"] == 1
        b.open_all()
        assert shared.result(10) == "slow-shared"
        _wait_started(b, 2)
        assert "slow-gone" not in b.started and ("regex", "slow-gone") not in s._cache
    finally:
        b.open_all()
        s.close()
