"""Benchmark datasets on the tiny presets' tokenizer: exact lengths, real sharing, seeded reproducibility."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from pdserve.bench.config import DatasetConfig, LoadConfig
from pdserve.bench.datasets import MultiTurn, PromptMaker, build_workload
from pdserve.bench.serving import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny-llama")


def requests(workload):
    return [c.first() for c in workload.conversations]


def prompts(cfg: DatasetConfig, tok, **load) -> list:
    return requests(build_workload(cfg, LoadConfig(**load), tok))


def test_random_prompts_have_exact_lengths_and_round_trip(tok):
    reqs = prompts(DatasetConfig(random_input_len=300, random_output_len=20, random_range_ratio=1.0), tok,
                   num_prompts=12)
    assert len(reqs) == 12
    for r in reqs:
        assert r.prompt_len == 300 and r.output_len == 20
        assert tok.encode(r.prompt) == list(r.prompt_ids) and len(r.prompt_ids) == 300
    assert len({r.prompt for r in reqs}) == 12


def test_random_range_ratio_bounds_lengths(tok):
    reqs = prompts(DatasetConfig(random_input_len=100, random_output_len=40, random_range_ratio=0.5), tok,
                   num_prompts=64)
    assert all(50 <= r.prompt_len <= 100 and 20 <= r.output_len <= 40 for r in reqs)
    assert all(len(tok.encode(r.prompt)) == r.prompt_len for r in reqs)
    assert len({r.prompt_len for r in reqs}) > 10


def test_same_seed_same_workload_other_seed_other_workload(tok):
    cfg = DatasetConfig(random_input_len=64, random_output_len=8, random_range_ratio=0.2)
    a, b = prompts(cfg, tok, num_prompts=8, seed=5), prompts(cfg, tok, num_prompts=8, seed=5)
    c = prompts(cfg, tok, num_prompts=8, seed=6)
    assert a == b and a != c


def test_fallback_without_word_tokens_still_exact(tok):
    maker = PromptMaker(tok, random.Random(0))
    maker.words = []  # a tokenizer with no " word" tokens: fit decoded random ids to the length
    for n in (1, 7, 64, 257):
        assert len(tok.encode(maker.text(n), add_special_tokens=False)) == n


def test_sharegpt_reads_a_local_file(tok, tmp_path):
    convs = [{"conversations": [{"from": "human", "value": f"Question {i} about rivers and mountains?"},
                                {"from": "gpt", "value": f"Answer {i}: " + "water flows downhill " * (i + 1)}]}
             for i in range(6)]
    convs += [{"conversations": [{"from": "human", "value": "one turn only"}]},
              {"conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "too short"}]}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(convs))
    cfg = DatasetConfig(dataset_name="sharegpt", dataset_path=str(path))
    reqs = prompts(cfg, tok, num_prompts=6)
    answers = {c["conversations"][0]["value"]: c["conversations"][1]["value"] for c in convs[:6]}
    assert sorted(r.prompt for r in reqs) == sorted(answers)
    for r in reqs:
        assert r.prompt_len == len(tok.encode(r.prompt))
        assert r.output_len == len(tok.encode(answers[r.prompt], add_special_tokens=False))
    assert {r.output_len for r in prompts(replace(cfg, sharegpt_output_len=5), tok, num_prompts=3)} == {5}
    with pytest.raises(ValueError, match="--num-prompts: .* only 6 usable"):
        prompts(cfg, tok, num_prompts=7)


@pytest.mark.parametrize("content,match", [(None, "cannot read"), ("{not json", "not JSON"),
                                           ('{"a": 1}', "JSON list")])
def test_sharegpt_bad_file_names_the_flag(tok, tmp_path, content, match):
    path = tmp_path / "d.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=f"--dataset-path: .*{match}"):
        prompts(DatasetConfig(dataset_name="sharegpt", dataset_path=str(path)), tok, num_prompts=1)


def test_shared_prefix_groups_really_share_their_system_prompt(tok):
    cfg = DatasetConfig(dataset_name="generated-shared-prefix", gsp_num_groups=3, gsp_prompts_per_group=4,
                        gsp_system_prompt_len=200, gsp_question_len=30, gsp_output_len=7)
    reqs = prompts(cfg, tok)
    assert len(reqs) == 12
    groups: dict[str, list] = {}
    for r in reqs:
        assert r.prompt_len == 230 and r.output_len == 7
        assert tok.encode(r.prompt) == list(r.prompt_ids)  # the server sees these ids
        groups.setdefault(r.tag, []).append(r.prompt_ids)
    assert len(groups) == 3 and all(len(g) == 4 for g in groups.values())
    heads = []
    for ids in groups.values():
        assert len({p[:200] for p in ids}) == 1  # one system prompt, token for token
        assert len({p[200:] for p in ids}) == 4  # distinct questions
        heads.append(ids[0][:200])
    assert len(set(heads)) == 3
    assert [r.tag for r in reqs] != sorted(r.tag for r in reqs)  # shuffled across groups, as sglang


def test_multi_turn_extends_previous_prompt_and_answer(tok):
    cfg = DatasetConfig(dataset_name="multi-turn", multi_turn_clients=3, multi_turn_rounds=3,
                        multi_turn_question_len=20, multi_turn_output_len=5)
    convs = build_workload(cfg, LoadConfig(), tok).conversations
    assert len(convs) == 3 and all(isinstance(c, MultiTurn) and c.num_requests == 3 for c in convs)
    conv = convs[0]
    r1 = conv.first()
    assert r1.prompt_len == 20 and r1.messages == ({"role": "user", "content": r1.prompt},)
    r2 = conv.next(r1, " the answer", None)
    assert r2.prompt.startswith(r1.prompt + " the answer") and len(r2.prompt) > len(r1.prompt + " the answer")
    assert r2.prompt_len == len(tok.encode(r2.prompt)) and r2.output_len == 5
    assert [m["role"] for m in r2.messages] == ["user", "assistant", "user"]
    assert r2.messages[1]["content"] == " the answer"
    r3 = conv.next(r2, " again", None)
    assert r3.prompt.startswith(r2.prompt + " again")
    assert conv.next(r3, "done", None) is None


def test_multi_turn_in_token_ids_extends_with_the_output_ids(tok):
    cfg = DatasetConfig(dataset_name="multi-turn", multi_turn_clients=1, multi_turn_rounds=2,
                        multi_turn_question_len=16, multi_turn_output_len=4)
    conv = build_workload(cfg, LoadConfig(), tok, use_ids=True).conversations[0]
    r1 = conv.first()
    r2 = conv.next(r1, "whatever", [11, 12, 13, 14])
    assert r2.prompt_ids[:16] == r1.prompt_ids and r2.prompt_ids[16:20] == (11, 12, 13, 14)
    assert r2.prompt_len == 16 + 4 + 16


def test_mixed_merges_two_timed_streams(tok):
    cfg = DatasetConfig(dataset_name="mixed", mixed_interactive_input_len=32, mixed_interactive_output_len=16,
                        mixed_background_input_len=400, mixed_background_output_len=4, mixed_background_rate=1.0)
    w = build_workload(cfg, LoadConfig(num_prompts=200, request_rate=3.0), tok)
    reqs = requests(w)
    assert len(reqs) == 200 and len(w.arrivals) == 200 and w.arrivals == sorted(w.arrivals)
    inter = [r for r in reqs if r.tag == "interactive"]
    back = [r for r in reqs if r.tag == "background"]
    assert len(inter) + len(back) == 200
    assert all(r.prompt_len == 32 and r.output_len == 16 for r in inter)
    assert all(r.prompt_len == 400 and r.output_len == 4 for r in back)
    assert 0.15 < len(back) / 200 < 0.35  # rates 3 : 1
    with pytest.raises(ValueError, match="--request-rate"):
        build_workload(cfg, LoadConfig(num_prompts=4), tok)  # an infinite interactive rate


def test_bad_dataset_flags_name_the_flag():
    for kwargs, flag in (({"dataset_name": "nope"}, "--dataset-name"), ({"random_range_ratio": 1.5},
                         "--random-range-ratio"), ({"gsp_question_len": 0}, "--gsp-question-len"),
                         ({"dataset_name": "sharegpt"}, "--dataset-path")):
        with pytest.raises(ValueError, match=flag):
            DatasetConfig(**kwargs)
