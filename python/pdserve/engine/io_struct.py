"""Typed messages between the frontend and the scheduler (pickled over ZMQ)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.request import SamplingParams


@dataclass
class TokenizedGenerateReq:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool = False


@dataclass
class AbortReq:
    rid: str


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


@dataclass
class BatchTokenOutput:
    outputs: list[TokenOutput] = field(default_factory=list)
