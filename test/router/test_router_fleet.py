"""``pdserve router`` (a real subprocess) as a fleet's router, in front of recording echo workers on
loopback: a circuit breaker opens on a worker whose requests die while its /health passes, keeps it
out of the picks, and closes once it serves again; a request whose decode died before its first byte
is retried on a new pair, one whose stream had started is never sent twice (each byte reaches the
client once); the concurrency cap queues, answers 429 with Retry-After when the queue is full and
408 when a request waited too long."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from router_utils import EchoWorker, Router, wait_for

FAST_HEALTH = ("--health-check-interval-secs", "0.1", "--health-check-timeout-secs", "2")
BREAKER_OPEN_S = 5  # long enough for a few requests on a loaded box while it is open (checked below)


@pytest.fixture(scope="module")
def echo():
    workers = {name: EchoWorker(name).start() for name in ("p1", "d1", "d2")}
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
        assert r.stop() in (0, None), r.output()


def events(response: httpx.Response) -> list:
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:])
            for line in response.iter_lines() if line.startswith("data: ")]


def cb_state(router: Router, worker: EchoWorker) -> float:
    return router.metric("pdserve_router:worker_cb_state", role="decode", worker=worker.url)


# -------------------------------------------------------------- breakers
def test_a_breaker_opens_on_a_dead_worker_and_closes_on_its_return(echo, make_router):
    p1, d1, d2 = echo["p1"], echo["d1"], echo["d2"]
    router = make_router([p1.url], [d1.url, d2.url], "--policy", "round_robin", "--cb-failure-threshold", "2",
                         "--cb-success-threshold", "1", "--cb-timeout-duration-secs", str(BREAKER_OPEN_S),
                         *FAST_HEALTH)
    d1.drop_requests = True  # its /health still passes: only the requests can tell
    for i in range(10):
        r = router.post("/generate", json={"text": f"a{i}"})
        assert r.status_code == 200 and r.json()["worker"] == "d2"  # each failure retried on d2
        if cb_state(router, d1) == 1:
            break
    assert cb_state(router, d1) == 1
    dropped = len(d1.generation_bodies())
    assert dropped == 2 == router.metric("pdserve_router:worker_errors_total", role="decode", worker=d1.url,
                                         kind="broken")
    assert router.metric("pdserve_router:retries_total", role="decode", worker=d1.url, reason="broken") == 2
    state = router.worker_state(d1.url)
    assert state["healthy"] and state["circuit_breaker"] == "open"
    assert "circuit breaker closed -> open (2 failures in a row" in router.output()

    answered = [router.post("/generate", json={"text": f"b{i}"}).json()["worker"] for i in range(4)]
    assert answered == ["d2"] * 4 and len(d1.generation_bodies()) == dropped  # open: never picked
    assert router.metric("pdserve_router:worker_cb_transitions_total", role="decode", worker=d1.url,
                         to="half_open") == 0  # all four were sent while it was open

    d1.drop_requests = False  # it is back
    wait_for(lambda: cb_state(router, d1) == 2, BREAKER_OPEN_S + 30, "half-open after the cool-down")
    answered = [router.post("/generate", json={"text": f"c{i}"}).json()["worker"] for i in range(2)]
    assert "d1" in answered  # the probe went through and succeeded
    assert cb_state(router, d1) == 0 and router.worker_state(d1.url)["circuit_breaker"] == "closed"
    for to, n in (("open", 1), ("half_open", 1), ("closed", 1)):
        assert router.metric("pdserve_router:worker_cb_transitions_total", role="decode", worker=d1.url,
                             to=to) == n


def test_a_client_whose_requests_crash_the_worker_cannot_open_its_breaker(echo, make_router):
    """Issue 33: 500s one client's requests cause (and 4xx) never open a breaker; a 502 still does."""
    p1, d1 = echo["p1"], echo["d1"]
    router = make_router([p1.url], [d1.url], "--cb-failure-threshold", "2", "--cb-timeout-duration-secs", "600",
                         "--retry-max-retries", "0", *FAST_HEALTH)
    for status in (500, 400, 422):
        d1.fail_status = status
        for i in range(4):
            assert router.post("/generate", json={"text": f"hostile{i}"}).status_code == status
    assert cb_state(router, d1) == 0 and router.worker_state(d1.url)["circuit_breaker"] == "closed"
    d1.fail_status = None
    r = router.post("/generate", json={"text": "the next client"})
    assert r.status_code == 200 and r.json()["worker"] == "d1"
    d1.fail_status = 502  # a gateway failure is the worker's: two in a row open it
    for i in range(2):
        router.post("/generate", json={"text": f"gw{i}"})
    assert cb_state(router, d1) == 1


# --------------------------------------------------------------- retries
def test_a_decode_dead_before_its_first_byte_is_retried_on_a_new_pair(echo, make_router):
    p1, d1, d2 = echo["p1"], echo["d1"], echo["d2"]
    router = make_router([p1.url], [d1.url, d2.url], "--policy", "round_robin", *FAST_HEALTH)
    d1.drop_requests = True
    body = {"prompt": "x", "stream": True, "echo_chunks": 3}
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        got = events(r)
    assert got == [{"worker": "d2", "i": i} for i in range(3)] + ["[DONE]"]  # d2's stream, once
    (to_d1,), (to_d2,) = d1.generation_bodies(), d2.generation_bodies()
    wait_for(lambda: len(p1.generation_bodies()) == 2, what="both prefill halves")
    rooms = [b["bootstrap_room"] for b in p1.generation_bodies()]
    assert rooms == [to_d1["bootstrap_room"], to_d2["bootstrap_room"]] and rooms[0] != rooms[1]  # a new pair
    assert router.metric("pdserve_router:retries_total", role="decode", worker=d1.url, reason="broken") == 1


def test_a_stream_that_started_is_never_sent_again(echo, make_router):
    """Its decode dies after two events: the client has them once, then an error event; no other
    decode ever sees the request (a non-/generate stream cannot be resumed)."""
    p1, d1, d2 = echo["p1"], echo["d1"], echo["d2"]
    router = make_router([p1.url], [d1.url, d2.url], "--policy", "round_robin", *FAST_HEALTH)
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "echo_chunks": 5,
            "echo_die_on": "d1", "echo_die_after": 2}
    with httpx.stream("POST", router.url + "/v1/chat/completions", json=body, timeout=30) as r:
        got = events(r)
    assert got[:2] == [{"worker": "d1", "i": 0}, {"worker": "d1", "i": 1}]
    assert got[2]["error"]["message"] == f"decode worker {d1.url}: stream broke" and got[3:] == ["[DONE]"]
    assert len(d1.generation_bodies()) == 1 and d2.generation_bodies() == []
    assert router.metric("pdserve_router:retries_total", role="decode", worker=d1.url, reason="broken") == 0


def test_without_retries_the_failure_is_the_answer(echo, make_router):
    p1, d1, d2 = echo["p1"], echo["d1"], echo["d2"]
    router = make_router([p1.url], [d1.url, d2.url], "--policy", "round_robin", "--disable-retries", *FAST_HEALTH)
    d1.drop_requests = True
    r = router.post("/generate", json={"text": "x"})
    assert r.status_code == 502
    assert r.json()["error"]["message"] == f"decode worker {d1.url}: answer broke off (retries disabled)"
    assert d2.generation_bodies() == []


# ----------------------------------------------------------------- the cap
def test_the_cap_queues_then_answers_429_with_retry_after_and_408_after_the_queue_timeout(echo, make_router):
    p1, d1 = echo["p1"], echo["d1"]
    router = make_router([p1.url], [d1.url], "--max-concurrent-requests", "1", "--queue-size", "1",
                         "--queue-timeout-secs", "2", *FAST_HEALTH)
    hold = {"text": "hold", "stream": True, "echo_chunks": 1, "echo_hold": True}
    queued: dict = {}
    with httpx.stream("POST", router.url + "/generate", json=hold, timeout=30) as held:
        lines = held.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # it holds the one slot
        waiter = threading.Thread(target=lambda: queued.update(r=router.post("/generate", json={"text": "q"})))
        waiter.start()
        wait_for(lambda: router.metric("pdserve_router:queued_requests") == 1, what="the second request queued")
        r = router.post("/generate", json={"text": "too many"})
        assert r.status_code == 429 and r.headers["Retry-After"].isdigit() and int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        assert r.json()["error"]["message"].startswith("max_concurrent_requests: 1 requests in flight")
        waiter.join(30)
        late = queued["r"]
        assert late.status_code == 408 and late.json()["error"]["code"] == "queue_timeout"
        assert late.headers["Retry-After"].isdigit()
        assert [b["text"] for b in d1.generation_bodies()] == ["hold"]  # neither reached a worker
        assert router.metric("pdserve_router:active_requests") == 1
    wait_for(lambda: router.metric("pdserve_router:active_requests") == 0, what="the slot freed")
    assert router.post("/generate", json={"text": "now"}).json()["worker"] == "d1"
    assert router.metric("pdserve_router:rejected_requests_total", reason="queue_full") == 1
    assert router.metric("pdserve_router:rejected_requests_total", reason="queue_timeout") == 1
