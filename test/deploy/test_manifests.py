"""docker/k8s: every object of the base and of each overlay, rendered as ``kubectl apply -k``
renders it, is valid against the Kubernetes API schemas (offline, strict: an unknown field
fails), and keeps what a P/D group needs to work on a cluster."""

from __future__ import annotations

import re
import shutil
import subprocess

import kubernetes_validate
import pytest
import yaml
from deploy_files import K8S, ROOT, kustomize_dirs, pod_containers, pod_spec, render, strategic_merge

# The oldest release with what the manifests use (StatefulSet spec.ordinals GA, the pod-index
# label), and the newest whose schemas kubernetes-validate ships.
K8S_VERSIONS = ("1.31.0", kubernetes_validate.latest_version())
TOKEN_ENV = "PDSERVE_DISAGGREGATION_AUTH_TOKEN"


def _id(path):
    return str(path.relative_to(K8S))


@pytest.fixture(scope="module", params=kustomize_dirs(), ids=_id)
def rendered(request):
    return request.param, render(request.param)


def groups(objects):
    """The prefill and decode StatefulSets (every node of every group)."""
    return [o for o in objects if o["kind"] == "StatefulSet"]


def test_the_tree_has_the_base_and_its_overlays():
    assert [_id(d) for d in kustomize_dirs()] == ["base", "overlays/cpu-tiny", "overlays/mooncake-master",
                                                  "overlays/two-node-decode"]


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_is_valid_against_the_api_schema(rendered, version):
    directory, objects = rendered
    kinds = {o["kind"] for o in objects}
    assert {"StatefulSet", "Deployment", "Service", "PodDisruptionBudget"} <= kinds
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            raise AssertionError(f"{_id(directory)}: {obj['kind']}/{obj['metadata']['name']}: {e.message} "
                                 f"at {'.'.join(map(str, e.path))}") from None


def test_names_are_unique(rendered):
    _, objects = rendered
    keys = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(keys) == len(set(keys))


def test_group_pods_have_host_network_memlock_shm_and_the_token(rendered):
    _, objects = rendered
    assert {o["metadata"]["name"] for o in groups(objects)} >= {"pdserve-prefill", "pdserve-decode"}
    for sts in groups(objects):
        spec, (c,) = pod_spec(sts), pod_containers(sts)
        name = sts["metadata"]["name"]
        assert spec["hostNetwork"] and spec["dnsPolicy"] == "ClusterFirstWithHostNet", name
        assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"], name
        shm = next(m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm")
        volume = next(v for v in spec["volumes"] if v["name"] == shm["name"])
        assert volume["emptyDir"]["medium"] == "Memory", name
        assert spec["securityContext"]["runAsNonRoot"], name
        _assert_token_from_secret(c, name)


def _assert_token_from_secret(container, name):
    env = {e["name"]: e for e in container.get("env", [])}
    assert env[TOKEN_ENV]["valueFrom"]["secretKeyRef"] == {"name": "pdserve-auth", "key": "token"}, name


def test_the_token_travels_only_in_the_environment(rendered):
    _, objects = rendered
    for obj in objects:
        for c in pod_containers(obj):
            assert not [a for a in c.get("args", []) if "auth-token" in str(a)], obj["metadata"]["name"]
            assert "value" not in {e["name"]: e for e in c.get("env", [])}.get(TOKEN_ENV, {})


def test_http_servers_are_probed_on_health_and_scraped(rendered):
    _, objects = rendered
    serving = [o for o in objects if o["kind"] in ("StatefulSet", "Deployment")
               and o["spec"]["template"]["metadata"]["labels"].get("pdserve/node-role") != "worker"]
    for obj in serving:
        name, (c,) = obj["metadata"]["name"], pod_containers(obj)
        assert obj["spec"]["template"]["metadata"]["annotations"]["prometheus.io/scrape"] == "true", name
        if "mooncake" in name:
            continue
        assert c["readinessProbe"]["httpGet"]["path"] == "/health", name
        assert obj["spec"]["template"]["metadata"]["annotations"]["prometheus.io/path"] == "/metrics", name
        if obj["kind"] == "StatefulSet":
            assert c["startupProbe"]["httpGet"]["path"] == c["livenessProbe"]["httpGet"]["path"] == "/health", name


def test_every_group_has_a_disruption_budget(rendered):
    _, objects = rendered
    budgets = [o["spec"]["selector"]["matchLabels"] for o in objects if o["kind"] == "PodDisruptionBudget"]
    for obj in groups(objects) + [o for o in objects if o["kind"] == "Deployment"]:
        labels = obj["spec"]["template"]["metadata"]["labels"]
        assert any(all(labels.get(k) == v for k, v in b.items()) for b in budgets), obj["metadata"]["name"]


def test_node_ranks_come_from_the_pod_ordinal():
    objects = render(K8S / "overlays" / "two-node-decode")
    sts = {o["metadata"]["name"]: o for o in groups(objects)}
    leader, worker = sts["pdserve-decode"], sts["pdserve-decode-worker"]
    assert worker["spec"].get("ordinals", {}).get("start") == 1 and leader["spec"]["replicas"] == 1
    nnodes = set()
    for sts in (leader, worker):
        args = pod_containers(sts)[0]["args"]
        assert args[args.index("--node-rank") + 1] == "$(POD_INDEX)"
        assert args[args.index("--dist-init-addr") + 1].startswith("pdserve-decode-0.pdserve-decode:")
        nnodes.add(int(args[args.index("--nnodes") + 1]))
    assert nnodes == {1 + worker["spec"]["replicas"]}


def test_the_router_reaches_node_0_of_each_group():
    objects = render(K8S / "base")
    router = next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "pdserve-router")
    args = pod_containers(router)[0]["args"]
    services = {o["metadata"]["name"] for o in objects if o["kind"] == "Service"}
    for flag, group in (("--prefill", "pdserve-prefill"), ("--decode", "pdserve-decode")):
        url = args[args.index(flag) + 1]
        assert url == f"http://{group}-0.{group}:30000" and group in services


def test_strategic_merge_follows_kubernetes_merge_keys():
    base = {"containers": [{"name": "a", "args": ["x", "y"], "resources": {"limits": {"gpu": 8, "memory": 1}}}],
            "volumes": [{"name": "v", "persistentVolumeClaim": {"claimName": "c"}}]}
    patch = {"containers": [{"name": "a", "args": ["z"], "resources": {"limits": {"gpu": None}}}],
             "volumes": [{"name": "v", "persistentVolumeClaim": None, "emptyDir": {}}]}
    assert strategic_merge(base, patch) == {
        "containers": [{"name": "a", "args": ["z"], "resources": {"limits": {"memory": 1}}}],
        "volumes": [{"name": "v", "emptyDir": {}}]}


@pytest.mark.skipif(not shutil.which("kubectl"), reason="no kubectl (its kustomize) on this host")
@pytest.mark.parametrize("directory", kustomize_dirs(), ids=_id)
def test_the_renderer_agrees_with_kubectl_kustomize(directory):
    out = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    want = sorted((d for d in yaml.safe_load_all(out.stdout) if d), key=lambda o: (o["kind"], o["metadata"]["name"]))
    got = sorted(render(directory), key=lambda o: (o["kind"], o["metadata"]["name"]))
    assert got == want


@pytest.mark.skipif(not shutil.which("mooncake_master"), reason="no mooncake_master (the Mooncake wheel's) here")
def test_mooncake_master_flags_are_the_binarys():
    objects = render(K8S / "overlays" / "mooncake-master")
    (master,) = [c for o in objects for c in pod_containers(o) if c.get("command") == ["mooncake_master"]]
    out = subprocess.run(["mooncake_master", "--help"], capture_output=True, text=True, timeout=60)
    known = set(re.findall(r"^\s+-(\w+) \(", out.stdout + out.stderr, re.M))
    assert "rpc_port" in known, out.stderr[-2000:]
    used = [a.lstrip("-").split("=", 1)[0] for a in master["args"]]
    assert used and not [f for f in used if f not in known], f"unknown to mooncake_master: {used}"
    ports = {p["name"]: str(p["containerPort"]) for p in master["ports"]}
    flags = dict(a.lstrip("-").split("=", 1) for a in master["args"])
    assert (flags["rpc_port"], flags["metrics_port"]) == (ports["rpc"], ports["metrics"])
    # the HTTP metadata server listens on every interface and takes anyone's PUT (docs/security.md)
    assert flags.get("enable_http_metadata_server", "false") == "false" and "metadata" not in ports


def test_the_schema_check_rejects_a_misspelled_field():
    sts = next(o for o in render(K8S / "base") if o["kind"] == "StatefulSet")
    pod_spec(sts)["hostNetwrok"] = pod_spec(sts).pop("hostNetwork")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, K8S_VERSIONS[0], strict=True)
