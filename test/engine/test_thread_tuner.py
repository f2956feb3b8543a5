"""The forward's thread tuner (engine/thread_tuner.py): its decisions on synthetic step times, when it
stays pinned, and that a step runs at the count it chose on the thread that runs it."""

import random
import threading

import pytest
import torch

from pdserve.config import ThreadLayout
from pdserve.engine.thread_tuner import ForwardThreads, ThreadTuner, TunerSettings, forward_threads, tuned_process_env

SETTINGS = TunerSettings(probe_steps=4, probe_every=16, margin=0.1, max_backoff=8, drift=0.25)


def _run(tuner: ThreadTuner, steps: int, per_token: dict[int, float], tokens: int = 32, noise: float = 0.0,
         rng: random.Random | None = None) -> list[int]:
    """Feed ``steps`` steps whose per-token seconds at each count are ``per_token`` (times 1 +- noise);
    the counts the tuner ran them at."""
    rng = rng or random.Random(0)
    counts = []
    for _ in range(steps):
        c = tuner.count_for(tokens)
        tuner.observe(tokens, c, per_token[c] * tokens * (1 + rng.uniform(-noise, noise)))
        counts.append(c)
    return counts


def _bucket(tuner: ThreadTuner, tokens: int = 32):
    return tuner.buckets[ThreadTuner.bucket_of(tokens)]


def test_switches_to_the_faster_count_and_mostly_runs_there():
    tuner = ThreadTuner((1, 2), SETTINGS)
    counts = _run(tuner, 400, {1: 1.0e-3, 2: 0.6e-3})
    b = _bucket(tuner)
    assert b.current == 2 and b.switches == 1
    # the first probe follows the first window, and the decision the window after it
    assert counts[:12] == [1] * 4 + [2] * 4 + [1] * 4 and counts[12:20] == [2] * 8
    assert counts.count(1) < 0.1 * len(counts)  # later probes of 1 are a small share
    assert b.last == pytest.approx({1: 1.0e-3, 2: 0.6e-3})


def test_stays_put_on_noise_and_probes_less_often():
    tuner = ThreadTuner((1, 2), SETTINGS)
    counts = _run(tuner, 2000, {1: 1.0e-3, 2: 1.0e-3}, noise=0.04)
    b = _bucket(tuner)
    assert b.current == 1 and b.switches == 0
    assert b.backoff == SETTINGS.max_backoff
    # probes back off: at a fixed interval there would be ~2000/20 of them
    assert b.probes < 2000 / (SETTINGS.probe_every * SETTINGS.max_backoff) + 5
    assert counts.count(2) == b.probes * SETTINGS.probe_steps


def test_a_burst_of_load_before_a_probe_does_not_switch():
    """Load from elsewhere slows the steps just before a probe: the window after it shows the
    current count as fast as the probed one, so it stays."""
    tuner = ThreadTuner((1, 2), SETTINGS)
    seq = []
    for step in range(40):
        c = tuner.count_for(32)
        burst = 3.0 if step < SETTINGS.probe_steps else 1.0
        tuner.observe(32, c, 1.0e-3 * 32 * (burst if c == 1 else 1.0))
        seq.append(c)
    assert seq[:8] == [1] * 4 + [2] * 4  # it probed after the slow window
    assert _bucket(tuner).current == 1 and _bucket(tuner).switches == 0 and _bucket(tuner).probes == 1


def test_a_collapsing_probe_gives_up_after_one_step():
    """Two threads ten times slower (an OpenMP team on a loaded machine): each probe costs one step."""
    tuner = ThreadTuner((1, 2), SETTINGS)
    counts = _run(tuner, 1000, {1: 1.0e-3, 2: 10.0e-3})
    b = _bucket(tuner)
    assert b.current == 1 and b.switches == 0 and b.probes >= 3
    assert counts.count(2) == b.probes
    assert b.last == pytest.approx({1: 1.0e-3, 2: 10.0e-3})


def test_a_count_slightly_faster_than_the_margin_does_not_win():
    tuner = ThreadTuner((1, 2), SETTINGS)
    _run(tuner, 500, {1: 1.0e-3, 2: 0.95e-3})
    assert _bucket(tuner).current == 1 and _bucket(tuner).switches == 0


def test_returns_when_the_other_gets_slower():
    """Two threads win on a quiet machine; then load comes and they collapse: back to one, soon
    (the slowdown itself triggers the probe, without waiting out the backoff)."""
    tuner = ThreadTuner((1, 2), SETTINGS)
    _run(tuner, 600, {1: 1.0e-3, 2: 0.6e-3})
    assert _bucket(tuner).current == 2 and _bucket(tuner).backoff == SETTINGS.max_backoff
    counts = _run(tuner, 60, {1: 1.0e-3, 2: 3.0e-3})
    b = _bucket(tuner)
    assert b.current == 1 and b.switches == 2
    # the slowdown probed within probe_every steps, not after the backed-off interval (8 x 16)
    assert counts.index(1) <= SETTINGS.probe_every + SETTINGS.probe_steps
    back = counts.index(1) + 2 * SETTINGS.probe_steps  # the step it switched back at (probe, window after)
    runs_of_two = [len(run) for run in "".join(map(str, counts[back:])).split("1") if run]
    assert runs_of_two and max(runs_of_two) <= SETTINGS.probe_steps  # two threads again only to probe
    # and once the load has gone, two threads win again
    _run(tuner, 600, {1: 1.0e-3, 2: 0.6e-3})
    assert _bucket(tuner).current == 2 and _bucket(tuner).switches == 3


def test_step_sizes_choose_apart():
    """A big prefill may gain from a second thread where a one-request decode does not."""
    tuner = ThreadTuner((1, 2), SETTINGS)
    rng = random.Random(1)
    for _ in range(300):
        for tokens, per_token in ((1, {1: 1.0e-3, 2: 1.5e-3}), (2048, {1: 1.0e-4, 2: 0.55e-4})):
            c = tuner.count_for(tokens)
            tuner.observe(tokens, c, per_token[c] * tokens * (1 + rng.uniform(-0.03, 0.03)))
    assert _bucket(tuner, 1).current == 1 and _bucket(tuner, 2048).current == 2
    shown = tuner.to_dict()
    assert shown["counts"] == [1, 2]
    assert shown["buckets"]["1"]["threads"] == 1 and shown["buckets"]["2048"]["threads"] == 2
    # a wide step starts at the larger count (test below): it stays there, its probes of one thread lost
    assert shown["buckets"]["2048"]["switches"] == 0 and shown["buckets"]["2048"]["probes"] >= 2
    assert set(shown["buckets"]["2048"]["ms_per_token"]) == {"1", "2"}


@pytest.mark.parametrize("faster", [1, 2])
def test_a_wide_step_starts_on_every_core_and_is_decided_within_three_steps(faster):
    """Prefill chunks (``wide_tokens`` and more) are few: the first runs at the larger count, the
    second probes the other, the third is the window after it, and the fourth runs at the winner
    (one thread when two collapse on a loaded machine, two on a quiet one)."""
    tuner = ThreadTuner((1, 2), SETTINGS)
    slow = {1: 2.0e-4, 2: 1.0e-4} if faster == 2 else {1: 1.0e-4, 2: 2.0e-4}
    counts = _run(tuner, 12, slow, tokens=SETTINGS.wide_tokens)
    assert counts[:3] == [2, 1, 2] and counts[3:] == [faster] * 9
    b = _bucket(tuner, SETTINGS.wide_tokens)
    assert b.current == faster and b.switches == (faster == 1) and b.probes == 1
    # one token fewer is not wide: it starts at the layout's count with four-step windows
    assert _run(tuner, 4, slow, tokens=SETTINGS.wide_tokens - 1) == [1] * 4


def test_a_waves_first_chunk_of_one_short_prompt_starts_on_every_core():
    """By default a prefill of 128 tokens (one of bench_peer's 64-256-token prompts, alone in a wave's
    first chunk) is wide: it would be one step per wave in its bucket, too few to fill a window."""
    tuner = ThreadTuner((1, 2))
    assert tuner.count_for(128) == 2 and tuner.count_for(200) == 2
    assert tuner.count_for(64) == 1 and tuner.count_for(32) == 1  # a decode batch of 32 starts at the layout's


def test_bucket_of_groups_powers_of_two():
    assert [ThreadTuner.bucket_of(n) for n in (1, 2, 3, 4, 7, 8, 32, 63, 64)] == [0, 1, 1, 2, 2, 3, 5, 5, 6]
    assert ThreadTuner.bucket_of(0) == 0


@pytest.mark.parametrize("field,value", [("probe_steps", 0), ("probe_every", 0), ("max_backoff", 0), ("wide_tokens", 0),
                                         ("margin", 1.0), ("margin", -0.1), ("drift", 0.0), ("give_up", 1.0)])
def test_bad_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        TunerSettings(**{field: value})


def test_counts_must_differ():
    with pytest.raises(ValueError, match="counts"):
        ThreadTuner((2, 2))


def _layout(cores=2, threads=1, source="cores"):
    return ThreadLayout(cores, threads, True, True, source, "why")


def test_tuned_between_the_layouts_count_and_every_core():
    threads = forward_threads(_layout(), tune=True, device_type="cpu")
    assert threads.tuner is not None and threads.tuner.counts == (1, 2)
    assert threads.to_dict()["enabled"] is True
    # a layout that already takes every core is tuned against one thread (the loaded machine's safe count)
    full = forward_threads(_layout(cores=4, threads=4), tune=True, device_type="cpu")
    assert full.tuner is not None and full.tuner.counts == (4, 1)


@pytest.mark.parametrize("layout,tune,device,why", [
    (_layout(threads=2, source="--num-threads"), True, "cpu", "--num-threads sets the torch threads"),
    (_layout(threads=3, source="OMP_NUM_THREADS"), True, "cpu", "OMP_NUM_THREADS sets the torch threads"),
    (_layout(), False, "cpu", "--disable-thread-tuning"),
    (_layout(), True, "cuda", "the forward runs on cuda"),
    (_layout(cores=1), True, "cpu", "one usable core"),
])
def test_pinned_when_the_operator_or_the_machine_decides(layout, tune, device, why):
    threads = forward_threads(layout, tune, device)
    assert threads.tuner is None and threads.pinned == layout.torch_threads
    shown = threads.to_dict()
    assert {k: shown[k] for k in ("enabled", "threads", "reason")} == \
        {"enabled": False, "threads": layout.torch_threads, "reason": why}
    with threads.step(8) as count:
        assert count == layout.torch_threads


def test_a_step_runs_at_the_chosen_count_on_its_own_thread():
    """OpenMP's count is per thread: the worker's steps set it there, at each probe and back."""
    threads = ForwardThreads(tuner=ThreadTuner((1, 2), TunerSettings(probe_steps=2, probe_every=3)))
    seen: list[tuple[int, int]] = []

    def work():
        for _ in range(12):
            with threads.step(4) as count:
                seen.append((count, torch.get_num_threads()))

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert all(count == actual for count, actual in seen), seen
    assert {count for count, _ in seen} == {1, 2}
    assert threads.to_dict()["buckets"]["4"]["probes"] >= 2


def test_exactly_one_of_pinned_and_tuner():
    with pytest.raises(ValueError):
        ForwardThreads()
    with pytest.raises(ValueError):
        ForwardThreads(pinned=1, tuner=ThreadTuner((1, 2)))


def test_a_tuned_process_starts_with_passive_openmp_waits_unless_the_operator_chose():
    assert tuned_process_env(True, {}) == {"OMP_WAIT_POLICY": "passive"}
    assert tuned_process_env(False, {}) == {}
    assert tuned_process_env(True, {"OMP_WAIT_POLICY": "active"}) == {}
    assert tuned_process_env(True, {"GOMP_SPINCOUNT": "10000"}) == {}


def test_shows_the_processs_openmp_wait_policy(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    assert ForwardThreads(pinned=1).to_dict()["omp_wait_policy"] == "passive"
    monkeypatch.delenv("OMP_WAIT_POLICY")
    assert ForwardThreads(pinned=1).to_dict()["omp_wait_policy"] == ""


@pytest.mark.parametrize("env,first,want", [
    ({}, "", "passive"),  # torch not loaded yet, nothing chosen: passive waits
    ({"OMP_WAIT_POLICY": "active"}, "", "active"),  # the operator's choice stays
    ({"OMP_NUM_THREADS": "2"}, "", None),  # a pinned count is never tuned
    ({}, "import torch", None),  # torch (and OpenMP) already loaded: too late, left alone
])
def test_the_engine_gets_passive_waits_only_when_it_loads_torch(env, first, want):
    """``pdserve.Engine`` sets OMP_WAIT_POLICY before its import loads torch, as a tuned server's
    scheduler process is started with it (a fresh interpreter: OpenMP reads it once, at load)."""
    import os
    import subprocess
    import sys

    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    code = f"{first}\nimport os, sys, pdserve\npdserve.Engine\nassert 'torch' in sys.modules\n" \
           "print(os.environ.get('OMP_WAIT_POLICY'))"
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(want)

