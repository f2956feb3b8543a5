"""Checking that a client's constraint compiles, in a child process with CPU and memory limits that
can be killed (issue 33: a compile thread cannot be stopped, and a hostile schema can hold it, and
its memory, for as long as it likes).

Why a check and not the compile itself: a compiled grammar cannot cross a process cheaply. xgrammar's
serialized form of a 200-field schema took 47 s and 192 MB against 0.45 s to compile; llguidance and
outlines-core have none. So the frontend, which faces clients, compiles each new constraint here only
to learn whether it compiles within the limits (the answer is a few bytes of JSON), and the
scheduler, which only ever sees constraints its frontend accepted, compiles the same text in its own
process: the same backend, text and vocabulary make the same work, which the check has bounded.

One ``IsolatedCompiler`` per compile thread (``CompileService(make_worker=...)``), each with one child
(a new interpreter) started on its first compile and kept for the next. For each
compile the child sets its own limits relative to what it already uses:

* ``RLIMIT_AS``: its address space may grow by ``memory_mb`` (the backend's allocation then fails,
  and the child answers that the grammar needs more memory than it may have);
* ``RLIMIT_CPU``: ``cpu_s`` more seconds of CPU, past which the kernel ends the child (SIGXCPU).

The parent kills the child (SIGKILL) when nobody waits for its compile any more (the request timed
out, the client left) and it has run ``KILL_GRACE_S``, and on close; a child that ended is replaced
at once (it imports while the thread waits for work). The child also dies with the thread that
started it (PR_SET_PDEATHSIG), so a frontend that is killed leaves no compile behind.
Messages both ways are JSON, never pickle (a child that misbehaves must not run code in the parent),
the child's of a bounded size so a runaway answer cannot grow the parent; the child is given the
backend's settings and the tokenizer's directory, and loads the tokenizer itself.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from pdserve.config import GrammarConfig
from pdserve.constrained.base import GrammarError, short_error

MAX_REPLY_BYTES = 4096  # a child's answer: whether it compiled, in how long, or why not
# A compile nobody waits for is killed once it has run this long. Sooner would cost more than it
# saves: a new child imports torch and xgrammar (seconds of CPU), while most compiles end well within
# this, and what ends is cached for the next asker (a client that hung up and resends).
KILL_GRACE_S = 2.0
POLL_S = 0.1  # how often a compile's thread asks whether anyone still waits
_PR_SET_PDEATHSIG = 1


class CompileKilled(GrammarError):
    """The compile was stopped on purpose (nobody waited for it any more): not the constraint's fault."""


class CompileDropped(GrammarError):
    """Nobody waited any more while the child was still starting: the compile never began (the child
    lives on for the next one)."""


@dataclass(frozen=True)
class BackendSpec:
    """What a child needs to build the server's backend (``create_grammar_backend``'s arguments)."""

    config: GrammarConfig
    tokenizer: Any
    vocab_size: int
    stop_token_ids: tuple[int, ...]

    def to_json(self, memory_mb: int, cpu_s: int) -> bytes:
        """The spec and the limits as JSON: the tokenizer by the directory it was loaded from."""
        path = getattr(self.tokenizer, "name_or_path", None) if self.tokenizer is not None else None
        if self.tokenizer is not None and not (isinstance(path, str) and Path(path).is_dir()):
            raise ValueError("the compile worker loads the tokenizer from its directory, which this tokenizer "
                             "does not name (--no-grammar-compile-isolation compiles in process)")
        cls = type(self.tokenizer)
        generic = self.tokenizer is not None and f"{cls.__module__}.{cls.__qualname__}" == GENERIC_TOKENIZER
        return json.dumps({"config": asdict(self.config), "tokenizer": path, "generic": generic,
                           "vocab_size": self.vocab_size, "stop_token_ids": list(self.stop_token_ids),
                           "memory_mb": memory_mb, "cpu_s": cpu_s}).encode()

    @staticmethod
    def from_json(data: bytes) -> tuple[BackendSpec, int, int]:
        """(spec, memory_mb, cpu_s) from ``to_json``'s bytes, the tokenizer loaded from its directory."""
        d = json.loads(data)
        tokenizer = None
        if d["tokenizer"] is not None:
            tokenizer = _load_tokenizer(d["tokenizer"], bool(d.get("generic")))
        spec = BackendSpec(GrammarConfig(**d["config"]), tokenizer, int(d["vocab_size"]),
                           tuple(int(t) for t in d["stop_token_ids"]))
        return spec, int(d["memory_mb"]), int(d["cpu_s"])


GENERIC_TOKENIZER = "transformers.tokenization_utils_tokenizers.TokenizersBackend"


def _load_tokenizer(path: str, generic: bool):
    """The class the server's tokenizer has, from its directory: transformers' generic class is
    loaded directly, as the server loaded it (AutoTokenizer's config classes import torch, seconds
    of CPU in every child)."""
    if generic:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


class IsolatedCompiler:
    """One child process that compiles one constraint at a time (used by one compile thread).

    Contract: ``compile`` (one thread at a time) blocks until the child answered and returns the
    compile's seconds, or raises GrammarError naming the field: it does not compile, it needs more
    than the limits, or it was killed (CompileKilled: nobody waited for it past KILL_GRACE_S). ``kill``
    may be called from any thread and only sends SIGKILL (it never blocks): the compiling thread
    sees the child's end, reaps it and starts the next child at once, so the next compile does not
    wait for a whole interpreter to start. ``close`` kills and reaps it for good."""

    def __init__(self, spec: BackendSpec, memory_mb: int, cpu_s: int):
        self.spec = spec
        self.memory_mb = memory_mb
        self.cpu_s = cpu_s
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._killed: subprocess.Popen | None = None  # the child ``kill`` ended (its compile was dropped)
        self._busy = False  # a compile waits for the child's answer
        self._ready = False  # the current child has built its backend (it said so)
        self._closed = False

    @property
    def pid(self) -> int | None:
        with self._lock:
            return self._process.pid if self._process is not None else None

    def compile(self, kind: str, text: str, abandoned: Callable[[], bool] = lambda: False) -> float:
        """``abandoned()`` (asked every POLL_S) true: nobody waits any more; the child is killed once the
        compile has run KILL_GRACE_S (before it began, the compile is dropped and the child kept)."""
        process, conn = self._started()
        try:
            if not self._ready and not self._await_ready(conn, abandoned):
                raise CompileDropped(kind, "nobody waits for it any more")
            conn.send_bytes(json.dumps([kind, text]).encode())
            t0 = time.monotonic()
            while not conn.poll(POLL_S):
                if time.monotonic() - t0 >= KILL_GRACE_S and abandoned():
                    self.kill()
            reply = json.loads(conn.recv_bytes(MAX_REPLY_BYTES))
        except GrammarError:
            raise
        except (EOFError, OSError, ValueError):  # the child died (a limit, a kill) or answered nonsense
            raise self._ended(kind, process, conn) from None
        finally:
            self._busy = False
        if self._killed is process:  # killed after it answered: reap it now, the next compile starts another
            self._ended(kind, process, conn)
        if "error" in reply:
            raise GrammarError(kind, str(reply["error"])[:MAX_REPLY_BYTES])
        return float(reply["seconds"])

    def _await_ready(self, conn: Connection, abandoned: Callable[[], bool]) -> bool:
        """Wait for a new child's ``{"ready": true}`` (its imports and backend are no compile's time);
        False when nobody waits any more before it came."""
        while not conn.poll(POLL_S):
            if abandoned():
                return False
        json.loads(conn.recv_bytes(MAX_REPLY_BYTES))
        self._ready = True
        return True

    def kill(self) -> None:
        with self._lock:
            if self._process is not None:
                self._killed = self._process
                self._process.kill()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            process, conn = self._process, self._conn
            self._process = self._conn = None
            if process is not None:
                process.kill()
            if conn is not None and not self._busy:  # else the compiling thread closes it
                conn.close()
        if process is not None:
            process.wait(5)  # reaped: no zombie left behind

    def _started(self) -> tuple[subprocess.Popen, Connection]:
        with self._lock:
            if self._closed:
                raise GrammarError("grammar", "the server is shutting down")
            if self._process is None or self._conn is None or self._process.poll() is not None:
                self._process, self._conn = self._spawn()
                self._ready = False
            self._busy = True
            return self._process, self._conn

    def _spawn(self) -> tuple[subprocess.Popen, Connection]:
        """A fresh child (a new interpreter: torch and fork do not mix, and multiprocessing's spawn would
        import the server's main module again), given the backend's spec on a socket it inherits. It
        starts importing at once; a compile sent meanwhile waits in the socket."""
        spec = self.spec.to_json(self.memory_mb, self.cpu_s)  # fails before a spawn
        mine, theirs = socket.socketpair()
        package_root = str(Path(__file__).resolve().parents[2])  # where ``pdserve`` is imported from here
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
        process = subprocess.Popen(
            [sys.executable, "-c", f"from pdserve.constrained.isolation import main; main({theirs.fileno()})"],
            pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL)
        theirs.close()  # only the child holds its end: its death is an EOF here
        conn = Connection(mine.detach())
        conn.send_bytes(spec)
        return process, conn

    def _ended(self, kind: str, process: subprocess.Popen, conn: Connection) -> GrammarError:
        """Reap ``process``, which stopped answering, start the next child, and say why it stopped."""
        try:
            code = process.wait(5)
        except subprocess.TimeoutExpired:  # alive but answering nonsense
            process.kill()
            code = process.wait()
        with self._lock:
            killed, self._killed = self._killed is process, None
            conn.close()
            if self._process is process:
                self._process, self._conn = self._spawn() if not self._closed else (None, None)
                self._ready = False
        if killed:
            return CompileKilled(kind, "its compile was stopped: nobody waits for it any more")
        if code == -signal.SIGXCPU:
            return GrammarError(kind, f"compiling it used more than {self.cpu_s} s of CPU "
                                      f"(--grammar-compile-timeout); simplify it")
        return GrammarError(kind, f"its compile ended the compile worker (exit code {code}); it "
                                  f"may need more than --grammar-compile-memory-mb {self.memory_mb}")


def cpu_seconds(config: GrammarConfig) -> int:
    """The CPU a check may use: as many seconds as the wall-clock limit (whole seconds, RLIMIT_CPU's unit)."""
    return max(1, math.ceil(config.compile_timeout_s))


# ----------------------------------------------------------------- child side
def main(fd: int) -> None:
    """The child's entry point: its spec from the parent on socket ``fd``, then ``serve``."""
    _die_with_parent()
    os.nice(10)  # like the compile threads (its imports too): what CPU the serving processes leave
    conn = Connection(fd)
    spec, memory_mb, cpu_s = BackendSpec.from_json(conn.recv_bytes())
    serve(conn, spec, memory_mb, cpu_s)


def serve(conn: Connection, spec: BackendSpec, memory_mb: int, cpu_s: int) -> None:
    """The child's loop: a request ``[kind, text]`` in, ``{"seconds": s}`` or ``{"error": why}`` out. The
    backend is built before the first request arrives (a replaced child is ready by the next compile)."""
    from pdserve.constrained import create_grammar_backend

    signal.signal(signal.SIGXCPU, signal.SIG_DFL)  # past the CPU limit the kernel ends this process
    try:
        backend = create_grammar_backend(spec.config, spec.tokenizer, spec.vocab_size, list(spec.stop_token_ids))
        broken = ""
    except Exception as e:  # noqa: BLE001 - e.g. the backend's package missing: every request's error
        backend, broken = None, f"cannot be compiled: {short_error(e)}"
    conn.send_bytes(b'{"ready": true}')
    while True:
        try:
            kind, text = json.loads(conn.recv_bytes())
        except (EOFError, OSError):  # the parent closed its end or is gone
            return
        try:
            reply = _compile_limited(backend, kind, text, memory_mb, cpu_s) if backend else {"error": broken}
        except Exception as e:  # noqa: BLE001 - a backend's own failure becomes the request's error
            reply = {"error": f"could not be compiled: {short_error(e)}"}
        conn.send_bytes(json.dumps(reply).encode()[:MAX_REPLY_BYTES])


def _compile_limited(backend: Any, kind: str, text: str, memory_mb: int, cpu_s: int) -> dict:
    _limit(memory_mb, cpu_s)
    t0 = time.perf_counter()
    try:
        compiled = backend.compile(kind, text)
    except MemoryError:
        return {"error": _over_memory(memory_mb)}
    except GrammarError as e:
        return {"error": _over_memory(memory_mb) if "bad_alloc" in e.why else e.why}
    finally:
        _unlimit()
    del compiled  # only whether it compiles is wanted
    return {"seconds": time.perf_counter() - t0}


def _over_memory(memory_mb: int) -> str:
    return f"compiling it needs more than {memory_mb} MiB (--grammar-compile-memory-mb); simplify it"


def _limit(memory_mb: int, cpu_s: int) -> None:
    """Allow ``memory_mb`` more address space and ``cpu_s`` more CPU seconds than used now."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    used_cpu = math.ceil(usage.ru_utime + usage.ru_stime)
    resource.setrlimit(resource.RLIMIT_CPU, (used_cpu + cpu_s, resource.RLIM_INFINITY))
    resource.setrlimit(resource.RLIMIT_AS, (_address_space() + memory_mb * 2**20, resource.RLIM_INFINITY))


def _unlimit() -> None:
    """No address-space limit between compiles (the next one sets its own); the CPU limit stays until then."""
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def _address_space() -> int:
    """This process's address space now, in bytes (VmSize)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmSize in /proc/self/status")


def _die_with_parent() -> None:
    """SIGKILL this process when the thread that started it ends (Linux; best effort elsewhere)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (AttributeError, OSError):
        return
    if os.getppid() == 1:  # the parent was gone before the request to follow it
        os._exit(0)
