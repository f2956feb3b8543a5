"""constrained/service.py: compiles run on the service's threads (never the caller's), the same
constraint compiles once (later requests hit the cache, even while it still compiles), failures
are cached as failures, the cache is bounded (least recently used dropped), a compile past the
timeout raises GrammarTimeout naming the field."""

from __future__ import annotations

import threading

import pytest

from pdserve.config import GrammarConfig
from pdserve.constrained import Grammar, GrammarBackend, GrammarError, GrammarTimeout
from pdserve.constrained.service import CompileService


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
