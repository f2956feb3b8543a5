"""Worker discovery. Kubernetes: ``pdserve router --service-discovery`` (a real subprocess, the
official client) against a local API server replaying recorded answers (``kube_api.py``), with
echo workers at the pods' IPs (127.0.0.x): workers are added as pods turn Running + Ready and
dropped as they turn unready, terminate or are deleted, each change as its event is released.
A workers file: edited while the router runs, its workers come and go; a broken edit changes
nothing. Then the pure parts: parsing a workers file, a pod's worker, and what a source may remove."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from kube_api import RECORDED, KubeAPI
from router_utils import EchoWorker, Router, wait_for

from entrypoints.server_utils import free_port
from pdserve.router.discovery import Reconciler, Wanted, WorkersFile, parse_workers, pod_worker
from pdserve.router.policy import RoundRobinPolicy
from pdserve.router.workers import Fleet, Role, make_worker_set

FAST_HEALTH = ("--health-check-interval-secs", "0.1", "--health-check-timeout-secs", "2")
SELECTORS = ("--selector", "app=pdserve", "--prefill-selector", "pdserve.ai/role=prefill",
             "--decode-selector", "pdserve.ai/role=decode")


def roles(router: Router) -> tuple[dict, set]:
    """The router's prefill workers (url -> bootstrap port) and decode workers."""
    info = router.get("/get_server_info").json()
    return {w["url"]: w["bootstrap_port"] for w in info["prefill"]}, {w["url"] for w in info["decode"]}


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"}  # never the real cluster
    return {**env, **extra}


# ----------------------------------------------------------------- Kubernetes
@pytest.fixture
def pods():
    port = free_port()
    workers = {name: EchoWorker(name, port=port, host=ip).start()
               for name, ip in (("p0", "127.0.0.2"), ("d0", "127.0.0.3"), ("d1", "127.0.0.4"), ("p1", "127.0.0.5"))}
    yield port, workers
    for w in workers.values():
        w.close()


def test_kubernetes_discovery_follows_recorded_pod_events(pods, tmp_path):
    port, w = pods
    api = KubeAPI().start()
    router = Router([], [], "--service-discovery", *SELECTORS, "--service-discovery-namespace", "llm",
                    "--service-discovery-port", str(port), "--policy", "round_robin", *FAST_HEALTH,
                    env=_env(KUBECONFIG=str(api.kubeconfig(tmp_path / "kubeconfig"))))
    try:
        router.start()  # ready: the listed pods are up
        # the list: prefill-0 (bootstrap port from its annotation) and decode-0; decode-1 is Pending
        # and other-server-0 has another app label
        assert roles(router) == ({w["p0"].url: 9101}, {w["d0"].url})
        r = router.post("/generate", json={"text": "hi"})
        assert r.status_code == 200 and r.json()["worker"] == "d0"
        assert r.json()["body"]["bootstrap_port"] == 9101 and r.json()["body"]["bootstrap_host"] == "127.0.0.2"
        wait_for(lambda: api.watchers() == 2, what="a watch per role")
        assert {q["query"]["labelSelector"] for q in api.requests} == {"app=pdserve,pdserve.ai/role=prefill",
                                                                       "app=pdserve,pdserve.ai/role=decode"}
        assert all(q["token_ok"] and q["path"] == "/api/v1/namespaces/llm/pods" for q in api.requests)

        expected = [
            ({w["p0"].url: 9101}, {w["d0"].url, w["d1"].url}),  # decode-1 Running + Ready
            ({w["p0"].url: 9101}, {w["d0"].url, w["d1"].url}),  # prefill-1 ADDED, Pending: not yet
            ({w["p0"].url: 9101}, {w["d0"].url, w["d1"].url}),  # a BOOKMARK
            ({w["p0"].url: 9101, w["p1"].url: 9102}, {w["d0"].url, w["d1"].url}),  # prefill-1 Ready
            ({w["p0"].url: 9101, w["p1"].url: 9102}, {w["d1"].url}),  # decode-0's readiness fails
            ({w["p1"].url: 9102}, {w["d1"].url}),  # prefill-0 terminating (deletionTimestamp)
            ({w["p1"].url: 9102}, {w["d1"].url}),  # prefill-0 DELETED
            ({w["p1"].url: 9102}, {w["d0"].url, w["d1"].url}),  # decode-0 Ready again
            ({w["p1"].url: 9102}, {w["d1"].url}),  # decode-0 force-deleted: DELETED alone
        ]
        for want in expected:
            event = api.release()
            what = f"{event['type']} {event['object']['metadata'].get('name', '')}"
            wait_for(lambda want=want: roles(router) == want, 15, f"the router's workers after {what}")
        assert not api.pending
        # one list and one watch per role: every event came through the watches, none failed
        assert sorted(q["watch"] for q in api.requests) == [False, False, True, True]
        assert "trying again" not in router.output()
        wait_for(lambda: router.get("/health").json()["status"] == "ok", what="the new workers healthy")
        served = {router.post("/generate", json={"text": f"t{i}"}).json()["worker"] for i in range(3)}
        assert served == {"d1"}  # decode-0 left: nothing more reaches it
        assert {b["bootstrap_port"] for b in w["p1"].generation_bodies()} == {9102}
        assert router.metric("pdserve_router:discovery_events_total", source="kubernetes", event="added") == 5
        assert router.metric("pdserve_router:discovery_events_total", source="kubernetes", event="removed") == 3
        assert f'worker="{w["d0"].url}"' not in router.get("/metrics").text.split("worker_healthy", 1)[1] \
            .split("# HELP", 1)[0]  # a removed worker's gauges go
    finally:
        assert router.stop() == 0, router.output()
        api.close()


def test_kubernetes_discovery_without_a_configuration_exits_1_saying_why(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pdserve", "router", "--service-discovery", *SELECTORS,
                           "--service-discovery-namespace", "llm", "--port", str(free_port())],
                          capture_output=True, text=True, timeout=120,
                          env=_env(KUBECONFIG=str(tmp_path / "missing"), HOME=str(tmp_path)))
    assert proc.returncode == 1, proc.stderr
    assert "service_discovery: no Kubernetes configuration" in proc.stderr and "Traceback" not in proc.stderr


# ---------------------------------------------------------------- workers file
@pytest.fixture(scope="module")
def echo():
    workers = {name: EchoWorker(name).start() for name in ("p1", "p2", "d1", "d2")}
    yield workers
    for w in workers.values():
        w.close()


def _write(path: Path, text: str) -> None:
    """As an operator or a ConfigMap update would: a new file moved into place."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(text)
    os.replace(tmp, path)


def test_a_watched_workers_file_adds_and_drops_workers(echo, tmp_path):
    p1, p2, d1, d2 = (echo[n] for n in ("p1", "p2", "d1", "d2"))
    path = tmp_path / "workers.json"
    path.write_text(json.dumps({"prefill": [{"url": p1.url, "bootstrap_port": 9100}], "decode": [d1.url]}))
    router = Router([], [], "--workers-file", str(path), *FAST_HEALTH)
    try:
        router.start()
        assert roles(router) == ({p1.url: 9100}, {d1.url})
        _write(path, json.dumps({"prefill": [{"url": p1.url, "bootstrap_port": 9100}, p2.url],
                                 "decode": [{"url": d2.url}]}))
        wait_for(lambda: roles(router) == ({p1.url: 9100, p2.url: 8998}, {d2.url}), 15, "the edit applied")
        wait_for(lambda: router.get("/health").json()["status"] == "ok", what="d2 healthy")
        assert router.post("/generate", json={"text": "x"}).json()["worker"] == "d2"
        _write(path, '{"prefill": [], "decode": ["not a url"]}')
        wait_for(lambda: "keeping the workers as they are" in router.output(), 15, "the broken edit refused")
        assert "decode[0]: 'not a url' is not an http(s)://HOST[:PORT] URL" in router.output()
        assert roles(router) == ({p1.url: 9100, p2.url: 8998}, {d2.url})
        _write(path, json.dumps({"prefill": [p2.url], "decode": [d1.url, d2.url]}))
        wait_for(lambda: roles(router) == ({p2.url: 8998}, {d1.url, d2.url}), 15, "the fixed file applied")
        assert router.output().count("keeping the workers as they are") == 1
        assert "down: no healthy decode worker" not in router.output()  # d2 came before d1 went
    finally:
        assert router.stop() == 0, router.output()


def test_a_yaml_workers_file_next_to_flag_workers(echo, tmp_path):
    """Workers from the flags stay whatever the file says; the file's own come and go."""
    p1, p2, d1, d2 = (echo[n] for n in ("p1", "p2", "d1", "d2"))
    path = tmp_path / "workers.yaml"
    path.write_text(f"prefill:\n  - url: {p2.url}\n    bootstrap_port: 9200\ndecode: [{d2.url}]\n")
    router = Router([(p1.url, 9100)], [d1.url], "--workers-file", str(path), *FAST_HEALTH)
    try:
        router.start()
        wait_for(lambda: roles(router) == ({p1.url: 9100, p2.url: 9200}, {d1.url, d2.url}), 15, "both sources")
        _write(path, f"prefill: []\ndecode: [{d1.url}]\n")  # d1 is the flags': not the file's to drop
        wait_for(lambda: roles(router) == ({p1.url: 9100}, {d1.url}), 15, "the file's workers dropped")
    finally:
        assert router.stop() == 0, router.output()


def test_a_bad_workers_file_at_start_exits_1_naming_the_field(tmp_path):
    path = tmp_path / "workers.json"
    path.write_text('{"prefill": [{"url": "http://p:1", "bootstrap_port": "x"}], "decode": []}')
    proc = subprocess.run([sys.executable, "-m", "pdserve", "router", "--workers-file", str(path),
                           "--port", str(free_port())], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "prefill[0].bootstrap_port: must be an integer port, got 'x'" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("mode,owner,message", [
    (0o666, None, "mode 666 lets others change it"),
    (0o620, None, "mode 620 lets others change it"),
    (0o644, 12345, "owned by uid 12345"),
])
def test_a_workers_file_others_may_change_is_refused(tmp_path, monkeypatch, mode, owner, message):
    """The router sends its worker key and every prompt to the URLs the file names."""
    path = tmp_path / "workers.json"
    path.write_text('{"prefill": ["http://p:1"], "decode": ["http://d:2"]}')
    os.chmod(path, mode)
    if owner is not None:
        real = os.stat

        def stat(p, *a, **kw):
            st = real(p, *a, **kw)
            if str(p) != str(path):
                return st
            return os.stat_result((st.st_mode, st.st_ino, st.st_dev, st.st_nlink, owner, *tuple(st)[5:]))

        monkeypatch.setattr(os, "stat", stat)
    with pytest.raises(ValueError) as e:
        WorkersFile(str(path))._read()
    assert message in str(e.value) and "refused" in str(e.value)
    os.chmod(path, 0o644)
    if owner is None:
        assert WorkersFile(str(path))._read() == [Wanted(Role.PREFILL, "http://p:1", 8998),
                                                  Wanted(Role.DECODE, "http://d:2")]


def test_a_world_writable_workers_file_stops_the_router_at_start(tmp_path):
    path = tmp_path / "workers.json"
    path.write_text('{"prefill": ["http://p:1"], "decode": ["http://d:2"]}')
    os.chmod(path, 0o666)
    proc = subprocess.run([sys.executable, "-m", "pdserve", "router", "--workers-file", str(path),
                           "--port", str(free_port())], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "workers_file:" in proc.stderr and "mode 666 lets others change it" in proc.stderr
    assert "Traceback" not in proc.stderr


# ------------------------------------------------------------------ pure parts
def test_parse_workers_names_the_field():
    assert parse_workers('{"prefill": ["http://p:1/"], "decode": ["http://d:2"]}', yaml_syntax=False) == [
        Wanted(Role.PREFILL, "http://p:1", 8998), Wanted(Role.DECODE, "http://d:2")]
    assert parse_workers("decode:\n  - url: http://d:2\n", yaml_syntax=True) == [Wanted(Role.DECODE, "http://d:2")]
    for text, message in (("[]", "must be an object with 'prefill' and 'decode'"),
                          ('{"decoder": []}', "must be an object with 'prefill' and 'decode'"),
                          ('{"prefill": "http://p:1"}', "prefill: must be a list"),
                          ('{"prefill": [{"url": "http://p:1", "port": 1}]}', "prefill[0]: give a URL"),
                          ('{"prefill": [{"url": "http://p:1", "bootstrap_port": 0}]}',
                           "prefill[0]: prefill http://p:1: bootstrap_port: must be in 1..65535"),
                          ('{"decode": ["http://d:1", "http://d:1/"]}', "http://d:1 is listed twice"),
                          ("{", "invalid JSON")):
        with pytest.raises(ValueError) as e:
            parse_workers(text, yaml_syntax=False)
        assert message in str(e.value)


def test_pod_worker_from_recorded_pods():
    from kubernetes import client

    doc = json.loads(RECORDED.read_text())
    api = client.ApiClient()

    def v1pod(raw: dict):
        return api.deserialize(json.dumps(raw), "V1Pod", "application/json")  # as the client builds them

    by_name = {p["metadata"]["name"]: p for p in doc["list"]["items"]}
    assert pod_worker(v1pod(by_name["pdserve-prefill-0"]), Role.PREFILL, 30000, "sglang.ai/bootstrap-port") == \
        Wanted(Role.PREFILL, "http://127.0.0.2:30000", 9101)
    assert pod_worker(v1pod(by_name["pdserve-decode-0"]), Role.DECODE, 30000, "sglang.ai/bootstrap-port") == \
        Wanted(Role.DECODE, "http://127.0.0.3:30000")
    assert pod_worker(v1pod(by_name["pdserve-decode-1"]), Role.DECODE, 30000, "x") is None  # Pending
    prefill = by_name["pdserve-prefill-0"]
    assert pod_worker(v1pod(prefill), Role.PREFILL, 80, "other/annotation").bootstrap_port == 8998
    ipv6 = json.loads(json.dumps(prefill))
    ipv6["status"]["podIP"] = "fd00::5"
    assert pod_worker(v1pod(ipv6), Role.PREFILL, 80, "x").url == "http://[fd00::5]:80"


def test_a_source_removes_only_what_it_added():
    rr = RoundRobinPolicy(random.Random(0))
    fleet = Fleet(make_worker_set(Role.PREFILL, ["http://p:1"], rr, [8998]),
                  make_worker_set(Role.DECODE, [], RoundRobinPolicy(random.Random(0))))
    removed = []
    fleet.on_remove.append(lambda w: removed.append(w.url))
    events = []
    rec = Reconciler(fleet, "file", events.append)
    rec.apply([Wanted(Role.PREFILL, "http://p:1", 8998), Wanted(Role.DECODE, "http://d:1")])
    assert [w.url for w in fleet.sets[Role.DECODE].workers] == ["http://d:1"] and events == ["added"]
    assert fleet.find("http://d:1").source == "file" and not fleet.find("http://d:1").healthy  # unchecked
    rec.apply([Wanted(Role.DECODE, "http://d:2")], roles=(Role.DECODE,))
    assert [w.url for w in fleet.sets[Role.DECODE].workers] == ["http://d:2"]
    rec.apply([])
    assert [w.url for w in fleet.sets[Role.PREFILL].workers] == ["http://p:1"]  # the flags' worker stays
    assert removed == ["http://d:1", "http://d:2"] and events == ["added", "added", "removed", "removed"]
    rec.apply([Wanted(Role.PREFILL, "http://q:1", 9000)])
    rec.apply([Wanted(Role.PREFILL, "http://q:1", 9001)])  # its bootstrap port changed: added anew
    assert fleet.find("http://q:1").bootstrap_port == 9001


def test_a_removed_worker_lets_go_of_its_kv_follower_and_gauges():
    """Discovery removing a prefill stops the thread following its KV events and drops its gauges;
    a follower a cache refresh started for it as it was being removed is stopped at the next round."""
    from pdserve.router.app import build_context
    from pdserve.router.config import PrefillSpec, RouterArgs
    from pdserve.router.kv_events import KVEventSubscriber

    args = RouterArgs(prefill=(PrefillSpec("http://127.0.0.1:1"), PrefillSpec("http://127.0.0.1:2")),
                      decode=("http://127.0.0.1:3",), policy="round_robin")
    ctx = build_context(args, random.Random(0))
    gone, kept = ctx.prefill.workers

    def follower(worker):  # what a cache refresh sets up for a prefill publishing KV events
        view = ctx.cache._view(worker)
        view.events = KVEventSubscriber(worker.url, f"tcp://127.0.0.1:{free_port()}", dict, 5.0).start()
        return view.events

    threads = [follower(gone)._thread, follower(kept)._thread]

    async def healthy(_worker):
        return None

    ctx.checker.probe = healthy
    asyncio.run(ctx.checker.check_all())
    assert gone.url in ctx.metrics.render(ctx.sets).decode()
    assert ctx.fleet.remove(gone.url, "kubernetes") is gone
    assert gone.kv is None and gone.url not in ctx.cache.views
    assert not threads[0].is_alive() and threads[1].is_alive()
    assert gone.url not in ctx.metrics.render(ctx.sets).decode() and [w.url for w in ctx.prefill.workers] == [kept.url]
    late = follower(gone)  # a refresh that was reading its info as it went
    asyncio.run(ctx.checker.check_all())
    assert gone.kv is None and gone.url not in ctx.cache.views and not late._thread.is_alive()
    ctx.cache.close()
    assert not threads[1].is_alive()


def test_a_failing_api_is_described_the_same_way_each_time():
    """The watch threads log a failure once until it changes: the words must not carry dates or addresses."""
    from kubernetes.client.rest import ApiException

    from pdserve.router.discovery import _why

    assert _why(ApiException(status=403, reason="Forbidden")) == (
        "the Kubernetes API answered 403 Forbidden (RBAC: the service account needs get, list and watch on pods)")
    a, b = (_why(OSError(f"<urllib3.connection.HTTPConnection object at {hex(id(o))}>: refused")) for o in (1, 2))
    assert a == b == "OSError: <urllib3.connection.HTTPConnection object>: refused"
