"""Speculative decoding (engine/speculative.py): the accept rules as pure functions, and the
engine with speculation against the engine without it (greedy output token-identical), with
real draft models (NEXTN on tiny-deepseek, EAGLE on tiny-llama: random weights, so little is
accepted) and with an oracle draft that proposes the reference continuation with deliberate
mistakes (many drafts accepted, partial acceptance, stops inside an accepted run)."""


import pytest
import torch

import pdserve
from constrained.grammar_fixtures import CONSTRAINTS, check_output
from pdserve.config import ServerArgs
from pdserve.engine.request import SamplingParams
from pdserve.engine.speculative import SpeculativeDecode, accept_greedy, accept_sampled, processed_probs

STEPS = 3
GREEDY = {"temperature": 0.0, "ignore_eos": True}


# ------------------------------------------------------------------ pure rules
def test_accept_greedy_keeps_the_matching_prefix_then_the_targets_token():
    assert accept_greedy([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all accepted + bonus
    assert accept_greedy([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # first mismatch replaced
    assert accept_greedy([5, 6, 7], [1, 6, 7, 8]) == [1]
    assert accept_greedy([], [4]) == [4]


def _first_token_tv(rule, p, q, n=20000, seed=0):
    """Total variation between the first emitted token's empirical law and p[0]."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(p.shape[1])
    for _ in range(n):
        d = int(torch.multinomial(q[0], 1, generator=g))
        counts[rule([d], p, q, g)[0]] += 1
    return 0.5 * float((counts / n - p[0]).abs().sum())


P = torch.tensor([[0.5, 0.2, 0.2, 0.1, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2]])
Q = torch.tensor([[0.1, 0.1, 0.3, 0.2, 0.3]])


def _accept_unverified(drafts, p, q, g):
    return drafts + [0]


def _resample_from_p(drafts, p, q, g):
    d = drafts[0]
    if float(torch.rand((), generator=g)) * float(q[0, d]) < float(p[0, d]):
        return [d]
    return [int(torch.multinomial(p[0], 1, generator=g))]


def test_speculative_sampling_keeps_the_targets_distribution():
    assert _first_token_tv(accept_sampled, P, Q) < 0.02
    # the rule's test can fail: wrong rules are far from p
    assert _first_token_tv(_accept_unverified, P, Q) > 0.1
    assert _first_token_tv(_resample_from_p, P, Q) > 0.05


def test_speculative_sampling_two_drafts_joint_law():
    """Two drafts: the law of the first two emitted tokens (when two are emitted or the second is
    the bonus) matches p0 x p1, p1 independent of the first token here."""
    p = torch.tensor([[0.6, 0.3, 0.1], [0.1, 0.1, 0.8], [0.3, 0.3, 0.4]])
    q = torch.tensor([[0.2, 0.2, 0.6], [0.5, 0.4, 0.1]])
    g = torch.Generator().manual_seed(1)
    n, joint = 20000, torch.zeros(3, 3)
    for _ in range(n):
        d = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(2)]
        out = accept_sampled(d, p, q, g)
        second = out[1] if len(out) > 1 else int(torch.multinomial(p[1], 1, generator=g))
        joint[out[0], second] += 1
    expected = p[0][:, None] * p[1][None, :]
    assert 0.5 * float((joint / n - expected).abs().sum()) < 0.03


def test_processed_probs_greedy_is_one_hot_and_sampling_respects_top_k():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]] * 2)
    probs = processed_probs(logits, [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=2)],
                            [[], []])
    assert probs[0].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert probs[1, 0] == 0 and probs[1, 2] == 0 and abs(float(probs[1].sum()) - 1) < 1e-6


# ------------------------------------------------------------------ flags
@pytest.mark.parametrize("kw,flag", [
    (dict(speculative_eagle_topk=2), "--speculative-eagle-topk"),
    (dict(speculative_num_draft_tokens=9), "--speculative-num-draft-tokens"),
    (dict(tp_size=2), "--speculative-algorithm"),
    (dict(enable_torch_compile=True), "--speculative-algorithm"),
    (dict(speculative_algorithm="MEDUSA"), "--speculative-algorithm"),
])
def test_unsupported_speculation_is_refused_naming_the_flag(kw, flag):
    args = dict(model_path="tiny-deepseek", speculative_algorithm="NEXTN") | kw
    with pytest.raises(ValueError, match=flag):
        ServerArgs(**args)


def test_eagle_needs_a_draft_and_nextn_needs_mla(eagle_dir):
    with pytest.raises(ValueError, match="--speculative-draft-model-path"):
        ServerArgs(model_path="tiny-llama", speculative_algorithm="EAGLE")
    with pytest.raises(ValueError, match="NEXTN"):
        pdserve.Engine(model_path="tiny-llama", speculative_algorithm="NEXTN")


# ------------------------------------------------------------------ engine
@pytest.fixture(scope="module")
def eagle_dir():
    """tiny-llama's EAGLE draft preset (one Llama layer, config only: seeded dummy weights)."""
    return "tiny-llama-eagle"


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 400, (9 + 3 * i,), generator=g).tolist() for i in range(n)]


CASES = {"NEXTN": ("tiny-deepseek", {}), "EAGLE": ("tiny-llama", None)}


def _spec_kwargs(alg, eagle_dir):
    kw = dict(speculative_algorithm=alg, speculative_num_steps=STEPS)
    if alg == "EAGLE":
        kw["speculative_draft_model_path"] = eagle_dir
    return kw


@pytest.fixture(scope="module", params=["NEXTN", "EAGLE"])
def pair(request, eagle_dir):
    """(plain engine, speculative engine) on the same target."""
    model = CASES[request.param][0]
    # JSON without free whitespace, so grammar outputs end well inside max_new_tokens
    # speculative decoding never jumps forward (a jumped run is not token-identical), so neither does the reference
    plain = pdserve.Engine(model_path=model, page_size=4, constrained_json_disable_any_whitespace=True,
                           grammar_jump_forward=False)
    spec = pdserve.Engine(model_path=model, page_size=4, chunked_prefill_size=8,
                          constrained_json_disable_any_whitespace=True, **_spec_kwargs(request.param, eagle_dir))
    return plain, spec


def _no_leak(engine):
    s = engine.scheduler
    s.check_memory()
    assert not s.has_work() and s.pages_held_by_requests() == 0
    assert s.allocator.num_free + s.cache.num_cached_pages == s.allocator.num_pages


SAMPLING = [GREEDY | {"max_new_tokens": m} for m in (1, 5, 16, 11)]


def test_real_draft_greedy_output_is_identical(pair):
    plain, spec = pair
    prompts = _prompts(4)
    ref = plain.generate(input_ids=prompts, sampling_params=SAMPLING)
    out = spec.generate(input_ids=prompts, sampling_params=SAMPLING)
    assert [o["output_ids"] for o in out] == [o["output_ids"] for o in ref]
    meta = out[2]["meta_info"]
    assert meta["spec_verify_ct"] >= 1 and meta["spec_draft_token_num"] >= meta["spec_verify_ct"]
    assert 0 <= meta["spec_accept_rate"] <= 1 and meta["spec_accept_length"] >= 1
    # colocated: the first token came from prefill, every other one from a verify
    assert meta["spec_verify_ct"] + meta["spec_accept_token_num"] == len(out[2]["output_ids"]) - 1
    assert meta["spec_accept_length"] == pytest.approx(1 + meta["spec_accept_token_num"] / meta["spec_verify_ct"])
    assert spec.scheduler.stats()["spec_verify_ct"] > 0
    _no_leak(spec)


def test_real_draft_stop_strings_match(pair):
    plain, spec = pair
    prompts = _prompts(2, seed=3)
    ref = plain.generate(input_ids=prompts, sampling_params=GREEDY | {"max_new_tokens": 16})
    text = ref[0]["text"]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    sp = GREEDY | {"max_new_tokens": 16, "stop": [stop]}
    assert [o["text"] for o in spec.generate(input_ids=prompts, sampling_params=sp)] == \
           [o["text"] for o in plain.generate(input_ids=prompts, sampling_params=sp)]
    _no_leak(spec)


def test_seeded_sampling_with_speculation_repeats(pair):
    _, spec = pair
    prompts = _prompts(2, seed=5)
    sp = {"temperature": 0.8, "top_k": 20, "max_new_tokens": 10, "seed": 7, "ignore_eos": True}
    a = spec.generate(input_ids=prompts, sampling_params=sp)
    b = spec.generate(input_ids=prompts, sampling_params=sp)
    assert [o["output_ids"] for o in a] == [o["output_ids"] for o in b]
    _no_leak(spec)


class OracleDecode(SpeculativeDecode):
    """Proposes the reference continuation (``seqs``: full greedy sequences by prompt), wrong on
    every position divisible by ``wrong_every``: verify must accept runs and reject the rest."""

    def __init__(self, scheduler, seqs, wrong_every=5):
        super().__init__(scheduler, STEPS)
        self.seqs, self.wrong_every = seqs, wrong_every

    def _draft(self, reqs, batch, target_hidden):
        V = self.s.model_config.vocab_size
        logits = torch.zeros(len(reqs), V)
        end = 0
        for i, (req, pre, ext) in enumerate(zip(reqs, batch.prefix_lens, batch.extend_lens)):
            target = pre + ext - 1 + 2  # the row at position p proposes the token of p + 2
            seq = self.seqs[tuple(req.origin_input_ids)]
            tok = seq[target] if target < len(seq) else 0
            if target % self.wrong_every == 0:
                tok = (tok + 1) % V
            logits[i, tok] = 10.0
            end += ext
        return logits, torch.zeros(len(reqs), target_hidden.shape[-1])


@pytest.fixture(scope="module")
def oracle(pair):
    plain, spec = pair
    prompts = _prompts(4, seed=11)
    ref = plain.generate(input_ids=prompts, sampling_params=GREEDY | {"max_new_tokens": 24})
    seqs = {tuple(p): p + o["output_ids"] for p, o in zip(prompts, ref)}
    spec.scheduler.decode_step = OracleDecode(spec.scheduler, seqs)
    yield plain, spec, prompts, ref
    from pdserve.engine.speculative import make_decode_step

    spec.scheduler.decode_step = make_decode_step(spec.scheduler)


def test_oracle_draft_accepts_many_and_output_is_identical(oracle):
    plain, spec, prompts, ref = oracle
    out = spec.generate(input_ids=prompts, sampling_params=GREEDY | {"max_new_tokens": 24})
    assert [o["output_ids"] for o in out] == [o["output_ids"] for o in ref]
    for o in out:
        m = o["meta_info"]
        assert m["spec_accept_token_num"] > 0 and m["spec_accept_token_num"] < m["spec_draft_token_num"]
        assert m["spec_accept_length"] > 1.5  # verifies emitted several tokens each
    _no_leak(spec)


@pytest.mark.parametrize("max_new", [2, 6, 9])
def test_oracle_stops_inside_an_accepted_run(oracle, max_new):
    """max_new_tokens and a stop token id that fall inside a run of accepted drafts."""
    plain, spec, prompts, ref = oracle
    stop_tok = ref[0]["output_ids"][max_new - 1]
    for sp in (GREEDY | {"max_new_tokens": max_new},
               GREEDY | {"max_new_tokens": 24, "stop_token_ids": [stop_tok]}):
        want = plain.generate(input_ids=prompts, sampling_params=sp)
        got = spec.generate(input_ids=prompts, sampling_params=sp)
        assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
        assert [o["meta_info"]["finish_reason"] for o in got] == [o["meta_info"]["finish_reason"] for o in want]
    _no_leak(spec)


def test_oracle_logprobs_match_plain_decoding(oracle):
    plain, spec, prompts, ref = oracle
    sp = GREEDY | {"max_new_tokens": 12}
    want = plain.generate(input_ids=prompts[:2], sampling_params=sp, return_logprob=True, top_logprobs_num=2)
    got = spec.generate(input_ids=prompts[:2], sampling_params=sp, return_logprob=True, top_logprobs_num=2)
    for w, g in zip(want, got):
        a = [lp for lp, _, _ in w["meta_info"]["output_token_logprobs"]]
        b = [lp for lp, _, _ in g["meta_info"]["output_token_logprobs"]]
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-4)
        assert [t[1] for t in w["meta_info"]["output_token_logprobs"]] == \
               [t[1] for t in g["meta_info"]["output_token_logprobs"]]


def test_metrics_render_the_speculative_figures(oracle):
    from pdserve.obs.metrics import ServerMetrics

    _, spec, prompts, _ = oracle
    spec.generate(input_ids=prompts[:1], sampling_params=GREEDY | {"max_new_tokens": 6})
    m = ServerMetrics("tiny")
    m.set_scheduler_stats(spec.scheduler.stats())
    text = m.render().decode()
    verify = [line for line in text.splitlines() if line.startswith("pdserve:spec_verify_total")]
    assert verify and float(verify[0].split()[-1]) > 0
    assert "pdserve:spec_accept_length" in text and "pdserve:spec_draft_tokens" in text


def test_retraction_under_a_tiny_page_budget_keeps_output_and_pages(eagle_dir):
    """Verify rows need k + 1 slots: growth retracts like plain decode, pages come back."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(5, 400, (12 + i,), generator=g).tolist() for i in range(8)]
    sp = GREEDY | {"max_new_tokens": 24}
    ref = pdserve.Engine(model_path="tiny-deepseek", page_size=4).generate(input_ids=prompts, sampling_params=sp)
    tight = pdserve.Engine(model_path="tiny-deepseek", page_size=4, max_total_tokens=96,
                           **_spec_kwargs("NEXTN", eagle_dir))
    out = tight.generate(input_ids=prompts, sampling_params=sp)
    assert tight.scheduler.num_retractions > 0
    assert [o["output_ids"] for o in out] == [o["output_ids"] for o in ref]
    _no_leak(tight)


def test_oracle_greedy_with_penalties_matches_plain_decoding(oracle):
    """Penalties see the tokens before each verify row: drafts accepted in one step count."""
    plain, spec, prompts, _ = oracle
    sp = GREEDY | {"max_new_tokens": 16, "frequency_penalty": 0.7, "presence_penalty": 0.3}
    want = plain.generate(input_ids=prompts, sampling_params=sp)
    got = spec.generate(input_ids=prompts, sampling_params=sp)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]


def test_a_colocated_prefill_drafts_every_prompt_position_and_proposes(eagle_dir):
    """After the prompt's last chunk samples its first token, the draft runs over that chunk
    (the token one ahead of its last row is the sampled one): the draft layer holds KV at every
    prompt position and the request has its first proposal before its first decode step."""
    from pdserve.engine.request import SamplingParams as SP

    eng = pdserve.Engine(model_path="tiny-deepseek", page_size=4, chunked_prefill_size=8,
                         **_spec_kwargs("NEXTN", eagle_dir))
    s = eng.scheduler
    (prompt,) = _prompts(1, seed=9)
    prompt = prompt + prompt[:4]  # 13 tokens: two chunks
    req = s.add_request("a", prompt, SP(max_new_tokens=8, temperature=0.0, ignore_eos=True).validate())
    while not req.output_ids:
        s.step()
    assert req.draft is not None and len(req.draft.tokens) == 1
    pool = s.runner.pool
    rows = pool.latent[pool.num_layers - 1].view(pool.num_slots, -1)[s.kv_manager.slots(req, 0, len(prompt))]
    assert bool((rows.abs().sum(-1) > 0).all())
    while s.has_work():
        s.step()
    _no_leak(eng)


def test_oracle_sampled_drafts_are_accepted_at_the_targets_rates(oracle):
    """Sampled requests through the engine with the oracle's proposals: accepted drafts happen
    (the sampled path is exercised), and every output keeps its seed's repeatability."""
    _, spec, prompts, _ = oracle
    sps = [{"temperature": 0.3, "top_k": 2, "max_new_tokens": 8, "seed": s, "ignore_eos": True} for s in range(40)]
    a = spec.generate(input_ids=[prompts[0]] * 40, sampling_params=sps)
    b = spec.generate(input_ids=[prompts[0]] * 40, sampling_params=sps)
    assert [o["output_ids"] for o in a] == [o["output_ids"] for o in b]
    assert sum(o["meta_info"]["spec_accept_token_num"] for o in a) > 0


# ------------------------------------------------------------------ grammars
def test_grammar_with_real_drafts_is_valid_and_identical(pair):
    """Drafts are masked along the grammar and verified under it: greedy output equals plain
    decoding under the same grammar, and sampled output stays inside it."""
    from pdserve.engine.speculative import make_decode_step

    plain, spec = pair
    prompts = _prompts(3, seed=21)
    sps = [{"temperature": 0.0, "max_new_tokens": 128, kind: text} for kind, text in CONSTRAINTS.items()]
    ref = plain.generate(input_ids=prompts, sampling_params=sps)
    kept, spec.scheduler.decode_step = spec.scheduler.decode_step, make_decode_step(spec.scheduler)  # the real draft
    try:
        out = spec.generate(input_ids=prompts, sampling_params=sps)
        sampled = spec.generate(input_ids=prompts,
                                sampling_params=[{**sp, "temperature": 0.9, "seed": 1} for sp in sps])
    finally:
        spec.scheduler.decode_step = kept
    assert [o["output_ids"] for o in out] == [o["output_ids"] for o in ref]
    for o, kind in [*zip(out, CONSTRAINTS), *zip(sampled, CONSTRAINTS)]:
        assert o["meta_info"]["finish_reason"]["type"] == "stop", o
        check_output(kind, o["text"])
    assert spec.scheduler.grammar.live == 0
    _no_leak(spec)


def test_grammar_with_oracle_drafts_accepts_runs_and_matches_plain(pair):
    """An oracle proposing the grammar's own greedy continuation (wrong every 5th position, and
    a wrong token the grammar forbids is masked out of the draft): verify masks each row with
    the grammar advanced along the draft, accepts runs, rolls back the rest; output equals
    plain decoding under the grammar and is valid."""
    plain, spec = pair
    prompts = _prompts(3, seed=23)
    sps = [{"temperature": 0.0, "max_new_tokens": 128, kind: text} for kind, text in CONSTRAINTS.items()]
    ref = plain.generate(input_ids=prompts, sampling_params=sps)
    seqs = {tuple(p): p + o["output_ids"] for p, o in zip(prompts, ref)}
    kept, spec.scheduler.decode_step = spec.scheduler.decode_step, OracleDecode(spec.scheduler, seqs)
    try:
        out = spec.generate(input_ids=prompts, sampling_params=sps)
    finally:
        spec.scheduler.decode_step = kept
    assert [o["output_ids"] for o in out] == [o["output_ids"] for o in ref]
    accepted = sum(o["meta_info"]["spec_accept_token_num"] for o in out)
    assert accepted > sum(o["meta_info"]["spec_verify_ct"] for o in out)  # runs of drafts were accepted
    for o, kind in zip(out, CONSTRAINTS):
        assert o["meta_info"]["finish_reason"]["type"] == "stop", o
        check_output(kind, o["text"])
    _no_leak(spec)
