"""A real ``pdserve serve``'s HTTP frontend imports no torch and no transformers config class (they
import torch): seconds of CPU every server start, and the scheduler process, which runs the model,
imports them anyway. Observed from outside on the live process (its memory maps) and, at its exit,
from inside (its ``sys.modules``, written by a wrapper that runs the same CLI)."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

from entrypoints.server_utils import Server
from pdserve.assets import preset_dir

# ``python WRAPPER OUT serve ...``: the pdserve CLI, then the modules its process held, as JSON in OUT.
# (The scheduler, spawned, runs this file as __mp_main__: the guard keeps it out.)
WRAPPER = """
import json, sys

if __name__ == "__main__":
    out = sys.argv.pop(1)
    from pdserve.entrypoints.cli import main
    try:
        code = main(sys.argv[1:])
    finally:
        with open(out, "w") as f:
            json.dump(sorted(sys.modules), f)
    sys.exit(code)
"""


def _torch_or_hf_config(modules) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] == "torch" or m == "transformers.configuration_utils"
                  or (m.startswith("transformers.models.") and ".configuration_" in m))


def _mapped_torch_libraries(pid: int) -> list[str]:
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return sorted({line.split()[-1] for line in maps if "/torch/lib/" in line})


def test_the_frontend_of_a_served_model_imports_no_torch(tmp_path):
    wrapper, out = tmp_path / "serve_and_list_modules.py", tmp_path / "modules.json"
    wrapper.write_text(WRAPPER)
    server = Server(model="tiny-llama")
    server.cmd = [sys.executable, str(wrapper), str(out), *server.cmd[3:]]  # the same flags, through the wrapper
    try:
        server.start()
        r = server.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 3})
        assert r.status_code == 200, r.text
        info = server.get("/model_info").json()
        vocab = json.loads((preset_dir("tiny-llama") / "config.json").read_text())["vocab_size"]
        assert info["architecture"] == "LlamaForCausalLM" and info["vocab_size"] == vocab
        assert not _mapped_torch_libraries(server.proc.pid), "the frontend process loaded torch"
        scheduler = server.info()["scheduler_pids"][0]
        assert _mapped_torch_libraries(scheduler), "the check can see torch loaded (the scheduler's)"
        server.signal(signal.SIGTERM)
        assert server.wait(30) == 0, server.output()
    finally:
        server.stop()
    assert out.exists(), "the wrapper wrote no module list"
    modules = json.loads(out.read_text())
    assert "pdserve.entrypoints.http_server" in modules and "transformers" in modules  # it served, with a tokenizer
    assert not _torch_or_hf_config(modules)
