"""A newcomer's first minutes: user errors at start-up are one clear line, never a traceback."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from safetensors.torch import load_file, save_file

from fixtures.tiny_models import make_tiny_hf_model


def _serve(model_path: str, *argv: str) -> subprocess.CompletedProcess:
    with socket.socket() as s:  # only for a port nobody listens on; the server is expected not to start
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return subprocess.run([sys.executable, "-m", "pdserve", "serve", "--model-path", model_path,
                           "--port", str(port), *argv], capture_output=True, text=True, timeout=180)


def _error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if "error" in line.lower()]


def test_model_dir_without_weights_names_the_cli_flag(tmp_path):
    src = Path(make_tiny_hf_model("LlamaForCausalLM", tmp_path / "src"))
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(src / "config.json", bare / "config.json")
    proc = _serve(str(bare))
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    [line] = _error_lines(proc)
    assert "model_path" in line and "--load-format dummy" in line and "load_format=" not in line


def test_checkpoint_error_in_the_scheduler_is_one_line(tmp_path):
    """The config names no architecture (resolved from model_type, so start-up gets as far as
    the scheduler process); the checkpoint lacks a tensor, which only loading finds."""
    path = Path(make_tiny_hf_model("Qwen3ForCausalLM", tmp_path / "m"))
    cfg = json.loads((path / "config.json").read_text())
    del cfg["architectures"]
    (path / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    proc = _serve(str(path))
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    [line] = _error_lines(proc)
    assert "checkpoint is missing 1 tensor(s): model.layers.1.self_attn.k_proj.weight" in line


def test_a_server_with_the_in_memory_transfer_backend_is_refused():
    """It moves KV only between schedulers in one process; a server's run in their own."""
    proc = _serve("tiny-llama", "--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "memory")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    [line] = _error_lines(proc)
    assert "disaggregation_transfer_backend: 'memory' moves KV only between schedulers in one process" in line


def test_a_model_type_transformers_does_not_know_is_refused_in_one_line(tmp_path):
    """Only transformers knows its model types, and the frontend imports none of it (it imports
    torch): the scheduler process refuses, and the frontend prints its line and exits. (No tokenizer
    files: transformers' AutoTokenizer would warn of the unknown type first, in a line of its own.)"""
    path = Path(make_tiny_hf_model("LlamaForCausalLM", tmp_path / "m"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).unlink()
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "model_type": "no_such_type"}))
    proc = _serve(str(path))
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    [line] = _error_lines(proc)
    assert "model_type: 'no_such_type'" in line and "is unknown to transformers" in line
