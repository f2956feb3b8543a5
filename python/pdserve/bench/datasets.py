"""Benchmark workloads: what is sent, as conversations of one or more requests.

Every synthetic prompt has an exact length in tokens and a text that round-trips:
``tokenizer.encode(text) == prompt_ids``, so sending the text (what a client of any
server does) or the ids (``--tokenize-prompt``) puts the same tokens into the
server. That is why random prompts are drawn from the vocabulary's *word tokens*
(a space and letters, e.g. ``" river"``): byte-level BPE splits text at spaces
first, so a sequence of word tokens re-tokenizes into exactly itself and two
prompts concatenate without merging across the seam (shared prefixes stay
shared token for token). Tokenizers without such tokens fall back to fitting
decoded random ids to the length by truncation and padding.

Datasets:
- ``random``: lengths uniform in [ratio * L, L] (sglang's and vLLM's rule).
- ``sharegpt``: the first two turns of conversations in a local ShareGPT JSON file.
- ``generated-shared-prefix``: groups of prompts sharing one long system prompt.
- ``multi-turn``: clients x rounds; each round's prompt is the previous prompt,
  its answer and a new question (a conversation is closed-loop: round r+1 is
  sent when round r's answer is in).
- ``mixed``: interactive short requests plus a background stream of long prompts,
  each with its own arrival rate; requests carry the tag of their stream.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from pdserve.bench.arrivals import arrival_offsets
from pdserve.bench.config import DatasetConfig, LoadConfig

FIT_TRIES = 32


@dataclass(frozen=True)
class BenchRequest:
    """One request to send. ``prompt_ids`` are what the server's tokenizer makes of ``prompt``."""

    prompt: str
    prompt_ids: tuple[int, ...] | None
    prompt_len: int
    output_len: int
    messages: tuple[dict, ...] | None = None  # chat history (multi-turn); None: one user message
    tag: str = ""  # the stream a request belongs to (mixed: "interactive" / "background")
    round: int = 0  # multi-turn: which round of its conversation (1-based); 0 elsewhere

    def __post_init__(self):
        assert self.prompt_len >= 1 and self.output_len >= 1, (self.prompt_len, self.output_len)

    @property
    def token_ids(self) -> tuple[int, ...]:
        """``prompt_ids``, for the paths that send token ids (every generated dataset sets them)."""
        if self.prompt_ids is None:
            raise ValueError("prompt_ids: this request carries text only, no token ids to send")
        return self.prompt_ids


# ------------------------------------------------------------------ prompts
class PromptMaker:
    """Text prompts of an exact token length from a seeded RNG (see the module docstring)."""

    def __init__(self, tokenizer, rng: random.Random):
        self.tok = tokenizer
        self.rng = rng
        self.words = word_tokens(tokenizer)
        self.any_ids = [i for i in range(len(tokenizer)) if i not in set(tokenizer.all_special_ids)]
        # tokens the tokenizer adds around any text (a BOS), which count towards a prompt's length
        self.n_special = len(tokenizer.encode("a")) - len(tokenizer.encode("a", add_special_tokens=False))

    def encode(self, text: str, specials: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=specials)

    def text(self, n: int) -> str:
        """A text of exactly ``n`` content tokens (no special tokens)."""
        if n <= 0:
            return ""
        if len(self.words) >= 16:
            ids = [self.rng.choice(self.words) for _ in range(n)]
            text = self.tok.decode(ids)
            if self.encode(text, specials=False) == ids:
                return text
        return self._fit(n)

    def _fit(self, n: int) -> str:
        ids = [self.rng.choice(self.any_ids) for _ in range(n)]
        for _ in range(FIT_TRIES):
            got = self.encode(self.tok.decode(ids), specials=False)
            if len(got) == n:
                return self.tok.decode(got)
            ids = got[:n] if len(got) > n else got + [self.rng.choice(self.any_ids) for _ in range(n - len(got))]
        raise ValueError(f"could not make a prompt of exactly {n} tokens with this tokenizer")

    def request(self, text: str, output_len: int, tag: str = "") -> BenchRequest:
        ids = self.encode(text)
        return BenchRequest(text, tuple(ids), len(ids), output_len, tag=tag)

    def prompt(self, n: int, output_len: int, tag: str = "") -> BenchRequest:
        """A request whose prompt is exactly ``n`` tokens as the server counts them (specials included)."""
        return self.request(self.text(max(n - self.n_special, 1)), output_len, tag)

    def extension(self, prefix: str, n: int) -> str:
        """Text of ``n`` tokens that appended to ``prefix`` leaves the prefix's tokens unchanged."""
        base = self.encode(prefix)
        for _ in range(FIT_TRIES):
            tail = self.text(n)
            if self.encode(prefix + tail) == base + self.encode(tail, specials=False):
                return tail
        raise ValueError(f"could not extend a prompt by {n} tokens without changing its tokens")


def word_tokens(tokenizer) -> list[int]:
    """Ids whose text is a space and ASCII letters/digits and that encode back to themselves alone."""
    special = set(tokenizer.all_special_ids)
    ids = [i for i in range(len(tokenizer)) if i not in special]
    texts = tokenizer.batch_decode([[i] for i in ids])
    cand = [(i, t) for i, t in zip(ids, texts) if len(t) > 1 and t[0] == " " and t[1:].isascii() and t[1:].isalnum()]
    if not cand:
        return []
    enc = tokenizer([t for _, t in cand], add_special_tokens=False)["input_ids"]
    return [i for (i, _), e in zip(cand, enc) if list(e) == [i]]


# ------------------------------------------------------------ conversations
class Conversation:
    """A sequence of requests; the next one may depend on the previous answer.

    ``first()`` is the opening request; ``next(request, text, output_ids)`` the one
    that follows an answer, or None when the conversation is over.
    """

    def first(self) -> BenchRequest:
        raise NotImplementedError

    def next(self, request: BenchRequest, text: str, output_ids: list[int] | None) -> BenchRequest | None:
        return None

    @property
    def num_requests(self) -> int:
        return 1


@dataclass
class SingleTurn(Conversation):
    request: BenchRequest

    def first(self) -> BenchRequest:
        return self.request


@dataclass
class MultiTurn(Conversation):
    """Round r+1's prompt = round r's prompt + its answer + question r+1.

    With ``use_ids`` (native backends sending input_ids) the prompt is extended in
    token ids (prompt ids + output ids + question ids), so every round's prompt
    starts with the previous round's tokens exactly; otherwise as text, and chat
    backends also get the history as messages.
    """

    questions: list[str]
    output_len: int
    maker: PromptMaker
    use_ids: bool = False
    round: int = field(default=0, init=False)

    @property
    def num_requests(self) -> int:
        return len(self.questions)

    def first(self) -> BenchRequest:
        req = self.maker.request(self.questions[0], self.output_len, tag="turn1")
        return replace(req, messages=({"role": "user", "content": self.questions[0]},), round=1)

    def next(self, request: BenchRequest, text: str, output_ids: list[int] | None) -> BenchRequest | None:
        self.round += 1
        if self.round >= len(self.questions):
            return None
        q = self.questions[self.round]
        prompt = request.prompt + text + q
        if request.messages is None:
            raise ValueError("multi-turn: a follow-up needs the previous request's messages")
        messages = (*request.messages, {"role": "assistant", "content": text}, {"role": "user", "content": q})
        if self.use_ids:
            if output_ids is None:
                raise ValueError("multi-turn with input_ids needs the server's output_ids (a native backend)")
            ids = (*request.token_ids, *output_ids, *self.maker.encode(q, specials=False))
        else:
            ids = tuple(self.maker.encode(prompt))
        # later turns are where a prefix cache (and cache-aware routing) shows: reported apart
        return BenchRequest(prompt, ids, len(ids), self.output_len, messages, "later_turns", self.round + 1)


@dataclass
class Workload:
    """Conversations to run; ``arrivals`` (seconds from the start, one per conversation) when the
    dataset times itself (mixed), else the load's request rate decides."""

    name: str
    conversations: list[Conversation]
    arrivals: list[float] | None = None

    @property
    def num_requests(self) -> int:
        return sum(c.num_requests for c in self.conversations)

    def schedule(self, load: LoadConfig, rng: np.random.Generator) -> list[float]:
        if self.arrivals is not None:
            return self.arrivals
        return arrival_offsets(len(self.conversations), load.request_rate, load.burstiness, rng)


# ----------------------------------------------------------------- datasets
def build_workload(cfg: DatasetConfig, load: LoadConfig, tokenizer, use_ids: bool = False) -> Workload:
    """The dataset of ``cfg``, seeded by ``load.seed`` (same seed, same prompts and arrivals)."""
    rng = np.random.default_rng(load.seed)
    maker = PromptMaker(tokenizer, random.Random(load.seed))
    builders = {"random": _random, "sharegpt": _sharegpt, "generated-shared-prefix": _shared_prefix,
                "multi-turn": _multi_turn, "mixed": _mixed}
    return builders[cfg.dataset_name](cfg, load, maker, rng, use_ids)


def length_range(n: int, ratio: float, minimum: int = 1) -> tuple[int, int]:
    """Inclusive [low, high] of sglang's ``--random-range-ratio`` rule."""
    return max(int(n * ratio), minimum), n


def _random(cfg, load, maker, rng, use_ids) -> Workload:
    in_lo, in_hi = length_range(cfg.random_input_len, cfg.random_range_ratio)
    out_lo, out_hi = length_range(cfg.random_output_len, cfg.random_range_ratio)
    ins = rng.integers(in_lo, in_hi + 1, size=load.num_prompts)
    outs = rng.integers(out_lo, out_hi + 1, size=load.num_prompts)
    return Workload("random", [SingleTurn(maker.prompt(int(i), int(o))) for i, o in zip(ins, outs)])


def _sharegpt(cfg, load, maker, rng, use_ids) -> Workload:
    pairs = load_sharegpt(cfg.dataset_path)
    order = rng.permutation(len(pairs))
    reqs: list[Conversation] = []
    for k in order:
        if len(reqs) == load.num_prompts:
            break
        prompt, answer = pairs[k]
        ids = maker.encode(prompt)
        out = cfg.sharegpt_output_len or len(maker.encode(answer, specials=False))
        if len(ids) < 2 or out < 2:  # too short to time (sglang prunes the same)
            continue
        if cfg.sharegpt_context_len and len(ids) + out > cfg.sharegpt_context_len:
            continue
        reqs.append(SingleTurn(BenchRequest(prompt, tuple(ids), len(ids), out)))
    if len(reqs) < load.num_prompts:
        raise ValueError(f"--num-prompts: {cfg.dataset_path} has only {len(reqs)} usable conversations "
                         f"(two or more turns, prompt and answer of 2+ tokens), {load.num_prompts} asked for")
    return Workload("sharegpt", reqs)


def load_sharegpt(path: str) -> list[tuple[str, str]]:
    """(first human turn, first answer) of each conversation with two or more turns."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"--dataset-path: cannot read {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--dataset-path: {path} is not JSON: {e}") from None
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path: {path} must hold a JSON list of ShareGPT conversations")
    pairs = []
    for item in data:
        turns = item.get("conversations", item.get("conversation", [])) if isinstance(item, dict) else []
        if not isinstance(turns, list):
            continue
        if len(turns) >= 2 and all(isinstance(t, dict) and isinstance(t.get("value"), str) for t in turns[:2]):
            pairs.append((turns[0]["value"], turns[1]["value"]))
    return pairs


def _shared_prefix(cfg, load, maker, rng, use_ids) -> Workload:
    reqs: list[Conversation] = []
    for group in range(cfg.gsp_num_groups):
        system = maker.text(max(cfg.gsp_system_prompt_len - maker.n_special, 1))
        for _ in range(cfg.gsp_prompts_per_group):
            question = maker.extension(system, cfg.gsp_question_len)
            reqs.append(SingleTurn(maker.request(system + question, cfg.gsp_output_len, tag=f"group{group}")))
    return Workload("generated-shared-prefix", [reqs[i] for i in rng.permutation(len(reqs))])


def _multi_turn(cfg, load, maker, rng, use_ids) -> Workload:
    convs: list[Conversation] = []
    for _ in range(cfg.multi_turn_clients):
        first = maker.text(max(cfg.multi_turn_question_len - maker.n_special, 1))
        rest = [maker.text(cfg.multi_turn_question_len) for _ in range(cfg.multi_turn_rounds - 1)]
        convs.append(MultiTurn([first, *rest], cfg.multi_turn_output_len, maker, use_ids))
    return Workload("multi-turn", convs)


def _mixed(cfg, load, maker, rng, use_ids) -> Workload:
    rate = cfg.mixed_interactive_rate or load.request_rate
    if math.isinf(rate):
        raise ValueError("--request-rate: the mixed dataset needs a finite interactive rate "
                         "(--request-rate or --mixed-interactive-rate)")
    streams = (("interactive", rate, cfg.mixed_interactive_input_len, cfg.mixed_interactive_output_len),
               ("background", cfg.mixed_background_rate, cfg.mixed_background_input_len,
                cfg.mixed_background_output_len))
    timed = []
    for tag, r, n_in, n_out in streams:
        offsets = arrival_offsets(load.num_prompts, r, load.burstiness, rng)
        timed += [(t, tag, n_in, n_out) for t in offsets]
    timed = sorted(timed, key=lambda x: x[0])[:load.num_prompts]
    convs: list[Conversation] = [SingleTurn(maker.prompt(n_in, n_out, tag)) for _, tag, n_in, n_out in timed]
    return Workload("mixed", convs, arrivals=[t for t, *_ in timed])
