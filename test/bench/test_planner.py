"""The P:D planner: hand-computed timelines, closed-form ratios, colocation, thresholds, SLO safety."""

from __future__ import annotations

import json
import random

import pytest

from pdserve.bench.config import ProfileConfig
from pdserve.bench.planner import (
    SLO,
    Deployment,
    Evaluation,
    Hardware,
    Plan,
    SimRequest,
    WorkloadModel,
    margin_lines,
    meets,
    offered_rate,
    plan,
    request_tpot,
    simulate,
    threshold_candidates,
    with_margin,
    workload_from_lengths,
    workload_from_result,
)
from pdserve.bench.profiles import (
    PROFILE_SCHEMA,
    CacheAudit,
    Curve,
    DecodeProfile,
    PrefillProfile,
    check_context_room,
    load_profile,
)


def linear_prefill(seconds_per_token: float, overhead: float = 0.0) -> PrefillProfile:
    return PrefillProfile(Curve((1.0, 10000.0), (overhead + seconds_per_token, overhead + 10000 * seconds_per_token)))


def linear_decode(seconds_per_request: float, base: float = 0.0) -> DecodeProfile:
    """step(B) = base + B * seconds_per_request."""
    return DecodeProfile(Curve((1.0, 1000.0), (base + seconds_per_request, base + 1000 * seconds_per_request)))


def hw(prefill=None, decode=None, **kw) -> Hardware:
    return Hardware(prefill or linear_prefill(0.001), decode or linear_decode(0.01), **kw)


def one(arrival, isl, osl) -> list[SimRequest]:
    return [SimRequest(arrival, isl, osl)]


# ----------------------------------------------------------------- curves
def test_curve_interpolates_and_extends():
    c = Curve((100.0, 200.0, 400.0), (1.0, 2.0, 3.0))
    assert [c(x) for x in (50, 100, 150, 300, 400, 600)] == pytest.approx([1.0, 1.0, 1.5, 2.5, 3.0, 4.0])
    assert Curve((10.0,), (2.0,))(30) == pytest.approx(6.0)  # one point: proportional beyond it
    with pytest.raises(ValueError, match="increasing"):
        Curve((2.0, 1.0), (1.0, 1.0))
    with pytest.raises(ValueError, match="> 0"):
        Curve((1.0,), (0.0,))


# ------------------------------------------------------------- timelines
def test_colocated_request_timeline():
    (r,) = simulate(Deployment(colocated=1), hw(linear_prefill(0.005)), one(1.0, 100, 3))
    assert r.first_token == pytest.approx(1.5)  # prefill 100 * 5 ms gives the first token
    assert r.finish == pytest.approx(1.52)  # two decode steps of 10 ms
    assert request_tpot(r) == pytest.approx(0.01)


def test_disaggregated_request_timeline_includes_transfer_and_first_decode_step():
    h = hw(linear_prefill(0.005), transfer_s_per_token=0.001, transfer_overhead_s=0.05)
    (r,) = simulate(Deployment(prefill=1, decode=1), h, one(0.0, 100, 3))
    # prefill 0.5, transfer 0.05 + 0.1, then decode emits every token: 0.66, 0.67, 0.68
    assert r.first_token == pytest.approx(0.66)
    assert r.finish == pytest.approx(0.68)


def test_prefill_priority_then_shared_decode_steps():
    reqs = [SimRequest(0.0, 10, 4), SimRequest(0.0, 10, 4)]
    a, b = simulate(Deployment(colocated=1), hw(linear_prefill(0.001)), reqs)
    assert a.first_token == pytest.approx(0.01)  # the first arrival is prefilled alone
    assert b.first_token == pytest.approx(0.02)  # the second next, before any decode step (prefill priority)
    assert a.finish == b.finish == pytest.approx(0.02 + 3 * 0.02)  # then steps of batch 2: 20 ms each


def test_a_long_prefill_stalls_colocated_decode_but_not_disaggregated():
    h = hw(linear_prefill(0.001))
    reqs = [SimRequest(0.0, 10, 50), SimRequest(0.1, 2000, 2)]  # a chat, then a 2 s prompt arrives
    colo = simulate(Deployment(colocated=1), h, reqs)[0]
    dis = simulate(Deployment(prefill=1, decode=1), h, reqs)[0]
    assert request_tpot(colo) > 0.04  # 2 s of prefill inside 49 gaps of ~10 ms
    assert request_tpot(dis) < 0.02  # the long prompt runs on the prefill instance


def test_short_prompts_below_the_threshold_prefill_on_decode():
    h = hw(linear_prefill(0.001), transfer_overhead_s=0.5)
    short = simulate(Deployment(prefill=1, decode=1, min_prefill_tokens=64), h, one(0.0, 32, 2))[0]
    assert short.first_token == pytest.approx(0.032)  # no transfer: prefilled locally
    long = simulate(Deployment(prefill=1, decode=1, min_prefill_tokens=64), h, one(0.0, 100, 2))[0]
    assert long.first_token == pytest.approx(0.1 + 0.5 + 0.01)


def test_router_spreads_requests_over_instances():
    reqs = [SimRequest(0.0, 100, 2) for _ in range(4)]
    done = simulate(Deployment(prefill=2, decode=2), hw(linear_prefill(0.001)), reqs)
    # two prefill instances take two prompts each, one after the other: the last KV is ready at 0.2 s, not 0.4;
    # the two decode instances take two requests each, so it runs in a batch of one: 10 ms
    assert max(r.first_token for r in done) == pytest.approx(0.2 + 0.01)


# ------------------------------------------------------------ closed form
def closed_form_workload(isl: int, osl: int, rate: float) -> WorkloadModel:
    return WorkloadModel((isl,), (osl,), rate)


@pytest.mark.parametrize("osl,expected", [(30, (1, 3)), (10, (1, 1))])
def test_decode_work_k_times_prefill_work_gives_one_to_k(osl, expected):
    # prefill 0.1 s per request (no batching gain); decode step = 10 ms * batch (no batching gain either):
    # a request's decode work is osl * 10 ms, i.e. osl/10 times its prefill work. At 8 req/s one prefill
    # instance is 80% busy and k decode instances are too. (With work this linear, colocating the same
    # number of instances does as well, so the check is on the best disaggregated deployment.)
    h = hw(linear_prefill(0.1 / 512), linear_decode(0.01))
    p = plan(h, closed_form_workload(512, osl, 8.0), SLO(ttft=3.0, tpot=0.5), max_instances=8, num_requests=1500)
    best = p.best_disaggregated.deployment
    assert (best.prefill, best.decode) == expected


def test_prefill_heavy_work_gives_more_prefill_instances():
    h = hw(linear_prefill(0.2 / 2048), linear_decode(0.01))  # 0.2 s prefill vs 10 * 10 ms decode
    p = plan(h, closed_form_workload(2048, 10, 8.0), SLO(ttft=3.0, tpot=0.5), max_instances=8, num_requests=1500)
    best = p.best_disaggregated.deployment
    assert (best.prefill, best.decode) == (2, 1)


def test_long_prompts_stalling_colocated_decode_make_disaggregation_win():
    # 0.5 s prefills inside 8-token answers at 20 ms a step: colocated TPOT blows a 50 ms SLO
    h = hw(linear_prefill(0.5 / 2048), linear_decode(0.02))
    p = plan(h, closed_form_workload(2048, 8, 1.0), SLO(ttft=3.0, tpot=0.05), max_instances=6, num_requests=1000)
    assert p.recommendation.deployment == Deployment(prefill=1, decode=1)
    assert p.verdict.startswith("disaggregate")
    assert p.best_colocated is None or p.best_colocated.goodput_per_instance < p.recommendation.goodput_per_instance


def test_short_prompts_at_low_rate_colocate():
    h = hw(linear_prefill(0.0005), linear_decode(0.002, base=0.01))
    p = plan(h, closed_form_workload(32, 16, 1.0), SLO(ttft=0.5, tpot=0.1), max_instances=8, num_requests=500)
    assert p.recommendation.deployment == Deployment(colocated=1)
    assert p.verdict.startswith("colocate") and p.best_disaggregated is not None


def test_bimodal_prompts_get_a_min_prefill_tokens_threshold():
    # 9 in 10 requests are 32-token chats, 1 in 10 a 4096-token document. A transfer costs 0.3 s of
    # handshake, more than the 0.25 s TTFT SLO: only chats prefilled on decode can meet it.
    h = hw(linear_prefill(0.0001), linear_decode(0.001, base=0.01), transfer_overhead_s=0.3)
    wl = WorkloadModel((32,) * 9 + (4096,), (32,) * 10, 2.0)
    p = plan(h, wl, SLO(ttft=0.25, tpot=0.2, attainment=0.85), max_instances=4, num_requests=1000)
    best = p.best_disaggregated
    assert best is not None and 32 < best.deployment.min_prefill_tokens <= 4096
    always = [e for e in p.evaluations if e.deployment.colocated == 0 and e.deployment.min_prefill_tokens == 0]
    assert always and not any(e.feasible for e in always)


# ------------------------------------------------------------ SLO safety
@pytest.mark.parametrize("seed", range(6))
def test_never_recommends_a_deployment_that_misses_the_slos(seed):
    rnd = random.Random(seed)
    h = hw(linear_prefill(rnd.uniform(1e-5, 4e-4), rnd.uniform(0, 0.05)),
           linear_decode(rnd.uniform(1e-4, 3e-3), rnd.uniform(0.005, 0.03)),
           transfer_s_per_token=rnd.uniform(0, 1e-5), transfer_overhead_s=rnd.uniform(0, 0.02))
    wl = workload_from_lengths(rnd.choice([64, 512, 2048]), rnd.choice([16, 64, 256]), 0.5, rnd.uniform(0.5, 8),
                               seed=seed)
    slo = SLO(ttft=rnd.uniform(0.2, 3.0), tpot=rnd.uniform(0.02, 0.2), attainment=rnd.choice([0.9, 0.99]))
    p = plan(h, wl, slo, max_instances=6, num_requests=400, seed=seed)
    if p.recommendation is None:
        assert p.verdict.startswith("no deployment") and not any(e.feasible for e in p.evaluations)
        return
    assert p.recommendation in (p.best_colocated, p.best_disaggregated)
    for pick in (p.best_colocated, p.best_disaggregated):
        if pick is not None:  # re-run each candidate independently of the planner's bookkeeping
            done = simulate(pick.deployment, h, wl.requests(400, seed))
            assert sum(meets(r, slo) for r in done) / len(done) >= slo.attainment


def test_impossible_slos_give_no_recommendation():
    h = hw(linear_prefill(0.001), linear_decode(0.01))
    p = plan(h, closed_form_workload(512, 8, 1.0), SLO(ttft=0.1, tpot=0.5), max_instances=4, num_requests=100)
    assert p.recommendation is None and "no deployment of up to 4 instances" in p.verdict  # prefill alone 0.5 s


# ---------------------------------------------------------------- margin
def _plan_of(rec: Evaluation, *others: Evaluation) -> Plan:
    return with_margin(Plan(rec, rec, None, [], [rec, *others], f"disaggregate: {rec.deployment}"))


def test_a_lead_under_five_percent_is_a_warning_not_a_recommendation():
    rec = Evaluation(Deployment(prefill=1, decode=1), True, 1.0, 0.500)
    same_shape = Evaluation(Deployment(prefill=1, decode=1, min_prefill_tokens=64), True, 1.0, 0.4999)
    coloc = Evaluation(Deployment(colocated=2), True, 0.99, 0.495)
    p = _plan_of(rec, same_shape, coloc, Evaluation(Deployment(colocated=1), False, 0.5, 0.5))
    assert p.runner_up is coloc and p.margin == pytest.approx(0.5 / 0.495 - 1) and p.close_call
    lines = margin_lines(p)
    assert lines[0].startswith("WARNING: no clear winner: 1P1D leads 2 colocated by only 1.0% in goodput per "
                               "instance (0.5 vs 0.495 req/s)")
    assert not any(line.startswith("Recommendation:") for line in lines)
    assert p.to_dict()["close_call"] is True


def test_a_clear_lead_prints_its_margin():
    rec = Evaluation(Deployment(prefill=1, decode=1), True, 1.0, 0.5)
    p = _plan_of(rec, Evaluation(Deployment(colocated=4), True, 1.0, 0.25))
    assert p.margin == pytest.approx(1.0) and not p.close_call
    assert margin_lines(p) == ["Recommendation: disaggregate: 1P1D",
                               "Margin: 100.0% more goodput per instance than 4 colocated (0.5 vs 0.25 req/s)"]
    alone = _plan_of(rec, Evaluation(Deployment(colocated=1), False, 0.2, 0.2))
    assert alone.margin is None and margin_lines(alone)[1] == "Margin: no other deployment simulated meets the SLOs"


def test_a_simulated_plan_reports_its_margin():
    h = hw(linear_prefill(0.5 / 2048), linear_decode(0.02))
    p = plan(h, closed_form_workload(2048, 8, 1.0), SLO(ttft=3.0, tpot=0.05), max_instances=4, num_requests=300)
    assert p.recommendation is not None and p.runner_up is not None and p.margin is not None
    assert p.margin == pytest.approx(p.recommendation.goodput_per_instance / p.runner_up.goodput_per_instance - 1)


# ------------------------------------------------------------- profiling
def test_profile_lengths_past_the_context_are_refused_naming_the_flag():
    check_context_room(ProfileConfig(profile="prefill", profile_input_lens=(256, 1024, 4095)), 4096)
    with pytest.raises(ValueError, match=r"^--profile-input-lens: 4096 leaves no room .* context length of 4096 "
                                         r"tokens; use lengths up to 4095"):
        check_context_room(ProfileConfig(profile="prefill", profile_input_lens=(256, 1024, 4096)), 4096)
    with pytest.raises(ValueError, match=r"^--profile-context-len: 4000 prompt \+ 128 output"):
        check_context_room(ProfileConfig(profile="decode", profile_context_len=4000, profile_output_len=128), 4096)


def test_cache_audit_warns_about_hits_and_unverifiable_runs():
    assert CacheAudit(True, [0, 0, None]).warning() == ""
    hit = CacheAudit(True, [0, 2048, 16])
    assert hit.warning().startswith("2 of 3 timed requests reused up to 2048 cached prompt tokens")
    assert hit.to_dict() == {"flushed_before_each": True, "max_cached_tokens": 2048,
                             "requests_with_cache_hits": 2, "requests": 3}
    assert "cannot be ruled out" in CacheAudit(False, [None, None]).warning()
    assert CacheAudit(False, [0, 0]).warning() == ""  # no flush, but the server says nothing was reused


# ---------------------------------------------------------------- inputs
def test_workload_from_a_bench_result():
    result = {"schema": "pdserve.bench/v1", "args": {"request_rate": 4.0, "dataset_name": "random", "burstiness": 1},
              "details": {"success": [True, False, True], "input_lens": [100, 7, 300], "output_lens": [10, 0, 30]}}
    wl = workload_from_result(result)
    assert (wl.input_lens, wl.output_lens, wl.rate) == ((100, 300), (10, 30), 4.0)
    assert workload_from_result(result, rate=9.0).rate == 9.0
    with pytest.raises(ValueError, match="--request-rate"):
        workload_from_result({**result, "args": {"request_rate": "inf"}})
    assert offered_rate({"dataset_name": "mixed", "request_rate": 3.0, "mixed_background_rate": 0.5}) == 3.5


def test_threshold_candidates_split_the_lengths():
    # quantiles 32 (10-75%) and 438.4 (90%) give 33 and 439; powers of two above the shortest prompt
    assert threshold_candidates([32] * 9 + [4096]) == [0, 33, 64, 128, 256, 439, 512, 1024, 2048, 4096]
    assert threshold_candidates([100] * 5) == [0]


def test_profile_files(tmp_path):
    good = {"schema": PROFILE_SCHEMA, "kind": "decode", "points": [{"batch_size": 4, "step_seconds": 0.02},
                                                                   {"batch_size": 1, "step_seconds": 0.01}]}
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"schema": PROFILE_SCHEMA, "kind": "prefill", "points": [
        {"input_len": 10, "seconds": 0.1}]}) + "\n" + json.dumps(good) + "\n")
    assert load_profile(str(path), "decode").step(2) == pytest.approx(0.01 + 0.01 / 3)
    assert load_profile(str(path), "prefill").time(20) == pytest.approx(0.2)
    bad = tmp_path / "bad.json"
    for content, kind, match in ((json.dumps({**good, "points": [{"batch_size": 1}]}), "decode", "step_seconds"),
                                 ("nope", "decode", "not JSON"),
                                 (json.dumps({**good, "kind": "prefill", "schema": "x"}), "prefill",
                                  "not a pdserve.profile/v1"),
                                 (json.dumps(good), "prefill", "holds no 'prefill' profile")):
        bad.write_text(content)
        with pytest.raises(ValueError, match=f"--{kind}-profile .*{match}"):
            load_profile(str(bad), kind)


@pytest.mark.parametrize("seed", range(8))
def test_run_stepping_decode_matches_its_per_step_twin(seed):
    rnd = random.Random(seed)
    h = hw(linear_prefill(rnd.uniform(1e-5, 1e-3), rnd.uniform(0, 0.02)),
           linear_decode(rnd.uniform(1e-4, 5e-3), rnd.uniform(0.002, 0.02)),
           transfer_s_per_token=rnd.uniform(0, 1e-4), transfer_overhead_s=rnd.uniform(0, 0.05),
           max_running_requests=rnd.choice([2, 8, 256]), max_prefill_tokens=rnd.choice([512, 16384]))
    wl = workload_from_lengths(rnd.choice([32, 300, 2000]), rnd.choice([1, 5, 60]), rnd.uniform(0, 1),
                               rnd.uniform(1, 30), seed=seed)
    reqs = wl.requests(300, seed)
    dep = rnd.choice([Deployment(colocated=rnd.randint(1, 3)),
                      Deployment(prefill=rnd.randint(1, 3), decode=rnd.randint(1, 3),
                                 min_prefill_tokens=rnd.choice([0, 100, 1000]))])
    fast, slow = simulate(dep, h, reqs), simulate(dep, h, reqs, stepwise=True)
    for f, s in zip(fast, slow):
        assert f.first_token == pytest.approx(s.first_token, abs=1e-9)
        assert f.finish == pytest.approx(s.finish, abs=1e-9)
