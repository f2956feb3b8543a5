"""The offline Engine's state built once per engine, not per request."""

from __future__ import annotations

import pdserve


def test_engine_logprob_texts_are_decoded_once_per_engine():
    """The offline Engine keeps one token-text memo: a second request showing the same tokens' texts
    decodes none of them again."""
    with pdserve.Engine(model_path="tiny-llama", max_total_tokens=1024, num_threads=1) as engine:
        real_decode, calls = engine.tokenizer.decode, []

        def counting(ids, **kwargs):
            calls.append(ids)
            return real_decode(ids, **kwargs)

        engine.tokenizer.decode = counting
        kw = dict(input_ids=[5, 6, 7, 8], sampling_params={"max_new_tokens": 4, "temperature": 0},
                  return_logprob=True, top_logprobs_num=3, return_text_in_logprobs=True)
        first = engine.generate(**kw)
        singles = sum(len(ids) == 1 for ids in calls)
        second = engine.generate(**kw)
    def ids_and_texts(out):  # the logprobs themselves move in the last bits (the second one hits the cache)
        return [[(t, text) for _, t, text in top] for top in out["meta_info"]["output_top_logprobs"]]

    assert ids_and_texts(first) == ids_and_texts(second)
    assert singles > 0 and sum(len(ids) == 1 for ids in calls) == singles  # one-token decodes: the memo's


def test_engine_keeps_its_start_out_of_the_collectors_passes_until_shutdown(monkeypatch):
    """The Engine freezes what its start built (the model, torch's and transformers' objects), so a full
    collection during generate does not walk them; shutdown thaws it, and a failed start leaves nothing
    frozen."""
    import gc

    import pytest

    engine = pdserve.Engine(model_path="tiny-llama", max_total_tokens=1024, num_threads=1)
    model = engine.scheduler.runner.model
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 10_000 and id(model) not in {id(o) for o in gc.get_objects()}  # frozen: no pass sees it
        engine.generate(input_ids=[5, 6, 7, 8], sampling_params={"max_new_tokens": 4, "temperature": 0})
        gc.collect()
        assert gc.get_freeze_count() > frozen - 100  # only what refcounting freed left the frozen set
    finally:
        engine.shutdown()
    assert id(model) in {id(o) for o in gc.get_objects()}  # thawed
    assert gc.get_freeze_count() == 0
    with pytest.raises(ValueError, match="disaggregation_mode"):
        pdserve.Engine(model_path="tiny-llama", disaggregation_mode="prefill")
    from pdserve.entrypoints import engine as engine_module

    def broken(*args, **kwargs):
        raise RuntimeError("the model could not be built")

    monkeypatch.setattr(engine_module, "build_model_runner", broken)
    with pytest.raises(RuntimeError, match="could not be built"):
        pdserve.Engine(model_path="tiny-llama", max_total_tokens=1024, num_threads=1)
    assert gc.get_freeze_count() == 0
