"""Sampling parameters and the request state machine."""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from pdserve.constrained.limits import check_constraint

if TYPE_CHECKING:
    import torch

    from pdserve.constrained.base import Grammar
    from pdserve.engine.io_struct import BootstrapRef
    from pdserve.engine.logprobs import ReqLogprobs
    from pdserve.engine.stop import StopStringMatcher
    from pdserve.mem.radix_cache import RadixNode
    from pdserve.obs.timeline import StageClock

# torch.Generator.manual_seed's range; OpenAI clients send any 64-bit integer.
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1
INT64_MAX = (1 << 63) - 1  # integer fields travel to the scheduler as 64-bit integers
MAX_N = 128  # parallel samples of one prompt (n, best_of)
# Constrained decoding (SGLang's fields): at most one per request. The bound keeps a hostile
# document from tying up a compile worker; a real schema of hundreds of fields is a few KiB.
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf")
MAX_GRAMMAR_CHARS = 256 << 10
# Every stop string is looked for after every token, by the scheduler and by the frontend's stream;
# OpenAI takes 4, these bounds leave room for templates' own stops and keep that work small.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


@dataclass
class SamplingParams:
    """SGLang-named sampling fields. ``validate`` raises ValueError naming the bad field."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_k: int = -1  # -1: whole vocabulary
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    n: int = 1
    # Constrained decoding: a JSON-schema document (as a JSON string), a regular expression, or an
    # EBNF grammar (the backend's dialect: GBNF for xgrammar, Lark for llguidance). At most one.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    # The output starts in a thinking part that ends with this text (the reasoning parser's marker,
    # e.g. "</think>"): the grammar above constrains only what follows it (SGLang's reasoner grammar).
    think_end: str | None = None

    @classmethod
    def from_dict(cls, d: dict | None) -> SamplingParams:
        d = dict(d or {})
        known = _SAMPLING_FIELD_NAMES
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"sampling_params.{unknown[0]}: unknown field (known: {', '.join(sorted(known))})")
        if isinstance(d.get("stop"), str):
            d["stop"] = [d["stop"]]
        if d.get("stop") is None:
            d.pop("stop", None)
        if d.get("stop_token_ids") is None:
            d.pop("stop_token_ids", None)
        if d.get("max_new_tokens") is None:
            d.pop("max_new_tokens", None)
        return cls(**d)

    def validate(self, vocab_size: int | None = None) -> SamplingParams:
        def bad(name, why):
            raise ValueError(f"sampling_params.{name}: {why}, got {getattr(self, name)!r}")

        def is_int(x):
            return isinstance(x, int) and not isinstance(x, bool)

        def is_num(x):
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        if not is_int(self.max_new_tokens) or self.max_new_tokens < 0:
            bad("max_new_tokens", "must be an integer >= 0")
        if not is_num(self.temperature) or self.temperature < 0:
            bad("temperature", "must be a number >= 0")
        if not is_int(self.top_k) or (self.top_k < 1 and self.top_k != -1) or self.top_k > INT64_MAX:
            bad("top_k", f"must be -1 (disabled) or an integer in [1, {INT64_MAX}] (any k >= the vocabulary: all)")
        if not is_num(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not is_num(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if self.seed is not None and (not is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            bad("seed", f"must be an integer in [{SEED_MIN}, {SEED_MAX}] (64 bits)")
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be a boolean")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a non-empty string or a list of non-empty strings")
        self._validate_stop()
        if not isinstance(self.stop_token_ids, list) or not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of token ids >= 0")
        if vocab_size is not None and any(t >= vocab_size for t in self.stop_token_ids):
            bad("stop_token_ids", f"ids must be < vocab size {vocab_size}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not is_num(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                bad(name, "must be in [-2, 2]")
        if not is_int(self.n) or not 1 <= self.n <= MAX_N:
            bad("n", f"must be an integer in [1, {MAX_N}]")
        self._validate_grammar(bad)
        return self

    def _validate_stop(self) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"sampling_params.stop: {len(self.stop)} stop strings, at most {MAX_STOP_STRINGS}")
        longest = max(map(len, self.stop), default=0)
        if longest > MAX_STOP_CHARS:
            raise ValueError(f"sampling_params.stop: a stop string of {longest} characters, at most {MAX_STOP_CHARS}")

    def _validate_grammar(self, bad) -> None:
        for name in GRAMMAR_FIELDS:
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, str) or not value.strip():
                bad(name, "must be a non-empty string" + (" (a JSON-schema document as a JSON string)"
                                                          if name == "json_schema" else ""))
            if len(value) > MAX_GRAMMAR_CHARS:
                raise ValueError(f"sampling_params.{name}: too large ({len(value)} characters, at most "
                                 f"{MAX_GRAMMAR_CHARS})")
            try:  # depth, counts and repetitions, before anything parses it (constrained/limits.py)
                check_constraint(name, value)
            except ValueError as e:
                raise ValueError(f"sampling_params.{e}") from None
        if self.think_end is not None and (not isinstance(self.think_end, str) or not 0 < len(self.think_end) <= 64):
            bad("think_end", "must be a non-empty string of at most 64 characters")
        set_fields = [name for name in GRAMMAR_FIELDS if getattr(self, name) is not None]
        if len(set_fields) > 1:
            raise ValueError(f"sampling_params.{set_fields[1]}: at most one of json_schema, regex, ebnf may be "
                             f"set, got {' and '.join(set_fields)}")

    @property
    def grammar(self) -> tuple[str, str] | None:
        """The constraint as (kind, text), kind one of GRAMMAR_FIELDS; None when unconstrained."""
        for name in GRAMMAR_FIELDS:
            value = getattr(self, name)
            if value is not None:
                return name, value
        return None

    def for_copy(self, index: int) -> SamplingParams:
        """The params of parallel sample ``index`` of ``n``: one sequence, and with a seed, a
        distinct one per copy (so seeded copies differ, and a request stays reproducible)."""
        seed = self.seed
        if seed is not None:
            seed += index
            if seed > SEED_MAX:  # wrap around, staying in the valid range
                seed -= 1 << 64
        return dataclasses.replace(self, n=1, seed=seed)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


# read once: ``from_dict`` runs for every request
_SAMPLING_FIELD_NAMES = frozenset(f.name for f in fields(SamplingParams))


@dataclass(frozen=True)
class RequestLimits:
    """What every request is checked against, by the frontend early and the scheduler again."""

    context_len: int
    vocab_size: int
    max_total_tokens: int  # KV pool capacity in tokens


def token_ids_in_range(ids: list[int], vocab_size: int) -> bool:
    """Whether every id is an int (not a bool) in ``[0, vocab_size)``. Every request's prompt passes
    here, in the frontend and again in the scheduler: a prompt of plain ints (what JSON parsing and
    the tokenizer give) is checked by C loops (``map``, ``min``, ``max``), about half a per-id Python
    loop's time (~7 against ~15 us for 160 ids); anything else (an int subclass, a non-int) takes the
    per-id loop."""
    if set(map(type, ids)) <= {int}:
        return not ids or (min(ids) >= 0 and max(ids) < vocab_size)
    return all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids)


def check_request(input_ids: list[int], max_new_tokens: int, limits: RequestLimits,
                  prompt_field: str = "input_ids", max_tokens_field: str = "max_new_tokens") -> None:
    """Raise ValueError starting with the offending field if the request can never be served."""
    if not input_ids:
        raise ValueError(f"{prompt_field}: the prompt is empty")
    if not token_ids_in_range(input_ids, limits.vocab_size):
        raise ValueError(f"{prompt_field}: token ids must be integers in [0, {limits.vocab_size})")
    if len(input_ids) >= limits.context_len:
        raise ValueError(f"{prompt_field}: prompt ({len(input_ids)} tokens) leaves no room in the context "
                         f"length ({limits.context_len})")
    if len(input_ids) + max_new_tokens > limits.context_len:
        raise ValueError(f"{max_tokens_field}: prompt ({len(input_ids)} tokens) + {max_tokens_field} "
                         f"({max_new_tokens}) exceeds the context length ({limits.context_len})")
    if len(input_ids) + 1 > limits.max_total_tokens:
        raise ValueError(f"{prompt_field}: prompt ({len(input_ids)} tokens) does not fit the KV cache "
                         f"({limits.max_total_tokens} tokens)")
    # Alone in the pool a request holds KV for every token but its last output at most.
    if len(input_ids) + max_new_tokens - 1 > limits.max_total_tokens:
        raise ValueError(f"{max_tokens_field}: prompt ({len(input_ids)} tokens) + {max_tokens_field} "
                         f"({max_new_tokens}) needs more KV than the whole cache holds "
                         f"({limits.max_total_tokens} tokens)")


def check_scheduler_request(input_ids: list[int], sampling: SamplingParams, limits: RequestLimits) -> None:
    """What a scheduler (or the Engine's client of its ranks) checks before queueing a request:
    the sampling values, one sequence per request, and ``check_request``."""
    sampling.validate(limits.vocab_size)
    if sampling.n != 1:
        raise ValueError("sampling_params.n: the scheduler runs one sequence per request; "
                         "submit n requests (the frontends do)")
    check_request(input_ids, sampling.max_new_tokens, limits, max_tokens_field="sampling_params.max_new_tokens")


class ReqState(enum.Enum):
    WAITING = "waiting"  # queued for prefill (new, or retracted and re-queued)
    WAITING_FOR_KV = "waiting_for_kv"  # disaggregated decode: pages reserved, KV in flight
    PREFILLING = "prefilling"  # admitted; some chunks of its prefill still to run
    RUNNING = "running"  # in the decode set
    TRANSFERRING = "transferring"  # disaggregated prefill: prompt done, KV writes draining
    FINISHED = "finished"


def finish_stop(matched: Any) -> dict:
    return {"type": "stop", "matched": matched}


def finish_length(length: int) -> dict:
    return {"type": "length", "length": length}


def finish_abort(message: str) -> dict:
    return {"type": "abort", "message": message}


def grammar_refused(token: int) -> dict:
    """A sampled token the request's grammar does not allow (a masking bug, never the client's)."""
    return finish_abort(f"constrained decoding: the grammar refused sampled token {token}")


class Req:
    """One generation request and the KV memory it holds.

    Memory invariants (checked by ``check``):
    - ``pages[:num_cached_pages]`` belong to the radix cache and are locked via
      ``cache_node``; the rest belong to this request and are freed, cached or
      quarantined exactly once, by ``mem.cache_manager.KVCacheManager`` (which
      alone sets these fields).
    - ``0 <= cached_len <= kv_len <= len(fill_ids)``; tokens ``[0, kv_len)`` have
      KV in the pool; ``len(pages) * page_size >= kv_len``.
    - RUNNING: ``kv_len == len(fill_ids) - 1`` (the last token is fed next step).
    """

    def __init__(self, rid: str, input_ids: list[int], sampling: SamplingParams,
                 return_logprob: bool = False, arrival: int = 0, uid: int | None = None, group: str | None = None,
                 cache_salt: str = ""):
        if not input_ids:
            raise ValueError("input_ids: the prompt is empty")
        self.rid = rid  # chosen by the client: may be reused once this request has finished
        # Identity unique for the life of the scheduler that assigned it (Scheduler.add_request);
        # what the engine keys per-request state on, since a client can reuse a ``rid``.
        self.uid = uid
        # The API call this sequence belongs to (its other prompts and samples share it): admission
        # lets groups take turns (policy.order_waiting). None: a group of its own.
        self.group = group
        # the prefix tree it matches and fills: requests with different salts share no KV page
        self.cache_salt = cache_salt
        self.origin_input_ids = list(input_ids)
        self.sampling = sampling
        self.return_logprob = return_logprob
        self.arrival = arrival
        self.output_ids: list[int] = []
        # prompt + output, grown in place by append_output (read every step; never re-concatenated)
        self.fill_ids: list[int] = list(input_ids)
        self.stop_matcher: StopStringMatcher | None = None  # set when stop strings can be checked
        self.output_logprobs: list[float] = []
        self.state = ReqState.WAITING
        self.finish_reason: dict | None = None
        # memory
        self.pages: list[int] = []
        self.num_cached_pages = 0
        self.cache_node: RadixNode | None = None
        self.row: int | None = None
        self.kv_len = 0
        self.cached_len = 0  # prefix tokens served from the radix cache at admission
        self.cached_tokens_reported = 0  # first admission's hit, reported in meta_info
        # cached_len split by the tier each token's KV came from (set with cached_len), and the
        # first admission's split, reported in meta_info beside cached_tokens
        self.cached_by_tier: dict[str, int] = {}
        self.cached_by_tier_reported: dict[str, int] | None = None
        # On a decode server: its own prefix-cache hit (prompt tokens it did not ask prefill for),
        # reported in meta_info beside prefill's cached_tokens; None elsewhere
        self.decode_cached_tokens: int | None = None
        self.num_retractions = 0
        self.generator: torch.Generator | None = None  # torch.Generator for seeded sampling, created by the scheduler
        self.logprob: ReqLogprobs | None = None  # input logprob state, set by the scheduler if asked
        self.clock: StageClock | None = None  # set by the scheduler: the TTFT breakdown
        # speculative decoding (engine/speculative.py): proposals and per-request figures
        self.draft: Any = None  # DraftState while running with speculation
        self.held_back: int | None = None  # disaggregated prefill: the last prompt token, decode's to run
        self.spec_stats: Any = None  # SpecStats when the server speculates
        self.room: int | None = None  # disaggregation: the bootstrap room pairing its two halves
        self.bootstrap: BootstrapRef | None = None  # disaggregation: the prefill half's address (decode)
        # constrained decoding (engine/grammar.py): its matcher once compiled; why the compile failed
        self.grammar: Grammar | None = None
        self.grammar_error: str | None = None

    def append_output(self, token: int) -> None:
        """The only way a token joins the output (keeps ``fill_ids`` == prompt + output)."""
        self.output_ids.append(token)
        self.fill_ids.append(token)

    def hold_back_last_token(self) -> None:
        """Disaggregated prefill: decode's first step feeds the last prompt token, so this request
        prefills only the rest (and its prompt, as the engine sees it, is one token shorter)."""
        assert not self.output_ids and self.prompt_len > 1 and self.kv_len == 0, self
        self.held_back = self.origin_input_ids[-1]
        self.origin_input_ids.pop()
        self.fill_ids.pop()

    @property
    def prompt_len(self) -> int:
        return len(self.origin_input_ids)

    # The late fields below are set by one component before the others read them; these accessors
    # say which, so a broken invariant fails with the request's name instead of an AttributeError.
    @property
    def engine_uid(self) -> int:
        """The scheduler-assigned identity; set by ``Scheduler.add_request``."""
        if self.uid is None:
            raise RuntimeError(f"{self!r} has no uid (not queued by a scheduler)")
        return self.uid

    @property
    def table_row(self) -> int:
        """The page-table row; set by ``KVCacheManager.admit`` and held until the request's memory is released."""
        if self.row is None:
            raise RuntimeError(f"{self!r} holds no page-table row (not admitted, or already released)")
        return self.row

    @property
    def bootstrap_room(self) -> int:
        """The disaggregation room; set by the scheduler for every request of a prefill or decode server."""
        if self.room is None:
            raise RuntimeError(f"{self!r} has no bootstrap room (not a disaggregated request)")
        return self.room

    @property
    def bootstrap_ref(self) -> BootstrapRef:
        """The prefill half's address; set on every request a decode server accepts."""
        if self.bootstrap is None:
            raise RuntimeError(f"{self!r} has no bootstrap address (not a disaggregated decode request)")
        return self.bootstrap

    @property
    def stage_clock(self) -> StageClock:
        """The TTFT breakdown; set by ``Scheduler.add_request`` on every request it queues."""
        if self.clock is None:
            raise RuntimeError(f"{self!r} has no stage clock (not queued by a scheduler)")
        return self.clock

    @property
    def finished(self) -> bool:
        return self.state is ReqState.FINISHED

    def check(self, page_size: int) -> None:
        assert len(self.fill_ids) == self.prompt_len + len(self.output_ids), (self.rid, len(self.fill_ids))
        assert 0 <= self.cached_len <= self.kv_len <= len(self.fill_ids), (self.rid, self.cached_len, self.kv_len)
        assert len(self.pages) * page_size >= self.kv_len, (self.rid, len(self.pages), self.kv_len)
        assert self.num_cached_pages <= len(self.pages)
        if self.state is ReqState.RUNNING:
            assert self.kv_len == len(self.fill_ids) - 1, (self.rid, self.kv_len, len(self.fill_ids))

    def __repr__(self) -> str:
        return (f"Req({self.rid}, {self.state.value}, prompt={self.prompt_len}, "
                f"out={len(self.output_ids)}, kv={self.kv_len})")
