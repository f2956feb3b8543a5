"""constrained/isolation.py: a client's constraint is checked in a child process with CPU and memory
limits (issue 33): over a limit it is an error naming the field and the flag, the child serves the
next constraint after it, a compile nobody waits for is killed (its process reaped, none left
behind), and a frontend that dies takes its compile children with it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from grammar_fixtures import EOS, PERSON, VOCAB, tokenizer

from pdserve.config import GrammarConfig
from pdserve.constrained import GrammarError
from pdserve.constrained.isolation import BackendSpec, CompileDropped, CompileKilled, IsolatedCompiler
from pdserve.constrained.service import CompileService

pytest.importorskip("xgrammar")


def wide_schema(fields: int, variant: str = "f") -> str:
    """An object of ``fields`` properties: compile time and memory grow with it (within the constraint
    limits: it is shallow and has no large repetition)."""
    props = {f"{variant}_{i}": {"type": "string", "pattern": "^[a-z]{1,12}$"} if i % 2 else
             {"type": "integer", "minimum": 0, "maximum": 10_000} for i in range(fields)}
    return json.dumps({"type": "object", "properties": props, "required": list(props)})


def _spec(**kw) -> BackendSpec:
    return BackendSpec(GrammarConfig(**kw), tokenizer(), VOCAB, (EOS,))


def _gone(pid: int) -> bool:
    """Exited and reaped (no zombie either)."""
    return not Path(f"/proc/{pid}").exists()


def _wait(predicate, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_over_the_memory_limit_is_an_error_naming_the_flag_and_the_child_serves_on():
    w = IsolatedCompiler(_spec(), memory_mb=8, cpu_s=60)
    try:
        assert w.compile("json_schema", json.dumps(PERSON)) >= 0
        pid = w.pid
        with pytest.raises(GrammarError, match=r"^sampling_params.json_schema: compiling it needs more than 8 MiB "
                                               r"\(--grammar-compile-memory-mb\)"):
            w.compile("json_schema", wide_schema(2000))
        with pytest.raises(GrammarError, match="^sampling_params.regex: does not compile"):
            w.compile("regex", "(")  # the backend's own error, as without isolation
        assert w.compile("regex", "[a-z]+") >= 0
        assert w.pid == pid  # the limit failed the compile, not the child
    finally:
        w.close()
    assert _gone(pid)


def test_over_the_cpu_limit_the_child_is_ended_and_the_next_compile_gets_a_new_one():
    w = IsolatedCompiler(_spec(), memory_mb=4096, cpu_s=1)
    try:
        assert w.compile("regex", "a+") >= 0
        first = w.pid
        with pytest.raises(GrammarError, match=r"^sampling_params.json_schema: compiling it used more than 1 s of CPU"):
            w.compile("json_schema", wide_schema(4000))
        assert first is not None and _gone(first)
        assert w.compile("regex", "b+") >= 0 and w.pid != first
    finally:
        w.close()


@pytest.fixture(scope="module")
def service():
    """A CompileService with one compile thread, and the children (``IsolatedCompiler``) it made. Shared by
    the two tests below, in this order: the child the first one keeps serves the second one's first
    compile, so the module starts one child fewer (each is a new interpreter that imports torch and
    xgrammar)."""
    config = GrammarConfig(compile_threads=1, compile_memory_mb=4096)
    spec = BackendSpec(config, tokenizer(), VOCAB, (EOS,))
    workers: list[IsolatedCompiler] = []

    def make_worker():
        workers.append(IsolatedCompiler(spec, config.compile_memory_mb, 600))
        return workers[-1]

    s = CompileService(lambda: pytest.fail("no compile in this process"), config, make_worker=make_worker)
    try:
        yield s, workers
    finally:
        s.close()
    assert all(w.pid is None for w in workers)


def test_a_compile_abandoned_while_its_child_starts_is_dropped_and_the_child_kept(service):
    """A child's start (imports, backend) is no compile's time: abandoned meanwhile, the compile is
    dropped (counted as abandoned, not killed) and the child starts on for the next one."""
    s, workers = service
    assert all(w.pid is None for w in workers)  # no child yet: this compile waits for its start (this test runs first)
    fut = s.submit("regex", "x+", "mallory")
    _wait(lambda: s._jobs[("regex", "x+")].started)  # its thread took it: the child is starting
    s.release("regex", "x+")
    with pytest.raises(CompileDropped):
        fut.result(60)
    _wait(lambda: s.queued("mallory") == 0)
    pid = workers[0].pid
    st = s.stats.to_dict()
    assert (st["killed"], st["abandoned"], st["compile_failures"]) == (0, 1, 0)
    assert ("regex", "x+") not in s._cache
    assert s.submit("regex", "y+", "alice").result(60) >= 0
    assert pid is not None and workers[0].pid == pid  # the same child served it


def test_a_running_compile_nobody_waits_for_is_killed_and_reaped(service):
    """The service kills the child of a started compile once its last waiter released it and it ran
    KILL_GRACE_S: nothing is cached, the kill is counted (not as a failure), no process is left, and
    the next check works."""
    s, workers = service
    assert s.submit("regex", "a+", "alice").result(60) >= 0  # the child is up
    (worker,) = workers
    pid = worker.pid
    assert s.submit("regex", "d+", "alice").result(60) >= 0  # released at once, but it ends first:
    s.release("regex", "d+")
    assert s.submit("regex", "d+", "alice").result(0) >= 0  # cached, and the child lives on
    assert worker.pid == pid
    slow = wide_schema(6000, "gone")
    fut = s.submit("json_schema", slow, "mallory")
    _wait(lambda: s._jobs.get(("json_schema", slow)) is not None and s._jobs[("json_schema", slow)].started)
    s.release("json_schema", slow)
    with pytest.raises(CompileKilled, match="nobody waits"):
        fut.result(30)
    assert pid is not None and _gone(pid)
    st = s.stats.to_dict()
    assert (st["killed"], st["compile_failures"]) == (1, 0)
    _wait(lambda: s.queued("mallory") == 0)  # its thread forgets it after setting the Future
    assert ("json_schema", slow) not in s._cache
    assert s.submit("regex", "c+", "alice").result(60) >= 0 and worker.pid not in (None, pid)


def test_a_child_that_cannot_start_is_each_requests_error_and_the_thread_lives_on():
    config = GrammarConfig(compile_threads=1)
    spec = BackendSpec(config, lambda: None, VOCAB, (EOS,))  # a tokenizer that cannot reach a child
    s = CompileService(lambda: pytest.fail("no compile in this process"), config,
                       make_worker=lambda: IsolatedCompiler(spec, 64, 60))
    try:
        for text in ("a+", "b+"):  # the second is served by the same thread
            with pytest.raises(GrammarError, match=r"^sampling_params.regex: could not be checked"):
                s.submit("regex", text, "alice").result(30)
    finally:
        s.close()


PARENT = textwrap.dedent("""
    import sys, threading
    sys.path.insert(0, {fixtures!r})
    from grammar_fixtures import EOS, VOCAB, tokenizer
    from pdserve.config import GrammarConfig
    from pdserve.constrained.isolation import BackendSpec, IsolatedCompiler
    w = IsolatedCompiler(BackendSpec(GrammarConfig(), tokenizer(), VOCAB, (EOS,)), 4096, 600)
    w.compile("regex", "a+")
    print(w.pid, flush=True)
    threading.Event().wait()
""")


def test_a_frontend_killed_takes_its_compile_child_with_it():
    parent = subprocess.Popen([sys.executable, "-c", PARENT.format(fixtures=str(Path(__file__).parent))],
                              stdout=subprocess.PIPE, text=True, env={**os.environ})
    try:
        child = int(parent.stdout.readline())
        assert not _gone(child)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    # its parent gone, init reaps it: it must stop existing
    _wait(lambda: _gone(child), 30)


def test_the_child_loads_the_class_the_server_loaded(tmp_path):
    """The generic class straight from the directory (no torch for the tokenizer); any other class
    (a qwen2 directory: transformers picks Qwen2Tokenizer) through AutoTokenizer, as before."""
    from transformers import AutoTokenizer

    spec = _spec()
    data = spec.to_json(4096, 60)
    assert json.loads(data)["generic"] is True
    back, _, _ = BackendSpec.from_json(data)
    assert type(back.tokenizer) is type(spec.tokenizer)
    assert back.tokenizer.encode("héllo wörld 123") == spec.tokenizer.encode("héllo wörld 123")
    src = Path(spec.tokenizer.name_or_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((src / name).read_bytes())
    config = json.loads((src / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "qwen2"}))
    other = BackendSpec(GrammarConfig(), AutoTokenizer.from_pretrained(str(tmp_path)), VOCAB, (EOS,))
    data = other.to_json(4096, 60)
    assert json.loads(data)["generic"] is False
    back, _, _ = BackendSpec.from_json(data)
    assert type(back.tokenizer) is type(other.tokenizer) and type(back.tokenizer).__name__ != "TokenizersBackend"
