"""Input (prompt) log-probabilities: what a request asks for and how the scheduler gathers them.

SGLang's names: ``return_logprob``, ``logprob_start_len``, ``top_logprobs_num``.
The input logprob of prompt position i is log p(prompt[i] | prompt[:i]), read from
the logits at position i - 1; position 0 has none (None). A request gets positions
``[start, prompt_len)``, so ``start + len(input_token_logprobs) == prompt_len``
(SGLang's contract); ``logprob_start_len=-1`` means ``prompt_len - 1``.

Logits exist only for positions the model runs, so a prefix-cache hit must stop
at ``start - 1`` while input logprobs are still wanted; once the prompt has been
prefilled, they are kept (a retracted request re-matches the cache freely).
Logprobs are the log-softmax of the raw logits (before penalties and temperature),
as SGLang and OpenAI report them.

Legend: T tokens in the step, K prompt positions whose logits are wanted, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the HTTP frontend validates logprob params and must not import torch
    import torch

    from pdserve.engine.sampler import TopLogprobs


def resolve_start(logprob_start_len: int, prompt_len: int) -> int:
    """-1 -> prompt_len - 1 (one input logprob, SGLang's default); else unchanged."""
    return prompt_len - 1 if logprob_start_len == -1 else logprob_start_len


def check_logprob_params(prompt_len: int, logprob_start_len, top_logprobs_num, vocab_size: int,
                         start_field: str = "logprob_start_len", top_field: str = "top_logprobs_num") -> None:
    """Raise ValueError starting with the offending field."""
    if not _is_int(logprob_start_len) or not -1 <= logprob_start_len <= prompt_len:
        raise ValueError(f"{start_field}: must be -1 or in [0, prompt length {prompt_len}], "
                         f"got {logprob_start_len!r}")
    if not _is_int(top_logprobs_num) or not 0 <= top_logprobs_num <= vocab_size:
        raise ValueError(f"{top_field}: must be in [0, vocab size {vocab_size}], got {top_logprobs_num!r}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass
class ReqLogprobs:
    """Scheduler-side logprob state of one request (``Req.logprob``).

    ``input_logprobs[j]`` / ``input_top[j]`` belong to prompt position ``start + j``;
    they fill in position order over the prefill chunks and leave with the request's
    first output (``take_input``).
    """

    prompt_len: int
    start: int
    top_k: int = 0
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top: list[TopLogprobs | None] = field(default_factory=list)
    input_sent: bool = False

    @classmethod
    def create(cls, prompt_len: int, logprob_start_len: int, top_logprobs_num: int) -> ReqLogprobs:
        state = cls(prompt_len, resolve_start(logprob_start_len, prompt_len), top_logprobs_num)
        if state.start == 0:  # the first token has no context, hence no logprob
            state.input_logprobs.append(None)
            state.input_top.append(None)
        return state

    @property
    def input_pending(self) -> bool:
        return len(self.input_logprobs) < self.prompt_len - self.start

    def max_prefix_len(self) -> int | None:
        """Longest cache hit that keeps every wanted logit computable (None: no limit)."""
        return max(self.start - 1, 0) if self.input_pending else None

    def logit_positions(self, kv_len: int, n: int) -> range:
        """Positions among ``[kv_len, kv_len + n)`` whose logits give a wanted input logprob."""
        if not self.input_pending:
            return range(0)
        first = max(self.start - 1, 0, kv_len)
        return range(first, min(kv_len + n, self.prompt_len - 1))

    def take_input(self) -> tuple[list, list | None] | None:
        """The input logprobs (and top-k, if asked) once, when complete or at the end."""
        if self.input_sent or self.start >= self.prompt_len:
            return None
        self.input_sent = True
        return self.input_logprobs, (self.input_top if self.top_k else None)


@dataclass
class PromptLogitPlan:
    """Which of a step's T tokens need logits for input logprobs, and whose they are.

    ``index[k]`` is a token index into the step's T tokens, ``owners[k]`` the request
    (its position in the batch) and ``targets[k]`` the prompt token that logit row predicts.
    """

    index: list[int] = field(default_factory=list)  # [K]
    owners: list[int] = field(default_factory=list)  # [K]
    targets: list[int] = field(default_factory=list)  # [K]

    @classmethod
    def build(cls, reqs: list, lens: list[int]) -> PromptLogitPlan:
        """From an extend batch (requests with their ``kv_len`` before the step, chunk lengths)."""
        plan, offset = cls(), 0
        for b, (req, n) in enumerate(zip(reqs, lens)):
            lp = req.logprob
            for p in lp.logit_positions(req.kv_len, n) if lp is not None else ():
                plan.index.append(offset + p - req.kv_len)
                plan.owners.append(b)
                plan.targets.append(req.origin_input_ids[p + 1])
            offset += n
        return plan

    def record(self, reqs: list, logits: torch.Tensor) -> None:
        """Append each request's input logprobs from ``logits`` [K, V] (rows in plan order)."""
        if not self.index:
            return
        from pdserve.engine.sampler import token_logprobs  # torch: scheduler side only

        top_ks = [reqs[b].logprob.top_k for b in self.owners]
        chosen, tops = token_logprobs(logits, self.targets, top_ks)
        for k, b in enumerate(self.owners):
            state = reqs[b].logprob
            state.input_logprobs.append(chosen[k])
            state.input_top.append(tops[k] if tops is not None else [])
