"""docker/Dockerfile.*: what the recipes promise (pinned bases, registry-only installs, a
non-root user, a health check, pdserve as entrypoint) and the health-check script against a real
HTTP server. No image is built here (no Docker engine); the build context, the wheel built from
it and the CPU image's default command run from that wheel are test_wheel_from_context.py's."""

from __future__ import annotations

import http.server
import re
import subprocess
import sys
import threading

import pytest
from deploy_files import DOCKER, DOCKERFILES, ROOT, dockerfile_commands, dockerfile_instructions, final_stage

from entrypoints.server_utils import free_port

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
    for needed in ('"torch==${TORCH_VERSION}"', '".[cpu]"', "libibverbs1", "libnuma1", "libcurl4", "gcc"):
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
