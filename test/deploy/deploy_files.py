"""The deployment files under docker/ read the way their tools read them, for the tests beside
this module: the pdserve command lines in the Dockerfiles, the compose file, the Kubernetes
manifests and docs/deployment.md, and the manifests as ``kubectl apply -k`` renders them.

The kustomize renderer covers what docker/k8s uses (resources, strategic-merge and JSON 6902
patches, image overrides) and refuses any other kustomization field, so a manifest change that
needs more fails here instead of being checked half-rendered.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
DOCKERFILES = (DOCKER / "Dockerfile.cpu", DOCKER / "Dockerfile.cuda")
COMPOSE_FILES = (DOCKER / "compose.yaml", DOCKER / "compose.rdma.yaml")
K8S = DOCKER / "k8s"
DEPLOYMENT_DOC = ROOT / "docs" / "deployment.md"

# What a Kubernetes downward-API field holds at run time, for the commands that use one.
FIELD_SAMPLES = {"status.podIP": "10.0.0.1"}
POD_INDEX_FIELD = "metadata.labels['apps.kubernetes.io/pod-index']"


@dataclass(frozen=True)
class Command:
    """One pdserve invocation: ``argv`` after the ``pdserve`` program name, and where it is."""

    source: str
    argv: tuple[str, ...]


# ------------------------------------------------------------ Dockerfiles
def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out, pending = [], ""
    for line in path.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        word, _, rest = (pending + line).strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        pending = ""
    return out


def exec_form(text: str, where: str) -> list[str]:
    """A JSON-array (exec form) ENTRYPOINT/CMD; the shell form would hide signals from pdserve."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise AssertionError(f"{where}: not in exec (JSON array) form: {text!r} ({e})") from None
    if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise AssertionError(f"{where}: not a JSON array of strings: {text!r}")
    return value


def dockerfile_commands(path: Path) -> list[Command]:
    """The image's default command: ENTRYPOINT ["pdserve"] + the last CMD of the final stage."""
    final = final_stage(dockerfile_instructions(path))
    entry = [exec_form(a, f"{path.name} ENTRYPOINT") for i, a in final if i == "ENTRYPOINT"]
    cmd = [exec_form(a, f"{path.name} CMD") for i, a in final if i == "CMD"]
    if entry != [["pdserve"]]:
        raise AssertionError(f"{path.name}: the final stage's ENTRYPOINT must be [\"pdserve\"], got {entry}")
    return [Command(f"{path.name} CMD", tuple(cmd[-1]))] if cmd else []


def final_stage(instructions: list[tuple[str, str]]) -> list[tuple[str, str]]:
    starts = [k for k, (i, _) in enumerate(instructions) if i == "FROM"]
    return instructions[starts[-1]:]


# ---------------------------------------------------------------- compose
_COMPOSE_VAR = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def compose_interpolate(text: str, where: str) -> str:
    """``${VAR:-default}`` -> default; a variable without a default has no value to check."""
    def sub(m: re.Match) -> str:
        if m.group(2) is None:
            raise AssertionError(f"{where}: ${{{m.group(1)}}} has no default, so its command cannot be checked")
        return m.group(2)

    return _COMPOSE_VAR.sub(sub, text)


def load_compose(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def compose_commands(path: Path) -> list[Command]:
    """Every service's command (the image's entrypoint is pdserve)."""
    out = []
    for name, service in (load_compose(path).get("services") or {}).items():
        if "command" not in service:
            continue
        where = f"{path.name} services.{name}.command"
        if "entrypoint" in service:
            raise AssertionError(f"{where}: an entrypoint override hides the command from this check")
        cmd = service["command"]
        argv = shlex.split(cmd) if isinstance(cmd, str) else [str(a) for a in cmd]
        out.append(Command(where, tuple(compose_interpolate(a, where) for a in argv)))
    return out


# ------------------------------------------------------------- kustomize
KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "resources", "patches", "images"}
# Strategic merge: lists of these keys merge item by item on the named field; other lists are
# replaced whole (Kubernetes' patchMergeKey for the fields docker/k8s patches).
MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name", "volumes": "name",
              "volumeMounts": "mountPath", "ports": "containerPort"}


def render(directory: Path) -> list[dict]:
    """The objects ``kubectl apply -k directory`` would apply."""
    kfile = directory / "kustomization.yaml"
    if not kfile.is_file():
        raise AssertionError(f"{directory}: no kustomization.yaml")
    spec = yaml.safe_load(kfile.read_text())
    unknown = set(spec) - KUSTOMIZATION_FIELDS
    if unknown:
        raise AssertionError(f"{kfile}: fields {sorted(unknown)} are not rendered by this check")
    objects: list[dict] = []
    for res in spec.get("resources", []):
        path = (directory / res).resolve()
        objects += render(path) if path.is_dir() else _load_docs(path)
    for patch in spec.get("patches", []):
        _apply_patch(objects, directory, patch, kfile)
    for image in spec.get("images", []):
        _set_image(objects, image)
    return objects


def _load_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _find(objects: list[dict], kind: str, name: str, where: Path) -> dict:
    for obj in objects:
        if obj["kind"] == kind and obj["metadata"]["name"] == name:
            return obj
    raise AssertionError(f"{where}: patch target {kind}/{name} is not among the resources")


def _apply_patch(objects: list[dict], directory: Path, patch: dict, where: Path) -> None:
    if set(patch) - {"path", "target"}:
        raise AssertionError(f"{where}: patch fields {sorted(set(patch) - {'path', 'target'})} are not rendered")
    docs = _load_docs(directory / patch["path"])
    if "target" in patch:  # JSON 6902: a list of operations on one object
        t = patch["target"]
        _json6902(_find(objects, t["kind"], t["name"], where), docs[0], where)
        return
    for doc in docs:
        obj = _find(objects, doc["kind"], doc["metadata"]["name"], where)
        merged = strategic_merge(obj, doc)
        obj.clear()
        obj.update(merged)


def strategic_merge(base, patch, key: str | None = None):
    """``patch`` over ``base``: maps merge, null deletes, lists of MERGE_KEYS merge by their key."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            else:
                out[k] = strategic_merge(out[k], v, k) if k in out else copy.deepcopy(v)
        return out
    if isinstance(base, list) and isinstance(patch, list) and key in MERGE_KEYS:
        field, out = MERGE_KEYS[key], copy.deepcopy(base)
        for item in patch:
            match = next((i for i, b in enumerate(out) if b.get(field) == item.get(field)), None)
            if match is None:
                out.append(copy.deepcopy(item))
            else:
                out[match] = strategic_merge(out[match], item)
        return out
    return copy.deepcopy(patch)


def _json6902(obj: dict, ops: list[dict], where: Path) -> None:
    for op in ops:
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        node = obj
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        if op["op"] in ("add", "replace") and isinstance(node, list):
            index = len(node) if last == "-" else int(last)
            node[index:index + (op["op"] == "replace")] = [op["value"]]
        elif op["op"] in ("add", "replace"):
            node[last] = op["value"]
        elif op["op"] == "remove":
            del node[int(last) if isinstance(node, list) else last]
        else:
            raise AssertionError(f"{where}: JSON patch op {op['op']!r} is not rendered")


def _set_image(objects: list[dict], image: dict) -> None:
    for container in (c for obj in objects for c in pod_containers(obj)):
        name, _, tag = container["image"].partition(":")
        if name == image["name"]:
            container["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}"


def pod_spec(obj: dict) -> dict | None:
    if obj["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        return obj["spec"]["template"]["spec"]
    return obj["spec"] if obj["kind"] == "Pod" else None


def pod_containers(obj: dict) -> list[dict]:
    spec = pod_spec(obj)
    return [] if spec is None else spec.get("containers", []) + spec.get("initContainers", [])


def kustomize_dirs() -> list[Path]:
    return sorted(p.parent for p in K8S.rglob("kustomization.yaml"))


def k8s_commands(directory: Path) -> list[Command]:
    """Each pdserve container's args (no ``command``: the image's entrypoint, pdserve), with
    ``$(VAR)`` replaced by what the container's env gives it."""
    out = []
    for obj in render(directory):
        for c in pod_containers(obj):
            if "command" in c or not c["image"].split(":")[0].endswith("pdserve"):
                continue
            where = f"{directory.relative_to(ROOT)}: {obj['kind']}/{obj['metadata']['name']} {c['name']}"
            env = _env_values(obj, c)
            out.append(Command(where, tuple(_expand(str(a), env, where) for a in c.get("args", []))))
    return out


def _env_values(obj: dict, container: dict) -> dict[str, str]:
    ordinal = str(obj["spec"].get("ordinals", {}).get("start", 0)) if obj["kind"] == "StatefulSet" else None
    values = {}
    for e in container.get("env", []):
        if "value" in e:
            values[e["name"]] = e["value"]
            continue
        field = e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        if field == POD_INDEX_FIELD and ordinal is not None:
            values[e["name"]] = ordinal  # the first pod's; the others differ only in --node-rank
        elif field in FIELD_SAMPLES:
            values[e["name"]] = FIELD_SAMPLES[field]
    return values


def _expand(arg: str, env: dict[str, str], where: str) -> str:
    def sub(m: re.Match) -> str:
        if m.group(1) not in env:
            raise AssertionError(f"{where}: $({m.group(1)}) is not set from the container's env")
        return env[m.group(1)]

    return re.sub(r"\$\((\w+)\)", sub, arg)


# ------------------------------------------------------------------ docs
def shell_blocks(markdown: str) -> list[str]:
    """Lines of ```bash/sh/console blocks, continuations joined, prompts and comments dropped."""
    lines, out = [], []
    for block in re.findall(r"```(?:bash|sh|shell|console)\n(.*?)```", markdown, re.S):
        pending = ""
        for line in block.splitlines():
            line = line.strip()
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            lines.append((pending + line).removeprefix("$ ").strip())
            pending = ""
    for line in lines:
        code = line.split(" #", 1)[0].strip() if not line.startswith("#") else ""
        if code:
            out.append(code)
    return out


def doc_invocations(markdown: str) -> list[list[str]]:
    """Every command in the doc's shell blocks, split at ``&&``, ``||``, ``;`` and pipes."""
    out = []
    for line in shell_blocks(markdown):
        words = shlex.split(line, comments=True)
        current: list[str] = []
        for w in words:
            if w in ("&&", "||", ";", "|"):
                out.append(current)
                current = []
            else:
                current.append(w)
        out.append(current)
    return [c for c in out if c]


# docker run options that take a value (those the doc uses; an unknown option fails the test).
DOCKER_RUN_VALUE_OPTIONS = {"-p", "--publish", "-v", "--volume", "-e", "--env", "--name", "--gpus", "--shm-size",
                            "--network", "--env-file", "--ulimit", "--cap-add", "--device", "--ipc"}
DOCKER_RUN_FLAGS = {"--rm", "-d", "--detach", "-it", "-i", "-t"}


def docker_run_argv(words: list[str], where: str) -> tuple[str, list[str]]:
    """(image, pdserve argv) of a ``docker run`` command; an empty argv means the image's CMD."""
    i = 2
    while i < len(words) and words[i].startswith("-"):
        opt = words[i].split("=", 1)[0]
        if opt in DOCKER_RUN_VALUE_OPTIONS:
            i += 1 if "=" in words[i] else 2
        elif opt in DOCKER_RUN_FLAGS:
            i += 1
        else:
            raise AssertionError(f"{where}: docker run option {opt} is unknown to this check")
    if i >= len(words):
        raise AssertionError(f"{where}: docker run without an image")
    return words[i], words[i + 1:]


def doc_commands(path: Path = DEPLOYMENT_DOC) -> list[Command]:
    """pdserve commands of the doc: ``pdserve ...`` and ``docker run IMAGE args`` with args."""
    out = []
    for words in doc_invocations(path.read_text()):
        where = f"{path.name}: {' '.join(words)}"
        if words[0] == "pdserve":
            out.append(Command(where, tuple(words[1:])))
        elif words[:2] == ["docker", "run"]:
            _, argv = docker_run_argv(words, where)
            if argv:
                out.append(Command(where, tuple(argv)))
    return out
