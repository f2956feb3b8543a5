"""The forward's threads tuned per step (engine/thread_tuner.py) inside an Engine: on by default when
nothing pins the count, off with --num-threads or --disable-thread-tuning, shown in the server info,
and token-identical to the untuned engine, overlapped and on the plain loop."""

import pytest
import torch

import pdserve
from pdserve.engine.thread_tuner import TunerSettings

MODEL = "tiny-llama"
# Probe at every other step, so that a short generation runs its forwards at both counts.
EAGER = TunerSettings(probe_steps=1, probe_every=1, margin=0.1, max_backoff=1)


@pytest.fixture
def unpinned(monkeypatch):
    """No OMP_NUM_THREADS (the test session sets it to 1, which pins the count like an operator's)."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    yield
    torch.set_num_threads(1)  # this thread's count as the session had it


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1500, (3 + 9 * i,), generator=g).tolist() for i in range(n)]


def _engine(**kw) -> pdserve.Engine:
    return pdserve.Engine(model_path=MODEL, page_size=4, chunked_prefill_size=32, **kw)


def test_pinned_by_the_operator(unpinned):
    with _engine(num_threads=1) as engine:
        tuning = engine.get_server_info()["thread_tuning"]
        assert (tuning["enabled"], tuning["threads"], tuning["reason"]) == \
            (False, 1, "--num-threads sets the torch threads")


@pytest.mark.skipif(pdserve.config.usable_cores() < 2, reason="one core leaves no thread count to choose")
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "plain"])
def test_tuned_outputs_match_the_untuned_engine(unpinned, overlap):
    prompts = _prompts(8)  # 3..66 tokens: prefill chunks and decode batches of several sizes
    sps = [{"max_new_tokens": 4 + 3 * i, "temperature": 0.0, "ignore_eos": True} for i in range(8)]
    flags = {"disable_overlap_schedule": not overlap}
    with _engine(disable_thread_tuning=True, **flags) as off:
        assert off.get_server_info()["thread_tuning"]["enabled"] is False
        want = [o["output_ids"] for o in off.generate(input_ids=prompts, sampling_params=sps)]
    with _engine(**flags) as on:
        tuner = on.scheduler.threads.tuner
        assert tuner is not None and len(set(tuner.counts)) == 2
        tuner.settings = EAGER
        got = [o["output_ids"] for o in on.generate(input_ids=prompts, sampling_params=sps)]
        info = on.get_server_info()
    assert got == want
    tuning = info["thread_tuning"]
    assert tuning["enabled"] is True and tuning["counts"] == list(tuner.counts)
    assert info["thread_layout"]["torch_threads"] == tuner.counts[0]
    buckets = tuning["buckets"]
    assert sum(b["probes"] for b in buckets.values()) > 0
    # every decided bucket measured both counts, and runs at one of them
    for b in buckets.values():
        assert b["threads"] in tuner.counts
        if b["ms_per_token"]:
            assert set(b["ms_per_token"]) == {str(c) for c in tuner.counts}
