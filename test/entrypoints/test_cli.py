"""The ``pdserve`` CLI: flag -> ServerArgs mapping and clean exit code 2 on bad arguments."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.config import ServerArgs
from pdserve.entrypoints.cli import build_parser, server_args_from_namespace

FLAGS = ["--model-path", "tiny-deepseek", "--tokenizer-path", "/tok", "--load-format", "dummy",
         "--dtype", "bfloat16", "--host", "0.0.0.0", "--port", "8123", "--page-size", "16",
         "--max-running-requests", "8", "--max-total-tokens", "4096", "--chunked-prefill-size", "256",
         "--schedule-policy", "lpm", "--disable-radix-cache", "--random-seed", "7", "--api-key", "k",
         "--log-level", "debug", "--served-model-name", "tiny", "--max-request-bytes", "1000",
         "--num-threads", "3", "--enable-torch-compile", "--torch-compile-max-bs", "8"]


def test_every_flag_maps_to_server_args():
    ns = build_parser().parse_args(["serve", *FLAGS])
    args = server_args_from_namespace(ns)
    assert args == ServerArgs(model_path="tiny-deepseek", tokenizer_path="/tok", load_format="dummy",
                              dtype="bfloat16", host="0.0.0.0", port=8123, page_size=16, max_running_requests=8,
                              max_total_tokens=4096, chunked_prefill_size=256, schedule_policy="lpm",
                              disable_radix_cache=True, random_seed=7, api_key="k", log_level="debug",
                              served_model_name="tiny", max_request_bytes=1000, num_threads=3,
                              enable_torch_compile=True, torch_compile_max_bs=8)


def test_defaults_are_server_args_defaults():
    args = server_args_from_namespace(build_parser().parse_args(["serve", "--model-path", "tiny-deepseek"]))
    assert args == ServerArgs(model_path="tiny-deepseek")


def _run(*argv: str, module: str = "pdserve") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("argv,field", [
    (["--page-size", "0"], "page_size"),
    (["--port", "70000"], "port"),
    (["--max-running-requests", "0"], "max_running_requests"),
    (["--max-total-tokens", "0"], "max_total_tokens"),
    (["--max-request-bytes", "0"], "max_request_bytes"),
    (["--torch-compile-max-bs", "0"], "torch_compile_max_bs"),
])
def test_invalid_server_args_exit_2_naming_the_field(argv, field):
    proc = _run("serve", "--model-path", "tiny-deepseek", *argv)
    assert proc.returncode == 2
    assert field in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("argv, field", [
    (["--disaggregation-mode", "prefil"], "--disaggregation-mode"),
    (["--disaggregation-fallback", "retry"], "--disaggregation-fallback"),
    (["--disaggregation-timeout-s", "0"], "disaggregation_timeout_s"),
    (["--disaggregation-min-prefill-tokens", "-1"], "disaggregation_min_prefill_tokens"),
    (["--disaggregation-bootstrap-port", "70000"], "disaggregation_bootstrap_port"),
])
def test_invalid_disaggregation_flags_exit_2_naming_the_field(argv, field):
    proc = _run("serve", "--model-path", "tiny-llama", *argv)
    assert proc.returncode == 2
    assert field in proc.stderr and "Traceback" not in proc.stderr


def test_unknown_model_exits_2():
    proc = _run("serve", "--model-path", "/no/such/model")
    assert proc.returncode == 2 and "model_path" in proc.stderr


def test_entry_points_share_the_cli():
    assert "serve" in _run("--help").stdout
    help_text = _run("serve", "--help").stdout
    for flag in ("--disaggregation-mode", "--disaggregation-bootstrap-port", "--disaggregation-fallback",
                 "--disaggregation-min-prefill-tokens", "--disaggregation-timeout-s"):
        assert flag in help_text
    assert "--model-path" in _run("--help", module="pdserve.launch_server").stdout
    assert _run("serve", module="pdserve").returncode == 2  # --model-path is required


def test_console_script_is_declared():
    from pathlib import Path

    import tomllib

    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"]["pdserve"] == "pdserve.__main__:main"
