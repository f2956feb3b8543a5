"""Logprobs, echo and n through a real server, checked against transformers' log-softmax of the same
tiny model (float32, 1e-4): native /generate (SGLang's names), OpenAI completions and chat (the
``openai`` client), streaming and not. One server serves the module."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from fixtures.tiny_models import make_hf_model_and_dir
from server_utils import Server

TOL = 1e-4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_hf_model_and_dir("LlamaForCausalLM", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def server(model):
    s = Server("--max-total-tokens", "4096", model=model[1])
    try:
        yield s.start()
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 400, (n,), generator=g).tolist()


def hf_logprobs(hf, seq: list[int]) -> torch.Tensor:
    """[len(seq), V]: row i is log p(. | seq[:i + 1])."""
    with torch.no_grad():
        return torch.log_softmax(hf(input_ids=torch.tensor([seq])).logits[0].float(), -1)


def expected(ref: torch.Tensor, seq: list[int], first: int) -> list[float | None]:
    """The logprob of seq[p] for p >= first (None at position 0)."""
    return [None if p == 0 else float(ref[p - 1, seq[p]]) for p in range(first, len(seq))]


def assert_close(got: list, want: list) -> None:
    assert len(got) == len(want)
    assert [g is None for g in got] == [w is None for w in want]
    assert [g for g in got if g is not None] == pytest.approx([w for w in want if w is not None], abs=TOL)


# ------------------------------------------------------------ /generate
def test_generate_input_output_and_top_logprobs(server, model):
    hf, _ = model
    prompt = _prompt(19, 1)
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
            "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 3, "return_text_in_logprobs": True}
    r = server.post("/generate", json=body)
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    seq = prompt + r.json()["output_ids"]
    ref = hf_logprobs(hf, seq)
    assert [t for _, t, _ in meta["input_token_logprobs"]] == prompt
    assert_close([lp for lp, _, _ in meta["input_token_logprobs"]], expected(ref, seq, 0)[:len(prompt)])
    assert_close([lp for lp, _, _ in meta["output_token_logprobs"]], expected(ref, seq, len(prompt)))
    assert all(isinstance(text, str) for _, _, text in meta["output_token_logprobs"])
    assert meta["input_top_logprobs"][0] is None
    for p, top in enumerate(meta["input_top_logprobs"][1:] + meta["output_top_logprobs"], start=1):
        vals, ids = ref[p - 1].topk(3)
        assert [t for _, t, _ in top] == ids.tolist()
        assert [lp for lp, _, _ in top] == pytest.approx(vals.tolist(), abs=TOL)
    # The same through a stream, incrementally (issue 33): each event carries its own tokens' entries
    # and the prompt's come once, in the first event; joined, they are the unstreamed answer's.
    with httpx.stream("POST", server.url + "/generate", json={**body, "stream": True}, timeout=60) as s:
        events = [json.loads(line[6:])["meta_info"] for line in s.iter_lines() if line.startswith("data: {")]
    assert events[0]["input_token_logprobs"] == meta["input_token_logprobs"]
    assert events[0]["input_top_logprobs"] == meta["input_top_logprobs"]
    assert all(e["input_token_logprobs"] == [] == e["input_top_logprobs"] for e in events[1:])
    joined = [x for e in events for x in e["output_token_logprobs"]]
    assert [x[1] for x in joined] == [x[1] for x in meta["output_token_logprobs"]]
    assert_close([x[0] for x in joined], [x[0] for x in meta["output_token_logprobs"]])
    tops = [t for e in events for t in e["output_top_logprobs"]]
    assert [[x[1] for x in t] for t in tops] == [[x[1] for x in t] for t in meta["output_top_logprobs"]]
    assert_close([x[0] for t in tops for x in t], [x[0] for t in meta["output_top_logprobs"] for x in t])


def test_generate_default_start_and_n(server, model):
    hf, _ = model
    prompt = _prompt(11, 2)
    r = server.post("/generate", json={"input_ids": prompt, "return_logprob": True,
                                       "sampling_params": {"max_new_tokens": 4, "temperature": 0.8, "seed": 3,
                                                           "n": 3, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    outs = r.json()
    assert len(outs) == 3 and len({tuple(o["output_ids"]) for o in outs}) > 1
    for o in outs:
        meta = o["meta_info"]
        assert meta["cached_tokens"] == len(prompt) - 1  # the shared prefill put the prompt in the cache
        assert len(meta["input_token_logprobs"]) == 1  # logprob_start_len -1: the last prompt token
        seq = prompt + o["output_ids"]
        ref = hf_logprobs(hf, seq)
        assert_close([x[0] for x in meta["input_token_logprobs"] + meta["output_token_logprobs"]],
                     expected(ref, seq, len(prompt) - 1))


# --------------------------------------------------------------- OpenAI
def test_completions_echo_logprobs_lm_eval_style(client, model):
    """lm-evaluation-harness's loglikelihood request: token prompts, echo, logprobs 1, max_tokens 0."""
    hf, _ = model
    prompts = [_prompt(9, 3), _prompt(14, 4)]
    r = client.completions.create(model="m", prompt=prompts, echo=True, logprobs=1, max_tokens=0, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    for choice, prompt in zip(r.choices, prompts):
        lp = choice.logprobs
        assert len(lp.token_logprobs) == len(prompt)  # one per prompt token, the first null
        assert_close(lp.token_logprobs, expected(hf_logprobs(hf, prompt), prompt, 0))
        assert lp.top_logprobs[0] is None
        assert all(len(top) == 1 and max(top.values()) >= tok - TOL
                   for top, tok in zip(lp.top_logprobs[1:], lp.token_logprobs[1:]))
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
        assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == sum(map(len, prompts))


def test_completions_logprobs_stream_and_echo_match(client, model):
    hf, _ = model
    prompt = _prompt(12, 5)
    kw = dict(model="m", prompt=prompt, max_tokens=5, temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    full = client.completions.create(echo=True, **kw).choices[0]
    lp = full.logprobs
    n_out = len(lp.tokens) - len(prompt)
    assert n_out == 5
    seq = prompt + [int(hf_logprobs(hf, prompt)[-1].argmax())]  # the first greedy token
    ref = hf_logprobs(hf, seq)
    assert_close(lp.token_logprobs[:len(prompt) + 1], expected(ref, seq, 0))
    stream = client.completions.create(echo=True, stream=True, **kw)
    chunks = [c for c in stream if c.choices]
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    lps = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    offsets = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.text_offset]
    assert tokens == lp.tokens and offsets == lp.text_offset
    assert_close(lps, lp.token_logprobs)
    assert "".join(c.choices[0].text for c in chunks) == full.text
    plain = client.completions.create(**kw).choices[0]
    assert plain.logprobs.tokens == lp.tokens[len(prompt):]
    assert_close(plain.logprobs.token_logprobs, lp.token_logprobs[len(prompt):])
    assert plain.logprobs.text_offset[0] == 0
    assert full.text.endswith(plain.text)


def test_completions_n_shares_the_prompt(client, server):
    prompt = _prompt(24, 6)
    r = client.completions.create(model="m", prompt=prompt, n=4, max_tokens=8, temperature=1.0, seed=11,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert len({c.text for c in r.choices}) > 1  # seeded samples differ
    assert r.usage.prompt_tokens == 4 * len(prompt) and r.usage.completion_tokens == 4 * 8
    assert r.usage.prompt_tokens_details.cached_tokens == 4 * (len(prompt) - 1)
    again = client.completions.create(model="m", prompt=prompt, n=4, max_tokens=8, temperature=1.0, seed=11,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    greedy = client.completions.create(model="m", prompt=prompt, n=3, max_tokens=8, temperature=0)
    assert len({c.text for c in greedy.choices}) == 1
    server.wait_idle()


def test_completions_best_of_keeps_the_likeliest(client):
    prompt = _prompt(10, 7)
    kw = dict(model="m", prompt=prompt, max_tokens=6, temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    all3 = client.completions.create(n=3, logprobs=0, **kw).choices
    best = client.completions.create(n=1, best_of=3, logprobs=0, **kw).choices
    assert len(best) == 1
    want = max(all3, key=lambda c: sum(c.logprobs.token_logprobs))
    assert best[0].text == want.text
    assert sum(best[0].logprobs.token_logprobs) == pytest.approx(sum(want.logprobs.token_logprobs), abs=1e-3)
    plain = client.completions.create(n=1, best_of=3, **kw).choices  # selection needs no logprobs returned
    assert plain[0].text == want.text and plain[0].logprobs is None


def test_chat_logprobs_top_logprobs_n_and_stream(client, model):
    hf, path = model
    from transformers import AutoTokenizer

    from pdserve.web.chat import chat_prompt_ids

    messages = [{"role": "user", "content": "Count with me: one two"}]
    ids = chat_prompt_ids(AutoTokenizer.from_pretrained(path), messages)
    kw = dict(model="m", messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3,
              extra_body={"ignore_eos": True})
    r = client.chat.completions.create(n=2, **kw)
    assert len(r.choices) == 2 and r.usage.prompt_tokens_details.cached_tokens == 2 * (len(ids) - 1)
    content = r.choices[0].logprobs.content
    # Greedy samples agree: same tokens; logprobs within TOL, not bit-equal, since the two copies
    # may reach the scheduler in different steps and so run in batches of different shapes.
    other = r.choices[1].logprobs.content
    assert [e.token for e in other] == [e.token for e in content]
    assert [e.logprob for e in other] == pytest.approx([e.logprob for e in content], abs=TOL)
    assert len(content) == 5
    ref_first = hf_logprobs(hf, ids)[-1]
    assert content[0].logprob == pytest.approx(float(ref_first.max()), abs=TOL)
    assert [t.logprob for t in content[0].top_logprobs] == pytest.approx(ref_first.topk(3).values.tolist(),
                                                                         abs=TOL)
    assert content[0].bytes == list(content[0].token.encode())
    stream = client.chat.completions.create(stream=True, **kw)
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=TOL)


def test_stream_n_interleaves_choices(client):
    stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], n=3,
                                            max_tokens=4, temperature=1.0, seed=2, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    by_index: dict[int, list] = {}
    for c in chunks:
        for ch in c.choices:
            by_index.setdefault(ch.index, []).append(ch)
    assert sorted(by_index) == [0, 1, 2]
    for events in by_index.values():
        assert events[0].delta.role == "assistant" and events[-1].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 12


BAD = [
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "n": 3, "best_of": 2}, "best_of"),
    ("/v1/completions", {"prompt": "x", "n": 1, "best_of": 2, "stream": True}, "best_of"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                              "top_logprobs": 21}, "top_logprobs"),
    ("/generate", {"input_ids": [1, 2, 3], "return_logprob": True, "logprob_start_len": 4}, "logprob_start_len"),
    ("/generate", {"input_ids": [1, 2, 3], "return_logprob": True, "top_logprobs_num": -1}, "top_logprobs_num"),
    ("/generate", {"input_ids": [1, 2], "stream": True, "sampling_params": {"n": 2}}, "stream"),
    ("/generate", {"input_ids": [1, 2, 3], "return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num"),
    ("/generate", {"input_ids": [[1, 2], [1, 3]], "return_logprob": True, "top_logprobs_num": [2, 21]},
     "top_logprobs_num"),
]


@pytest.mark.parametrize("path,body,field", BAD, ids=[f"{p}-{f}-{i}" for i, (p, _, f) in enumerate(BAD)])
def test_bad_logprob_fields_name_the_field(server, path, body, field):
    r = server.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(field + ":"), r.json()
    assert r.json()["error"]["param"] == field


# ------------------------------------------------------------- --max-logprobs
MAX_LOGPROBS = 20  # the flag's default, which the module's server runs with


@pytest.mark.parametrize("path,body,field", [
    ("/generate", {"return_logprob": True, "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 1}},
     "top_logprobs_num"),
    ("/v1/completions", {"echo": True, "max_tokens": 0}, "logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "max_tokens": 1}, "top_logprobs"),
], ids=["generate", "completions", "chat"])
def test_top_logprobs_over_max_logprobs_is_400_naming_the_flag(server, model, path, body, field):
    """Top-k up to the vocabulary, at every prompt position (logprob_start_len 0), made a 5 KB
    request answer with 63 MB; over --max-logprobs the request is refused before it runs."""
    vocab = model[0].config.vocab_size
    prompt = {"/generate": {"input_ids": _prompt(200, 7)}, "/v1/completions": {"prompt": _prompt(200, 7)},
              "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]}}[path]
    r = server.post(path, json={**prompt, **body, field: vocab})
    assert r.status_code == 400, r.text[:200]
    err = r.json()["error"]
    assert err["message"].startswith(field + ":") and err["param"] == field, err
    assert f"--max-logprobs ({MAX_LOGPROBS})" in err["message"], err


def test_prompt_logprobs_at_the_cap_are_bounded_by_it(server):
    """The response grows with prompt length x top-k: at the cap every position carries exactly
    --max-logprobs alternatives, prompt and output alike."""
    prompt = _prompt(200, 7)
    r = server.post("/generate", json={"input_ids": prompt, "return_logprob": True, "logprob_start_len": 0,
                                       "top_logprobs_num": MAX_LOGPROBS,
                                       "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}})
    assert r.status_code == 200, r.text[:200]
    meta = r.json()["meta_info"]
    assert len(meta["input_top_logprobs"]) == len(prompt) and meta["input_top_logprobs"][0] is None
    tops = meta["input_top_logprobs"][1:] + meta["output_top_logprobs"]
    assert {len(t) for t in tops} == {MAX_LOGPROBS}
