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
