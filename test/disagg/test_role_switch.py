"""``POST /pd_role_switch`` on real servers behind ``pdserve router``: server A starts prefill and B
decode; under a bounded load A becomes decode (the router serves decode alone meanwhile) and B
prefill, so the deployment runs reversed. No request fails or changes its tokens (the colocated
engine's greedy outputs are the reference), the router moves both workers between its sets, the
reversed pair really disaggregates, pages balance on both servers, and refusals name the field.
Then the roles swap once more, and the router's sets must follow what the servers report on
/health: every later request is served disaggregated by the new pair, its KV transfers counted on
both, nothing prefilled locally on either side. One deployment for the module."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from pd_servers import decode_server, prefill_server, start_all

import pdserve
from entrypoints.server_utils import free_port
from router.router_utils import Router, wait_for

MODEL = "tiny-llama"
FLAGS = ("--page-size", "16", "--max-total-tokens", "8192", "--num-threads", "1")
NEW = 12


def _greedy() -> dict:
    return {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 1500) for _ in range(rng.choice((5, 40, 90, 150)))] for _ in range(n)]


class Deployment:
    def __init__(self):
        self.a, self.boot_a = prefill_server(MODEL, *FLAGS)
        self.boot_b = free_port()  # B's registry port once it is prefill
        self.b = decode_server(MODEL, *FLAGS, "--disaggregation-bootstrap-port", str(self.boot_b))
        self.router: Router | None = None

    def start(self) -> Deployment:
        start_all([self.a, self.b])
        self.router = Router([(self.a.url, self.boot_a)], [self.b.url], "--health-check-interval-secs", "0.3").start()
        return self

    def stop(self) -> None:
        if self.router is not None:
            self.router.stop()
        for s in (self.a, self.b):
            s.stop()

    def roles(self) -> dict[str, list[str]]:
        info = self.router.get("/get_server_info").json()
        return {role: [w["url"] for w in info[role]] for role in ("prefill", "decode")}

    def generate(self, ids: list[int]) -> list[int]:
        r = self.router.post("/generate", json={"input_ids": ids, "sampling_params": _greedy()}, timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["meta_info"]["finish_reason"]["type"] == "length", out
        return out["output_ids"]


@pytest.fixture(scope="module")
def dep():
    d = Deployment()
    try:
        yield d.start()
    finally:
        d.stop()


@pytest.fixture(scope="module")
def reference() -> dict[tuple[int, ...], list[int]]:
    prompts = _prompts(24)
    eng = pdserve.Engine(model_path=MODEL, page_size=16, num_threads=1)
    try:
        outs = eng.generate(input_ids=prompts, sampling_params=_greedy())
    finally:
        eng.shutdown()
    return {tuple(p): o["output_ids"] for p, o in zip(prompts, outs)}


def _switch(server, role: str, **extra) -> httpx.Response:
    return server.post("/pd_role_switch", json={"target_role": role, "quiet_secs": 1.0, **extra}, timeout=120)


def test_refusals_name_the_field(dep):
    r = _switch(dep.a, "prefill")
    assert r.status_code == 400 and "already prefill" in r.json()["error"]["message"]
    r = dep.a.post("/pd_role_switch", json={"target_role": "both"})
    assert r.status_code == 400 and "target_role" in r.json()["error"]["message"]
    r = dep.a.post("/pd_role_switch", json={"target_role": "decode", "timeout_secs": -1})
    assert r.status_code == 400 and "timeout_secs" in r.json()["error"]["message"]
    assert dep.a.info()["disaggregation_mode"] == "prefill"


def test_switch_under_load_keeps_every_answer(dep, reference):
    prompts = [list(p) for p in reference]
    with ThreadPoolExecutor(4) as pool:
        first = [pool.submit(dep.generate, p) for p in prompts[:12]]
        to_decode = pool.submit(_switch, dep.a, "decode")
        answers = [f.result() for f in first]
        r = to_decode.result()
        assert r.status_code == 200, r.text
        assert r.json()["role"] == "decode"
        second = [pool.submit(dep.generate, p) for p in prompts[12:18]]  # decode alone serves these
        r = _switch(dep.b, "prefill")
        assert r.status_code == 200, r.text
        answers += [f.result() for f in second]
    wait_for(lambda: dep.roles() == {"prefill": [dep.b.url], "decode": [dep.a.url]}, 30, "router moved both")
    wait_for(lambda: dep.router.get("/health").json().get("status") == "ok", 30, "router out of degraded mode")
    sent_before = dep.b.info()["rooms_completed"]
    with ThreadPoolExecutor(3) as pool:
        answers += list(pool.map(dep.generate, prompts[18:]))
    assert answers == [reference[tuple(p)] for p in prompts]
    assert dep.b.info()["rooms_completed"] >= sent_before + 1  # B prefills for A now: reversed P/D really runs
    for server, role in ((dep.a, "decode"), (dep.b, "prefill")):
        info = server.wait_idle()
        assert info["disaggregation_mode"] == role
        assert [s["role"] for s in info["role_switches"]] == [role]
        assert f'pdserve:role_switches_total{{model_name="{MODEL}",outcome="done",target_role="{role}"}} 1.0' \
            in server.get("/metrics").text
    assert dep.router.metric("pdserve_router:worker_role_switches_total", from_role="prefill", to_role="decode",
                             worker=dep.a.url) == 1


def _counters(server) -> dict[str, float]:
    """A server's counters from its /metrics (``pdserve:<name>_total``, summed over labels)."""
    out: dict[str, float] = {}
    for line in server.get("/metrics").text.splitlines():
        if not line.startswith("pdserve:"):
            continue
        sample, value = line.rsplit(" ", 1)
        name = sample.split("{", 1)[0][len("pdserve:"):]
        if name.endswith("_total"):
            out[name[:-len("_total")]] = out.get(name[:-len("_total")], 0.0) + float(value)
    return out


def test_after_a_switch_the_router_serves_disaggregated_on_the_new_pair(dep):
    """The router must take each server's role from its /health: were it to keep its own idea, it
    would send prefill halves to the new decode and decode halves to the new prefill, and the
    requests would be prefilled locally (or fail) instead of transferred."""
    before_roles = dep.roles()
    prefill, decode = (dep.a, dep.b) if before_roles["prefill"] == [dep.a.url] else (dep.b, dep.a)
    for server, role in ((prefill, "decode"), (decode, "prefill")):  # the router serves decode alone between
        r = _switch(server, role)
        assert r.status_code == 200 and r.json()["role"] == role, r.text
    new_prefill, new_decode = decode, prefill
    wait_for(lambda: dep.roles() == {"prefill": [new_prefill.url], "decode": [new_decode.url]}, 30,
             "the router's sets follow the reported roles")
    wait_for(lambda: dep.router.get("/health").json().get("status") == "ok", 30, "router out of degraded mode")
    degraded = dep.router.metric("pdserve_router:degraded_requests_total")
    before = {s.url: _counters(s) for s in (new_prefill, new_decode)}
    prompts = [[random.Random(11 + i).randrange(3, 1500) for _ in range(60)] for i in range(4)]  # new to both
    for p in prompts:
        assert len(dep.generate(p)) == NEW
    after = {s.url: _counters(s) for s in (new_prefill, new_decode)}

    def delta(server, name: str) -> float:
        return after[server.url].get(name, 0.0) - before[server.url].get(name, 0.0)

    n = len(prompts)
    assert dep.router.metric("pdserve_router:degraded_requests_total") == degraded  # each went to a pair
    assert delta(new_decode, "decode_kv_requests") == n and delta(new_decode, "decode_kv_received") == n
    assert delta(new_prefill, "prefill_rooms_completed") == n
    assert delta(new_prefill, "kv_transfer_bytes") > 0 and delta(new_decode, "kv_transfer_bytes_received") > 0
    for server in (new_prefill, new_decode):  # nothing prefilled locally, on either side
        assert delta(server, "decode_fallbacks") == 0 and delta(server, "decode_local_prefills") == 0
        assert delta(server, "prefill_rooms_failed") == 0 and delta(server, "prefill_rooms_dropped") == 0
    assert "decode_kv_requests" not in after[new_prefill.url]  # a prefill now: it decodes nothing
