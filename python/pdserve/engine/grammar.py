"""The scheduler's side of constrained decoding (pdserve.constrained does the grammar work).

A request with ``sampling.json_schema`` / ``regex`` / ``ebnf`` is compiled on a compile thread
when it arrives (``submit``) and waits, without holding anyone up, until ``poll`` finds its
compile done: then it holds its own ``Grammar`` (``Req.grammar``). A compile that fails or runs
past ``--grammar-compile-timeout`` fails that request alone (a 400 naming the field, through
``Req.grammar_error``). A server that never samples (a disaggregated prefill) compiles nothing.

Each step the rows of requests holding a grammar get a token bitmask, filled on a mask thread
while the forward pass runs when the batch is known before it (decode, verify), and applied to
the logits before sampling; a batch without grammars does no mask work at all (``live`` is 0).

With several scheduler ranks in lock step (``lockstep``), a compile runs to completion at
``submit``: ranks must admit the same requests in the same step, and a compile thread's timing
is not something ranks agree on.

Reasoning (``sampling.think_end``, set by the API from the reasoning parser): the request's grammar
sits behind a ``ThinkingGrammar`` that lets every token through, unmasked and unaccepted, until the
output's text contains the end-of-thinking marker; from the next token on the grammar constrains.

Jump-forward (``GrammarConfig.jump_forward``): where a grammar allows one continuation only (a
schema's next key, ``": "``), ``jump`` returns that text's tokens, accepted into the grammar, for the
scheduler to append unsampled (the text is tokenized alone: the tokens around its edges are not
merged with the sampled ones, so the token ids differ from a run without it, never the text's
validity).

Legend: B requests (rows), T verify rows, V logits width, W = ceil(V / 32).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pdserve.config import GrammarConfig
from pdserve.constrained import Grammar, GrammarError, create_grammar_backend
from pdserve.constrained import bitmask as bm
from pdserve.constrained.base import MAX_ROLLBACK
from pdserve.constrained.service import CompileService, timeout_error
from pdserve.constrained.stats import GrammarStats

if TYPE_CHECKING:
    from pdserve.engine.request import Req, SamplingParams


@dataclass
class _Pending:
    req: Req
    kind: str
    future: Future
    since: float  # time.monotonic() at submit


@dataclass
class StepMask:
    """One step's bitmask [B, W] for ``rows`` (those with a grammar), maybe still being filled on
    the mask thread (``future``, whose result is the seconds the filling took)."""

    bitmask: torch.Tensor
    rows: list[int]
    future: Future | None
    fill_s: float = 0.0

    def wait(self) -> float:
        """Seconds spent filling (on whichever thread)."""
        if self.future is not None:
            self.fill_s = self.future.result()
            self.future = None
        return self.fill_s


class ReqGrammars:
    """Compiles, holds and applies the grammars of one scheduler's requests (module docstring)."""

    def __init__(self, config: GrammarConfig, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]):
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.stats = GrammarStats()
        self.pending: dict[int, _Pending] = {}  # Req.uid -> its compile
        self.live = 0  # requests holding a Grammar now
        self.lockstep = False
        # Fill decode masks on the mask thread while the forward runs (the scheduler turns it on when
        # the model runs on a GPU); False: after the forward, on this thread. On CPU the forward holds
        # the cores and the hand-off costs more CPU than the fill itself (benchmark/bench_constrained.py).
        self.overlap = False
        self._service: CompileService | None = None
        self._mask_pool: ThreadPoolExecutor | None = None
        self.jumped_tokens = 0  # tokens jump-forward appended

    # ------------------------------------------------------------ compile
    def check(self, sampling: SamplingParams) -> None:
        """Raise GrammarError (ValueError) when this server cannot constrain ``sampling`` at all."""
        constraint = sampling.grammar
        if constraint is None:
            return
        kind = constraint[0]
        if not self.config.enabled:
            raise GrammarError(kind, "this server runs --grammar-backend none (constrained decoding is off)")
        if self.tokenizer is None:
            raise GrammarError(kind, "needs the tokenizer (the server runs --skip-tokenizer-init)")

    @property
    def service(self) -> CompileService:
        if self._service is None:
            self._service = CompileService(self._make_backend, self.config, self.stats)
        return self._service

    def _make_backend(self):
        return create_grammar_backend(self.config, self.tokenizer, self.vocab_size, self.stop_token_ids)

    def submit(self, req: Req) -> None:
        """Start compiling ``req``'s constraint (nothing without one)."""
        constraint = req.sampling.grammar
        if constraint is None or req.sampling.max_new_tokens == 0:  # nothing will be sampled
            return
        self.stats.count("requests")
        kind, text = constraint
        future = self.service.submit(kind, text)
        if self.lockstep:
            try:
                self._hold(req, future.result())
            except GrammarError as e:
                req.grammar_error = str(e)
            return
        self.pending[req.engine_uid] = _Pending(req, kind, future, time.monotonic())

    def waiting_for(self, req: Req) -> bool:
        """``req``'s grammar is still compiling: it may not sample yet."""
        return bool(self.pending) and req.uid in self.pending

    def poll(self) -> list[Req]:
        """Give each request whose compile finished its Grammar; returns the requests whose
        compile failed or timed out (``grammar_error`` set), for the caller to finish."""
        if not self.pending:
            return []
        failed = []
        now = time.monotonic()
        for uid, p in list(self.pending.items()):
            if p.future.done():
                del self.pending[uid]
                try:
                    self._hold(p.req, p.future.result())
                except GrammarError as e:
                    p.req.grammar_error = str(e)
                    failed.append(p.req)
            elif now - p.since > self.config.compile_timeout_s:
                del self.pending[uid]
                self._release_compile(p.req)
                self.stats.count("timeouts")
                p.req.grammar_error = str(timeout_error(p.kind, self.config.compile_timeout_s))
                failed.append(p.req)
        return failed

    def _hold(self, req: Req, compiled: Any) -> None:
        grammar = self.service.backend().matcher(compiled)
        if req.sampling.think_end is not None:
            grammar = ThinkingGrammar(grammar, req.sampling.think_end, self.tokenizer.decode)
        req.grammar = grammar
        self.live += 1

    def wait(self, timeout: float) -> None:
        """Block up to ``timeout`` for any pending compile (the scheduler has nothing else to run)."""
        if self.pending:
            wait_futures([p.future for p in self.pending.values()], timeout, return_when="FIRST_COMPLETED")

    def release(self, req: Req) -> None:
        """``req`` finished: forget its compile (dropped unless someone else waits for it) or its Grammar."""
        if self.pending.pop(req.uid, None) is not None:  # type: ignore[arg-type]
            self._release_compile(req)
        if req.grammar is not None:
            req.grammar = None
            self.live -= 1

    def _release_compile(self, req: Req) -> None:
        """``req`` no longer waits for its compile (constrained/service.py drops one nobody waits for)."""
        if req.sampling.grammar is not None:
            self.service.release(*req.sampling.grammar)

    # -------------------------------------------------------------- masks
    def start_mask(self, reqs: Sequence[Req]) -> StepMask | None:
        """Start filling the next token's mask of ``reqs`` on the mask thread (None: no grammar)."""
        if not self.overlap:
            return None
        rows = self._rows(reqs)
        if not rows:
            return None
        mask = bm.allocate(len(reqs), self.vocab_size)
        fill = self.service.backend().fill_bitmasks
        return StepMask(mask, rows, self._mask_thread().submit(_timed, fill, _grammars(reqs, rows), mask))

    def start_verify_mask(self, reqs: Sequence[Req], drafts: Sequence[list[int]]) -> StepMask | None:
        """Speculative verify: request b's rows follow its output, then d1, d1 d2, ... (its
        ``drafts[b]``); each row's mask is its grammar's after that prefix (walked, then rolled back)."""
        if not any(r.grammar is not None for r in reqs):
            return None
        mask = bm.allocate(sum(len(d) + 1 for d in drafts), self.vocab_size)
        rows: list[int] = []
        walks = []
        offset = 0
        for r, d in zip(reqs, drafts):
            if r.grammar is not None:
                rows += range(offset, offset + len(d) + 1)
                walks.append(_Walk(r.grammar, offset, d, every_prefix=True))
            offset += len(d) + 1
        return StepMask(mask, rows, self._mask_thread().submit(_timed, _fill_walks, walks, mask))

    def apply(self, logits: torch.Tensor, reqs: Sequence[Req], mask: StepMask | None = None) -> None:
        """Mask ``logits`` [B, V] in place: -inf where a request's grammar disallows the token
        (``mask``: started earlier for the same rows; else filled now)."""
        if mask is None:
            mask = self._fill_now(reqs)
            if mask is None:
                return
        fill_s = mask.wait()
        t0 = time.perf_counter()
        bm.apply_bitmask_(logits, mask.bitmask, mask.rows)
        self.stats.observe_mask(fill_s + time.perf_counter() - t0)

    def apply_along(self, logits: torch.Tensor, reqs: Sequence[Req], drafts: Sequence[list[int]]) -> None:
        """Draft proposal: row b of ``logits`` [B, V] follows request b's output then ``drafts[b]``."""
        t0 = time.perf_counter()
        mask = bm.allocate(len(reqs), self.vocab_size)
        walks = [_Walk(r.grammar, i, d, every_prefix=False)
                 for i, (r, d) in enumerate(zip(reqs, drafts)) if r.grammar is not None]
        if not walks:
            return
        _fill_walks(walks, mask)
        bm.apply_bitmask_(logits, mask, [w.row for w in walks])
        self.stats.observe_mask(time.perf_counter() - t0)

    @staticmethod
    def _rows(reqs: Sequence[Req]) -> list[int]:
        """The batch rows whose request's grammar constrains its next token (the rows a mask covers)."""
        return [i for i, r in enumerate(reqs) if r.grammar is not None and not _thinking(r.grammar)]

    def _fill_now(self, reqs: Sequence[Req]) -> StepMask | None:
        rows = self._rows(reqs)
        if not rows:
            return None
        mask = bm.allocate(len(reqs), self.vocab_size)
        fill_s = _timed(self.service.backend().fill_bitmasks, _grammars(reqs, rows), mask)
        return StepMask(mask, rows, None, fill_s)

    def _mask_thread(self) -> ThreadPoolExecutor:
        if self._mask_pool is None:
            self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="pdserve-grammar-mask")
        return self._mask_pool

    # ------------------------------------------------------------ advance
    def advance(self, req: Req, token: int) -> bool:
        """``req`` emitted ``token``: its grammar moves past it (False: the grammar refuses it)."""
        grammar = req.grammar
        return grammar is None or grammar.accept_token(token)

    def advance_all(self, reqs: Sequence[Req], tokens: Sequence[int]) -> list[bool]:
        """``advance`` of each request by its token (one batched call into the backend)."""
        out = [True] * len(reqs)
        rows = self._rows(reqs)  # before the thinking parts move: the token that ends one is not the grammar's
        for i, r in enumerate(reqs):  # a thinking part takes any token (and may end with it)
            if r.grammar is not None and _thinking(r.grammar):
                r.grammar.accept_token(tokens[i])
        if rows:
            accepted = self.service.backend().accept_each([g for _, g in _grammars(reqs, rows)],
                                                          [tokens[i] for i in rows])
            for i, ok in zip(rows, accepted):
                out[i] = ok
        return out

    @staticmethod
    def terminated(req: Req) -> bool:
        return req.grammar is not None and req.grammar.is_terminated()

    def jump(self, req: Req, room: int) -> list[int]:
        """Jump-forward (module docstring): the tokens, at most ``room``, of the text ``req``'s grammar
        allows as its only continuation, already accepted into it; [] when there is a choice."""
        grammar = req.grammar
        if not self.config.jump_forward or grammar is None or room <= 0:
            return []
        text = grammar.jump_forward_string()
        if not text:
            return []
        tokens = self.tokenizer.encode(text, add_special_tokens=False)[:room]
        # a tokenizer that adds a prefix space (SentencePiece) makes tokens the grammar refuses: keep
        # the accepted ones (none at worst: the model samples as without jump-forward)
        tokens = tokens[:grammar.accept_tokens(tokens)]
        self.jumped_tokens += len(tokens)
        return tokens

    def stats_dict(self) -> dict:
        return {"grammar": {**self.stats.to_dict(), "jump_forward_tokens": self.jumped_tokens},
                "num_grammar_queue_reqs": len(self.pending)}

    def close(self) -> None:
        if self._service is not None:
            self._service.close()
        if self._mask_pool is not None:
            self._mask_pool.shutdown(wait=False, cancel_futures=True)


def _timed(fill, *args) -> float:
    t0 = time.perf_counter()
    fill(*args)
    return time.perf_counter() - t0


def _grammars(reqs: Sequence[Req], rows: list[int]) -> list[tuple[int, Grammar]]:
    """The backend's own grammar of each row (past its thinking part: a batched backend call takes
    only its own kind)."""
    out = []
    for i in rows:
        grammar = reqs[i].grammar
        assert grammar is not None, reqs[i]
        out.append((i, grammar.inner if isinstance(grammar, ThinkingGrammar) else grammar))
    return out


def _thinking(grammar: Grammar) -> bool:
    return isinstance(grammar, ThinkingGrammar) and grammar.thinking


class ThinkingGrammar(Grammar):
    """``inner`` behind a thinking part that ends with the text ``end``: while thinking, every token
    is allowed and ``inner`` does not move; the token whose text completes ``end`` is the last one
    thinking, and the grammar constrains from the next (text that same token carries past ``end`` is
    outside the grammar: models put a newline there, which the reasoning parser strips).

    The end is looked for in the text of the last few tokens (``decode``), enough to hold ``end``
    however it is split: every token of an occurrence carries at least one of its bytes. Rollback
    (speculative walks) undoes thinking tokens too, up to ``MAX_ROLLBACK``."""

    def __init__(self, inner: Grammar, end: str, decode: Any):
        self.inner = inner
        self.end = end
        self.decode = decode
        self.window = len(end.encode()) + 1
        self.thinking = True
        self.tail: list[int] = []  # the last ``window`` tokens while thinking
        self.history: list[list[int] | None] = []  # per accepted token: the tail before it, None: inner took it

    def accept_token(self, token: int) -> bool:
        if not self.thinking:
            if not self.inner.accept_token(token):
                return False
            self._remember(None)
            return True
        self._remember(self.tail)
        self.tail = (self.tail + [token])[-self.window:]
        self.thinking = self.end not in self.decode(self.tail)
        return True

    def _remember(self, tail: list[int] | None) -> None:
        self.history.append(tail)
        if len(self.history) > MAX_ROLLBACK:
            del self.history[0]

    def rollback(self, num_tokens: int) -> None:
        if not num_tokens:
            return
        undone = self.history[-num_tokens:]
        del self.history[-num_tokens:]
        self.inner.rollback(sum(t is None for t in undone))
        first_thinking = next((t for t in undone if t is not None), None)
        if first_thinking is not None:
            self.thinking, self.tail = True, first_thinking

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.thinking:
            bitmask[row].fill_(-1)  # all bits: every token
        else:
            self.inner.fill_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return not self.thinking and self.inner.is_terminated()

    def jump_forward_string(self) -> str:
        return "" if self.thinking else self.inner.jump_forward_string()

    def copy(self) -> Grammar:
        twin = ThinkingGrammar(self.inner.copy(), self.end, self.decode)
        twin.thinking, twin.tail, twin.history = self.thinking, list(self.tail), list(self.history)
        return twin


@dataclass
class _Walk:
    """A grammar walked along ``tokens`` from its state: ``every_prefix``: rows ``row`` ..
    ``row + len(tokens)`` get the mask after each prefix (verify); else ``row`` gets the mask
    after all of them (the next draft)."""

    grammar: Grammar
    row: int
    tokens: list[int]
    every_prefix: bool


def _fill_walks(walks: list[_Walk], mask: torch.Tensor) -> None:
    """Fill each walk's rows, then roll its grammar back to where it was. Rows past a token the
    grammar refuses stay all-allowed: no accept rule reaches them (that token is masked in the
    row before)."""
    for w in walks:
        accepted = 0
        if w.every_prefix:
            _fill_row(w.grammar, mask, w.row)
        for j, tok in enumerate(w.tokens):
            if not w.grammar.accept_token(tok):
                break
            accepted += 1
            if w.every_prefix:
                _fill_row(w.grammar, mask, w.row + j + 1)
        if not w.every_prefix and accepted == len(w.tokens):
            _fill_row(w.grammar, mask, w.row)
        w.grammar.rollback(accepted)


def _fill_row(grammar: Grammar, mask: torch.Tensor, row: int) -> None:
    if not grammar.is_terminated():  # after the end nothing follows: the row is never sampled
        grammar.fill_bitmask(mask, row)
