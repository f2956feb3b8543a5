"""Scheduler behaviour through the offline Engine: retraction, limits, stop conditions, bad input."""

import json

import pytest
import torch

import pdserve
from fixtures.oracle import teacher_forced_logprobs
from fixtures.tiny_models import make_hf_model_and_dir


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(transformers model, checkpoint dir): the oracle and the engine's input."""
    return make_hf_model_and_dir("LlamaForCausalLM", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def llama_dir(llama):
    return llama[1]


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory):
    return make_hf_model_and_dir("DeepseekV3ForCausalLM", tmp_path_factory.mktemp("dsv3"))[1]


def _prompts(n, length=12, seed=0, vocab=400):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length + i,), generator=g).tolist() for i in range(n)]


GREEDY = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}


def _assert_no_leak(engine):
    s = engine.scheduler
    s.check_memory()
    assert not s.has_work()
    assert s.allocator.num_free + s.cache.num_cached_pages == s.allocator.num_pages


@pytest.mark.parametrize("model", ["llama_dir", "deepseek_dir"])
@pytest.mark.parametrize("radix", [True, False])
def test_retraction_under_tiny_page_budget_keeps_greedy_output(request, model, radix):
    path = request.getfixturevalue(model)
    prompts = _prompts(8)
    ref = pdserve.Engine(model_path=path, page_size=4).generate(input_ids=prompts, sampling_params=GREEDY)
    # 8 requests x (12..19 prompt + 24 output) tokens need ~300 slots; give 96.
    tight = pdserve.Engine(model_path=path, page_size=4, max_total_tokens=96,
                           disable_radix_cache=not radix)
    out = tight.generate(input_ids=prompts, sampling_params=GREEDY)
    assert tight.scheduler.num_retractions > 0
    assert [o["output_ids"] for o in out] == [o["output_ids"] for o in ref]
    _assert_no_leak(tight)


def test_page_accounting_holds_after_every_step_under_pressure(deepseek_dir):
    engine = pdserve.Engine(model_path=deepseek_dir, page_size=4, max_total_tokens=96, chunked_prefill_size=8)
    sched = engine.scheduler
    for i, p in enumerate(_prompts(8)):
        sched.add_request(f"r{i}", p, pdserve_sp(GREEDY))
    finished = set()
    while sched.has_work():
        finished |= {o.rid for o in sched.step() if o.finished}
        sched.check_memory()
    assert finished == {f"r{i}" for i in range(8)}
    assert sched.num_retractions > 0
    _assert_no_leak(engine)


def test_max_running_requests_is_respected(llama_dir):
    engine = pdserve.Engine(model_path=llama_dir, max_running_requests=2)
    seen = []
    sched = engine.scheduler
    for i, p in enumerate(_prompts(5)):
        sched.add_request(f"r{i}", p, pdserve_sp(GREEDY))
    while sched.has_work():
        sched.step()
        sched.check_memory()
        seen.append(len(sched.running) + (sched.chunked is not None))
    assert max(seen) == 2
    _assert_no_leak(engine)


def pdserve_sp(d):
    from pdserve.engine.request import SamplingParams

    return SamplingParams.from_dict(d).validate()


def test_max_new_tokens_and_stop_token_ids(llama_dir):
    engine = pdserve.Engine(model_path=llama_dir)
    prompt = _prompts(1)[0]
    base = engine.generate(input_ids=prompt, sampling_params=GREEDY)
    assert base["meta_info"]["finish_reason"] == {"type": "length", "length": 24}
    short = engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 5})
    assert short["output_ids"] == base["output_ids"][:5]
    stop_tok = base["output_ids"][6]
    first = base["output_ids"].index(stop_tok)
    out = engine.generate(input_ids=prompt, sampling_params={**GREEDY, "stop_token_ids": [stop_tok]})
    assert out["output_ids"] == base["output_ids"][:first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}
    _assert_no_leak(engine)


def test_stop_strings_cut_the_text(llama_dir):
    engine = pdserve.Engine(model_path=llama_dir)
    assert engine.tokenizer is not None, "fixture should ship the preset tokenizer"
    prompt = "The quick brown fox"
    base = engine.generate(prompt=prompt, sampling_params=GREEDY)
    text = base["text"]
    assert len(text) > 8
    stop = text[len(text) // 2:len(text) // 2 + 3]
    out = engine.generate(prompt=prompt, sampling_params={**GREEDY, "stop": stop})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == text[:text.find(stop)]
    assert len(out["output_ids"]) < len(base["output_ids"])
    _assert_no_leak(engine)


def _straddling_stop(tokenizer, ids: list[int]) -> tuple[str, int]:
    """(stop, k): the last two characters of token k-1's text and the first two of token k's,
    where the string first occurs in the output and no single token's text contains it."""
    full = tokenizer.decode(ids)
    texts = [tokenizer.decode(ids[:i]) for i in range(len(ids) + 1)]  # text of the first i tokens
    for k in range(1, len(ids)):
        prev, before, upto = texts[k - 1], texts[k], texts[k + 1]
        if not (upto.startswith(before) and before.startswith(prev) and full.startswith(upto)):
            continue  # a token boundary inside a multi-byte character
        if len(before) - len(prev) < 2 or len(upto) - len(before) < 2:
            continue
        stop = full[len(before) - 2:len(before) + 2]
        if full.find(stop) == len(before) - 2 and not any(stop in tokenizer.decode([t]) for t in ids):
            return stop, k
    raise AssertionError(f"no two-token stop string in {full!r}")


def test_stop_string_spanning_two_tokens(llama_dir):
    """A stop string made of one token's tail and the next token's head ends the request at
    the second token, and the text is cut where the stop string starts."""
    engine = pdserve.Engine(model_path=llama_dir)
    prompt = "The quick brown fox"
    base = engine.generate(prompt=prompt, sampling_params=GREEDY)
    stop, k = _straddling_stop(engine.tokenizer, base["output_ids"])
    out = engine.generate(prompt=prompt, sampling_params={**GREEDY, "stop": [stop]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["output_ids"] == base["output_ids"][:k + 1]
    assert out["text"] == base["text"][:base["text"].find(stop)]
    _assert_no_leak(engine)


def test_seeded_sampling_is_reproducible(llama_dir):
    engine = pdserve.Engine(model_path=llama_dir)
    p = _prompts(1)[0]
    sp = {"max_new_tokens": 16, "temperature": 1.0, "top_p": 0.9, "seed": 1234}
    a = engine.generate(input_ids=p, sampling_params=sp)
    # Batched with other requests, the seeded one still draws the same tokens.
    b = engine.generate(input_ids=[_prompts(2, seed=9)[0], p], sampling_params=[{"max_new_tokens": 16,
                        "temperature": 1.0}, sp])[1]
    assert a["output_ids"] == b["output_ids"]
    c = engine.generate(input_ids=p, sampling_params={**sp, "seed": 99})
    assert c["output_ids"] != a["output_ids"]


@pytest.mark.parametrize("sp", [GREEDY, {**GREEDY, "temperature": 0.9, "seed": 5}], ids=["greedy", "sampled"])
def test_return_logprob(llama, sp):
    """Each output token's logprob is transformers' log_softmax of the raw logits at that
    token (not the argmax's, not temperature-scaled), within 1e-4."""
    hf, path = llama
    prompt = _prompts(1)[0]
    out = pdserve.Engine(model_path=path).generate(input_ids=prompt, sampling_params=sp, return_logprob=True)
    lps = out["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in lps] == out["output_ids"] and len(lps) == 24
    want = teacher_forced_logprobs(hf, prompt, out["output_ids"])
    assert [lp for lp, _, _ in lps] == pytest.approx(want, abs=1e-4)


def test_lpm_policy_gives_same_tokens(llama_dir):
    prompts = _prompts(6)
    a = pdserve.Engine(model_path=llama_dir, schedule_policy="lpm", page_size=2,
                       max_running_requests=2).generate(input_ids=prompts, sampling_params=GREEDY)
    b = pdserve.Engine(model_path=llama_dir).generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in a] == [o["output_ids"] for o in b]


@pytest.mark.parametrize("kwargs, field", [
    (dict(input_ids=[]), "input_ids"),
    (dict(prompt=""), "input_ids"),
    (dict(input_ids=[1] * 600), "input_ids"),  # context is 512
    (dict(input_ids=[1, 2], sampling_params={"max_new_tokens": 600}), "sampling_params.max_new_tokens"),
    (dict(input_ids=[1, 10 ** 6]), "input_ids"),
    (dict(input_ids=[1, 2], sampling_params={"temperature": -1}), "sampling_params.temperature"),
    (dict(input_ids=[1, 2], sampling_params={"top_p": 0}), "sampling_params.top_p"),
    (dict(input_ids=[1, 2], sampling_params={"max_new_tokens": -3}), "sampling_params.max_new_tokens"),
    (dict(input_ids=[1, 2], sampling_params={"ignore_eos": "yes"}), "sampling_params.ignore_eos"),
    (dict(input_ids=[1, 2], sampling_params={"skip_special_tokens": [], "stop": "x"}),
     "sampling_params.skip_special_tokens"),  # ended the scheduler before
    (dict(), "prompt/input_ids"),
])
def test_bad_input_names_the_field_and_engine_stays_usable(llama_dir, kwargs, field):
    engine = pdserve.Engine(model_path=llama_dir)
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        engine.generate(**kwargs)
    out = engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 3})
    assert len(out["output_ids"]) == 3
    _assert_no_leak(engine)


def test_unknown_architecture_and_missing_weights(tmp_path, llama_dir):
    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = json.loads(open(f"{llama_dir}/config.json").read())
    (bad / "config.json").write_text(json.dumps({**cfg, "architectures": ["FooForCausalLM"]}))
    with pytest.raises(ValueError, match="architectures"):
        pdserve.Engine(model_path=str(bad))
    empty = tmp_path / "noweights"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="safetensors"):
        pdserve.Engine(model_path=str(empty))
    with pytest.raises(ValueError, match="model_path"):
        pdserve.Engine(model_path=str(tmp_path / "nope"))


def test_engine_reads_the_model_config_once(llama_dir, monkeypatch):
    from pdserve.config import ModelConfig

    calls = []
    real = ModelConfig.from_path.__func__

    def counted(cls, *args, **kwargs):
        calls.append(args)
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(ModelConfig, "from_path", classmethod(counted))
    engine = pdserve.Engine(model_path=llama_dir)
    assert len(calls) == 1
    assert engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2})["output_ids"]


def test_max_new_tokens_zero_and_abort(llama_dir):
    engine = pdserve.Engine(model_path=llama_dir)
    out = engine.generate(input_ids=[4, 5, 6], sampling_params={"max_new_tokens": 0})
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"]["type"] == "length"
    sched = engine.scheduler
    sched.add_request("x", _prompts(1, length=40)[0], pdserve_sp(GREEDY))
    sched.step()
    sched.step()
    assert sched.abort("x")
    outs = sched.step()
    assert any(o.rid == "x" and o.finished and o.finish_reason["type"] == "abort" for o in outs)
    _assert_no_leak(engine)


def test_model_dir_without_tokenizer_serves_input_ids(tmp_path, llama_dir):
    import shutil

    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(f"{llama_dir}/{f}", bare / f)
    engine = pdserve.Engine(model_path=str(bare))
    assert engine.tokenizer is None
    ref = pdserve.Engine(model_path=llama_dir).generate(input_ids=[5, 6, 7], sampling_params=GREEDY)
    out = engine.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)
    assert out["output_ids"] == ref["output_ids"] and out["text"] == ""
    with pytest.raises(ValueError, match="prompt"):
        engine.generate(prompt="hello")


@pytest.mark.parametrize("model", ["llama_dir", "deepseek_dir"])
def test_layer_hook_runs_after_each_layers_kv_is_written(request, model):
    """The disaggregation hook: called once per layer, in order, with that layer's new KV already
    in the pool and the next layer's not yet."""
    engine = pdserve.Engine(model_path=request.getfixturevalue(model), page_size=4)
    runner = engine.scheduler.runner
    pool = runner.pool
    seen = []

    def written(layer, loc):
        buf = pool.latent if hasattr(pool, "latent") else pool.k
        flat = buf[layer].reshape(pool.num_pages * pool.page_size, -1) if hasattr(pool, "latent") else \
            buf[layer].transpose(1, 2).reshape(pool.num_pages * pool.page_size, -1)
        return bool((flat[loc] != 0).any(dim=-1).all())

    def hook(layer_id, fb):
        nxt = layer_id + 1
        seen.append((layer_id, fb.mode.value, written(layer_id, fb.out_cache_loc),
                     nxt < pool.num_layers and written(nxt, fb.out_cache_loc)))

    runner.layer_hook = hook
    engine.generate(input_ids=_prompts(1)[0], sampling_params={**GREEDY, "max_new_tokens": 2})
    L = pool.num_layers
    assert [s[0] for s in seen] == list(range(L)) * 2  # one extend step, one decode step
    assert [s[1] for s in seen] == ["extend"] * L + ["decode"] * L
    assert all(s[2] for s in seen) and not any(s[3] for s in seen)


@pytest.mark.parametrize("kw, field", [(dict(tp_size=3), "tp_size"), (dict(tp_size=2, ep_size=2), "ep_size"),
                                       (dict(tp_size=2, dp_size=3, enable_dp_attention=True), "dp_size"),
                                       (dict(tp_size=2, dp_size=2, enable_dp_attention=True), "enable_dp")])
def test_parallel_settings_that_cannot_shard_the_model_are_refused(llama_dir, kw, field):
    """Refused before any rank starts (the model has 4 heads, no experts and GQA attention)."""
    with pytest.raises(ValueError, match=f"^{field}"):
        pdserve.Engine(model_path=llama_dir, **kw)


def test_a_small_call_is_admitted_between_the_sequences_of_a_big_one(llama_dir):
    """Fair admission: the sequences of one big call (group "big") wait for free slots, and a call of
    one sequence that arrives after all of them gets its first token in the next wave, not after the
    big call's last sequence; greedy tokens are the same as without groups."""
    sp = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    prompts = _prompts(9)
    engine = pdserve.Engine(model_path=llama_dir, max_running_requests=2)
    sched = engine.scheduler
    for i, p in enumerate(prompts[:8]):
        sched.add_request(f"big{i}", p, pdserve_sp(sp), group="big")
    sched.add_request("small", prompts[8], pdserve_sp(sp), group="small")
    first_step: dict[str, int] = {}
    outputs: dict[str, list[int]] = {}
    step = 0
    while sched.has_work():
        for o in sched.step():
            first_step.setdefault(o.rid, step)
            outputs.setdefault(o.rid, []).extend(o.new_token_ids)
        step += 1
    big_steps = sorted(first_step[f"big{i}"] for i in range(8))
    assert first_step["small"] <= big_steps[2], first_step  # in the second wave, beside big2
    assert first_step["small"] < big_steps[-1], first_step
    alone = pdserve.Engine(model_path=llama_dir).generate(input_ids=prompts, sampling_params=sp)
    assert [outputs[f"big{i}"] for i in range(8)] + [outputs["small"]] == [o["output_ids"] for o in alone]
    _assert_no_leak(engine)
