"""The deployment files under docker/ read the way their tools read them, for the tests beside
this module: the pdserve command lines in the Dockerfiles, the compose file and the Kubernetes
manifests, the commands of the docs' shell blocks (COMMAND_DOCS) as a shell would run them, and
the manifests as ``kubectl apply -k`` renders them.

The kustomize renderer covers what docker/k8s uses (resources, strategic-merge patches with
``$patch: delete``, JSON 6902 patches, image overrides; LeaderWorkerSets' two pod templates) and
refuses any other kustomization field, so a manifest change that needs more fails here instead of
being checked half-rendered. Where kubectl is installed, test_manifests.py compares it with
``kubectl kustomize``.
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
# The docs whose every command block test_doc_commands.py parses with the CLIs.
COMMAND_DOCS = (DEPLOYMENT_DOC, ROOT / "docs" / "disaggregation.md")

# What a Kubernetes downward-API field holds at run time, for the commands that use one.
FIELD_SAMPLES = {"status.podIP": "10.0.0.1", "metadata.namespace": "default"}
POD_INDEX_FIELD = "metadata.labels['apps.kubernetes.io/pod-index']"


@dataclass(frozen=True)
class Command:
    """One invocation: ``argv`` after the program name, where it is, which program (``pdserve``,
    ``sglang-router`` or ``mooncake_master``) and the environment a doc gave it (``VAR=value``)."""

    source: str
    argv: tuple[str, ...]
    program: str = "pdserve"
    env: tuple[tuple[str, str], ...] = ()


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
    if len(docs) != 1:  # kustomize's `patches` takes one patch per file
        raise AssertionError(f"{where}: {patch['path']} holds {len(docs)} patches; `patches` takes one per file")
    if "target" in patch:  # JSON 6902: a list of operations on one object
        t = patch["target"]
        _json6902(_find(objects, t["kind"], t["name"], where), docs[0], where)
        return
    for doc in docs:
        obj = _find(objects, doc["kind"], doc["metadata"]["name"], where)
        if doc.get("$patch") == "delete":  # the object goes (kustomize's strategic-merge delete)
            objects.remove(obj)
            continue
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
        field, out, new = MERGE_KEYS[key], copy.deepcopy(base), []
        for item in patch:
            match = next((i for i, b in enumerate(out) if b.get(field) == item.get(field)), None)
            if match is None:
                new.append(copy.deepcopy(item))
            else:
                out[match] = strategic_merge(out[match], item)
        return new + out  # kustomize puts the items the base lacks first
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


LWS_KIND = "LeaderWorkerSet"


def pod_templates(obj: dict) -> list[dict]:
    """The pod templates (``metadata`` + ``spec``) of a workload; a LeaderWorkerSet has two, its
    leader's (when given; else the worker template serves the leader too) and its workers'."""
    if obj["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        return [obj["spec"]["template"]]
    if obj["kind"] == LWS_KIND:
        lwt = obj["spec"]["leaderWorkerTemplate"]
        return [t for t in (lwt.get("leaderTemplate"), lwt["workerTemplate"]) if t is not None]
    return [obj] if obj["kind"] == "Pod" else []


def pod_spec(obj: dict) -> dict | None:
    """The pod spec of a one-template workload."""
    templates = pod_templates(obj)
    assert len(templates) <= 1, f"{obj['kind']}/{obj['metadata']['name']} has {len(templates)} pod templates"
    return templates[0]["spec"] if templates else None


def template_containers(template: dict) -> list[dict]:
    return template["spec"].get("containers", []) + template["spec"].get("initContainers", [])


def pod_containers(obj: dict) -> list[dict]:
    return [c for t in pod_templates(obj) for c in template_containers(t)]


def kustomize_dirs() -> list[Path]:
    return sorted(p.parent for p in K8S.rglob("kustomization.yaml"))


def k8s_commands(directory: Path) -> list[Command]:
    """Each pdserve container's args (no ``command``: the image's entrypoint, pdserve), with
    ``$(VAR)`` replaced by what the container's env gives it."""
    out = []
    for obj in render(directory):
        for index, template in enumerate(pod_templates(obj)):
            for c in template_containers(template):
                if "command" in c or not c["image"].split(":")[0].endswith("pdserve"):
                    continue
                role = f" {('leader', 'worker')[index]}" if obj["kind"] == LWS_KIND else ""
                where = f"{directory.relative_to(ROOT)}: {obj['kind']}/{obj['metadata']['name']}{role} {c['name']}"
                env = _env_values(obj, c, index)
                out.append(Command(where, tuple(_expand(str(a), env, where) for a in c.get("args", []))))
    return out


def lws_env(obj: dict, template_index: int) -> dict[str, str]:
    """What the LeaderWorkerSet controller injects into every container of a group's first pods
    (the leader's worker index is 0; the first worker's 1)."""
    name, lwt = obj["metadata"]["name"], obj["spec"]["leaderWorkerTemplate"]
    leader_template = "leaderTemplate" in lwt
    index = 0 if leader_template and template_index == 0 else 1
    return {"LWS_LEADER_ADDRESS": f"{name}-0.{name}.default", "LWS_GROUP_SIZE": str(lwt.get("size", 1)),
            "LWS_WORKER_INDEX": str(index)}


def _env_values(obj: dict, container: dict, template_index: int = 0) -> dict[str, str]:
    ordinal = str(obj["spec"].get("ordinals", {}).get("start", 0)) if obj["kind"] == "StatefulSet" else None
    values = lws_env(obj, template_index) if obj["kind"] == LWS_KIND else {}
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
    """Lines of ```bash/sh/console blocks, continuations joined, prompts and comments dropped (in a
    console block only the ``$ `` lines are commands; the rest is their output)."""
    lines, out = [], []
    for lang, block in re.findall(r"```(bash|sh|shell|console)\n(.*?)```", markdown, re.S):
        pending = ""
        for line in block.splitlines():
            line = line.strip()
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            line, pending = (pending + line).strip(), ""
            if lang == "console" and not line.startswith("$ "):
                continue
            lines.append(line.removeprefix("$ ").strip())
    for line in lines:
        code = line.split(" #", 1)[0].strip() if not line.startswith("#") else ""
        if code:
            out.append(code)
    return out


_ASSIGNMENT = re.compile(r"[A-Za-z_]\w*=")
_VARIABLE = re.compile(r"\$(?:\{(\w+)\}|(\w+))")
SEPARATORS = ("&&", "||", ";", "|", "&")


def expand_variables(line: str, variables: dict[str, str]) -> str:
    """``$VAR`` and ``${VAR}`` replaced as the shell would for the variables the doc set before the
    line (others stay as written); nothing inside single quotes."""
    out, quote, i = [], None, 0
    while i < len(line):
        ch, m = line[i], _VARIABLE.match(line, i)
        if ch in "'\"" and quote in (None, ch):
            quote = None if quote else ch
        if quote != "'" and m and (m.group(1) or m.group(2)) in variables:
            value = variables[m.group(1) or m.group(2)]
            out.append(value.replace("\\", "\\\\").replace('"', '\\"') if quote == '"' else shlex.quote(value))
            i = m.end()
            continue
        out.append(ch)
        i += 1
    return "".join(out)


def doc_invocations_with_env(markdown: str) -> list[tuple[list[str], dict[str, str]]]:
    """Every command in the doc's shell blocks, split at ``&&``, ``||``, ``;``, ``|`` and ``&``, with the
    variables set before it (``VAR=value``, ``export VAR=value``) expanded in it and given to it as
    its environment, with its own ``VAR=value`` prefixes."""
    variables: dict[str, str] = {}
    out = []
    for line in shell_blocks(markdown):
        words = shlex.split(expand_variables(line, variables), comments=True)
        commands: list[list[str]] = [[]]
        for w in words:
            if w in SEPARATORS:
                commands.append([])
            else:
                commands[-1].append(w)
        for cmd in (c for c in commands if c):
            exported = cmd[0] == "export"
            cmd = cmd[1:] if exported else cmd
            n = next((i for i, w in enumerate(cmd) if not _ASSIGNMENT.match(w)), len(cmd))
            assigned = dict(w.split("=", 1) for w in cmd[:n])
            if n == len(cmd) or exported:
                variables.update(assigned)
            else:
                out.append((cmd[n:], {**variables, **assigned}))
    return out


def doc_invocations(markdown: str) -> list[list[str]]:
    """Every command in the doc's shell blocks (doc_invocations_with_env without the environment)."""
    return [words for words, _ in doc_invocations_with_env(markdown)]


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


# ``python -m MODULE`` forms of the programs: (program, argv words put in front of the rest).
PYTHON_MODULES = {
    "pdserve": ("pdserve", ()),
    "pdserve.launch_server": ("pdserve", ("serve",)),
    "pdserve.router": ("pdserve", ("router",)),
    "sglang_router.launch_router": ("sglang-router", ()),
}


def program_argv(words: list[str], where: str) -> tuple[str | None, list[str]]:
    """Which CLI a doc command runs and its argv after the program name; None for another program
    (curl, kubectl ...) and for ``docker run IMAGE`` alone, which runs the image's CMD."""
    if words[0] in ("pdserve", "mooncake_master"):
        return words[0], words[1:]
    if Path(words[0]).name in ("python", "python3") and words[1:2] == ["-m"] and len(words) > 2:
        program, front = PYTHON_MODULES.get(words[2], (None, ()))
        return program, [*front, *words[3:]]
    if words[:2] == ["docker", "run"]:
        _, argv = docker_run_argv(words, where)
        return ("pdserve", argv) if argv else (None, [])
    return None, []


def doc_commands(path: Path = DEPLOYMENT_DOC) -> list[Command]:
    """The commands of the doc that run pdserve, sglang-router or mooncake_master."""
    out = []
    for words, env in doc_invocations_with_env(path.read_text()):
        where = f"{path.name}: {' '.join(words)}"
        program, argv = program_argv(words, where)
        if program:
            out.append(Command(where, tuple(argv), program, tuple(sorted(env.items()))))
    return out
