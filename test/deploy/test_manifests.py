"""docker/k8s: every object of the base and of each overlay, rendered as ``kubectl apply -k``
renders it, is valid against the Kubernetes API schemas (offline, strict: an unknown field
fails; a LeaderWorkerSet against its CRD's schema, schemas/, and its pod templates against the
core API's), and keeps what a P/D group needs to work on a cluster."""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from deploy_files import (
    K8S,
    LWS_KIND,
    ROOT,
    kustomize_dirs,
    pod_containers,
    pod_spec,
    pod_templates,
    render,
    strategic_merge,
    template_containers,
)

# The oldest release with what the manifests use (StatefulSet spec.ordinals GA, the pod-index
# label), and the newest whose schemas kubernetes-validate ships.
K8S_VERSIONS = ("1.31.0", kubernetes_validate.latest_version())
TOKEN_ENV = "PDSERVE_DISAGGREGATION_AUTH_TOKEN"
LWS_CRD = Path(__file__).parent / "schemas" / "leaderworkerset.x-k8s.io_leaderworkersets.yaml"


def _id(path):
    return str(path.relative_to(K8S))


@pytest.fixture(scope="module", params=kustomize_dirs(), ids=_id)
def rendered(request):
    return request.param, render(request.param)


def groups(objects):
    """The prefill and decode groups: StatefulSets and LeaderWorkerSets (every node of every group)."""
    return [o for o in objects if o["kind"] in ("StatefulSet", LWS_KIND)]


def test_the_tree_has_the_base_and_its_overlays():
    assert [_id(d) for d in kustomize_dirs()] == ["base", "overlays/cpu-tiny", "overlays/leaderworkerset",
                                                  "overlays/mooncake-master", "overlays/router-discovery",
                                                  "overlays/two-node-decode"]


# ------------------------------------------------------------- API schemas
def _strict(schema):
    """A CRD schema in which an object with listed properties takes no others: the API server
    refuses an unknown field (kubectl's default field validation is Strict)."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if "properties" in schema and "additionalProperties" not in schema \
            and not schema.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


@functools.cache
def lws_validator() -> jsonschema.protocols.Validator:
    crd = yaml.safe_load(LWS_CRD.read_text())
    assert crd["spec"]["names"]["kind"] == LWS_KIND
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return jsonschema.Draft7Validator(_strict(v1["schema"]["openAPIV3Schema"]))


def validate(obj: dict, version: str) -> None:
    """Against the API's schema; a LeaderWorkerSet against its CRD's, its metadata and each of its
    pod templates also against the core API's (ObjectMeta, PodTemplateSpec), which the CRD copies."""
    if obj["kind"] != LWS_KIND:
        return kubernetes_validate.validate(obj, version, strict=True)
    assert obj["apiVersion"] == "leaderworkerset.x-k8s.io/v1", obj["apiVersion"]
    errors = sorted(lws_validator().iter_errors(obj), key=lambda e: list(map(str, e.path)))
    if errors:
        raise kubernetes_validate.ValidationError(errors[0], version)
    meta = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj["metadata"]}
    kubernetes_validate.validate(meta, version, strict=True)
    for template in pod_templates(obj):
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                                      "template": template}, version, strict=True)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_is_valid_against_the_api_schema(rendered, version):
    directory, objects = rendered
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "Service", "PodDisruptionBudget"} <= kinds and kinds & {"StatefulSet", LWS_KIND}
    for obj in objects:
        try:
            validate(obj, version)
        except kubernetes_validate.ValidationError as e:
            raise AssertionError(f"{_id(directory)}: {obj['kind']}/{obj['metadata']['name']}: {e.message} "
                                 f"at {'.'.join(map(str, e.path))}") from None


@pytest.mark.parametrize("where,change", [
    ("spec", lambda spec: spec["leaderWorkerTemplate"].update(sizee=2)),  # an unknown field
    ("spec", lambda spec: spec.update(startupPolicy="LeaderStarted")),  # not in the enum
    ("spec", lambda spec: spec["leaderWorkerTemplate"].update(size="two")),  # not an integer
    ("worker", lambda spec: spec.update(hostNetwrok=True)),  # a pod template's unknown field
])
def test_the_lws_check_rejects_a_broken_object(where, change):
    lws = next(o for o in render(K8S / "overlays" / "leaderworkerset") if o["kind"] == LWS_KIND)
    change(lws["spec"] if where == "spec" else lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"])
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(lws, K8S_VERSIONS[0])


def test_names_are_unique(rendered):
    _, objects = rendered
    keys = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(keys) == len(set(keys))


def test_group_pods_have_host_network_memlock_shm_and_the_token(rendered):
    _, objects = rendered
    assert {o["metadata"]["name"] for o in groups(objects)} >= {"pdserve-prefill", "pdserve-decode"}
    for group in groups(objects):
        for template in pod_templates(group):
            spec, (c,) = template["spec"], template_containers(template)
            name = f"{group['kind']}/{group['metadata']['name']} {template['metadata']['labels']}"
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


def _serving_templates(objects):
    """(name, template) of every pod that serves HTTP: all but a multi-node group's workers."""
    for obj in objects:
        for template in pod_templates(obj):
            if obj["kind"] in ("StatefulSet", "Deployment", LWS_KIND) \
                    and template["metadata"]["labels"].get("pdserve/node-role") != "worker":
                yield f"{obj['kind']}/{obj['metadata']['name']}", template


def test_http_servers_are_probed_on_health_and_scraped(rendered):
    _, objects = rendered
    for name, template in _serving_templates(objects):
        (c,) = template_containers(template)
        assert template["metadata"]["annotations"]["prometheus.io/scrape"] == "true", name
        if "mooncake" in name:
            continue
        assert c["readinessProbe"]["httpGet"]["path"] == "/health", name
        assert template["metadata"]["annotations"]["prometheus.io/path"] == "/metrics", name
        if not name.startswith("Deployment/"):
            assert c["startupProbe"]["httpGet"]["path"] == c["livenessProbe"]["httpGet"]["path"] == "/health", name


def test_every_http_listener_requires_the_api_key_from_the_secret(rendered):
    """The servers listen on the node's address and the router on every interface: each takes the
    API key and the admin key from the Secret (pdserve refuses such a bind without a key)."""
    _, objects = rendered
    for name, template in _serving_templates(objects):
        if "mooncake" in name:
            continue
        (c,) = template_containers(template)
        env = {e["name"]: e for e in c.get("env", [])}
        for var, key in (("PDSERVE_API_KEY", "api-key"), ("PDSERVE_ADMIN_API_KEY", "admin-api-key")):
            assert env[var]["valueFrom"]["secretKeyRef"] == {"name": "pdserve-auth", "key": key}, name
        assert "--allow-no-api-key" not in c["args"], name


def test_only_the_discovering_router_holds_a_service_account_token(rendered):
    where, objects = rendered
    for obj in objects:
        for template in pod_templates(obj):
            discovers = "--service-discovery" in template_containers(template)[0].get("args", [])
            assert template["spec"].get("automountServiceAccountToken") is discovers, \
                f"{_id(where)}: {obj['kind']}/{obj['metadata']['name']}"


def test_the_router_admits_clients_on_its_http_port_only(rendered):
    _, objects = rendered
    (policy,) = [o for o in objects if o["kind"] == "NetworkPolicy"]
    router = next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "pdserve-router")
    assert policy["spec"]["podSelector"]["matchLabels"] == router["spec"]["selector"]["matchLabels"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["ingress"] == [{"ports": [{"protocol": "TCP", "port": 30000}]}]


def test_every_group_has_a_disruption_budget(rendered):
    _, objects = rendered
    budgets = [o["spec"]["selector"]["matchLabels"] for o in objects if o["kind"] == "PodDisruptionBudget"]
    for obj in groups(objects) + [o for o in objects if o["kind"] == "Deployment"]:
        for template in pod_templates(obj):
            labels = template["metadata"]["labels"]
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


def _arg(args: list, flag: str) -> str:
    return str(args[args.index(flag) + 1])


def _multi(args: list, flag: str) -> list[str]:
    """The values of a flag that takes several (up to the next flag)."""
    start = args.index(flag) + 1
    end = next((i for i in range(start, len(args)) if str(args[i]).startswith("--")), len(args))
    return [str(a) for a in args[start:end]]


def test_lws_groups_take_their_ranks_and_rendezvous_from_lws():
    """Leader = node 0 (HTTP, the rendezvous at its own LWS_LEADER_ADDRESS); workers take their rank
    from LWS_WORKER_INDEX; --nnodes is the group size; otherwise leader and workers run one command."""
    lwss = [o for o in render(K8S / "overlays" / "leaderworkerset") if o["kind"] == LWS_KIND]
    assert {o["metadata"]["name"] for o in lwss} == {"pdserve-prefill", "pdserve-decode"}
    for lws in lwss:
        spec, lwt = lws["spec"], lws["spec"]["leaderWorkerTemplate"]
        # the leader's readiness waits for every rank: LeaderReady would never start the workers
        assert spec["startupPolicy"] == "LeaderCreated" and lwt["restartPolicy"] == "RecreateGroupOnPodRestart"
        assert spec["networkConfig"]["subdomainPolicy"] == "Shared" and lwt["size"] >= 2
        (leader,), (worker,) = (template_containers(lwt[t]) for t in ("leaderTemplate", "workerTemplate"))
        assert lwt["leaderTemplate"]["metadata"]["labels"]["pdserve/node-role"] == "leader"
        assert lwt["workerTemplate"]["metadata"]["labels"]["pdserve/node-role"] == "worker"
        assert _arg(leader["args"], "--node-rank") == "0"
        assert _arg(worker["args"], "--node-rank") == "$(LWS_WORKER_INDEX)"
        for args in (leader["args"], worker["args"]):
            assert _arg(args, "--nnodes") == "$(LWS_GROUP_SIZE)"
            assert re.fullmatch(r"\$\(LWS_LEADER_ADDRESS\):\d+", _arg(args, "--dist-init-addr"))
        strip = [a for i, a in enumerate(leader["args"]) if "--node-rank" not in leader["args"][max(i - 1, 0):i + 1]]
        assert strip == [a for i, a in enumerate(worker["args"])
                         if "--node-rank" not in worker["args"][max(i - 1, 0):i + 1]]
        assert "readinessProbe" not in worker and "ports" not in worker, "workers serve no HTTP"


def _selects(selector: list[str], labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in (s.split("=", 1) for s in selector))


@pytest.mark.parametrize("overlay", ["router-discovery", "leaderworkerset"])
def test_the_discovering_router_finds_every_group_leader_and_only_them(overlay):
    objects = render(K8S / "overlays" / overlay)
    router = next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "pdserve-router")
    (c,) = pod_containers(router)
    args = c["args"]
    assert "--service-discovery" in args and "--prefill" not in args and "--decode" not in args
    env = {e["name"]: e for e in c["env"]}
    assert _arg(args, "--service-discovery-namespace") == "$(POD_NAMESPACE)"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    annotation = _arg(args, "--bootstrap-port-annotation")
    for role in ("prefill", "decode"):
        selector = _multi(args, f"--{role}-selector")
        found = [(g, t) for g in groups(objects) for t in pod_templates(g)
                 if _selects(selector, t["metadata"]["labels"])]
        assert found, f"--{role}-selector {selector} selects no pod"
        for group, template in found:
            (server,) = template_containers(template)
            assert template["metadata"]["labels"]["pdserve/node-role"] == "leader", group["metadata"]["name"]
            assert _arg(server["args"], "--disaggregation-mode") == role
            assert _arg(server["args"], "--port") == _arg(args, "--service-discovery-port")
            if role == "prefill":
                boot = _arg(server["args"], "--disaggregation-bootstrap-port")
                assert template["metadata"]["annotations"][annotation] == boot
        leaders = [t for g in groups(objects) for t in pod_templates(g)
                   if t["metadata"]["labels"]["app.kubernetes.io/component"] == role
                   and t["metadata"]["labels"]["pdserve/node-role"] == "leader"]
        assert len(found) == len(leaders)


def test_the_discovering_router_may_read_pods_and_nothing_else():
    objects = render(K8S / "overlays" / "router-discovery")
    by_kind = {o["kind"]: o for o in objects if o["kind"] in ("ServiceAccount", "Role", "RoleBinding")}
    router = next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "pdserve-router")
    account = pod_spec(router)["serviceAccountName"]
    assert by_kind["ServiceAccount"]["metadata"]["name"] == account
    assert by_kind["Role"]["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    binding = by_kind["RoleBinding"]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": by_kind["Role"]["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    assert not [o for o in objects if o["kind"] in ("ClusterRole", "ClusterRoleBinding")]


def test_the_store_overlay_wires_every_server_to_the_master():
    """The Mooncake master overlay is the hierarchical cache's Store tier: every prefill and decode
    server runs the cache with the mooncake backend at the master's Service and RPC port."""
    objects = render(K8S / "overlays" / "mooncake-master")
    (master,) = [c for o in objects for c in pod_containers(o) if c.get("command") == ["mooncake_master"]]
    rpc = dict(a.lstrip("-").split("=", 1) for a in master["args"])["rpc_port"]
    service = next(o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == "pdserve-mooncake-master")
    port = next(p for p in service["spec"]["ports"] if p["name"] == "rpc")
    assert str(port["port"]) == rpc
    servers = [c for g in groups(objects) for c in pod_containers(g)]
    assert {_arg(c["args"], "--disaggregation-mode") for c in servers} == {"prefill", "decode"}
    for c in servers:
        args = c["args"]
        assert "--enable-hierarchical-cache" in args and _arg(args, "--hicache-storage-backend") == "mooncake"
        extra = json.loads(_arg(args, "--hicache-storage-backend-extra-config"))
        assert extra["master_server_address"] == f"{service['metadata']['name']}:{port['port']}"
        assert extra["local_hostname"] == "$(POD_IP)"  # its segment, at the address peers reach


def test_servers_in_the_cuda_image_compute_on_the_gpu(rendered):
    """--device cuda: without a visible GPU the server refuses to start instead of running on CPU."""
    _, objects = rendered
    for group in groups(objects):
        for c in pod_containers(group):
            on_cuda = c["image"].endswith(":cuda")
            assert (_arg(c["args"], "--device") if "--device" in c["args"] else None) == ("cuda" if on_cuda else None)


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
