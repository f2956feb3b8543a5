"""``pdserve router`` (a real subprocess) in front of real aiohttp echo workers on loopback,
which record exactly what reached them: bootstrap fields, relaying, errors, health, policies,
disconnects, info routes, start-up and shutdown."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import httpx
import pytest
from router_utils import EchoWorker, Router, wait_for

from entrypoints.server_utils import free_port, port_is_free

FAST_HEALTH = ("--health-check-interval-secs", "0.1", "--health-check-timeout-secs", "2")


@pytest.fixture(scope="module")
def echo():
    workers = {name: EchoWorker(name).start() for name in ("p1", "p2", "d1", "d2")}
    yield workers
    for w in workers.values():
        w.close()


@pytest.fixture(autouse=True)
def _reset(echo):
    for w in echo.values():
        w.reset()


@pytest.fixture
def make_router():
    routers = []

    def make(prefill, decode, *flags) -> Router:
        r = Router(prefill, decode, *flags)
        routers.append(r)
        return r.start()

    yield make
    for r in routers:
        assert r.stop() in (0, None), r.output()  # None: the test already stopped it


def bodies(worker: EchoWorker, n: int) -> list[dict]:
    """The generation bodies ``worker`` got, once there are ``n`` (prefill's half may land after decode answered)."""
    wait_for(lambda: len(worker.generation_bodies()) >= n, what=f"{worker.name} got {n} requests")
    assert len(worker.generation_bodies()) == n
    return worker.generation_bodies()


def next_event(lines) -> dict:
    """The next SSE data event from ``lines`` (keep ``lines`` referenced: dropping a half-read
    httpx line iterator closes the connection, which is a client leaving)."""
    return json.loads(next(line for line in lines if line.startswith("data: "))[6:])


def events(response: httpx.Response) -> list:
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            out.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    return out


# ------------------------------------------------------------ bootstrap
def test_bootstrap_fields_reach_both_and_decode_answers(echo, make_router):
    p1, d1 = echo["p1"], echo["d1"]
    router = make_router([(p1.url, 9100)], [d1.url])
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 4}, "rid": "r1"}
    r = router.post("/generate", json=body, headers={"Authorization": "Bearer k"})
    assert r.status_code == 200
    assert r.json()["worker"] == "d1"
    (sent_p,), (sent_d,) = bodies(p1, 1), bodies(d1, 1)
    assert sent_p == sent_d == r.json()["body"]  # the same body, the same room, to both
    assert {k: v for k, v in sent_d.items() if not k.startswith("bootstrap_")} == body
    assert sent_d["bootstrap_host"] == "127.0.0.1" and sent_d["bootstrap_port"] == 9100
    assert isinstance(sent_d["bootstrap_room"], int) and 0 <= sent_d["bootstrap_room"] < 2**63
    assert all(rec.headers.get("Authorization") == "Bearer k" for rec in p1.received + d1.received
               if rec.method == "POST")


@pytest.mark.parametrize("path,body,batch", [
    ("/generate", {"text": ["a", "b", "c"]}, 3),
    ("/generate", {"input_ids": [[1, 2], [3]]}, 2),
    ("/generate", {"input_ids": [1, 2, 3]}, None),
    ("/v1/completions", {"prompt": ["x", "y"], "max_tokens": 2}, 2),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2}, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, None),
])
def test_batches_get_one_room_per_prompt(echo, make_router, path, body, batch):
    router = make_router([(echo["p1"].url, 9100)], [echo["d1"].url])
    assert router.post(path, json=body).status_code == 200
    (sent_p,), (sent_d,) = bodies(echo["p1"], 1), bodies(echo["d1"], 1)
    assert sent_p == sent_d
    if batch is None:
        assert isinstance(sent_d["bootstrap_room"], int) and sent_d["bootstrap_port"] == 9100
    else:
        assert sent_d["bootstrap_host"] == ["127.0.0.1"] * batch and sent_d["bootstrap_port"] == [9100] * batch
        assert len(set(sent_d["bootstrap_room"])) == batch


def test_round_robin_on_both_sides_and_bootstrap_of_the_chosen_prefill(echo, make_router):
    p1, p2, d1, d2 = (echo[n] for n in ("p1", "p2", "d1", "d2"))
    router = make_router([(p1.url, 9101), (p2.url, 9102)], [d1.url, d2.url], "--policy", "round_robin")
    answered = [router.post("/generate", json={"text": f"t{i}"}).json()["worker"] for i in range(4)]
    assert answered == ["d1", "d2", "d1", "d2"]
    assert [b["text"] for b in bodies(p1, 2)] == ["t0", "t2"]
    assert [b["text"] for b in bodies(p2, 2)] == ["t1", "t3"]
    assert {b["bootstrap_port"] for b in p1.generation_bodies()} == {9101}
    assert {b["bootstrap_port"] for b in p2.generation_bodies()} == {9102}


def test_prefill_and_decode_policies_apart(echo, make_router):
    p1, p2, d1, d2 = (echo[n] for n in ("p1", "p2", "d1", "d2"))
    router = make_router([p1.url, p2.url], [d1.url, d2.url], "--policy", "random",
                         "--prefill-policy", "round_robin")
    for i in range(4):
        assert router.post("/generate", json={"text": f"t{i}"}).status_code == 200
    assert [b["text"] for b in bodies(p1, 2)] == ["t0", "t2"]  # round robin
    assert {b["bootstrap_port"] for b in bodies(p1, 2) + bodies(p2, 2)} == {8998}  # the default port
    info = router.get("/get_server_info").json()
    assert info["policy"] == {"prefill": "round_robin", "decode": "random"}


# ------------------------------------------------------------- relaying
def test_stream_is_relayed_as_decode_sent_it(echo, make_router):
    router = make_router([echo["p1"].url], [echo["d1"].url])
    body = {"text": "s", "stream": True, "echo_chunks": 4}
    with httpx.stream("POST", router.url + "/generate", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        via_router = r.read()
    with httpx.stream("POST", echo["d1"].url + "/generate", json=body, timeout=30) as r:
        direct = r.read()
    assert via_router == direct
    assert [e for e in events(httpx.Response(200, content=via_router))] == \
        [{"worker": "d1", "i": i} for i in range(4)] + ["[DONE]"]


def test_stream_is_not_buffered_and_a_client_leaving_closes_both_upstreams(echo, make_router):
    p1, d1 = echo["p1"], echo["d1"]
    router = make_router([p1.url], [d1.url])
    body = {"text": "hold", "stream": True, "echo_chunks": 2, "echo_hold": True}
    with httpx.stream("POST", router.url + "/generate", json=body, timeout=30) as r:
        lines = r.iter_lines()
        # decode holds the stream open after two events: they arrive only if nothing is buffered
        got = [next_event(lines), next_event(lines)]
        assert got == [{"worker": "d1", "i": 0}, {"worker": "d1", "i": 1}]
        assert router.worker_state(d1.url)["in_flight"] == 1
    wait_for(lambda: len(d1.disconnects) == 1 and len(p1.disconnects) == 1, what="both upstreams closed")
    wait_for(lambda: router.worker_state(d1.url)["in_flight"] == 0 == router.worker_state(p1.url)["in_flight"],
             what="leases released")
    assert router.metric("pdserve_router:client_disconnects_total") == 1


def test_a_client_leaving_before_the_answer_closes_both_upstreams(echo, make_router):
    p1, d1 = echo["p1"], echo["d1"]
    router = make_router([p1.url], [d1.url])
    with pytest.raises(httpx.ReadTimeout):  # the client gives up: its connection closes
        router.post("/generate", json={"text": "hold", "echo_hold": True}, timeout=1)
    wait_for(lambda: len(d1.disconnects) == 1 and len(p1.disconnects) == 1, what="both upstreams closed")
    wait_for(lambda: router.worker_state(d1.url)["in_flight"] == 0 == router.worker_state(p1.url)["in_flight"],
             what="leases released")
    assert router.metric("pdserve_router:client_disconnects_total") == 1


def test_decode_status_and_body_reach_the_client(echo, make_router):
    d1 = echo["d1"]
    router = make_router([echo["p1"].url], [d1.url])
    d1.fail_status = 422
    r = router.post("/generate", json={"text": "x", "stream": True})
    assert r.status_code == 422
    assert r.json() == {"error": {"message": "d1 failed", "worker": "d1"}}


def test_prefill_failure_is_logged_and_decode_still_answers(echo, make_router):
    p1, d1 = echo["p1"], echo["d1"]
    router = make_router([p1.url], [d1.url])
    p1.fail_status = 500
    r = router.post("/generate", json={"text": "x"})
    assert r.status_code == 200 and r.json()["worker"] == "d1"
    wait_for(lambda: router.metric("pdserve_router:worker_errors_total", role="prefill", worker=p1.url,
                                   kind="http_5xx") == 1, what="prefill error counted")
    assert f"prefill worker {p1.url}: /generate answered 500" in router.output()


def test_bad_bodies_are_refused_before_any_worker(echo, make_router):
    router = make_router([echo["p1"].url], [echo["d1"].url])
    r = router.post("/generate", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = router.post("/v1/completions", json=["a list"])
    assert r.status_code == 400 and r.json()["error"]["message"] == "request body: must be a JSON object"
    assert echo["p1"].generation_bodies() == [] and echo["d1"].generation_bodies() == []


# ---------------------------------------------------------------- health
def test_a_decode_failing_health_is_not_routed_to_and_503_names_it(echo, make_router):
    p1, d1 = echo["p1"], echo["d1"]
    router = make_router([p1.url], [d1.url], *FAST_HEALTH)
    d1.health_status = 503
    router.wait_health(d1.url, False)
    r = router.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 503
    err = r.json()["error"]
    assert err["type"] == "service_unavailable"
    assert err["message"] == f"no healthy decode worker ({d1.url}: GET /health answered 503)"
    assert p1.generation_bodies() == [] and d1.generation_bodies() == []
    health = router.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "down"
    assert health.json()["unhealthy"] == [{"url": d1.url, "role": "decode", "last_error": "GET /health answered 503"}]
    assert router.metric("pdserve_router:dead_workers", role="decode") == 1
    assert router.metric("pdserve_router:no_healthy_worker_total", role="decode") == 1
    d1.health_status = 200
    router.wait_health(d1.url, True)
    assert router.post("/generate", json={"text": "back"}).json()["worker"] == "d1"
    assert router.get("/health").status_code == 200


def test_no_healthy_prefill_degrades_to_decode_alone(echo, make_router):
    """Requests go to decode without bootstrap fields (decode prefills them), counted, logged once,
    reported by /health (still 200); the prefill is used again once it passes a health check."""
    p1, d1 = echo["p1"], echo["d1"]
    router = make_router([p1.url], [d1.url], *FAST_HEALTH)
    p1.health_status = 503
    router.wait_health(p1.url, False)
    for text in ("one", "two"):
        r = router.post("/generate", json={"text": text, "bootstrap_room": 5})
        assert r.status_code == 200 and r.json()["body"] == {"text": text}  # no bootstrap field, not even the client's
    assert p1.generation_bodies() == []
    health = router.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "degraded"
    assert router.metric("pdserve_router:degraded_requests_total") == 2
    assert router.metric("pdserve_router:degraded") == 1
    assert router.output().count("degraded: no healthy prefill worker") == 1
    p1.health_status = 200
    router.wait_health(p1.url, True)
    assert "bootstrap_room" in router.post("/generate", json={"text": "three"}).json()["body"]
    assert bodies(p1, 1)[0]["text"] == "three"
    assert router.get("/health").json()["status"] == "ok" and router.metric("pdserve_router:degraded") == 0
    assert router.metric("pdserve_router:degraded_requests_total") == 2
    assert "serving disaggregated again" in router.output()


def test_a_decode_refusing_connections_is_marked_dead_and_the_request_retried(echo, make_router):
    victim = EchoWorker("victim").start()
    try:
        router = make_router([echo["p1"].url], [victim.url, echo["d1"].url], "--policy", "round_robin",
                             "--health-check-interval-secs", "600")  # only the failed request can tell
        victim.stop()  # connections are now refused
        r = router.post("/generate", json={"text": "x"})
        assert r.status_code == 200 and r.json()["worker"] == "d1"
        state = router.worker_state(victim.url)
        assert not state["healthy"] and state["last_error"].startswith("connection failed")
        assert router.metric("pdserve_router:worker_errors_total", role="decode", worker=victim.url,
                             kind="connect") == 1
        assert [router.post("/generate", json={"text": "y"}).json()["worker"] for _ in range(3)] == ["d1"] * 3
        assert router.metric("pdserve_router:requests_total", role="decode", worker=victim.url) == 1
    finally:
        victim.close()


def test_least_load_avoids_the_busy_decode(echo, make_router):
    router = make_router([echo["p1"].url], [echo["d1"].url, echo["d2"].url], "--policy", "least_load")
    body = {"text": "hold", "stream": True, "echo_chunks": 1, "echo_hold": True}
    with httpx.stream("POST", router.url + "/generate", json=body, timeout=30) as r:
        lines = r.iter_lines()
        busy = next_event(lines)["worker"]
        others = {router.post("/generate", json={"text": f"t{i}"}).json()["worker"] for i in range(6)}
        assert others == {"d1", "d2"} - {busy}


# ----------------------------------------------------------- info routes
def test_info_routes(echo, make_router):
    p1, d1 = echo["p1"], echo["d1"]
    router = make_router([(p1.url, 9100)], [d1.url])
    for path in ("/v1/models", "/model_info", "/get_model_info"):
        assert router.get(path).json() == {"worker": "d1", "path": path, "internal_states": [{"worker": "d1"}]}
    assert router.get("/health").status_code == 200
    info = router.get("/get_server_info").json()
    assert info["prefill"] == [{"url": p1.url, "role": "prefill", "healthy": True, "in_flight": 0,
                                "last_error": None, "circuit_breaker": "closed", "bootstrap_port": 9100,
                                "kv_events": None, "load": {},  # an echo worker publishes no KV events
                                # nor its pool: the router's guess of its cache, at the default size
                                "cache_view": {"source": "approximate", "approximate": {
                                    "blocks": 0, "capacity": 1 << 16, "pool_known": False, "evicted": 0}},
                                "server_info": {"worker": "p1", "path": "/get_server_info",
                                                "internal_states": [{"worker": "p1"}]}}]
    assert info["decode"][0]["url"] == d1.url and info["decode"][0]["server_info"]["worker"] == "d1"
    assert info["internal_states"] == [{"worker": "d1"}]
    assert router.get("/server_info").json()["prefill"][0]["url"] == p1.url


def test_flush_cache_reaches_every_worker(echo, make_router):
    p1, d1 = echo["p1"], echo["d1"]
    router = make_router([p1.url], [d1.url])
    r = router.post("/flush_cache")
    assert r.status_code == 200 and r.json()["success"] is True
    assert [w["message"] for w in r.json()["workers"]] == ["p1 flushed", "d1 flushed"]
    d1.fail_status = 400
    r = router.post("/flush_cache")
    assert r.status_code == 400 and r.json()["success"] is False
    assert r.json()["error"]["message"] == f"flush_cache: failed on decode {d1.url} (400: d1 is busy)"


def test_a_body_nested_past_the_stack_is_a_400_at_the_router(echo, make_router):
    """Issue 33: never a 500 (which a breaker in front of this router would count)."""
    router = make_router([echo["p1"].url], [echo["d1"].url])
    deep = b'{"text": "x", "sampling_params": ' + b'{"a": ' * 3000 + b"1" + b"}" * 3001
    for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
        r = router.post(path, content=deep, headers={"Content-Type": "application/json"})
        assert r.status_code == 400, (path, r.text)
    assert echo["p1"].generation_bodies() == [] and echo["d1"].generation_bodies() == []


def test_cross_site_requests_never_reach_a_worker(echo, make_router):
    """Issue 33: the router refuses bodies that are not JSON (415), a foreign Origin on a POST and a
    foreign Host (403) before any worker sees them; its own clients pass."""
    p1, d1 = echo["p1"], echo["d1"]
    router = make_router([p1.url], [d1.url])
    for headers, status in [({"Content-Type": "text/plain", "Origin": "http://evil.example"}, 403),
                            ({"Content-Type": "text/plain"}, 415), ({"Host": "evil.example"}, 403)]:
        for path in ("/flush_cache", "/generate"):
            r = httpx.post(router.url + path, content=b'{"text": "x"}', headers=headers, timeout=30)
            assert r.status_code == status, (path, headers, r.text)
    assert d1.generation_bodies() == [] and p1.generation_bodies() == []
    assert not [x for w in (p1, d1) for x in w.received if x.path == "/flush_cache"]
    assert router.post("/generate", json={"text": "x"}).status_code == 200
    r = httpx.post(f"http://localhost:{router.port}/flush_cache", timeout=30)
    assert r.status_code == 200


def test_metrics_count_requests_per_worker(echo, make_router):
    p1, d1 = echo["p1"], echo["d1"]
    router = make_router([p1.url], [d1.url])
    for _ in range(3):
        router.post("/generate", json={"text": "x"})
    assert router.metric("pdserve_router:requests_total", role="decode", worker=d1.url) == 3
    assert router.metric("pdserve_router:requests_total", role="prefill", worker=p1.url) == 3
    assert router.metric("pdserve_router:worker_healthy", role="decode", worker=d1.url) == 1
    assert router.metric("pdserve_router:dead_workers", role="decode") == 0


# -------------------------------------------------------- start and stop
def _router_cmd(prefill: str, decode: str, *flags: str) -> list[str]:
    return [sys.executable, "-m", "pdserve", "router", "--prefill", prefill, "--decode", decode,
            "--port", str(free_port()), *flags]


def test_router_listens_at_once_and_names_the_workers_it_waits_for(echo):
    port = free_port()
    late_url = f"http://127.0.0.1:{port}"
    router = Router([echo["p1"].url], [late_url], "--worker-startup-timeout-secs", "0.5",
                    "--worker-startup-check-interval", "0.1", "--health-check-interval-secs", "600")
    try:
        router.start(ready=False)
        health = router.get("/health")
        assert health.status_code == 503
        assert health.json()["status"] == "starting" and health.json()["waiting_for"] == [late_url]
        r = router.post("/generate", json={"text": "x"})
        assert r.status_code == 503 and r.json()["error"]["message"].startswith(f"no healthy decode worker ({late_url}")
        wait_for(lambda: "still waiting for " + late_url in router.output(), what="start-up timeout logged")
        assert router.get("/health").json()["startup_timed_out"] == [late_url]
        assert f"waiting for decode worker {late_url} (GET /health failed" in router.output()
        late = EchoWorker("late", port=port).start()
        try:
            router.wait_health(late_url, True)  # probed at the start-up interval, not the 600 s one
            assert router.get("/health").json() == {"status": "ok", "waiting_for": [], "unhealthy": []}
            assert router.post("/generate", json={"text": "y"}).json()["worker"] == "late"
        finally:
            late.close()
    finally:
        assert router.stop() == 0, router.output()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_waiting_for_workers_exits_0(echo, sig):
    dead = f"http://127.0.0.1:{free_port()}"
    proc = subprocess.Popen(_router_cmd(dead, echo["d1"].url), stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        wait_for(lambda: len([r for r in echo["d1"].received if r.path == "/health"]) >= 1, what="first check")
        proc.send_signal(sig)
        assert proc.wait(15) == 0
        assert "Traceback" not in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()


def test_busy_port_exits_1(echo, make_router):
    router = make_router([echo["p1"].url], [echo["d1"].url])
    proc = subprocess.run([*_router_cmd(echo["p1"].url, echo["d1"].url), "--port", str(router.port)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and f"port: cannot bind 127.0.0.1:{router.port}" in proc.stderr


def test_sigterm_while_streaming_closes_upstreams_and_frees_the_port(echo, make_router):
    p1, d1 = echo["p1"], echo["d1"]
    router = make_router([p1.url], [d1.url])
    body = {"text": "hold", "stream": True, "echo_chunks": 1, "echo_hold": True}
    with httpx.stream("POST", router.url + "/generate", json=body, timeout=30) as r:
        lines = r.iter_lines()
        next_event(lines)
        assert router.stop(signal.SIGTERM) == 0
        with pytest.raises(httpx.RemoteProtocolError):
            list(lines)  # the router cut the held stream off when its graceful-shutdown time ran out
    assert len(d1.disconnects) == 1 and len(p1.disconnects) == 1
    assert port_is_free(router.port)


# ------------------------------------------------------ control routes
def test_abort_request_and_health_generate_reach_every_worker(echo, make_router):
    p1, d1 = echo["p1"], echo["d1"]
    router = make_router([p1.url], [d1.url])
    r = router.post("/abort_request", json={"rid": "r-1"})
    assert r.status_code == 200 and r.json()["success"] is True
    assert [x.body for x in p1.received + d1.received if x.path == "/abort_request"] == [{"rid": "r-1"}] * 2
    r = router.get("/health_generate")
    assert r.status_code == 200 and [w["status"] for w in r.json()["workers"]] == [200, 200]
    d1.health_status = 503  # its /health_generate fails too
    r = router.get("/health_generate")
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"


# -------------------------------------------------------------- API keys
@pytest.mark.parametrize("worker_key", [None, "worker-secret"])
def test_api_key_is_required_and_forwarded(echo, make_router, worker_key):
    p1, d1 = echo["p1"], echo["d1"]
    flags = ("--api-key", "router-secret", *(("--worker-api-key", worker_key) if worker_key else ()))
    router = make_router([p1.url], [d1.url], *flags)
    assert router.headers == {"Authorization": "Bearer router-secret"}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = router.post("/generate", json={"text": "x"}, headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key" and r.json()["error"]["param"] == "Authorization"
        assert router.post("/flush_cache", headers=headers).status_code == 401
    assert d1.generation_bodies() == []
    for path in ("/health", "/metrics"):  # open, as on a server
        assert router.get(path, headers={}).status_code == 200
    ok = router.headers
    assert router.post("/generate", json={"text": "x"}, headers=ok).json()["worker"] == "d1"
    assert router.post("/flush_cache", headers=ok).status_code == 200
    sent = f"Bearer {worker_key or 'router-secret'}"
    bodies(p1, 1)
    for w in (p1, d1):
        assert {r.headers.get("Authorization") for r in w.received} == {sent}  # health probes too
    assert "router-secret" not in router.output()


def test_admin_routes_need_the_admin_key_and_it_is_what_the_workers_get(echo, make_router):
    """--admin-api-key: the inference key opens no admin route (nothing reaches a worker); the admin
    key does, and the workers get the admin key for it. A client's own abort reaches the workers
    with the worker key and its X-Client-Token (so they check that it started the rid), never the admin key."""
    p1, d1 = echo["p1"], echo["d1"]
    router = make_router([p1.url], [d1.url], "--api-key", "router-secret", "--admin-api-key", "admin-secret")
    admin = {"Authorization": "Bearer admin-secret"}
    for path, body in (("/flush_cache", None), ("/abort_request", {"abort_all": True})):
        r = router.post(path, json=body)
        assert r.status_code == 403 and "admin key" in r.json()["error"]["message"], r.text
    control = ("/flush_cache", "/abort_request")
    assert [x.path for x in p1.received + d1.received if x.path in control] == []
    assert router.post("/flush_cache", headers=admin).status_code == 200
    assert router.post("/abort_request", json={"abort_all": True}, headers=admin).status_code == 200
    sent = [x.headers.get("Authorization") for x in p1.received + d1.received if x.path in control]
    assert sent == ["Bearer admin-secret"] * 4
    for w in (p1, d1):
        w.reset()
    mine = {**router.headers, "X-Client-Token": "alice"}
    assert router.post("/generate", json={"text": "x"}, headers=mine).status_code == 200
    assert router.post("/abort_request", json={"rid": "r-1"}, headers=mine).status_code == 200
    bodies(p1, 1)
    for x in p1.received + d1.received:
        if x.path in ("/generate", "/abort_request"):
            assert (x.headers.get("Authorization"), x.headers.get("X-Client-Token")) == ("Bearer router-secret",
                                                                                        "alice"), x.path
    assert "admin-secret" not in router.output()


def test_a_router_beyond_loopback_without_a_key_warns_once(echo, make_router):
    """Only when told it may (--allow-no-api-key): without that it refuses to start (test_router_trust)."""
    p1, d1 = echo["p1"], echo["d1"]
    open_router = make_router([p1.url], [d1.url], "--host", "0.0.0.0", "--allow-no-api-key")  # via 127.0.0.1
    keyed = make_router([p1.url], [d1.url], "--host", "0.0.0.0", "--api-key", "k")
    assert open_router.get("/health").status_code == 200
    warned = [line for line in open_router.output().splitlines() if "no --api-key and no --admin-api-key" in line]
    assert len(warned) == 1 and "0.0.0.0" in warned[0]
    assert "no --api-key" not in keyed.output()


# ----------------------------------------------------------- resumption
def test_a_stream_whose_decode_dies_resumes_on_another(echo, make_router):
    p1, d1, d2 = echo["p1"], echo["d1"], echo["d2"]
    router = make_router([p1.url], [d1.url, d2.url], "--policy", "round_robin")
    body = {"input_ids": [1, 2, 3], "stream": True, "sampling_params": {"max_new_tokens": 6, "min_new_tokens": 5},
            "echo_die_on": "d1", "echo_die_after": 2}
    with httpx.stream("POST", router.url + "/generate", json=body, timeout=30) as r:
        got = events(r)
    assert got[-1] == "[DONE]" and all("error" not in e for e in got[:-1])
    want = [1003 + i for i in range(6)]  # what an undisturbed run streams
    assert [e["output_ids"] for e in got[:-1]] == [want[:k] for k in range(1, 7)]
    assert got[-2]["text"] == "".join(f"<{t}>" for t in want)
    assert got[-2]["meta_info"]["completion_tokens"] == 6 and got[-2]["meta_info"]["prompt_tokens"] == 3
    resumed = d2.generation_bodies()[-1]
    k = len(resumed["input_ids"]) - 3  # tokens the router had relayed when d1 died (2 unless a load spike)
    assert resumed["input_ids"] == [1, 2, 3, *want[:k]] and k <= 2
    assert resumed["sampling_params"] == {"max_new_tokens": 6 - k, "min_new_tokens": 5 - k}
    assert got[-2]["meta_info"]["id"] == ("d1" if k else "d2")  # one stream, as the client began it
    assert router.metric("pdserve_router:resumed_streams_total") == 1
    assert f"resumed on {d2.url} after {k} tokens" in router.output()


def test_a_decode_that_dies_after_its_final_event_is_not_resumed(echo, make_router):
    """d1 sends its last event (the finish reason) and dies before [DONE]: the client has everything,
    so the router ends the stream itself; it asks no other decode to continue it (a resumed request
    of 0 new tokens, or an error event after the answer, if it did)."""
    p1, d1, d2 = echo["p1"], echo["d1"], echo["d2"]
    router = make_router([p1.url], [d1.url, d2.url], "--policy", "round_robin")
    body = {"input_ids": [1, 2, 3], "stream": True, "sampling_params": {"max_new_tokens": 3},
            "echo_die_on": "d1", "echo_die_after": 3}
    with httpx.stream("POST", router.url + "/generate", json=body, timeout=30) as r:
        got = events(r)
    assert len(d1.generation_bodies()) == 1  # the stream began on d1, which died
    assert got[-1] == "[DONE]" and all("error" not in e for e in got[:-1])
    assert [e["output_ids"] for e in got[:-1]] == [[1003], [1003, 1004], [1003, 1004, 1005]]
    assert got[-2]["meta_info"]["finish_reason"]["type"] == "length"
    assert d2.generation_bodies() == [] and router.metric("pdserve_router:resumed_streams_total") == 0
    alone = make_router([p1.url], [d1.url])  # no decode to resume on: still no error event
    with httpx.stream("POST", alone.url + "/generate", json=body, timeout=30) as r:
        got = events(r)
    assert got[-1] == "[DONE]" and got[-2]["output_ids"] == [1003, 1004, 1005] and "error" not in got[-2]


def test_a_stream_with_no_decode_left_ends_with_an_error_event(echo, make_router):
    router = make_router([echo["p1"].url], [echo["d1"].url])
    body = {"input_ids": [1], "stream": True, "sampling_params": {"max_new_tokens": 5},
            "echo_die_on": "d1", "echo_die_after": 1}
    with httpx.stream("POST", router.url + "/generate", json=body, timeout=30) as r:
        got = events(r)
    assert got[0]["output_ids"] == [1001] and got[-1] == "[DONE]"
    assert got[-2]["error"]["message"] == f"decode worker {echo['d1'].url}: stream broke"
    assert router.worker_state(echo["d1"].url)["in_flight"] == 0


def test_a_json_answer_that_breaks_off_is_asked_of_another_decode(echo, make_router):
    d1, d2 = echo["d1"], echo["d2"]
    router = make_router([echo["p1"].url], [d1.url, d2.url], "--policy", "round_robin")
    r = router.post("/generate", json={"text": "x", "echo_die_on": "d1"})
    assert r.status_code == 200 and r.json()["worker"] == "d2"
    assert router.metric("pdserve_router:worker_errors_total", role="decode", worker=d1.url, kind="broken") == 1
    alone = make_router([echo["p1"].url], [d1.url])
    r = alone.post("/generate", json={"text": "x", "echo_die_on": "d1"})
    assert r.status_code == 502 and r.json()["error"]["message"] == (
        f"decode worker {d1.url}: answer broke off and no other decode could take it")


def test_a_decode_that_became_prefill_sends_the_request_to_the_server_that_became_decode(echo, make_router):
    """The roles swapped (POST /pd_role_switch on both) between two health checks: the request
    reaches the old decode, which answers that it is prefill now. The router re-checks the roles
    at once and serves it on the old prefill, instead of a 502 because its decode set looked
    empty until the next check (a flake of test_role_switch's load test before)."""
    p1, d1 = echo["p1"], echo["d1"]
    p1.role, d1.role = "prefill", "decode"
    router = make_router([p1.url], [d1.url], "--health-check-interval-secs", "3600")
    assert router.post("/generate", json={"text": "hi"}).json()["worker"] == "d1"
    p1.role, d1.role, d1.switched_to_prefill, d1.bootstrap_port = "decode", "prefill", True, free_port()
    r = router.post("/generate", json={"text": "hi"})
    assert r.status_code == 200, r.text
    assert r.json()["worker"] == "p1"
    roles = router.get("/get_server_info").json()
    assert ([w["url"] for w in roles["prefill"]], [w["url"] for w in roles["decode"]]) == ([d1.url], [p1.url])
