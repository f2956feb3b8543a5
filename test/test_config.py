"""config.py rules that are not plain validation: the default torch thread count and the
torch.compile decode buckets."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pdserve.config import CompileConfig, ServerArgs, default_num_threads, usable_cores


def test_usable_cores_follow_the_affinity_mask():
    assert usable_cores() == len(os.sched_getaffinity(0))


def test_a_server_scheduler_leaves_one_core_to_the_frontend(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = usable_cores()
    assert default_num_threads() == max(1, cores - 1)
    assert default_num_threads(frontend=False) == cores


def test_omp_num_threads_wins_for_both(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert default_num_threads() == 3
    assert default_num_threads(frontend=False) == 3


def test_one_core_still_gets_one_thread():
    """A process pinned to one core (a container's cpuset) gets one thread, not zero."""
    code = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
            "from pdserve.config import default_num_threads as d; print(d(), d(frontend=False))")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60, check=True)
    assert out.stdout.split() == ["1", "1"]


@pytest.mark.parametrize("max_bs, buckets", [(1, (1,)), (2, (1, 2)), (6, (1, 2, 4, 6)),
                                             (32, (1, 2, 4, 8, 16, 32))])
def test_compile_buckets(max_bs, buckets):
    assert CompileConfig(True, max_bs).buckets == buckets


def test_bucket_for_pads_up_and_leaves_the_rest_eager():
    config = CompileConfig(True, 6)
    assert [config.bucket_for(b) for b in range(1, 8)] == [1, 2, 4, 4, 6, 6, None]
    assert CompileConfig(False, 6).bucket_for(3) is None


def test_compile_max_bs_is_validated_naming_the_flag():
    with pytest.raises(ValueError, match="torch_compile_max_bs"):
        ServerArgs(model_path="tiny-llama", enable_torch_compile=True, torch_compile_max_bs=0)


@pytest.mark.parametrize("config, message", [
    ('{"publisher": "kafka"}', "publisher 'kafka' is not one of"),
    ('{"endpont": "tcp://*:5557"}', r"unknown field\(s\) \['endpont'\]"),
    ('{"publisher": "zmq", "endpoint": "localhost:5557"}', "is not a tcp://"),
    ('{"max_queue_size": 0}', "max_queue_size must be an integer >= 1"),
    ("[1]", "must be a JSON object"),
    ("{bad", "not valid JSON"),
])
def test_kv_events_config_names_the_bad_field(config, message):
    with pytest.raises(ValueError, match=f"kv_events_config: .*{message}"):
        ServerArgs(model_path="tiny-llama", kv_events_config=config)
    assert not ServerArgs(model_path="tiny-llama").kv_events().enabled


def test_kv_events_publisher_names_an_endpoint_it_cannot_bind():
    from pdserve.config import KVEventsConfig
    from pdserve.obs.kv_event_publisher import KVEventPublisher

    with pytest.raises(ValueError, match="kv_events_config: cannot bind endpoint 'tcp://256.0.0.1:1'"):
        KVEventPublisher(KVEventsConfig("zmq", "tcp://256.0.0.1:1"))
