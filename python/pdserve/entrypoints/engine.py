"""Offline, in-process engine with SGLang's ``Engine.generate`` shape."""

from __future__ import annotations

import itertools
import logging
import uuid
from typing import Any

import torch

from pdserve.config import ServerArgs, default_num_threads
from pdserve.engine.io_struct import TokenOutput
from pdserve.engine.request import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.tokenizer import load_tokenizer, output_text

logger = logging.getLogger(__name__)


def _as_list(x, is_single) -> tuple[list, bool]:
    return ([x], True) if is_single(x) else (list(x), False)


class Engine:
    """``Engine(model_path=..., **server_args)``; ``generate(...)``; ``shutdown()``.

    Runs the scheduler in this process: ``generate`` blocks until every request
    it submitted has finished. A rejected input raises ValueError naming the
    field before anything is queued, so the engine stays usable.
    """

    def __init__(self, model_path: str, **kwargs: Any):
        self.args = ServerArgs(model_path=model_path, **kwargs)
        torch.set_num_threads(self.args.num_threads or default_num_threads())
        model_config = self.args.model_config()  # the one read of config.json in this process
        tok_path = self.args.tokenizer_path or model_config.path
        self.tokenizer = None if self.args.skip_tokenizer_init else load_tokenizer(tok_path)
        self.scheduler = Scheduler(model_config, self.args.cache_config(), self.args.scheduler_config(),
                                   self.tokenizer)
        self._ids = itertools.count()

    # ------------------------------------------------------------------ API
    def generate(self, prompt: str | list[str] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None,
                 sampling_params: dict | list[dict] | None = None,
                 return_logprob: bool | list[bool] = False) -> dict | list[dict]:
        batch, single = self._prepare(prompt, input_ids, sampling_params, return_logprob)
        rids = [self._submit(ids, sp, lp) for ids, sp, lp in batch]
        try:
            results = self._run_until_done(rids)
        except BaseException:
            for rid in rids:
                self.scheduler.abort(rid, "engine error")
            self.scheduler.step()
            raise
        out = [self._result(results[rid], sp) for rid, (_, sp, _) in zip(rids, batch)]
        return out[0] if single else out

    def flush_cache(self) -> bool:
        return self.scheduler.flush_cache()

    def get_server_info(self) -> dict:
        return {"args": self.args.to_dict(), **self.scheduler.stats()}

    def shutdown(self) -> None:
        for rid in list(self.scheduler.reqs):
            self.scheduler.abort(rid, "engine shut down")
        while self.scheduler.has_work():
            self.scheduler.step()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    # -------------------------------------------------------------- helpers
    def _prepare(self, prompt, input_ids, sampling_params, return_logprob):
        """Normalise to [(ids, SamplingParams, return_logprob)] and validate all of it."""
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
        n = len(ids_list)
        if n == 0:
            raise ValueError("prompt/input_ids: the batch is empty")
        sps = sampling_params if isinstance(sampling_params, list) else [sampling_params] * n
        lps = return_logprob if isinstance(return_logprob, list) else [return_logprob] * n
        if len(sps) != n or len(lps) != n:
            raise ValueError(f"sampling_params/return_logprob: expected {n} entries to match the prompts")
        batch = []
        for ids, sp, lp in zip(ids_list, sps, lps):
            params = SamplingParams.from_dict(sp)
            self.scheduler.validate(ids, params)
            batch.append((ids, params, bool(lp)))
        return batch, single

    def _submit(self, ids, params, return_logprob) -> str:
        rid = f"offline-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        self.scheduler.add_request(rid, ids, params, return_logprob)
        return rid

    def _run_until_done(self, rids: list[str]) -> dict[str, dict]:
        acc = {rid: {"ids": [], "logprobs": [], "final": None} for rid in rids}
        remaining = set(rids)
        while remaining:
            for o in self.scheduler.step():
                a = acc.get(o.rid)
                if a is None:
                    continue
                a["ids"] += o.new_token_ids
                a["logprobs"] += o.new_logprobs or []
                if o.finished:
                    a["final"] = o
                    remaining.discard(o.rid)
        return acc

    def _result(self, acc: dict, params: SamplingParams) -> dict:
        final: TokenOutput = acc["final"]
        meta = {
            "id": final.rid,
            "prompt_tokens": final.prompt_tokens,
            "completion_tokens": final.completion_tokens,
            "cached_tokens": final.cached_tokens,
            "finish_reason": final.finish_reason,
        }
        if acc["logprobs"]:
            meta["output_token_logprobs"] = [(lp, t, None) for lp, t in zip(acc["logprobs"], acc["ids"])]
        text = output_text(self.tokenizer, acc["ids"], final.finish_reason, params.skip_special_tokens)
        return {"text": text, "output_ids": acc["ids"], "meta_info": meta}
