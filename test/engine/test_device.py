"""--device / --attention-backend / --dtype: host defaults, refusals naming the flag, and the one
place a runner is built from the server arguments."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from pdserve.config import DeviceConfig, ServerArgs
from pdserve.engine.device import require_device
from pdserve.engine.model_runner import build_model_runner

CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU host's defaults")


@CPU_ONLY
def test_cpu_host_defaults_are_the_cpu_path():
    cfg = ServerArgs(model_path="tiny-llama").device_config()
    assert (cfg.device, cfg.attention_backend, cfg.dtype) == ("cpu", "torch_native", "float32")
    assert not cfg.use_cuda_graph and cfg.graph_size_for(1) is None


def test_cuda_defaults_are_flashinfer_and_bfloat16():
    cfg = DeviceConfig.resolve("cuda", None, "auto")
    assert (cfg.attention_backend, cfg.dtype) == ("flashinfer", "bfloat16")
    assert DeviceConfig.resolve("cuda", "triton", "float32").dtype == "float32"


def test_cuda_graph_sizes_pad_to_the_next_capture():
    cfg = DeviceConfig("cuda", "triton", "bfloat16", cuda_graph_max_bs=20)
    assert cfg.cuda_graph_batch_sizes == (1, 2, 4, 8, 16, 20)
    assert [cfg.graph_size_for(b) for b in (1, 3, 9, 20, 21)] == [1, 4, 16, 20, None]
    assert DeviceConfig("cuda", "triton", "bfloat16", disable_cuda_graph=True).graph_size_for(1) is None


@pytest.mark.parametrize("kwargs, field", [
    ({"device": "tpu"}, "device"),
    ({"attention_backend": "sdpa"}, "attention_backend"),
    ({"device": "cpu", "attention_backend": "flashinfer"}, "attention_backend"),
    ({"dtype": "int8"}, "dtype"),
    ({"cuda_graph_max_bs": 0}, "cuda_graph_max_bs"),
    ({"deepep_mode": "fast"}, "deepep_mode"),
])
def test_bad_device_arguments_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        ServerArgs(model_path="tiny-llama", **kwargs)


@CPU_ONLY
def test_cuda_without_a_gpu_is_refused():
    with pytest.raises(ValueError, match="^device: 'cuda' was asked for but torch .* sees no CUDA device"):
        require_device(DeviceConfig.resolve("cuda", "triton"))


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="^attention_backend: 'triton' on --device cpu .*TRITON_INTERPRET=1"):
        require_device(DeviceConfig("cpu", "triton"))


@CPU_ONLY
def test_build_model_runner_follows_the_arguments():
    args = ServerArgs(model_path="tiny-llama", max_total_tokens=64)
    runner = build_model_runner(args, args.model_config())
    assert runner.device.type == "cpu" and runner.backend.name == "torch_native"
    assert runner.pool.dtype == torch.float32 and runner.graphs is None


@CPU_ONLY
def test_serve_with_cuda_on_a_cpu_host_is_one_line():
    proc = subprocess.run([sys.executable, "-m", "pdserve", "serve", "--model-path", "tiny-llama",
                           "--device", "cuda"], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    [line] = [ln for ln in proc.stderr.splitlines() if "error" in ln.lower()]
    assert "device: 'cuda'" in line and "--device cpu" in line


def test_device_flags_map_to_server_args_and_up_forwards_them():
    from pdserve.entrypoints.cli import build_parser, server_args_from_namespace, server_flags_from_namespace

    flags = ["--device", "cpu", "--attention-backend", "torch_native", "--cuda-graph-max-bs", "8",
             "--disable-cuda-graph", "--deepep-mode", "normal", "--dtype", "float32"]
    args = server_args_from_namespace(build_parser().parse_args(["serve", "--model-path", "tiny-llama", *flags]))
    assert (args.device, args.attention_backend, args.cuda_graph_max_bs, args.disable_cuda_graph,
            args.deepep_mode, args.dtype) == ("cpu", "torch_native", 8, True, "normal", "float32")
    ns = build_parser().parse_args(["up", "--model-path", "tiny-llama", *flags])
    assert set(flags) <= set(server_flags_from_namespace(ns, ns.subparser))  # what `pdserve up` passes on


def _features(onednn=True, native_bf16=True):
    from pdserve.engine.device import CpuFeatures

    return CpuFeatures(onednn=onednn, native_bf16=native_bf16)


def test_cpu_gemm_policy_is_chosen_per_device_dtype_and_feature():
    from pdserve.engine.device import PACK_BFLOAT16, PACK_FLOAT32, cpu_pack_policy
    from pdserve.layers.cpu_gemm import PACK_ALWAYS

    cpu = lambda dtype="float32", gemm="auto": DeviceConfig("cpu", "torch_native", dtype, cpu_gemm=gemm)  # noqa: E731
    assert cpu_pack_policy(cpu(), _features()) == PACK_FLOAT32
    assert cpu_pack_policy(cpu("bfloat16"), _features()) == PACK_BFLOAT16
    assert cpu_pack_policy(cpu("bfloat16"), _features(native_bf16=False)) is None  # emulated bf16: F.linear
    assert cpu_pack_policy(cpu("float16"), _features()) is None
    assert cpu_pack_policy(cpu(gemm="packed"), _features()) == PACK_ALWAYS
    assert cpu_pack_policy(cpu(gemm="plain"), _features()) is None
    assert cpu_pack_policy(cpu(), _features(onednn=False)) is None  # a torch build without oneDNN
    # The GPU path keeps its kernels, whatever the flag says.
    assert cpu_pack_policy(DeviceConfig("cuda", "triton", "float32", cpu_gemm="packed"), _features()) is None


def test_cpu_features_read_the_flags_line(tmp_path):
    from pdserve.engine.device import CpuFeatures

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16 avx512_vnni\n\nprocessor\t: 1\n")
    assert CpuFeatures.detect(info).native_bf16
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx2\n")
    assert not CpuFeatures.detect(info).native_bf16
    assert not CpuFeatures.detect(tmp_path / "absent").native_bf16


def test_bad_cpu_gemm_names_the_field():
    with pytest.raises(ValueError, match="^cpu_gemm: 'fast' is not one of"):
        ServerArgs(model_path="tiny-llama", cpu_gemm="fast")


@CPU_ONLY
@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs torch's oneDNN ops")
@pytest.mark.parametrize("gemm, packs", [("packed", True), ("plain", False)])
def test_runner_packs_its_linears_as_the_flag_says(gemm, packs):
    from pdserve.layers.cpu_gemm import PACK_ALWAYS

    args = ServerArgs(model_path="tiny-llama", max_total_tokens=64, cpu_gemm=gemm)
    runner = build_model_runner(args, args.model_config())
    holders = [m for m in runner.model.modules() if hasattr(m, "packed")]
    assert len(holders) == 4 * 4 + 1  # qkv, o, gate_up, down per layer, and the LM head
    assert all((m.packed is not None) == packs for m in holders)
    assert runner.cpu_pack_policy == (PACK_ALWAYS if packs else None)


def test_cpu_gemm_flag_maps_to_server_args_and_up_forwards_it():
    from pdserve.entrypoints.cli import build_parser, server_args_from_namespace, server_flags_from_namespace

    ns = build_parser().parse_args(["serve", "--model-path", "tiny-llama", "--cpu-gemm", "plain"])
    assert server_args_from_namespace(ns).device_config().cpu_gemm == "plain"
    ns = build_parser().parse_args(["up", "--model-path", "tiny-llama", "--cpu-gemm", "plain"])
    assert ("--cpu-gemm", "plain") == server_flags_from_namespace(ns, ns.subparser)[-2:]
