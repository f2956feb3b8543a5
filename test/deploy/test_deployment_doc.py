"""docs/deployment.md says what the files do: every path it builds, composes or applies exists,
the commands it spells out are the ones in the manifests, and its CI commands are .ci/run's.
(Its pdserve commands are parsed with the CLI in test_flag_drift.py.)"""

from __future__ import annotations

import re

import pytest
from deploy_files import (
    DEPLOYMENT_DOC,
    K8S,
    ROOT,
    doc_invocations,
    kustomize_dirs,
    pod_containers,
    render,
    shell_blocks,
)

DOC = DEPLOYMENT_DOC.read_text()


def _option(words: list[str], *names: str) -> list[str]:
    return [words[i + 1] for i, w in enumerate(words) if w in names]


def test_every_dockerfile_built_exists_and_the_context_is_the_root():
    builds = [w for w in doc_invocations(DOC) if w[:2] == ["docker", "build"]]
    assert len(builds) >= 2
    for words in builds:
        (dockerfile,) = _option(words, "-f", "--file")
        assert (ROOT / dockerfile).is_file(), dockerfile
        assert words[-1] == ".", f"build context of {' '.join(words)}"


def test_every_compose_file_exists():
    files = [f for w in doc_invocations(DOC) if w[:2] == ["docker", "compose"] for f in _option(w, "-f")]
    assert "docker/compose.yaml" in files
    assert all((ROOT / f).is_file() for f in files), files


def test_every_kustomization_applied_exists():
    applied = [w[w.index("-k") + 1] for w in doc_invocations(DOC) if w[:3] == ["kubectl", "apply", "-k"]]
    assert set(applied) == {str(d.relative_to(ROOT)) for d in kustomize_dirs()}, "every kustomization, applied"
    assert all((ROOT / d / "kustomization.yaml").is_file() for d in applied), applied
    listed = {d for d in re.findall(r"`(docker/k8s/[\w/-]+)`", DOC)}
    assert all((ROOT / d).exists() for d in listed), listed


def test_every_file_in_the_table_exists():
    for path in re.findall(r"^\| `(docker/[^`]+)` \|", DOC, re.M):
        assert (ROOT / path).exists(), path


@pytest.mark.parametrize("inline", re.findall(r"`(pdserve (?:serve|router) [^`]+)`", DOC))
def test_spelled_out_commands_are_the_base_manifests(inline):
    args = {tuple(c.get("args", [])) for o in render(K8S / "base") for c in pod_containers(o)}
    assert tuple(inline.split()[1:]) in args, f"not a container's args in docker/k8s/base: {inline}"


def test_ci_commands_are_the_ones_ci_runs():
    block = DOC.split("## CI checks of these files", 1)[1]
    lines = [ln for ln in shell_blocks(block) if ln.split()[0] in ("hadolint", "yamllint", "check-jsonschema")]
    assert len(lines) == 3
    ci = (ROOT / ".ci" / "run").read_text()
    for line in lines:
        assert line in ci, line
