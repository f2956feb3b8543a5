"""Several samples of one prompt (``n``, ``best_of``) sharing the prompt's KV.

The prompt runs once first, as a request with no new tokens: its full pages land in
the radix cache (and it computes the prompt's logprobs, if asked), so each sample's
prefill is a cache hit, reported in its ``cached_tokens``, as SGLang does for
parallel sampling. One sample needs no such step.

Every sequence of one API call (each prompt's samples and shared prefill) carries the
call's ``group``, so the scheduler lets calls take turns at admission; the call's
sequences in all are capped by ``--max-seqs-per-request`` (``check_sequences``).

Disaggregated (a router's bootstrap fields on the job), the prompt still runs once: a prefill
server serves the room once, whatever ``n`` (it never samples); on decode the shared prefill is
the one request of the room, so its KV comes from prefill and lands in decode's radix cache, and
the samples then run there as local requests, each a cache hit of that KV, as colocated samples
are of their shared prefill (the same seeds, ``SamplingParams.for_copy``, the same tokens).
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from pdserve.engine.io_struct import BootstrapRef
from pdserve.engine.request import SamplingParams
from pdserve.entrypoints.tokenizer_manager import GenerateChunk, TokenizerManager
from pdserve.web.errors import RequestError
from pdserve.web.streaming import collect, gather_or_cancel


@dataclass
class PromptJob:
    """``count`` samples of ``input_ids``; ``sampling.n`` is ignored (``count`` rules)."""

    input_ids: list[int]
    sampling: SamplingParams
    count: int = 1
    return_logprob: bool = False  # output logprobs of every sample
    input_start: int | None = None  # prompt logprobs from this position on (None: none)
    top_logprobs_num: int = 0
    rid: str | None = None
    bootstrap: BootstrapRef | None = None  # a disaggregated request: the shared prefill's (or the one sample's)
    group: str | None = None  # the API call this prompt belongs to (new_group): admission takes turns by it
    cache_salt: str = ""  # its prefix cache tree (TokenizerManager.cache_salt)

    @property
    def shares_prefill(self) -> bool:
        return self.count > 1

    async def prefill(self, tm: TokenizerManager) -> GenerateChunk:
        """The prompt alone; carries the prompt's logprobs when ``input_start`` is set. Disaggregated,
        it is the room's request: decode receives the prompt's KV for it."""
        sampling = dataclasses.replace(self.sampling.for_copy(0), max_new_tokens=0)
        rid = None if self.rid is None else f"{self.rid}-prefill"
        gen = tm.generate(self.input_ids, sampling, self.input_start is not None, rid, stream=False,
                          logprob_start_len=self._start(True), top_logprobs_num=self.top_logprobs_num,
                          bootstrap=self.bootstrap, group=self.group, cache_salt=self.cache_salt)
        return await final_chunk(gen)

    def generators(self, tm: TokenizerManager, stream: bool) -> list[AsyncGenerator[GenerateChunk, None]]:
        """One generator per sample; after a shared prefill they skip the prompt's logprobs and run
        here, from the KV it left in the radix cache (its room is spent)."""
        with_input = not self.shares_prefill
        want = self.return_logprob or (with_input and self.input_start is not None)
        bootstrap = None if self.shares_prefill else self.bootstrap
        return [tm.generate(self.input_ids, self.sampling.for_copy(j), want, self._rid(j), stream,
                            logprob_start_len=self._start(with_input), top_logprobs_num=self.top_logprobs_num,
                            bootstrap=bootstrap, group=self.group, cache_salt=self.cache_salt)
                for j in range(self.count)]

    def _start(self, with_input: bool) -> int:
        return self.input_start if with_input and self.input_start is not None else len(self.input_ids)

    def _rid(self, j: int) -> str | None:
        if self.rid is None or self.count == 1:
            return self.rid
        return f"{self.rid}-{j}"


def samples_here(role: str, count: int, bootstrap: BootstrapRef | None) -> int:
    """The samples of one prompt this server runs: a prefill server serves a disaggregated prompt
    once, for its room, whatever ``count`` (decode samples every token, so the samples are decode's)."""
    return 1 if role == "prefill" and bootstrap is not None else count


def new_group() -> str:
    """A fresh admission group: one per API call, shared by all of its jobs."""
    return uuid.uuid4().hex


def check_sequences(counts: list[int], cap: int, prompt_field: str, count_field: str) -> None:
    """Refuse (400) a call of more sequences than ``--max-seqs-per-request`` (``cap``): ``counts``
    is each prompt's samples (n, or best_of). Admission takes turns between calls, but within one
    call every sequence still holds a slot, its KV and a share of each step, so a single call of
    500 prompts x n 128 could fill the server for minutes. The error names the prompts when there
    are more of them than the cap alone, else the per-prompt count."""
    total = sum(counts)
    if total <= cap:
        return
    name = prompt_field if len(counts) > cap else count_field
    raise RequestError(f"{name}: the request asks for {total} sequences ({len(counts)} prompt(s), up to "
                       f"{max(counts)} samples each), more than --max-seqs-per-request ({cap}); split it into "
                       f"smaller requests", param=name)


async def final_chunk(gen: AsyncGenerator[GenerateChunk, None]) -> GenerateChunk:
    """The one chunk of a non-streaming request (``generate`` yields it or raises)."""
    chunk = await collect(gen)
    if chunk is None:
        raise RuntimeError("a non-streaming request ended without its final chunk")
    return chunk


async def run_job(tm: TokenizerManager, job: PromptJob) -> list[GenerateChunk]:
    """Every sample's final chunk (non-streaming), each carrying the prompt's logprobs if asked."""
    if not job.shares_prefill:
        return [await final_chunk(job.generators(tm, stream=False)[0])]
    shared = await job.prefill(tm)
    chunks = await gather_or_cancel(*(final_chunk(g) for g in job.generators(tm, stream=False)))
    for c in chunks:
        attach_prompt_logprobs(c, shared)
    return chunks


def attach_prompt_logprobs(chunk: GenerateChunk, shared: GenerateChunk | None) -> None:
    if shared is not None and shared.input_logprobs is not None:
        chunk.input_logprobs, chunk.input_top_logprobs = shared.input_logprobs, shared.input_top_logprobs
