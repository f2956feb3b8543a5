"""The images carry everything. For each Dockerfile: its build context, taken from the files on disk
with its ``.dockerignore`` applied as Docker applies it (docker_context.py), is copied apart; the wheel
is built from that copy alone (as the image's ``pip install ".[cpu]"`` builds it, with this
environment's setuptools and no network); a fresh venv gets that wheel and nothing of this checkout;
every module of ``pdserve`` and ``pdserve_kernels`` imports there; and the CPU image's default command
(ENTRYPOINT + CMD), run from that venv, answers the README's request. No Docker engine here: the venv
stands in for the image's /opt/venv, its dependencies are this environment's packages."""

from __future__ import annotations

import ast
import json
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from deploy_files import DOCKER, DOCKERFILES, ROOT, dockerfile_commands, dockerfile_instructions
from docker_context import (
    build_wheel,
    copy_context,
    dependency_paths,
    excluded,
    fresh_venv,
    isolated_env,
    parse_dockerignore,
    run,
    wheel_files,
)

from entrypoints.server_utils import alive, descendants, free_port_block, port_is_free

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PACKAGES = ("pdserve", "pdserve_kernels")

# Run in the fresh venv: where the packages come from, what is on sys.path, and every module imported.
_IMPORT_ALL = """
import importlib, importlib.metadata, json, pkgutil, sys, traceback
out = {"sys_path": sys.path, "modules": [], "failed": {}, "files": {},
       "dist": str(importlib.metadata.distribution("pdserve").locate_file("pdserve"))}
for name in sys.argv[1:]:
    try:
        pkg = importlib.import_module(name)
    except BaseException:
        out["failed"][name] = traceback.format_exc(limit=-3)
        continue
    out["files"][name] = pkg.__file__
    for m in pkgutil.walk_packages(pkg.__path__, name + ".", onerror=lambda n: out["failed"].setdefault(n, "walk")):
        try:
            importlib.import_module(m.name)
            out["modules"].append(m.name)
        except BaseException:
            out["failed"][m.name] = traceback.format_exc(limit=-3)
out["editable_finders"] = [m for m in sys.modules if "editable" in m]
print(json.dumps(out))
"""


# The GPU-only packages: on a CPU host none is installed. The second pass makes importing them fail.
GPU_PACKAGES = ("triton", "flashinfer", "deep_ep", "deep_gemm")
_WITHOUT = """
import importlib.abc, os, sys
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in os.environ["PDSERVE_TEST_ABSENT"].split(","):
            raise ModuleNotFoundError(f"No module named {name!r} (absent for this test)", name=name)
sys.meta_path.insert(0, Absent())
"""


@dataclass(frozen=True)
class Image:
    """One Dockerfile's build context (copied apart) and the wheel built from it."""

    dockerfile: Path
    context: Path
    files: tuple[str, ...]
    wheel: Path


@dataclass(frozen=True)
class Installed:
    """The CPU image's wheel in a fresh venv, and what importing every module there gave."""

    image: Image
    venv: Path
    imported: dict


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    built: dict[Path, Image] = {}

    def get(dockerfile: Path) -> Image:
        if dockerfile not in built:
            tmp = tmp_path_factory.mktemp(dockerfile.name)
            context = tmp / "context"
            files = copy_context(ROOT, dockerfile.with_name(dockerfile.name + ".dockerignore"), context)
            built[dockerfile] = Image(dockerfile, context, tuple(files), build_wheel(context, tmp / "dist"))
        return built[dockerfile]

    return get


@pytest.fixture(scope="module")
def cpu(images, tmp_path_factory) -> Installed:
    image, venv = images(DOCKER / "Dockerfile.cpu"), tmp_path_factory.mktemp("venv")
    python = fresh_venv(image.wheel, venv)
    imported = json.loads(run([str(python), "-c", _IMPORT_ALL, *PACKAGES], env=isolated_env(venv), cwd=venv))
    return Installed(image, venv, imported)


def copied_sources(dockerfile: Path) -> list[str]:
    """What the recipe takes from the context: COPY sources (not ``--from`` a stage) and bind mounts."""
    instructions = dockerfile_instructions(dockerfile)
    out = [s for i, a in instructions if i == "COPY" and "--from=" not in a for s in a.split()[:-1]
           if not s.startswith("--")]
    for _, args in instructions:
        out += [w.split("source=", 1)[1].split(",")[0] for w in args.split() if w.startswith("--mount=type=bind")]
    return [s.rstrip("/") for s in out]


def _under(path: str, source: str) -> bool:
    return path == source or path.startswith(source + "/")


def source_files(directory: str) -> set[str]:
    """The package sources on disk under ``directory``, without what Python writes beside them."""
    rules = parse_dockerignore("**/__pycache__\n**/*.pyc\n**/*.egg-info")
    return {str(p.relative_to(ROOT)) for p in (ROOT / directory).rglob("*")
            if p.is_file() and not excluded(rules, str(p.relative_to(ROOT)))}


# ------------------------------------------------------------------ the context
@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_the_context_is_what_the_recipe_copies_and_nothing_else(dockerfile, images):
    image, sources = images(dockerfile), copied_sources(dockerfile)
    assert "pyproject.toml" in sources and "README.md" in sources
    for where in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["where"]:
        assert where in sources, f"{dockerfile.name} does not COPY {where}/, where pyproject finds packages"
    for source in sources:
        on_disk = source_files(source) if (ROOT / source).is_dir() else {source}
        missing = on_disk - set(image.files)
        assert on_disk and not missing, f"{dockerfile.name} copies {source}, the context lacks {sorted(missing)[:5]}"
    extra = [f for f in image.files if not any(_under(f, s) for s in sources)]
    assert not extra, f"sent to the builder but never copied: {extra[:10]}"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_the_wheel_carries_every_module_and_asset(dockerfile, images):
    image = images(dockerfile)
    in_wheel = wheel_files(image.wheel)
    want = set()
    for where in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["where"]:
        for path in source_files(where):
            rel = path.split("/", 1)[1]  # python/pdserve/x.py -> pdserve/x.py
            if rel.endswith(".py") or rel.startswith("pdserve/assets/"):
                want.add(rel)
    assert {p.split("/", 1)[0] for p in want} == set(PACKAGES)
    assert not want - in_wheel, f"not in the wheel: {sorted(want - in_wheel)[:10]}"


def test_both_images_build_the_same_wheel(images):
    """So what the CPU image's wheel shows below (imports, the served request) holds for the CUDA one."""
    cpu_wheel, cuda_wheel = (images(DOCKER / f"Dockerfile.{k}").wheel for k in ("cpu", "cuda"))
    with zipfile.ZipFile(cpu_wheel) as a, zipfile.ZipFile(cuda_wheel) as b:
        names = sorted(n for n in a.namelist() if not n.endswith("RECORD"))
        assert names == sorted(n for n in b.namelist() if not n.endswith("RECORD"))
        assert not [n for n in names if a.read(n) != b.read(n)]


# ----------------------------------------------------------------- the venv
def test_the_fresh_venv_imports_the_wheel_not_the_checkout(cpu):
    got = cpu.imported
    for name in PACKAGES:
        where = got["files"].get(name)
        assert where and Path(where).is_relative_to(cpu.venv), f"{name} from {where}: {got['failed'].get(name)}"
    assert Path(got["dist"]).is_relative_to(cpu.venv), got["dist"]
    borrowed = {Path(p).resolve() for p in dependency_paths()}
    from_checkout = [p for p in got["sys_path"]
                     if p and Path(p).resolve().is_relative_to(ROOT) and Path(p).resolve() not in borrowed]
    assert not from_checkout, got["sys_path"]
    assert not got["editable_finders"]


def test_every_module_imports_from_the_wheel(cpu):
    got = cpu.imported
    assert not got["failed"], "\n".join(f"{m}:\n{tb}" for m, tb in got["failed"].items())
    sources = {p for where in ("python", "kernels") for p in source_files(where) if p.endswith(".py")}
    assert len(got["modules"]) == len(sources) - len(PACKAGES), "a module was not walked"
    assert "pdserve.disagg.staging" in got["modules"] and "pdserve_kernels.kv_pack_ref" in got["modules"]


# ------------------------------------------------- the CPU image's command
def readme_generate_example() -> tuple[str, dict]:
    """The README's first curl example: its path on the server and its JSON body."""
    text = (ROOT / "README.md").read_text().replace("\\\n", " ")
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("curl ") and "/generate" in ln)
    words = shlex.split(line)
    url, body = next(w for w in words if "/generate" in w), words[words.index("-d") + 1]
    return "/" + url.split("/", 1)[1], json.loads(body)


def _wait_up(proc: subprocess.Popen, log: Path, children: set[int]) -> None:
    deadline = time.monotonic() + 300
    while "pdserve is up" not in log.read_text(errors="replace"):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        children |= set(descendants(proc.pid))
        time.sleep(0.2)
    children |= set(descendants(proc.pid))


def _argv0(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    except OSError:
        return ""


def test_cpu_image_default_command_serves_from_the_wheel(cpu):
    image, venv = cpu.image, cpu.venv
    (cmd,) = dockerfile_commands(image.dockerfile)
    argv = list(cmd.argv)
    assert argv[:1] == ["up"] and argv[argv.index("--host") + 1] == "0.0.0.0"
    env = isolated_env(venv)
    entrypoint = shutil.which("pdserve", path=env["PATH"])  # ENTRYPOINT ["pdserve"], found on the image's PATH
    assert entrypoint and Path(entrypoint).is_relative_to(venv), entrypoint
    port = free_port_block(4)  # the router, then a prefill and a decode server on the next ports
    env["PDSERVE_HEALTH_URL"] = f"http://127.0.0.1:{port}/health"
    # The image's command with this host's free ports (later flags win) and quieter logs.
    full = [entrypoint, *argv, "--port", str(port), "--bootstrap-port", str(port + 3), "--log-level", "warning"]
    workdir = Path(tempfile.mkdtemp(prefix="pdserve-image-home-"))  # the image's WORKDIR, outside the checkout
    # Beyond the loopback the command refuses to start without a key, in one line; `docker run -e
    # PDSERVE_API_KEY=...` gives it one (the Dockerfile says so).
    refused = subprocess.run(full, env=env, cwd=workdir, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--api-key" in refused.stderr, refused.stderr
    env["PDSERVE_API_KEY"] = "image-test-key"
    log = workdir / "pdserve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(full, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env,
                                cwd=workdir)
    children: set[int] = set()
    try:
        _wait_up(proc, log, children)
        pythons = [_argv0(c) for c in children if "python" in Path(_argv0(c)).name]
        assert pythons and all(Path(p).is_relative_to(venv) for p in pythons), pythons
        path, body = readme_generate_example()
        resp = httpx.post(f"http://127.0.0.1:{port}{path}", json=body, timeout=120,
                          headers={"Authorization": "Bearer image-test-key"})
        assert resp.status_code == 200, resp.text
        out = resp.json()
        assert out["text"] and out["meta_info"]["completion_tokens"] == body["sampling_params"]["max_new_tokens"]
        # The image's HEALTHCHECK: the script from the context, run by the venv's python.
        health = subprocess.run([str(venv / "bin" / "python"), str(image.context / "docker" / "healthcheck.py")],
                                env=env, cwd=workdir, timeout=60)
        assert health.returncode == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        wait_until = time.monotonic() + 30
        while any(alive(c) for c in children) and time.monotonic() < wait_until:
            time.sleep(0.2)
        assert not [c for c in children if alive(c)]
        assert all(port_is_free(p) for p in range(port, port + 4))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


# ------------------------------------------------- the matcher is Docker's
@pytest.mark.parametrize("lines,path,want", [
    # The Dockerfile reference's .dockerignore examples.
    (["*/temp*"], "somedir/temporary.txt", True),
    (["*/temp*"], "somedir/temp", True),
    (["*/temp*"], "temporary.txt", False),
    (["*/*/temp*"], "somedir/subdir/temporary.txt", True),
    (["temp?"], "tempa", True),
    (["temp?"], "temp", False),
    (["**/*.go"], "a/b/c.go", True),
    (["**/*.go"], "c.go", True),
    (["*.md", "!README*.md", "README-secret.md"], "README.md", False),
    (["*.md", "!README*.md", "README-secret.md"], "README-secret.md", True),
    (["*.md", "!README*.md", "README-secret.md"], "CHANGES.md", True),
    # Anchored at the root, unlike .gitignore; a trailing / and a leading / are dropped.
    (["foo"], "a/foo", False),
    (["/foo/"], "foo", True),
    # A pattern matches a path through its parents, and an exception re-includes below an
    # excluded directory, unlike .gitignore.
    (["*"], "python/pdserve/x.py", True),
    (["*", "!python/"], "python/pdserve/x.py", False),
    (["*", "!python/pdserve/x.py"], "python/pdserve/x.py", False),
    (["*", "!python/", "**/__pycache__"], "python/pdserve/__pycache__/x.cpython-311.pyc", True),
    (["# a comment", "", "x"], "y", False),
])
def test_the_matcher_follows_docker(lines, path, want):
    assert excluded(parse_dockerignore("\n".join(lines)), path) is want


def _imports_triton_at_load(module: str) -> bool:
    path = ROOT / "kernels" / Path(*module.split(".")).with_suffix(".py")
    tree = ast.parse(path.read_text())
    return any(isinstance(n, (ast.Import, ast.ImportFrom)) and "triton" in ast.unparse(n) for n in tree.body)


def test_without_the_gpu_packages_every_pdserve_module_still_imports(cpu):
    """GPU imports are lazy (docs/gpu.md): with triton, flashinfer, DeepEP and DeepGEMM absent, every
    module of pdserve imports, and of pdserve_kernels only the Triton kernel modules themselves fail."""
    env = {**isolated_env(cpu.venv), "PDSERVE_TEST_ABSENT": ",".join(GPU_PACKAGES)}
    got = json.loads(run([str(cpu.venv / "bin" / "python"), "-c", _WITHOUT + _IMPORT_ALL, *PACKAGES],
                         env=env, cwd=cpu.venv))
    failed = set(got["failed"])
    assert not {m for m in failed if not m.startswith("pdserve_kernels.")}, got["failed"]
    kernels = {m for m in cpu.imported["modules"] if m.startswith("pdserve_kernels.")}
    assert failed == {m for m in kernels if _imports_triton_at_load(m)}, got["failed"]
    assert all("triton" in tb for tb in got["failed"].values())
    assert {m for m in kernels if m.endswith("_ref")} <= set(got["modules"])
