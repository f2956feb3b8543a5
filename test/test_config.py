"""config.py rules that are not plain validation: the default torch thread count and the
torch.compile decode buckets."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pdserve.assets import PRESET_NAMES
from pdserve.config import (
    CompileConfig,
    ModelConfig,
    ModelFiles,
    ParallelConfig,
    ServerArgs,
    default_num_threads,
    usable_cores,
)


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


@pytest.fixture
def eight_cores(monkeypatch, tmp_path):
    """A model directory on a host whose process may use 8 cores and sets no OMP_NUM_THREADS."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    model = tmp_path / "m"
    model.mkdir()
    return model


def test_the_overlapped_scheduler_thread_keeps_a_core_of_its_own(monkeypatch, eight_cores):
    model = eight_cores
    on = ServerArgs(model_path=str(model)).thread_layout()
    assert (on.cores, on.torch_threads, on.overlap, on.frontend, on.source) == (8, 6, True, True, "cores")
    assert ServerArgs(model_path=str(model)).thread_layout(frontend=False).torch_threads == 7
    off = ServerArgs(model_path=str(model), disable_overlap_schedule=True).thread_layout()
    assert (off.torch_threads, off.overlap) == (7, False)
    assert ServerArgs(model_path=str(model), num_threads=3).thread_layout().to_dict()["source"] == "--num-threads"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert ServerArgs(model_path=str(model)).thread_layout().torch_threads == 1  # never zero


def test_the_thread_layout_says_why_in_words(monkeypatch, eight_cores):
    model = eight_cores
    server = ServerArgs(model_path=str(model)).thread_layout()
    assert server.reason == "8 usable cores, one left to the HTTP frontend and one to the overlapped scheduler thread"
    assert ServerArgs(model_path=str(model), disable_overlap_schedule=True).thread_layout(
        frontend=False).reason == "8 usable cores"
    assert ServerArgs(model_path=str(model), num_threads=3).thread_layout().reason == \
        "--num-threads sets the torch threads"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    tight = ServerArgs(model_path=str(model)).thread_layout()
    assert tight.torch_threads == 1 and tight.reason.endswith("at least one thread, so these share a core")


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


# ------------------------------------------------------- built once, read once
# Every component config ServerArgs hands out (ServerArgs.<name>()).
SUB_CONFIGS = ("cache_config", "hicache_config", "scheduler_config", "parallel_config", "compile_config",
               "device_config", "disagg_config", "kv_events")


@pytest.fixture
def token_file(tmp_path, monkeypatch):
    """(path of a P/D token file, list that gets one entry per open() of that file in this process)."""
    import builtins

    path = tmp_path / "pd-token"
    path.write_text("file-token\n")
    opens: list[str] = []
    real_open = builtins.open

    def counting_open(file, *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and os.fspath(file) == str(path):
            opens.append(str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting_open)
    return path, opens


def _args_with_token_file(path) -> ServerArgs:
    return ServerArgs(model_path="tiny-llama", enable_hierarchical_cache=True, page_size=4,
                      disaggregation_auth_token_file=str(path))


def test_sub_configs_are_built_once_and_handed_out_as_they_are():
    args = ServerArgs(model_path="tiny-llama", enable_hierarchical_cache=True, page_size=4)
    for name in SUB_CONFIGS:
        assert getattr(args, name)() is getattr(args, name)(), name
    assert args.cache_config().hicache is args.hicache_config()  # one HiCache config, composed into the cache's


def test_the_storage_tier_is_told_the_servers_host():
    """A shared tier's clients reach the memory this server lends at its --host."""
    args = ServerArgs(model_path="tiny-llama", enable_hierarchical_cache=True, host="10.0.0.11")
    assert args.hicache_config().host == "10.0.0.11"
    assert ServerArgs(model_path="tiny-llama").hicache_config().host == "127.0.0.1"


def test_the_token_file_is_read_once_however_often_its_configs_are_asked_for(token_file):
    path, opens = token_file
    args = _args_with_token_file(path)
    for _ in range(50):
        for name in SUB_CONFIGS:
            getattr(args, name)()
    assert opens == [str(path)]
    assert args.disagg_config().auth_token == args.hicache_config().auth_token == "file-token"


def test_a_pickled_args_carries_its_configs_and_reads_no_secret_again(token_file):
    import pickle

    path, opens = token_file
    args = pickle.loads(pickle.dumps(_args_with_token_file(path)))  # how a scheduler process receives it
    assert args.disagg_config().auth_token == "file-token" and args.hicache_config().auth_token == "file-token"
    assert opens == [str(path)]


def test_replace_builds_the_configs_of_the_new_args():
    args = ServerArgs(model_path="tiny-llama")
    other = args.replace(page_size=8, disaggregation_mode="decode")
    assert other.cache_config().page_size == 8 and other.disagg_config().mode == "decode"
    assert args.cache_config().page_size == 1 and args.disagg_config().mode == "null"
    assert not [k for k in args.to_dict() if k.startswith("_")]  # built configs are no fields: not in /server_info


def test_an_unreadable_token_file_still_fails_at_construction(tmp_path):
    with pytest.raises(ValueError, match="disaggregation_auth_token_file: cannot read"):
        ServerArgs(model_path="tiny-llama", disaggregation_auth_token_file=str(tmp_path / "missing"))


def _recording(post_init, built: list[str]):
    """``post_init``, also noting the class of each config it validates (one built) in ``built``."""
    def wrapper(self):
        built.append(type(self).__name__)
        post_init(self)
    return wrapper


def test_the_engine_request_path_reads_no_secret_and_builds_no_config(token_file, monkeypatch):
    """Requests through the offline Engine neither re-read the token file nor build a component config."""
    import pdserve
    from pdserve import config

    path, opens = token_file
    with pdserve.Engine(model_path="tiny-llama", max_total_tokens=1024, disaggregation_auth_token_file=str(path),
                        num_threads=1) as engine:
        built: list[str] = []
        for cls in (config.CacheConfig, config.HiCacheConfig, config.SchedulerConfig, config.ParallelConfig,
                    config.CompileConfig, config.DeviceConfig, config.DisaggConfig, config.KVEventsConfig):
            monkeypatch.setattr(cls, "__post_init__", _recording(cls.__post_init__, built))
        outs = engine.generate(input_ids=[[5, 6, 7, 8 + i] for i in range(8)],
                               sampling_params={"max_new_tokens": 4, "temperature": 0})
        for name in SUB_CONFIGS:
            getattr(engine.args, name)()
        assert all(o["meta_info"]["completion_tokens"] == 4 for o in outs)
    assert built == [] and opens == [str(path)]



def test_fp8_kv_cache_counts_one_byte_an_element_and_fits_four_times_the_fp32_tokens():
    """--kv-cache-dtype fp8_e4m3: the same KV budget holds 4x the tokens of a float32 pool (2x bf16)."""
    base = ServerArgs(model_path="tiny-llama", dtype="float32")
    model = base.model_config()
    assert model.kv_bytes_per_token("fp8_e4m3") * 4 == model.kv_bytes_per_token() == model.kv_bytes_per_token("auto")
    fp8 = base.replace(kv_cache_dtype="fp8_e4m3").cache_config()
    assert fp8.kv_cache_dtype == "fp8_e4m3"
    from pdserve.distributed.parallel_state import ParallelState
    from pdserve.engine.model_runner import kv_pool_budget

    pages = {c.kv_cache_dtype: kv_pool_budget(model, c, ParallelState()).num_pages for c in (fp8, base.cache_config())}
    assert pages["fp8_e4m3"] == 4 * pages["auto"]
    with pytest.raises(ValueError, match="^kv_cache_dtype: 'fp8_e5m2' is not one of"):
        ServerArgs(model_path="tiny-llama", kv_cache_dtype="fp8_e5m2")


def test_kv_cache_dtype_flag_reaches_the_cache_config():
    from pdserve.entrypoints.cli import build_parser, server_args_from_namespace

    ns = build_parser().parse_args(["serve", "--model-path", "tiny-llama", "--kv-cache-dtype", "fp8_e4m3"])
    assert server_args_from_namespace(ns).cache_config().kv_cache_dtype == "fp8_e4m3"



SPLITS = [dict(tp_size=tp, ep_size=ep, dp_size=dp, enable_dp_attention=dpa)
          for tp in (1, 2, 3, 4, 8) for ep in {1, tp} for dp, dpa in ((1, False), (2, True)) if not dpa or tp % 2 == 0]


def _refusal(parallel: ParallelConfig, model) -> str | None:
    """What ``parallel.check_model`` refuses ``model`` with, None when it accepts."""
    try:
        parallel.check_model(model)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("preset", [p for p in PRESET_NAMES if p != "tiny-llama-eagle"])  # a draft, not served
def test_the_frontends_model_files_agree_with_the_model_config(preset):
    """The start-up checks read config.json as json (ModelFiles: the HTTP frontend imports no transformers
    config class); the engine reads transformers' config, with its defaults and aliases. Over every split,
    the parallel checks accept and refuse alike on both, and the other checks' fields agree."""
    model, files = ModelConfig.from_path(preset), ModelFiles.read(preset)
    assert model.files == files and (files.path, files.architecture) == (model.path, model.architecture)
    assert (files.num_kv_heads, files.index_head_dim, files.quantization) == \
        (model.num_kv_heads, model.index_head_dim, model.quantization)
    assert getattr(files.config, "o_groups", None) == getattr(model.hf_config, "o_groups", None)
    outcomes = set()
    for split in SPLITS:
        parallel = ParallelConfig(**split)
        on_files, on_model = _refusal(parallel, files), _refusal(parallel, model)
        assert on_files == on_model, (split, on_files, on_model)
        outcomes.add(on_files)
    assert None in outcomes and len(outcomes) > 1  # the grid has splits each way


def _probe(device_files: tuple[str, ...]) -> tuple[bool, bool]:
    """(cuda_available(), whether it imported torch) in a fresh process seeing ``device_files`` as the GPU's."""
    code = ("import sys, pdserve.config as c\n"
            f"c.GPU_DEVICE_FILES = {device_files!r}\n"
            "print(c.cuda_available(), 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    available, imported = proc.stdout.split()
    return available == "True", imported == "True"


@pytest.mark.skipif(sys.platform != "linux", reason="the device-file short cut is Linux's")
def test_the_cuda_probe_imports_torch_only_where_a_gpu_driver_is():
    """Without a GPU driver's device files no CUDA device can be seen: the answer (and the HTTP frontend's
    default --device) needs no torch. With one, torch is asked."""
    import torch

    assert _probe(("/no/such/device",)) == (False, False)
    assert _probe(("/dev/null",)) == (torch.cuda.is_available(), True)


def test_the_prefill_chunk_defaults_per_device_and_the_flag_wins():
    """No --chunked-prefill-size: 1,024 tokens on CPU (a chunk's stall on two cores), 2,048 on an
    accelerator; a given value (even 2048, or <= 0: chunking off) is kept, and one below a page refused."""
    from pdserve.config import default_prefill_chunk

    assert default_prefill_chunk("cpu") == 1024 and default_prefill_chunk("cuda") == 2048
    args = ServerArgs(model_path="tiny-llama", device="cpu")
    assert args.chunked_prefill_size is None and args.scheduler_config().chunked_prefill_size == 1024
    for given in (2048, 512, 0, -1):
        assert ServerArgs(model_path="tiny-llama", chunked_prefill_size=given).scheduler_config() \
            .chunked_prefill_size == given
    with pytest.raises(ValueError, match="chunked_prefill_size: must be >= page_size"):
        ServerArgs(model_path="tiny-llama", page_size=16, chunked_prefill_size=8)
