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


def test_engine_keeps_the_imports_out_of_the_collectors_passes_until_shutdown():
    """The Engine freezes what existed before it (torch's and transformers' objects), so a full
    collection during generate does not walk them; its own objects stay collectable (a dropped engine
    is freed), and shutdown thaws the rest."""
    import gc

    import torch

    engine = pdserve.Engine(model_path="tiny-llama", max_total_tokens=1024, num_threads=1)
    model, imported = engine.scheduler.runner.model, torch.nn.Module.__init__
    try:
        tracked = {id(o) for o in gc.get_objects()}
        assert gc.get_freeze_count() > 10_000 and id(imported) not in tracked  # frozen: no pass walks it
        assert id(model) in tracked  # the engine's own objects are not frozen
        engine.generate(input_ids=[5, 6, 7, 8], sampling_params={"max_new_tokens": 4, "temperature": 0})
    finally:
        engine.shutdown()
    assert gc.get_freeze_count() == 0 and id(imported) in {id(o) for o in gc.get_objects()}  # thawed


def test_an_engine_dropped_without_shutdown_thaws_what_it_froze():
    """The freeze also takes in garbage still uncollected when the engine starts (here a cycle, as an
    earlier engine dropped with its KV pool would be): dropping the engine unshut thaws it too, so the
    next collection frees that garbage instead of the process holding it for good."""
    import gc
    import weakref

    class Cycle:
        pass

    gc.disable()  # no collection before the engine's freeze: the cycle is still garbage then
    try:
        garbage = Cycle()
        garbage.me = garbage
        gone = weakref.ref(garbage)
        del garbage
        engine = pdserve.Engine(model_path="tiny-llama", max_total_tokens=1024, num_threads=1)
        assert gc.get_freeze_count() > 10_000 and gone() is not None  # frozen with the imports
        engine.generate(input_ids=[5, 6, 7, 8], sampling_params={"max_new_tokens": 4, "temperature": 0})
        del engine
        assert gc.get_freeze_count() == 0
    finally:
        gc.enable()
    gc.collect()
    assert gone() is None
