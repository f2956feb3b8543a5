"""The frontend's check of a request's json_schema / regex / ebnf: compiled with the server's
backend (on the compile threads, cached by kind and text) before the request reaches the
scheduler, so a constraint that does not compile, or compiles too slowly, is a 400 naming the
field. A prefill server skips it: prefill never samples, the grammar is decode's alone. Compiles
queue per client (``owner``) and are dropped when the request stops waiting (constrained/service.py).
With ``--grammar-compile-isolation`` (the default) they run in child processes with CPU and memory
limits, killed when the request stops waiting (constrained/isolation.py); the scheduler then
compiles only constraints that passed."""

from __future__ import annotations

import asyncio
from typing import Any

from pdserve.config import GrammarConfig
from pdserve.constrained import GrammarError, create_grammar_backend
from pdserve.constrained.isolation import BackendSpec, IsolatedCompiler, cpu_seconds
from pdserve.constrained.service import CompileBusy, CompileService, timeout_error
from pdserve.constrained.stats import GrammarStats
from pdserve.engine.request import SamplingParams
from pdserve.web.api_key import request_owner
from pdserve.web.errors import RequestError
from pdserve.web.origin import request_peer


def compile_owner() -> str:
    """Whose compile queue a request's grammar joins: its key and X-Client-Token (``request_owner``) and
    the address it came from, so keyless clients are apart too (behind a router they share its address)."""
    return f"{request_owner()}@{request_peer()}"


class GrammarCheck:
    def __init__(self, config: GrammarConfig, tokenizer: Any):
        self.config = config
        self.tokenizer = tokenizer
        self.stats = GrammarStats()
        self._service: CompileService | None = None

    def _compile_service(self, vocab_size: int) -> CompileService:
        if self._service is None:
            eos = getattr(self.tokenizer, "eos_token_id", None)
            stop = [eos] if isinstance(eos, int) else []
            spec = BackendSpec(self.config, self.tokenizer, vocab_size, tuple(stop))
            make_worker = (lambda: IsolatedCompiler(spec, self.config.compile_memory_mb, cpu_seconds(self.config))
                           ) if self.config.compile_isolation else None
            self._service = CompileService(
                lambda: create_grammar_backend(self.config, self.tokenizer, vocab_size, stop), self.config, self.stats,
                make_worker=make_worker)
        return self._service

    async def check(self, sampling: SamplingParams, role: str, vocab_size: int, owner: str = "") -> None:
        """Raise RequestError (400, ``param`` the field) unless ``sampling``'s constraint compiles; 429
        when ``owner`` (the client) already has its most compiles queued (constrained/service.py)."""
        constraint = sampling.grammar
        if constraint is None or role == "prefill":
            return
        kind, text = constraint
        field = f"sampling_params.{kind}"
        if not self.config.enabled:
            raise RequestError(f"{field}: this server runs --grammar-backend none (constrained decoding is off)",
                               param=field)
        if self.tokenizer is None:
            raise RequestError(f"{field}: needs the tokenizer (the server runs --skip-tokenizer-init)", param=field)
        self.stats.count("requests")
        service = self._compile_service(vocab_size)
        try:
            compiled = service.submit(kind, text, owner)
        except CompileBusy as e:
            raise RequestError(str(e), param=field, status=429, code="grammar_compiles_busy") from None
        try:
            # asyncio.wait, not wait_for: a timeout must not cancel the shared compile
            done, _ = await asyncio.wait({asyncio.wrap_future(compiled)}, timeout=self.config.compile_timeout_s)
        finally:  # answered, timed out or cancelled (the client left): this request no longer waits
            service.release(kind, text)
        if not done:
            self.stats.count("timeouts")
            raise RequestError(str(timeout_error(kind, self.config.compile_timeout_s)), param=field)
        try:
            done.pop().result()
        except GrammarError as e:
            raise RequestError(str(e), param=field) from None

    def close(self) -> None:
        if self._service is not None:
            self._service.close()
