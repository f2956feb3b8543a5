"""Disaggregation with several scheduler ranks on either side, as real servers (one process per
rank, gloo on loopback, one Mooncake engine, or NIXL agent, per rank over TCP).

For the 16 mixed requests of fixtures/parallel_runs.py sent at once (prompts longer than a
chunk, one-token prompts, shared prefixes, two asking for logprobs), decode's greedy tokens equal
the single-rank colocated engine's, for: GQA prefill TP2 -> decode TP1 and TP1 -> TP2, DeepSeek
(a block-FP8 checkpoint, whose single-rank answers are transformers' on its dequantized copy)
prefill TP2 + EP2 -> decode DP2 with DP attention, and a GQA model with one KV head (replicated
over prefill's two ranks), and DeepSeek-V3.2 (whose index keys move with the latent) prefill TP2 + EP2 ->
decode DP2 with DP attention, and DeepSeek-V4 in the bounded layout (every state replicated: the
compressed entries, CSA's index keys and the boundary tails as pages, and each request's record of
window and open-window rings) prefill TP2 -> decode TP1. The two
llama pairs move their KV packed (one write per forward, layer, buffer and head block through
staging buffers), the others unpacked. Every prefill rank
that holds a source sends, no request falls back, and afterwards every rank's pages add up on
both sides. One deployment per configuration.

Then a prefill rank is killed with transfers in flight: decode (TP2) falls back to local
prefills on both of its ranks, token-identically, keeps serving, and its quarantine drains.
"""

from __future__ import annotations

import os
import random
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from pd_servers import decode_server, prefill_server, routed, start_all

from fixtures.parallel_runs import ENGINE_ARGS, LOGPROB_REQS, mixed_requests, single_rank_answers
from router.router_utils import wait_for

pytestmark = pytest.mark.skipif(not pytest.importorskip("mooncake"), reason="needs mooncake")

TP2 = ("--tp-size", "2")
NIXL = ("--disaggregation-transfer-backend", "nixl")
FLAGS = (*[x for k, v in ENGINE_ARGS.items() for x in (f"--{k.replace('_', '-')}", str(v))], "--num-threads", "1")
CONFIGS = {  # name -> (model, prefill flags, decode flags)
    "llama-prefill-tp2-decode-tp1": ("tiny-llama", TP2, ()),
    "llama-prefill-tp1-decode-tp2": ("tiny-llama", (), TP2),
    # DeepSeek as shipped: a block-FP8 checkpoint (with an MTP layer, skipped), dequantized on load
    "deepseek-fp8-prefill-tp2-ep2-decode-dp2-attention": (
        "deepseek-fp8", (*TP2, "--ep-size", "2"), (*TP2, "--dp-size", "2", "--enable-dp-attention")),
    "qwen2-one-kv-head-prefill-tp2-decode-tp1": ("qwen2-one-kv-head", TP2, ()),
    "llama-prefill-tp2-decode-tp1-nixl": ("tiny-llama", (*TP2, *NIXL), NIXL),
    # DeepSeek-V3.2: the index keys ride the latent's pages from the random source rank
    "deepseek-v32-prefill-tp2-ep2-decode-dp2-attention": (
        "deepseek-v32", (*TP2, "--ep-size", "2"), (*TP2, "--dp-size", "2", "--enable-dp-attention")),
    # DeepSeek-V4: every region from the random source rank; prefill splits heads and experts, decode holds all
    "deepseek-v4-prefill-tp2-decode-tp1": ("deepseek-v4", TP2, ()),
}
# Decode's default --disaggregation-transfer-pack auto packs where the TP sizes split heads
# differently: the llama pairs; MLA and a replicated single head move whole pages unpacked.
PACKED = {"llama-prefill-tp2-decode-tp1", "llama-prefill-tp1-decode-tp2", "llama-prefill-tp2-decode-tp1-nixl"}
MUST_TRANSFER = 9  # of the 16: all but the one-token prompt, the two logprob requests, the four prefix ones
TIMEOUT_S = 10


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from fixtures.fp8_checkpoints import make_fp8_checkpoint
    from fixtures.tiny_models import make_tiny_hf_model

    path = make_tiny_hf_model("Qwen2ForCausalLM", tmp_path_factory.mktemp("qwen2"), num_key_value_heads=1)
    fp8, dequantized = make_fp8_checkpoint("DeepseekV3ForCausalLM", tmp_path_factory.mktemp("ds-fp8"), mtp_layer=True)
    v32 = make_tiny_hf_model("DeepseekV32ForCausalLM", tmp_path_factory.mktemp("ds-v32"))
    return {"qwen2-one-kv-head": path, "deepseek-fp8": fp8, "deepseek-fp8-dequantized": dequantized,
            "deepseek-v32": v32, "deepseek-v4": _v4_checkpoint(tmp_path_factory.mktemp("ds-v4"))}


def _v4_checkpoint(folder) -> str:
    from fixtures.tiny_models import fill_hash_table, make_hf_model_and_dir

    hf, path = make_hf_model_and_dir("DeepseekV4ForCausalLM", folder)
    fill_hash_table(hf)
    hf.save_pretrained(path, safe_serialization=True)  # again, with the hash table
    return path


def test_the_fp8_reference_is_transformers_on_the_dequantized_copy(checkpoints):
    """What the FP8 pair's decode is held to (the single-rank engine's answers) is transformers'
    greedy output on the checkpoint's dequantized copy."""
    import torch
    from transformers import AutoModelForCausalLM

    from fixtures.tiny_models import greedy_continuation

    hf = AutoModelForCausalLM.from_pretrained(checkpoints["deepseek-fp8-dequantized"], dtype=torch.float32).eval()
    prompts, params = mixed_requests(2048)
    want = [greedy_continuation(hf, p, sp["max_new_tokens"]) for p, sp in zip(prompts, params)]
    assert [o["output_ids"] for o in single_rank_answers(checkpoints["deepseek-fp8"])] == want


@pytest.mark.parametrize("name", ["deepseek-v32", "deepseek-v4"])
def test_the_sparse_references_are_transformers(checkpoints, name):
    """What the V3.2 and V4 pairs' decode is held to (the single-rank engine's answers, prompts from 1
    to 9x V3.2's index_topk, and to 9 of V4's windows of 8, 17 of its CSA blocks) is transformers'
    greedy output."""
    import torch
    from transformers import AutoModelForCausalLM

    from fixtures.tiny_models import greedy_continuation

    hf = AutoModelForCausalLM.from_pretrained(checkpoints[name], dtype=torch.float32).eval()
    prompts, params = mixed_requests(2048)
    want = [greedy_continuation(hf, p, sp["max_new_tokens"]) for p, sp in zip(prompts, params)]
    assert [o["output_ids"] for o in single_rank_answers(checkpoints[name])] == want


class Pair:
    """A prefill server and a decode server, started side by side."""

    def __init__(self, model: str, prefill_flags, decode_flags, env: dict | None = None, decode_extra=()):
        self.model = model
        self.prefill, self.boot = prefill_server(model, *FLAGS, *prefill_flags, env=env)
        self.decode = decode_server(model, *FLAGS, *decode_flags, *decode_extra)

    def __enter__(self) -> Pair:
        start_all([self.prefill, self.decode])
        return self

    def __exit__(self, *exc) -> None:
        for s in (self.prefill, self.decode):
            s.stop()

    def send(self, indices: list[int], seed: int = 0) -> list[list[int]]:
        """Mixed requests ``indices`` at once through both servers (seeded rooms, so the MLA source
        draws are reproducible); decode's output ids."""
        prompts, params = mixed_requests(2048)
        rooms = random.Random(seed)
        bodies = [(self._body(i, prompts[i], params[i]), rooms.getrandbits(63)) for i in indices]
        with ThreadPoolExecutor(len(bodies)) as pool:
            futures = [pool.submit(routed, self.prefill, self.boot, self.decode, b, 180, room) for b, room in bodies]
            return [f.result()["output_ids"] for f in futures]

    @staticmethod
    def _body(i: int, prompt: list[int], params: dict) -> dict:
        body = {"input_ids": prompt, "sampling_params": params}
        if i in LOGPROB_REQS:  # as single_rank_answers asks: decode prefills these itself
            body.update(return_logprob=True, logprob_start_len=0, top_logprobs_num=2)
        return body


def assert_every_rank_accounted(info: dict, ranks: int) -> None:
    pages = info["rank_pages"] if ranks > 1 else [info]  # a single scheduler reports its own
    assert len(pages) == ranks, pages
    for r in pages:
        assert r["free_pages"] + r["cached_pages"] == r["total_pages"], pages


def _ranks(flags) -> int:
    return 2 if "--tp-size" in flags else 1


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, checkpoints):
    model, prefill_flags, decode_flags = CONFIGS[request.param]
    with Pair(checkpoints.get(model, model), prefill_flags, decode_flags) as p:
        p.ranks = (_ranks(prefill_flags), _ranks(decode_flags))
        p.packed = request.param in PACKED
        p.records = model == "deepseek-v4"  # the bounded layout on both sides: records move beside the pages
        yield p


def test_mixed_requests_match_the_single_rank_colocated_engine(pair):
    want = [o["output_ids"] for o in single_rank_answers(pair.model)]
    assert pair.send(list(range(16))) == want
    d, p = pair.decode.wait_idle(60), pair.prefill.wait_idle(60)
    assert d["fallbacks"] == 0 and d["transfer_failures"] == 0, d
    assert d["kv_received"] + d["local_prefills"] == 16 and d["kv_received"] >= MUST_TRANSFER, d
    assert p["rooms_completed"] == d["kv_received"] and p["rooms_failed"] == p["rooms_expired"] == 0, p
    if pair.ranks[0] > 1:  # the random source (MLA, replicated head) or the head split used every rank
        assert all(n > 0 for n in p["kv_writes_sent_by_rank"]), p["kv_writes_sent_by_rank"]
        assert sum(p["kv_writes_sent_by_rank"]) == p["kv_writes_sent"]
    assert_every_rank_accounted(p, pair.ranks[0])
    assert_every_rank_accounted(d, pair.ranks[1])
    assert d["quarantined_pages"] == 0 and d["staging_ranges_in_use"] == 0
    if pair.records:  # each side's budget holds records: P/D runs V4's bounded layout, not its pages per token
        assert p["kv_pool"]["record_bytes"] > 0 and d["kv_pool"]["record_bytes"] > 0, (p["kv_pool"], d["kv_pool"])
    if pair.packed:  # rooms of 2+ pages packed (one write per forward, layer, buffer, head block); 1-page ones not
        assert 0 < d["kv_rooms_packed"] <= d["kv_received"] and p["kv_writes_packed"] > 0, (d, p)
    else:
        assert d["kv_rooms_packed"] == 0 and p["kv_writes_packed"] == 0, (d, p)


# ---------------------------------------------------------------- a rank dies
@pytest.fixture(scope="module", params=[(), NIXL], ids=["mooncake", "nixl"])
def slow_pair(request):
    """Prefill TP2 whose writes reach the network 4 s late, so transfers are reliably in flight
    when a rank is killed, however loaded the machine (1.5 s was not: docs/testing.md); decode TP2
    with short timeouts. On each real backend. The delay costs no time: the kill ends the writes."""
    extra = ("--disaggregation-timeout-s", str(TIMEOUT_S), "--disaggregation-heartbeat-s", "0.5", *request.param)
    with Pair("tiny-llama", (*TP2, *request.param), TP2, env={"PDSERVE_TRANSFER_FAULTS": "delay_posts=4"},
              decode_extra=extra) as p:
        yield p


def test_a_killed_prefill_rank_leads_to_local_fallback_on_every_decode_rank(slow_pair):
    p = slow_pair
    want = [o["output_ids"] for o in single_rank_answers("tiny-llama")]
    victims = [4, 6, 7, 9]  # prompts of 9 to 40 tokens: each needs a transfer
    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(p.send, victims, 1)
        wait_for(lambda: p.decode.info()["num_waiting_for_kv"] == len(victims) or sent.done(), 60,
                 "every request waiting for its KV")
        assert not sent.done(), sent.result()
        os.kill(p.prefill.info()["scheduler_pids"][1], signal.SIGKILL)
        got = sent.result()
    assert got == [want[i] for i in victims]  # the client never saw the failure
    assert p.prefill.wait(30) not in (0, None)  # a rank down takes the whole prefill server down
    info = p.decode.info()
    assert info["fallbacks"] == len(victims) and info["kv_received"] == 0, info
    body = {"input_ids": mixed_requests(2048)[0][11], "sampling_params": mixed_requests(2048)[1][11]}
    assert httpx.post(p.decode.url + "/generate", json=body, timeout=120).json()["output_ids"] == want[11]
    info = p.decode.wait_idle(3 * TIMEOUT_S)  # the quarantine drained: every page is back
    assert info["quarantined_pages"] == 0
    assert_every_rank_accounted(info, 2)
