"""The torch-native backend's staged decode KV must follow request identity, not client rids.

A client may reuse a finished request's ``rid``. If the new request's length lines up with
the old one's (one token longer than at the old request's last decode step), a stage keyed on
rids and lengths would append onto the old request's KV and attend over it.
"""

import pytest
import torch

import pdserve
from fixtures.tiny_models import greedy_continuation, make_hf_model_and_dir
from pdserve.engine.request import SamplingParams
from pdserve.layers.forward_batch import ForwardMode

PROMPT_A, PROMPT_B = 10, 10
B_TOKENS = 5  # B finishes after its 5th token, at a decode step of length PROMPT_B + B_TOKENS - 1
# The reused rid's prompt is one shorter than that, so its first decode step is exactly
# "the staged batch, one token later" as far as rids and lengths can tell.
PROMPT_B2 = PROMPT_B + B_TOKENS - 1
A_TOKENS, B2_TOKENS = 24, 12


def _greedy(n):
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True).validate()


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "DeepseekV3ForCausalLM"])
def test_reused_rid_with_lined_up_length_gets_its_own_kv(tmp_path, arch):
    hf, path = make_hf_model_and_dir(arch, tmp_path)
    g = torch.Generator().manual_seed(3)
    prompt_a, prompt_b, prompt_b2 = (torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist()
                                     for n in (PROMPT_A, PROMPT_B, PROMPT_B2))
    # The plain loop: the lined-up steps below are its timing (overlap scheduling leaves a request
    # whose last token is in flight out of the next step), and the hook reads ``running`` mid-forward.
    sched = pdserve.Engine(model_path=path, disable_overlap_schedule=True).scheduler
    sched.runner.backend.decode_attention_impl = "torch"  # the stage (the CPU decode kernel keeps none)
    decodes = []  # (rids, uids, seq_lens) of every decode forward, recorded at layer 0

    def hook(layer_id, fb):
        if layer_id == 0 and fb.mode is ForwardMode.DECODE:
            reqs = tuple(sched.running)
            decodes.append((tuple(r.rid for r in reqs), tuple(r.uid for r in reqs), fb.seq_lens.tolist()))

    sched.runner.layer_hook = hook
    out = {"A": [], "B": [], "B2": []}
    for rid, prompt, n in (("A", prompt_a, A_TOKENS), ("B", prompt_b, B_TOKENS)):
        sched.add_request(rid, prompt, _greedy(n))
    reused = False
    while sched.has_work():
        for o in sched.step():
            key = "B2" if (o.rid == "B" and reused) else o.rid
            out[key] += o.new_token_ids
            if o.rid == "B" and o.finished and not reused:
                # The same rid again, right away: its prefill runs before A's next decode step.
                sched.add_request("B", prompt_b2, _greedy(B2_TOKENS))
                reused = True
        sched.check_memory()

    # The coincidence really happened: consecutive decode steps over rids (A, B) whose lengths
    # each grew by one, while the second "B" is another request.
    pairs = list(zip(decodes, decodes[1:]))
    assert any(prev[0] == cur[0] == ("A", "B") and prev[1] != cur[1]
               and cur[2] == [x + 1 for x in prev[2]] for prev, cur in pairs)
    assert out["A"] == greedy_continuation(hf, prompt_a, A_TOKENS)
    assert out["B"] == greedy_continuation(hf, prompt_b, B_TOKENS)
    assert out["B2"] == greedy_continuation(hf, prompt_b2, B2_TOKENS)
    assert sched.allocator.num_free + sched.cache.num_cached_pages == sched.allocator.num_pages


def test_backend_prepares_once_per_forward(tmp_path):
    """The model runner calls ``prepare`` once per forward, before any layer, and every layer
    of that forward reads the same metadata object."""
    _, path = make_hf_model_and_dir("LlamaForCausalLM", tmp_path)
    engine = pdserve.Engine(model_path=path, page_size=4, chunked_prefill_size=8)
    runner = engine.scheduler.runner
    prepared, seen = [], []
    real_prepare = runner.backend.prepare

    def prepare(fb):
        prepared.append(real_prepare(fb))
        return prepared[-1]

    runner.backend.prepare = prepare
    runner.layer_hook = lambda layer_id, fb: seen.append((layer_id, fb.attn_metadata))
    engine.generate(input_ids=[[5, 6, 7] * 7, [9, 8]], sampling_params={"max_new_tokens": 4, "temperature": 0})
    L = runner.pool.num_layers
    assert len(prepared) == engine.scheduler.forward_steps > 1
    assert len(seen) == L * len(prepared)
    for step, md in enumerate(prepared):
        assert [s[0] for s in seen[step * L:(step + 1) * L]] == list(range(L))
        assert all(s[1] is md for s in seen[step * L:(step + 1) * L])
