"""Offline, in-process engine with SGLang's ``Engine.generate`` shape."""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import uuid
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.config import ServerArgs
from pdserve.engine.io_struct import TokenOutput
from pdserve.engine.logprobs import check_logprob_params
from pdserve.engine.model_runner import build_model_runner
from pdserve.engine.request import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.tokenizer import load_tokenizer, output_text
from pdserve.entrypoints.logprobs import LogprobData, TokenTexts, sglang_meta

logger = logging.getLogger(__name__)


def _as_list(x, is_single) -> tuple[list, bool]:
    return ([x], True) if is_single(x) else (list(x), False)


class Engine:
    """``Engine(model_path=..., **server_args)``; ``generate(...)``; ``shutdown()``.

    One rank: runs the scheduler in this process. Several ranks (``tp_size`` ...): every
    rank runs in a subprocess, as under ``pdserve serve``, driven through a RankClient
    (which offers the scheduler calls used here); ``shutdown()`` stops them. Ranks are
    started with ``spawn``, so a script must build the Engine under
    ``if __name__ == "__main__":`` (as with SGLang's Engine). Either way
    ``generate`` blocks until every request it submitted has finished. A rejected input
    raises ValueError naming the field before anything is queued, so the engine stays usable.
    """

    _thaw: weakref.finalize | None = None  # set while this engine keeps the process's heap frozen

    def __init__(self, model_path: str, **kwargs: Any):
        self.args = ServerArgs(model_path=model_path, **kwargs)
        if self.args.disaggregation_mode != "null":
            raise ValueError("disaggregation_mode: the offline Engine runs colocated; start prefill and decode "
                             "servers with `pdserve serve --disaggregation-mode ...` (or `pdserve up`)")
        model_config = self.args.model_config()  # the one read of config.json in this process
        tok_path = self.args.tokenizer_path or model_config.path
        self.tokenizer = None if self.args.skip_tokenizer_init else load_tokenizer(tok_path)
        self.token_texts = TokenTexts(self.tokenizer)  # one memo for the engine's life (TokenizerManager's)
        from pdserve.engine.device_check import require_device

        require_device(self.args.device_config())  # before any rank starts: one clear line
        if self.args.parallel_config().world_size > 1:
            from pdserve.entrypoints.rank_client import RankClient
            from pdserve.layers.moe.dispatch import require_backend

            require_backend(self.args.moe_a2a_backend)
            self.scheduler: RankClient | Scheduler = RankClient(self.args, model_config)
        else:
            # What the imports built (torch's and transformers' heap: hundreds of thousands of objects
            # that live as long as the process) is frozen out of the collector's passes, as in a server's
            # scheduler process: a full pass otherwise walks all of it (a 174 ms stall in an offline round
            # of tiny-llama, measured). The engine's own objects are not frozen, so a dropped engine is
            # collected as before; shutdown() thaws the rest, and so does dropping the engine unshut: the
            # freeze also takes in whatever garbage was still uncollected (an earlier engine dropped but not
            # yet collected, with its KV pool), which a freeze never thawed would hold for the process's life.
            gc.freeze()
            self._thaw = weakref.finalize(self, gc.unfreeze)
            layout = self.args.thread_layout(frontend=False)
            torch.set_num_threads(layout.torch_threads)
            cache_config, scheduler_config = self.args.cache_config(), self.args.scheduler_config()
            runner = build_model_runner(self.args, model_config)
            self.scheduler = Scheduler(model_config, cache_config, scheduler_config, self.tokenizer, runner=runner,
                                       grammar=self.args.grammar_config())
            self.scheduler.use_threads(layout, not self.args.disable_thread_tuning)
        self._ids = itertools.count()

    # ------------------------------------------------------------------ API
    def generate(self, prompt: str | list[str] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None,
                 sampling_params: dict | list[dict] | None = None,
                 return_logprob: bool | list[bool] = False,
                 logprob_start_len: int | list[int] | None = None,
                 top_logprobs_num: int | list[int] | None = None,
                 return_text_in_logprobs: bool = False) -> dict | list[dict]:
        """SGLang's ``Engine.generate``. With ``return_logprob``, ``meta_info`` holds
        ``input_token_logprobs`` (prompt positions from ``logprob_start_len``, -1: the last) and
        ``output_token_logprobs`` as (logprob, token id, text or None) tuples, plus
        ``input_top_logprobs`` / ``output_top_logprobs`` when ``top_logprobs_num`` > 0.
        ``sampling_params.n`` > 1 gives n results per prompt (a list even for one prompt);
        the prompt is prefilled once and its n samples share its KV through the radix cache."""
        items, single = self._prepare(prompt, input_ids, sampling_params,
                                      {"return_logprob": return_logprob, "logprob_start_len": logprob_start_len,
                                       "top_logprobs_num": top_logprobs_num})
        texts = self.token_texts if return_text_in_logprobs else None
        prefills = self._run([it.prefill() for it in items if it.sampling.n > 1])
        seqs = [seq for it in items for seq in it.sequences()]
        results = self._run(seqs)
        prefill_of = dict(zip([it for it in items if it.sampling.n > 1], prefills))
        out = [self._result(acc, seq, prefill_of.get(seq.item), texts) for seq, acc in zip(seqs, results)]
        return out[0] if single and len(out) == 1 else out

    def flush_cache(self) -> bool:
        return self.scheduler.flush_cache()

    def get_server_info(self) -> dict:
        return {"args": self.args.to_dict(), **self.scheduler.stats()}

    def shutdown(self) -> None:
        for rid in list(self.scheduler.reqs):
            self.scheduler.abort(rid, "engine shut down")
        while self.scheduler.has_work():
            self.scheduler.step()
        close = getattr(self.scheduler, "close", None)  # a RankClient's ranks stop here
        if close is not None:
            close()
        if self._thaw is not None:  # what existed before the engine becomes collectable again (its cycles included)
            self._thaw()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    # -------------------------------------------------------------- helpers
    def _prepare(self, prompt, input_ids, sampling_params, logprob_args: dict) -> tuple[list[_Item], bool]:
        """Normalise to one validated _Item per prompt; raise ValueError naming the field."""
        ids_list, single = self._prompt_ids(prompt, input_ids)
        n = len(ids_list)
        per = {"sampling_params": _per_prompt(sampling_params, n, "sampling_params", dict)}
        per.update({k: _per_prompt(v, n, k, (bool, int)) for k, v in logprob_args.items()})
        items = []
        for i, ids in enumerate(ids_list):
            params = SamplingParams.from_dict(per["sampling_params"][i])
            params.validate(self.scheduler.model_config.vocab_size)
            self.scheduler.validate(ids, params.for_copy(0))
            item = _Item(ids, params, bool(per["return_logprob"][i]),
                         _default(per["logprob_start_len"][i], -1), _default(per["top_logprobs_num"][i], 0))
            if item.return_logprob:
                check_logprob_params(len(ids), item.logprob_start_len, item.top_logprobs_num,
                                     self.scheduler.model_config.vocab_size)
            items.append(item)
        return items, single

    def _prompt_ids(self, prompt, input_ids) -> tuple[list[list[int]], bool]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("prompt/input_ids: give exactly one of them")
        if prompt is not None:
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; send input_ids instead")
            texts, single = _as_list(prompt, lambda x: isinstance(x, str))
            if not all(isinstance(t, str) for t in texts):
                raise ValueError("prompt: must be a string or a list of strings")
            ids_list = [self.tokenizer.encode(t) for t in texts]
        else:
            ids_list, single = _as_list(input_ids, lambda x: len(x) == 0 or not isinstance(x[0], (list, tuple)))
            ids_list = [list(ids) for ids in ids_list]
        if not ids_list:
            raise ValueError("prompt/input_ids: the batch is empty")
        return ids_list, single

    def _run(self, seqs: list[_Seq]) -> list[_Acc]:
        """Submit every sequence, step until all have finished; abort them all on an error."""
        rids = []
        try:
            for seq in seqs:
                rids.append(self._submit(seq))
            return self._run_until_done(rids)
        except BaseException:
            for rid in rids:
                self.scheduler.abort(rid, "engine error")
            self.scheduler.step()
            raise

    def _submit(self, seq: _Seq) -> str:
        rid = f"offline-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        self.scheduler.add_request(rid, seq.item.input_ids, seq.sampling, seq.return_logprob,
                                   seq.logprob_start_len, seq.item.top_logprobs_num)
        return rid

    def _run_until_done(self, rids: list[str]) -> list[_Acc]:
        acc = {rid: _Acc() for rid in rids}
        remaining = set(rids)
        while remaining:
            for o in self.scheduler.step():
                a = acc.get(o.rid)
                if a is None:
                    continue
                a.add(o)
                if o.finished:
                    remaining.discard(o.rid)
        return [acc[rid] for rid in rids]

    def _result(self, acc: _Acc, seq: _Seq, prefill: _Acc | None, texts: TokenTexts | None) -> dict:
        final = acc.final
        if final is None:
            raise RuntimeError(f"request {acc!r} produced no output")
        meta = {
            "id": final.rid,
            "prompt_tokens": final.prompt_tokens,
            "completion_tokens": final.completion_tokens,
            "cached_tokens": final.cached_tokens,
            "cached_tokens_by_tier": final.cached_tokens_by_tier,
            "finish_reason": final.finish_reason,
            **final.spec_meta(),
        }
        if acc.timeline is not None:
            meta["timeline"] = acc.timeline
        if seq.item.return_logprob:
            data = acc.data
            if prefill is not None:  # the prompt's logprobs came with the shared prefill
                data.set_input(prefill.data.input_logprobs, prefill.data.input_top)
            meta.update(sglang_meta(data, seq.item.input_ids, texts, seq.item.top_logprobs_num))
        text = output_text(self.tokenizer, acc.data.output_ids, final.finish_reason, seq.sampling.skip_special_tokens)
        return {"text": text, "output_ids": acc.data.output_ids, "meta_info": meta}


@dataclass(eq=False)
class _Item:
    """One prompt of a generate call, validated; ``sampling.n`` sequences come from it."""

    input_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int

    def sequences(self) -> list[_Seq]:
        if self.sampling.n == 1:
            return [_Seq(self, self.sampling, self.return_logprob, self.logprob_start_len)]
        # The shared prefill already has the prompt's logprobs: the samples skip them.
        return [_Seq(self, self.sampling.for_copy(j), self.return_logprob, len(self.input_ids))
                for j in range(self.sampling.n)]

    def prefill(self) -> _Seq:
        """The prompt alone (no new tokens): it lands in the radix cache for the n samples."""
        return _Seq(self, dataclasses.replace(self.sampling.for_copy(0), max_new_tokens=0),
                    self.return_logprob, self.logprob_start_len)


@dataclass(eq=False)
class _Seq:
    item: _Item
    sampling: SamplingParams
    return_logprob: bool
    logprob_start_len: int


class _Acc:
    """What the scheduler sent for one request."""

    def __init__(self):
        self.data = LogprobData()
        self.final: TokenOutput | None = None
        self.timeline: dict | None = None  # the TTFT breakdown, sent with the first token

    def add(self, o: TokenOutput) -> None:
        self.timeline = o.timeline or self.timeline
        self.data.extend(o.new_token_ids, o.new_logprobs, o.new_top_logprobs)
        self.data.set_input(o.input_token_logprobs, o.input_top_logprobs)
        if o.finished:
            self.final = o


def _per_prompt(value, n: int, name: str, kind) -> list:
    """A scalar applies to every prompt; a list must have one entry per prompt."""
    if value is None or isinstance(value, kind):
        return [value] * n
    if not isinstance(value, list) or len(value) != n:
        raise ValueError(f"{name}: expected {n} entries to match the prompts")
    return value


def _default(value, default):
    return default if value is None else value
