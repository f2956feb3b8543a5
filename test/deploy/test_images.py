"""docker/Dockerfile.*: what the recipes promise (pinned bases, registry-only installs, a
non-root user, a health check, pdserve as entrypoint), the health-check script against a real
HTTP server, and the CPU image's default command run for real on this host, answering the
README's curl example. No image is built here (no Docker engine): the run is the image's
ENTRYPOINT + CMD in this checkout's environment."""

from __future__ import annotations

import http.server
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
from deploy_files import DOCKER, DOCKERFILES, ROOT, dockerfile_commands, dockerfile_instructions, final_stage

from entrypoints.server_utils import alive, descendants, free_port, port_is_free

HEALTHCHECK = DOCKER / "healthcheck.py"


def instructions(name: str) -> list[tuple[str, str]]:
    return dockerfile_instructions(DOCKER / name)


def arg_defaults(name: str) -> dict[str, str]:
    return dict(a.split("=", 1) for i, a in instructions(name) if i == "ARG" and "=" in a)


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_bases_are_pinned_by_tag_and_digest(path):
    defaults = arg_defaults(path.name)
    froms = [a.split()[0] for i, a in instructions(path.name) if i == "FROM"]
    assert len(froms) >= 2, "multi-stage: a build stage and a runtime stage"
    for ref in froms:
        image = defaults.get(ref.strip("${}"), ref)
        assert re.fullmatch(r"[\w./-]+:[\w.-]+@sha256:[0-9a-f]{64}", image), f"{ref} -> {image}"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_final_stage_runs_pdserve_as_a_user_with_a_health_check(path):
    final = final_stage(dockerfile_instructions(path))
    user = [a for i, a in final if i == "USER"]
    assert user and re.fullmatch(r"[1-9]\d*(:\d+)?", user[-1]), "a numeric non-root USER (runAsNonRoot can check it)"
    assert any(i == "HEALTHCHECK" and "pdserve-healthcheck" in a for i, a in final)
    assert any(i == "LABEL" and "org.opencontainers.image.title" in a for i, a in final)
    assert dockerfile_commands(path)  # ENTRYPOINT ["pdserve"] and a CMD


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_nothing_is_fetched_outside_the_registries_or_compiled(path):
    runs = " ".join(a for i, a in dockerfile_instructions(path) if i == "RUN")
    for word in ("git clone", "curl ", "wget ", "cmake", "make ", "setup.py", "nvcc", "ADD http"):
        assert word not in runs, f"{path.name}: {word!r}"
    assert not [a for i, a in dockerfile_instructions(path) if i == "ADD"], "ADD can fetch URLs: COPY only"
    for i, a in dockerfile_instructions(path):
        if i == "COPY" and "--from=" not in a:
            for src in a.split()[:-1]:
                assert src.startswith("--") or (ROOT / src).exists(), f"{path.name}: COPY {src} is not in the tree"


def test_cuda_image_installs_the_gpu_stack():
    runs = " ".join(a for i, a in instructions("Dockerfile.cuda") if i == "RUN")
    defaults = arg_defaults("Dockerfile.cuda")
    for needed in ('".[cuda]"', "flashinfer-python==", "mooncake-transfer-engine==", "libibverbs1", "libnuma1",
                   "ibverbs-providers", "$DEEPEP_WHEEL", "$NVSHMEM_WHEEL", "--mount=type=bind,source=docker/wheels"):
        assert needed in runs, needed
    assert defaults["DEEPEP_WHEEL"] == defaults["NVSHMEM_WHEEL"] == "", "DeepEP and NVSHMEM are optional"
    assert (DOCKER / "wheels").is_dir()


def test_cpu_image_installs_cpu_torch_and_the_cpu_extra():
    runs = " ".join(a for i, a in instructions("Dockerfile.cpu") if i == "RUN")
    assert arg_defaults("Dockerfile.cpu")["TORCH_VERSION"] == "2.13.0"
    for needed in ('"torch==${TORCH_VERSION}"', '".[cpu]"', "libibverbs1", "libnuma1", "libcurl4"):
        assert needed in runs, needed


# ------------------------------------------------------------ health check
class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):  # noqa: N802 - the http.server hook's name
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def _healthcheck(*args: str) -> int:
    return subprocess.run([sys.executable, str(HEALTHCHECK), *args], timeout=60).returncode


@pytest.mark.parametrize("status,code", [(200, 0), (503, 1)])
def test_healthcheck_script_follows_the_health_status(status, code):
    handler = type("H", (_Health,), {"status": status})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert _healthcheck(f"http://127.0.0.1:{server.server_port}/health") == code
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_healthcheck_script_fails_on_a_closed_port():
    assert _healthcheck(f"http://127.0.0.1:{free_port()}/health") == 1


# ------------------------------------------------- the CPU image's command
def readme_generate_example() -> tuple[str, dict]:
    """The README's first curl example: its path on the server and its JSON body."""
    text = (ROOT / "README.md").read_text().replace("\\\n", " ")
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("curl ") and "/generate" in ln)
    words = shlex.split(line)
    url, body = next(w for w in words if "/generate" in w), words[words.index("-d") + 1]
    return "/" + url.split("/", 1)[1], json.loads(body)


def test_cpu_image_default_command_serves_the_readme_example():
    (cmd,) = dockerfile_commands(DOCKER / "Dockerfile.cpu")
    argv = list(cmd.argv)
    assert argv[:1] == ["up"] and argv[argv.index("--host") + 1] == "0.0.0.0"
    port, boot = free_port(), free_port()
    # The image's command with this host's free ports (later flags win) and quieter logs.
    full = [sys.executable, "-m", "pdserve", *argv, "--port", str(port), "--bootstrap-port", str(boot),
            "--log-level", "warning"]
    log = tempfile.NamedTemporaryFile(prefix="pdserve-cpu-cmd-", suffix=".log", delete=False)
    proc = subprocess.Popen(full, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PDSERVE_HEALTH_URL": f"http://127.0.0.1:{port}/health"})
    children: set[int] = set()
    try:
        deadline = time.monotonic() + 300
        while "pdserve is up" not in Path(log.name).read_text(errors="replace"):
            assert proc.poll() is None and time.monotonic() < deadline, Path(log.name).read_text()[-3000:]
            children |= set(descendants(proc.pid))
            time.sleep(0.2)
        children |= set(descendants(proc.pid))
        path, body = readme_generate_example()
        resp = httpx.post(f"http://127.0.0.1:{port}{path}", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        out = resp.json()
        assert out["text"] and out["meta_info"]["completion_tokens"] == body["sampling_params"]["max_new_tokens"]
        assert subprocess.run([sys.executable, str(HEALTHCHECK)], timeout=60,
                              env={**os.environ, "PDSERVE_HEALTH_URL": f"http://127.0.0.1:{port}/health"}
                              ).returncode == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        wait_until = time.monotonic() + 30
        while any(alive(c) for c in children) and time.monotonic() < wait_until:
            time.sleep(0.2)
        assert not [c for c in children if alive(c)]
        assert all(port_is_free(p) for p in (port, port + 1, port + 2, boot))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        Path(log.name).unlink()


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_the_build_context_keeps_what_the_recipe_copies(path):
    ignore = (path.parent / (path.name + ".dockerignore")).read_text().splitlines()
    kept = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert "*" in ignore
    sources = [s for i, a in dockerfile_instructions(path) if i == "COPY" and "--from=" not in a
               for s in a.split()[:-1] if not s.startswith("--")]
    sources += re.findall(r"--mount=type=bind,source=([\w./-]+)", " ".join(a for _, a in dockerfile_instructions(path)))
    assert sources and not [s for s in sources if s.rstrip("/") not in kept]
