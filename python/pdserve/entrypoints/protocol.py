"""HTTP request bodies (pydantic, strict JSON types: a wrong type is a 400, never coerced).

Unknown fields are ignored, as OpenAI-compatible servers do; known fields are
type-checked here and range-checked by ``SamplingParams.validate``.

The routes read the raw body themselves (so a 413 comes before parsing and a bad field is a
400 in OpenAI's error shape, see ``errors.parse_body``); ``OPENAPI_BODIES`` names the model
each route documents in ``/openapi.json``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from pdserve.engine.io_struct import BootstrapRef
from pdserve.engine.request import MAX_GRAMMAR_CHARS, MAX_N, MAX_STOP_CHARS, MAX_STOP_STRINGS, SEED_MAX, SEED_MIN
from pdserve.web.errors import RequestError


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


MAX_CACHE_SALT_CHARS = 1024
# vLLM's ``cache_salt``: requests share cached prefix pages only with requests of the same salt
_CacheSalt = Annotated[str | None, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)]


class _Bootstrap(_Body):
    """What a P/D router adds (sglang-router's names): the prefill server's bootstrap registry
    and the room pairing the request's prefill and decode halves; lists for a batch."""

    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int | None] | None = None
    bootstrap_room: int | list[int] | None = None
    # the router's MAC over the three (disagg/routed.py); decode acts on unsigned ones only when allowed
    bootstrap_signature: str | None = Field(None, max_length=1000)

    def bootstraps(self, n: int, default_port: int, samples: int = 1) -> list[BootstrapRef | None]:
        """One BootstrapRef per prompt (None for all when the request was not routed). sglang-router
        gives the ``samples`` (``n``) of a single prompt a room each; pdserve prefills the prompt
        once (``parallel_sampling``), so the first room pairs it and the others are never opened:
        both servers read the body alike."""
        if self.bootstrap_room is None and self.bootstrap_host is None:
            return [None] * n
        if n > 1 and not isinstance(self.bootstrap_room, list):
            # One room would pair every prompt of the batch with the same prefill half.
            raise RequestError(f"bootstrap_room: a batch of {n} prompts needs a list of {n} rooms, one per prompt",
                               param="bootstrap_room")
        if isinstance(self.bootstrap_room, list) and len(set(self.bootstrap_room)) != len(self.bootstrap_room):
            raise RequestError("bootstrap_room: the rooms of a batch must be distinct", param="bootstrap_room")
        hosts, ports, rooms = (_per_prompt(_first_of_samples(v, n, samples), n, name) for v, name in (
            (self.bootstrap_host, "bootstrap_host"), (self.bootstrap_port, "bootstrap_port"),
            (self.bootstrap_room, "bootstrap_room")))
        out: list[BootstrapRef | None] = []
        for i, (host, port, room) in enumerate(zip(hosts, ports, rooms)):
            at = f"[{i}]" if n > 1 else ""
            if not host:
                raise RequestError(f"bootstrap_host{at}: required with bootstrap_room", param="bootstrap_host")
            if room is None or not 0 <= room < 2**64:
                raise RequestError(f"bootstrap_room{at}: must be an unsigned 64-bit integer, got {room!r}",
                                   param="bootstrap_room")
            port = default_port if port is None else port
            if not 0 < port < 65536:
                raise RequestError(f"bootstrap_port{at}: must be in 1..65535, got {port}", param="bootstrap_port")
            out.append(BootstrapRef(host.strip("[]"), port, room))
        return out


def _first_of_samples(value, n: int, samples: int):
    """A single prompt's list of one entry per sample (sglang-router's): its first entry."""
    if n == 1 and samples > 1 and isinstance(value, list) and len(value) == samples:
        return value[:1]
    return value


class PrefillLostRequest(_Body):
    """``POST /disaggregation/prefill_lost`` (the router's): the rooms whose prefill half broke, as
    (host, port, room) of the bootstrap fields the router sent, signed for this server."""

    refs: list[tuple[str, int, int]] = Field(min_length=1, max_length=1024)
    signature: str | None = Field(None, max_length=1000)


def _per_prompt(value, n: int, name: str) -> list:
    if not isinstance(value, list):
        return [value] * n
    if len(value) != n:
        raise RequestError(f"{name}: expected {n} entries (one per prompt), got {len(value)}", param=name)
    return value


_StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


class GenerateSamplingParams(BaseModel):
    """``sampling_params`` of ``/generate`` (SGLang's names), for the schema only: the route
    hands the object to ``SamplingParams.from_dict``, which refuses unknown fields, and
    ``SamplingParams.validate`` checks the ranges stated here."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int | None = Field(128, ge=0)
    temperature: float = Field(1.0, ge=0)
    top_k: int = Field(-1, description="-1 (the whole vocabulary) or >= 1")
    top_p: float = Field(1.0, gt=0, le=1)
    min_p: float = Field(0.0, ge=0, le=1)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: _StopString | Annotated[list[_StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    n: int = Field(1, ge=1, le=MAX_N)
    # Constrained decoding (SGLang's names); at most one of the three.
    json_schema: str | None = Field(None, min_length=1, max_length=MAX_GRAMMAR_CHARS, description=(
        "A JSON-schema document, as a JSON string: the output is a JSON value valid under it"))
    regex: str | None = Field(None, min_length=1, max_length=MAX_GRAMMAR_CHARS, description=(
        "A regular expression the whole output matches"))
    ebnf: str | None = Field(None, min_length=1, max_length=MAX_GRAMMAR_CHARS, description=(
        "An EBNF grammar the output is a sentence of (GBNF with xgrammar, root rule `root`)"))
    think_end: str | None = Field(None, min_length=1, max_length=64, description=(
        "The text that ends the model's thinking part: the constraint holds only after it"))


def _ref(model: type[BaseModel]) -> dict:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


# A plain dict at run time (SamplingParams.from_dict names the bad key), documented as the model.
_SamplingParamsField = Annotated[dict | list[dict] | None, WithJsonSchema({"anyOf": [
    _ref(GenerateSamplingParams), {"type": "array", "items": _ref(GenerateSamplingParams)}, {"type": "null"}]})]


class GenerateRequest(_Bootstrap):
    """SGLang's native ``POST /generate``: exactly one of ``text`` / ``input_ids``."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: _SamplingParamsField = None
    stream: bool = False
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] | None = None  # -1 / None: the last prompt token
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False
    rid: str | list[str] | None = None
    cache_salt: _CacheSalt = None


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingFields(_Bootstrap):
    """OpenAI sampling fields plus SGLang's extras (sent via the client's ``extra_body``)."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    user: str | None = None
    # SGLang extras
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    rid: str | None = None
    cache_salt: _CacheSalt = None
    # constrained decoding beside response_format (SGLang's extras; the engine checks the grammar)
    regex: str | None = None
    ebnf: str | None = None


class JsonSchemaFormat(_Body):
    """``response_format.json_schema``: the schema the reply must be valid under. ``strict`` is
    accepted for OpenAI compatibility; the grammar always enforces the whole schema."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's ``response_format``: text (no constraint), any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None
    response_format: ResponseFormat | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str
    arguments: str  # a JSON object, as a string (OpenAI's shape)


class ToolCallMessage(_Body):
    """A call in an earlier assistant turn, as the client echoes it back."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None  # None: an assistant turn that only called tools
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns: the call this is the result of
    reasoning_content: str | None = None  # an earlier assistant turn's thinking (templates may render it)

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class FunctionDefinition(_Body):
    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: ToolChoiceFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # None: up to the context length
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: auto with tools
    parallel_tool_calls: bool = True
    # SGLang's reasoning extras: split the thinking part off (with --reasoning-parser), stream it as
    # it comes (else in one piece once it ends), and keyword arguments for the chat template
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class AbortRequest(_Body):
    rid: str | None = None
    abort_all: bool = False




class RoleSwitchRequest(_Body):
    """``POST /pd_role_switch`` (SGLang's route): the role to take, and the bounds of the drain."""

    target_role: Literal["prefill", "decode"]
    timeout_secs: Annotated[float, Field(gt=0, le=3600)] = 60.0  # draining longer than this: refused (503)
    quiet_secs: Annotated[float, Field(ge=0, le=60)] = 2.0  # no new request for this long before switching
    max_inflight: Annotated[int, Field(ge=0)] = 64  # more requests in flight than this: refused at once (409)


# The request body each route documents; GenerateSamplingParams is referenced by GenerateRequest.
OPENAPI_BODIES: dict[str, type[BaseModel]] = {
    "/generate": GenerateRequest, "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest, "/abort_request": AbortRequest}
OPENAPI_EXTRA_MODELS: tuple[type[BaseModel], ...] = (GenerateSamplingParams,)
