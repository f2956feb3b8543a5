"""Speculative decoding (chain drafts, EAGLE topk 1): how a decode step runs, as a strategy the
scheduler picks once (``make_decode_step``), and the accept rules as pure functions.

Per running request with ``n = kv_len`` verified tokens and its last token ``t`` (not in KV):
  1. draft extend: after every target forward over positions p..q (a prompt chunk, or a
     verify's accepted rows) the draft runs over the same positions with the tokens one
     position ahead and the target's hidden states of those rows, writing its KV (the pool's
     extra layer) at their slots; its last row proposes d1.
  2. draft decode: steps 2..k, each on the previous draft token and the draft's own hidden state.
  3. verify: one EXTEND forward of the target over [t, d1..dk] at positions n..n+k; the accept
     rule (greedy: longest prefix matching the target's argmax, then the target's token;
     sampling: speculative sampling) emits 1..k+1 tokens; kv_len advances by what was emitted.
     Rejected rows' KV is simply overwritten later (their pages are the request's already).
Stop conditions apply token by token; tokens after a stop are dropped.

Legend: B requests, T token rows, k draft tokens of one request, V vocabulary, H hidden.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pdserve.engine import policy
from pdserve.engine.model_runner import ScheduledBatch
from pdserve.engine.request import Req, ReqState, SamplingParams, finish_abort, grammar_refused
from pdserve.engine.sampler import _filtered_probs, apply_penalties, token_logprobs
from pdserve.layers.forward_batch import ForwardMode

if TYPE_CHECKING:
    from pdserve.engine.scheduler import Scheduler


# ------------------------------------------------------------------ pure accept rules
def accept_greedy(drafts: list[int], target: list[int]) -> list[int]:
    """Tokens emitted by a greedy verify: ``target`` [k + 1] is the target's choice after
    each prefix [t], [t, d1], ...; drafts are kept while they equal it, then the target's token
    at the first mismatch (or its bonus token after all k)."""
    for i, d in enumerate(drafts):
        if d != target[i]:
            return drafts[:i] + [target[i]]
    return drafts + [target[len(drafts)]]


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from ``probs`` [V] (need not sum to 1) by inverse CDF."""
    cdf = probs.double().cumsum(0)
    u = torch.rand((), generator=generator, dtype=torch.float64)
    return int(torch.searchsorted(cdf, u * cdf[-1]).clamp(max=probs.shape[0] - 1))


def accept_sampled(drafts: list[int], p: torch.Tensor, q: torch.Tensor,
                   generator: torch.Generator | None) -> list[int]:
    """Speculative sampling (Leviathan et al.; Chen et al.): ``p`` [k + 1, V] the target's
    processed distributions after each prefix, ``q`` [k, V] the distributions the drafts were
    drawn from. Draft d_i is kept with probability min(1, p_i(d_i) / q_i(d_i)); the first
    rejected one is replaced by a draw from norm(max(0, p_i - q_i)); all kept: a bonus draw
    from p_k. The emitted tokens are distributed as the target's own samples."""
    out: list[int] = []
    for i, d in enumerate(drafts):
        pd, qd = float(p[i, d]), float(q[i, d])
        u = float(torch.rand((), generator=generator, dtype=torch.float64))
        if qd > 0 and u * qd < pd:
            out.append(d)
            continue
        residual = (p[i] - q[i]).clamp(min=0)
        out.append(_draw(residual if float(residual.sum()) > 0 else p[i], generator))
        return out
    out.append(_draw(p[len(drafts)], generator))
    return out


def processed_probs(logits: torch.Tensor, params: list[SamplingParams], outputs: list[list[int]]) -> torch.Tensor:
    """[N, V] the distribution a row is sampled from (penalties over ``outputs``, temperature,
    top-k, top-p, min-p); a greedy row is one-hot at its argmax."""
    logits = apply_penalties(logits.float(), params, outputs)  # [N, V]
    probs = torch.zeros_like(logits)
    greedy = [i for i, sp in enumerate(params) if sp.is_greedy]
    if greedy:
        g = torch.tensor(greedy)
        probs[g, logits[g].argmax(-1)] = 1.0
    stochastic = [i for i, sp in enumerate(params) if not sp.is_greedy]
    if stochastic:
        idx = torch.tensor(stochastic)
        sorted_probs, order = _filtered_probs(logits[idx], [params[i] for i in stochastic])
        full = torch.zeros_like(sorted_probs).scatter_(1, order, sorted_probs)
        probs[idx] = full / full.sum(-1, keepdim=True)
    return probs


def chained_argmax(logits: torch.Tensor, sp: SamplingParams, output: list[int], drafts: list[int]) -> list[int]:
    """[R] one request's greedy choice for rows that follow ``output`` + the first r drafts
    (penalties see the tokens before each row); no softmax: the greedy path's per-step cost."""
    if not (sp.frequency_penalty or sp.presence_penalty):
        return logits.argmax(-1).tolist()
    rows = list(range(logits.shape[0]))
    return apply_penalties(logits.float(), [sp] * len(rows), [output + drafts[:r] for r in rows]).argmax(-1).tolist()


def chained_probs(logits: torch.Tensor, sp: SamplingParams, output: list[int], drafts: list[int]) -> torch.Tensor:
    """[R, V] one request's processed distributions for rows that follow ``output`` + the first
    r drafts (row r): penalties see the tokens before each row."""
    rows = list(range(logits.shape[0]))
    return processed_probs(logits, [sp] * len(rows), [output + drafts[:r] for r in rows])


# ------------------------------------------------------------------ per-request state
@dataclass
class DraftState:
    """A running request's proposals: ``tokens`` d1..dj so far, ``probs`` [j, V] the processed
    draft distributions they were drawn from, ``hidden`` [H] the draft's last hidden state."""

    tokens: list[int]
    probs: torch.Tensor
    hidden: torch.Tensor


@dataclass
class SpecStats:
    """Per request: verify forwards, draft tokens proposed and accepted (SGLang's meta_info)."""

    verify_ct: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0


# ------------------------------------------------------------------ decode strategies
class DecodeStep:
    """Plain decoding: one token per running request per step."""

    def __init__(self, scheduler: Scheduler):
        self.s = scheduler

    def run(self) -> None:
        self.s._run_decode()

    def after_forward(self, reqs: list[Req], lens: list[int], hidden: torch.Tensor | None) -> None:
        """A target extend over ``reqs`` (``lens`` tokens each, their rows of ``hidden``) has
        run; nothing is sampled yet and the mode has not seen it (a prefill server's layer hook
        still posts this forward's writes)."""

    def after_sample(self, reqs: list[Req], lens: list[int], hidden: torch.Tensor | None) -> None:
        """The same extend's finished prefills have sampled their first token."""

    def stats(self) -> dict:
        return {}


class SpeculativeDecode(DecodeStep):
    """Draft, then verify, every step (module docstring)."""

    def __init__(self, scheduler: Scheduler, num_steps: int):
        super().__init__(scheduler)
        self.k = num_steps
        self.verify_ct = 0
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.emitted_tokens = 0
        self._drafted: set[int] = set()  # requests after_forward drafted this extend (by id)

    def stats(self) -> dict:
        return {"spec_verify_ct": self.verify_ct, "spec_draft_tokens": self.draft_tokens,
                "spec_accepted_tokens": self.accepted_tokens,
                "spec_accept_length": self.emitted_tokens / self.verify_ct if self.verify_ct else 0.0}

    # ---------------------------------------------------------------- draft
    def _draft(self, reqs: list[Req], batch: ScheduledBatch, target_hidden: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [B, V], hidden [B, H]) of each request's last row (tests override this)."""
        return self.s.runner.draft_forward(batch, self.s.kv_manager.req_to_token, target_hidden)

    def _propose(self, reqs: list[Req], logits: torch.Tensor, hidden: torch.Tensor, first: bool) -> None:
        """Each request's next draft token from the draft's logits [B, V], masked by its grammar
        (if any) walked along its drafts so far: drafts stay inside the grammar."""
        if self.s.grammar.live:
            self.s.grammar.apply_along(logits, reqs, [[] if first or r.draft is None else r.draft.tokens
                                                      for r in reqs])
        for i, req in enumerate(reqs):
            st = None if first else req.draft
            drafts = st.tokens if st is not None else []
            if req.sampling.is_greedy:  # the accept rule needs no draft distribution
                tok = chained_argmax(logits[i:i + 1], req.sampling, req.output_ids + drafts, [])[0]
                q = logits[i:i + 1, :0]
            else:
                q = chained_probs(logits[i:i + 1], req.sampling, req.output_ids + drafts, [])  # [1, V]
                tok = _draw(q[0], req.generator or getattr(self.s.sampler, "generator", None))
            if st is None:
                req.draft = DraftState([tok], q, hidden[i])
            else:
                st.tokens.append(tok)
                st.probs = torch.cat([st.probs, q])
                st.hidden = hidden[i]

    def draft_extend(self, reqs: list[Req], starts: list[int], hidden_rows: list[torch.Tensor]) -> None:
        """Draft KV for positions ``starts[b]..kv_len - 1`` of each request (tokens one ahead:
        ``fill_ids[p + 1]``), with the target's hidden states of those rows; proposes d1 for the
        running ones."""
        if not reqs:
            return
        ids: list[int] = []
        pos: list[int] = []
        loc: list[int] = []
        for req, start in zip(reqs, starts):
            ids += _known_tokens(req)[start + 1:req.kv_len + 1]
            pos += range(start, req.kv_len)
            loc += self.s.kv_manager.slots(req, start, req.kv_len)
        lens = [r.kv_len - s for r, s in zip(reqs, starts)]
        batch = ScheduledBatch(ForwardMode.EXTEND, ids, pos, loc, starts, lens, [r.table_row for r in reqs])
        logits, hidden = self._draft(reqs, batch, torch.cat(hidden_rows))
        running = [i for i, r in enumerate(reqs) if r.state is ReqState.RUNNING]
        for r in reqs:
            r.draft = None
        if running:
            idx = torch.tensor(running)
            self._propose([reqs[i] for i in running], logits[idx], hidden[idx], first=True)

    def _extend_chunks(self, reqs: list[Req], lens: list[int], hidden: torch.Tensor | None, which) -> list[Req]:
        """Draft extend over the chunk just run of each live request ``which(req)`` selects;
        returns those requests."""
        if hidden is None:
            raise RuntimeError("speculative decoding: the extend captured no hidden states")
        live, starts, rows = [], [], []
        offset = 0
        for req, n in zip(reqs, lens):
            if not req.finished and which(req):
                live.append(req)
                starts.append(req.kv_len - n)
                rows.append(hidden[offset:offset + n])
            offset += n
        self.draft_extend(live, starts, rows)
        return live

    def after_forward(self, reqs: list[Req], lens: list[int], hidden: torch.Tensor | None) -> None:
        """Every chunk is drafted once: here when its tokens one ahead are all known already
        (intermediate chunks; a disaggregated prefill, whose draft-layer writes go with the
        forward's), else in ``after_sample``, once the prompt's last chunk has its first token."""
        drafted = self._extend_chunks(reqs, lens, hidden, lambda r: len(_known_tokens(r)) > r.kv_len)
        self._drafted = {id(r) for r in drafted}

    def after_sample(self, reqs: list[Req], lens: list[int], hidden: torch.Tensor | None) -> None:
        drafted, self._drafted = self._drafted, set()
        self._extend_chunks(reqs, lens, hidden, lambda r: id(r) not in drafted)

    def _draft_steps(self, reqs: list[Req], k_eff: list[int]) -> None:
        """Draft decode steps 2..k: request b runs while it has fewer than k_eff[b] drafts."""
        for step in range(2, max(k_eff, default=0) + 1):
            sub = [r for r, k in zip(reqs, k_eff) if k >= step and r.draft is not None]
            if not sub:
                return
            pos = [r.kv_len + step - 2 for r in sub]
            loc = [self.s.kv_manager.slots(r, p, p + 1)[0] for r, p in zip(sub, pos)]
            batch = ScheduledBatch(ForwardMode.DECODE, [r.draft.tokens[-1] for r in sub], pos, loc, pos,
                                   [1] * len(sub), [r.table_row for r in sub])
            logits, hidden = self._draft(sub, batch, torch.stack([r.draft.hidden for r in sub]))
            self._propose(sub, logits, hidden, first=False)

    # ---------------------------------------------------------------- verify
    def _ensure_pages(self, k_of) -> bool:
        """Pages for every running request's verify rows (kv_len .. kv_len + k); retracts until
        they fit. False when nothing is left to run."""
        s = self.s
        while s.running:
            ok = all(s.kv_manager.grow(r, r.kv_len + k_of(r) + 1) for r in list(s.running))
            if ok:
                return True
            if len(s.running) == 1:
                s._finish(s.running[0], finish_abort("KV cache exhausted: the request does not fit in the "
                                                     "pool even alone"))
                return False
            s._retract(policy.pick_retraction(s.running))
        return False

    def _k(self, req: Req) -> int:
        """Draft tokens worth verifying: never past max_new_tokens (which also keeps the verify
        rows inside the context length)."""
        if req.draft is None:
            return 0
        return max(0, min(self.k, req.sampling.max_new_tokens - len(req.output_ids) - 1))

    def run(self) -> None:
        s = self.s
        if not self._ensure_pages(self._k):
            return
        reqs = list(s.running)
        k_eff = [self._k(r) for r in reqs]
        for r, k in zip(reqs, k_eff):
            s.kv_manager.write_slots(r, r.kv_len, r.kv_len + k + 1)
        self._draft_steps(reqs, k_eff)
        ids: list[int] = []
        pos: list[int] = []
        loc: list[int] = []
        drafts: list[list[int]] = []
        for r, k in zip(reqs, k_eff):
            d = r.draft.tokens[:k] if r.draft is not None else []
            drafts.append(d)
            ids += [r.fill_ids[-1], *d]
            pos += range(r.kv_len, r.kv_len + k + 1)
            loc += s.kv_manager.slots(r, r.kv_len, r.kv_len + k + 1)
        batch = ScheduledBatch(ForwardMode.EXTEND, ids, pos, loc, [r.kv_len for r in reqs], [k + 1 for k in k_eff],
                               [r.table_row for r in reqs])
        # grammar rows: each row's mask after its prefix of the draft, filled while the target runs
        mask = s.grammar.start_verify_mask(reqs, drafts) if s.grammar.live else None
        with s.threads.step(len(ids)):
            logits, hidden = s.runner.forward_all_rows(batch, s.kv_manager.req_to_token)  # [T, V], [T, H]
        if mask is not None:
            s.grammar.apply(logits, reqs, mask)
        s.forward_steps += 1
        s.new_token_ratio.decay()
        live, starts, rows = [], [], []
        offset = 0
        for r, d in zip(reqs, drafts):
            n = len(d) + 1
            start = r.kv_len
            emitted = self._accept(r, d, logits[offset:offset + n])
            if not r.finished:
                live.append(r)
                starts.append(start)
                rows.append(hidden[offset:offset + emitted])
            offset += n
        self.draft_extend(live, starts, rows)

    def _accept(self, req: Req, drafts: list[int], logits: torch.Tensor) -> int:
        """Verify ``req``'s drafts against its target rows ``logits`` [k + 1, V], append what
        is emitted (token by token, up to a stop) and return how many tokens were appended."""
        s = self.s
        if req.sampling.is_greedy:
            tokens = accept_greedy(drafts, chained_argmax(logits, req.sampling, req.output_ids, drafts))
        else:
            p = chained_probs(logits, req.sampling, req.output_ids, drafts)  # [k + 1, V]
            q = req.draft.probs[:len(drafts)] if req.draft is not None else p[:0]
            tokens = accept_sampled(drafts, p, q, req.generator or getattr(s.sampler, "generator", None))
        accepted = len(tokens) - 1
        stats = req.spec_stats
        stats.verify_ct += 1
        stats.draft_tokens += len(drafts)
        stats.accepted_tokens += accepted
        self.verify_ct += 1
        self.draft_tokens += len(drafts)
        self.accepted_tokens += accepted
        emitted: list[int] = []
        reason = None
        for tok in tokens:
            req.append_output(tok)
            req.kv_len += 1  # the row that produced ``tok`` held a verified token
            emitted.append(tok)
            advanced = s.grammar.advance(req, tok)
            reason = s._check_finish(req, tok) if advanced else grammar_refused(tok)
            if reason is not None:
                break
        self.emitted_tokens += len(emitted)
        lp = top = None
        if req.return_logprob:
            top_k = req.logprob.top_k if req.logprob else 0
            lp, top_all = token_logprobs(logits[:len(emitted)], emitted, [top_k] * len(emitted))
            req.output_logprobs.extend(lp)
            top = top_all if top_k else None
        if reason is not None:
            s._finish(req, reason, emit=False)
        out = s._output(req, emitted, lp, top)
        if len(req.output_ids) == len(emitted):
            out.timeline = req.stage_clock.breakdown()
        s._pending.append(out)
        return len(emitted)


def _known_tokens(req: Req) -> list[int]:
    """Every token of ``req`` known so far by position: prompt (with the last one a
    disaggregated prefill holds back for decode), then output."""
    held = [req.held_back] if req.held_back is not None else []
    return req.origin_input_ids + held + req.output_ids


def make_decode_step(scheduler: Scheduler) -> DecodeStep:
    """The scheduler's decode strategy: speculative when its runner has a draft model."""
    runner = scheduler.runner
    if getattr(runner, "draft", None) is not None:
        return SpeculativeDecode(scheduler, runner.speculative.num_steps)
    return DecodeStep(scheduler)
