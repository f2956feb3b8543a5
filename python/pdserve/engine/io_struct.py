"""Typed messages between the frontend and the scheduler, over ZMQ through ``engine/codec.py``
(msgpack of the type's name and its fields, decoded strictly into one of ``MESSAGES``; never
pickled). A new message type joins ``MESSAGES``, or no codec will carry it."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.request import SamplingParams


@dataclass(frozen=True)
class BootstrapRef:
    """Where a disaggregated request's other half lives: the prefill server's bootstrap
    registry (``host:port``) and the ``room`` pairing the two halves (set by the router)."""

    host: str
    port: int
    room: int


@dataclass
class TokenizedGenerateReq:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1  # first prompt position with an input logprob (-1: the last)
    top_logprobs_num: int = 0
    bootstrap: BootstrapRef | None = None  # set when a P/D router sent the request
    group: str | None = None  # the API call it belongs to (its other prompts and samples share it)
    cache_salt: str = ""  # its prefix cache tree: requests with different salts share no KV page


@dataclass
class AbortReq:
    """Abort one request (``rid``), or every request the scheduler holds (``abort_all``); or, with
    ``refused``, tell the mode about a disaggregated request the frontend refused before it reached
    the scheduler (``message``: why), whose other half must not wait for it."""

    rid: str
    abort_all: bool = False
    refused: BootstrapRef | None = None
    message: str = ""


@dataclass
class FlushCacheReq:
    pass


@dataclass
class FlushCacheResp:
    success: bool


@dataclass
class GetStatsReq:
    pass


@dataclass
class KVEventsSnapshotReq:
    pass


@dataclass
class KVEventsSnapshotResp:
    snapshot: dict | None  # None: this server publishes no KV events


@dataclass
class StatsResp:
    stats: dict


@dataclass
class RejectedReq:
    """The scheduler refused a request; ``message`` names the field and the reason."""

    rid: str
    message: str


@dataclass
class TokenOutput:
    """New tokens of one request produced by one scheduler step."""

    rid: str
    new_token_ids: list[int]
    new_logprobs: list[float] | None
    finished: bool
    finish_reason: dict | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    # With return_logprob: top-k (logprob, id) per new token, if top_logprobs_num > 0; and once,
    # with the request's first output, the prompt's logprobs from logprob_start_len on.
    new_top_logprobs: list[list[tuple[float, int]]] | None = None
    input_token_logprobs: list[float | None] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None
    # Once, with the first output token: where the scheduler-side time to it went, in seconds
    # (obs.timeline.STAGES: queue, prefill, transfer, decode_scheduling).
    timeline: dict[str, float] | None = None
    # cached_tokens split by tier: {"device": n, "host": n, "storage": n}
    cached_tokens_by_tier: dict[str, int] | None = None
    # A decode server's own prefix-cache hit (Req.decode_cached_tokens); None elsewhere
    decode_cached_tokens: int | None = None
    # Speculative decoding so far (None without it): verify forwards, draft tokens proposed, accepted
    spec_verify_ct: int | None = None
    spec_draft_token_num: int | None = None
    spec_accept_token_num: int | None = None

    def spec_meta(self) -> dict:
        """SGLang's speculative meta_info keys ({} without speculation)."""
        return spec_meta(self.spec_verify_ct, self.spec_draft_token_num, self.spec_accept_token_num)


def spec_meta(verify_ct: int | None, draft_tokens: int | None, accepted: int | None) -> dict:
    """``spec_verify_ct`` (verify forwards), ``spec_accept_length`` (tokens per verify: its
    accepted drafts plus the target's own token, so 1.0 when no draft is ever accepted; counted
    from the verifies, not the completion, because a colocated request's first token comes from
    prefill and a disaggregated decode's from a one-row verify), ``spec_accept_rate`` (accepted /
    proposed draft tokens), ``spec_accept_token_num``, ``spec_draft_token_num``; {} without
    speculation."""
    if verify_ct is None:
        return {}
    emitted = verify_ct + (accepted or 0)
    return {"spec_verify_ct": verify_ct,
            "spec_accept_length": emitted / verify_ct if verify_ct else 0.0,
            "spec_accept_rate": (accepted or 0) / draft_tokens if draft_tokens else 0.0,
            "spec_accept_token_num": accepted or 0, "spec_draft_token_num": draft_tokens or 0}


@dataclass
class BatchTokenOutput:
    outputs: list[TokenOutput] = field(default_factory=list)
    sent_at: float = 0.0  # the sender's time.monotonic() (the frontend's handoff profile, obs/handoff.py)
    sampled_at: float = 0.0  # when the oldest of these tokens was sampled, the same clock (0.0: unknown)


@dataclass
class SchedulerReady:
    """Sent once by a scheduler process when its model and KV pool are ready to serve."""

    pid: int
    context_len: int
    vocab_size: int
    total_pages: int
    page_size: int

    @property
    def max_total_tokens(self) -> int:
        return self.total_pages * self.page_size


@dataclass
class SchedulerFailed:
    """Sent by a scheduler process that is about to exit because of an error."""

    message: str


@dataclass
class ShutdownReq:
    """Ask a scheduler process to leave its loop and exit cleanly."""


@dataclass
class RoleSwitchReq:
    """Switch an idle P/D scheduler to ``target_role`` ("prefill" or "decode")."""

    target_role: str


@dataclass
class RoleSwitchResp:
    """``success``: the scheduler now runs ``role``; otherwise ``message`` says why not (``busy``:
    only because something is still in flight, so the frontend may ask again)."""

    success: bool
    role: str
    message: str = ""
    busy: bool = False


@dataclass
class PrefillLostReq:
    """The router saw these rooms' prefill halves break (their connection failed): decode prefills
    them locally now instead of waiting for KV that never comes."""

    rooms: list[int]
    reason: str


# Every message above; the frontend and scheduler codecs carry these (scheduler_loop.FRONTEND_CODEC).
MESSAGES: tuple[type, ...] = (
    TokenizedGenerateReq, AbortReq, FlushCacheReq, FlushCacheResp, GetStatsReq, KVEventsSnapshotReq,
    KVEventsSnapshotResp, StatsResp, RejectedReq, BatchTokenOutput, SchedulerReady, SchedulerFailed, ShutdownReq,
    RoleSwitchReq, RoleSwitchResp, PrefillLostReq)
