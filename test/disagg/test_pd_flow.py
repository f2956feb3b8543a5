"""The P/D protocol (decode reserves, prefill writes layer by layer, decode counts writes)
between a prefill and a decode scheduler (in one process, over
real ZMQ and each transfer backend: Mooncake engines, NIXL agents, and the in-memory one): token identity with
a colocated engine, layer-wise streaming, write counting, handshake refusal, aborts and
quarantine, conditional disaggregation, fallback."""

from __future__ import annotations

import dataclasses
import shutil
import time

import pytest
import torch
from pd_pair import POOL_TOKENS, RUN_TIMEOUT_S, PDPair, greedy

import pdserve
from fixtures.tiny_models import make_tiny_hf_model
from pdserve.config import ModelConfig
from pdserve.disagg import prefill as prefill_mode
from pdserve.disagg.layout import page_runs
from pdserve.disagg.protocol import MAX_NONCE, KVProgress, KVProgressAck
from pdserve.disagg.sender import RoomState
from pdserve.engine.request import ReqState, SamplingParams
from pdserve.models.fingerprint import weights_fingerprint
from pdserve.transfer import (
    FaultInjectingBackend,
    TransferBackend,
    merge_contiguous,
    mooncake_available,
    nixl_available,
)

NEEDS_MOONCAKE = pytest.mark.skipif(not mooncake_available(), reason="needs mooncake")
NEEDS_NIXL = pytest.mark.skipif(not nixl_available(), reason="needs nixl")
BACKENDS = [pytest.param("mooncake", marks=NEEDS_MOONCAKE), pytest.param("nixl", marks=NEEDS_NIXL), "memory"]

NEW = 12


def _prompts(lengths, seed=0, vocab=1500):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _colocated(model: str, prompts, n=NEW, **flags) -> list[list[int]]:
    """The colocated engine's greedy tokens (with the pairs' KV pool unless ``flags`` set one)."""
    eng = pdserve.Engine(model_path=model, num_threads=1, **{"max_total_tokens": POOL_TOKENS, **flags})
    out = eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": n, "temperature": 0, "ignore_eos": True})
    return [o["output_ids"] for o in out]


@pytest.fixture(params=BACKENDS)
def pair_factory(request):
    pairs = []

    def make(model="tiny-llama", **flags) -> PDPair:
        pairs.append(PDPair(model, backend=request.param, **flags))
        return pairs[-1]

    yield make
    for p in pairs:
        p.close()


# ------------------------------------------------------------------ identity
# Every layout on Mooncake; NIXL and the in-memory backend move bytes the same way for each, so
# GQA and MLA on NIXL and one on memory.
@pytest.mark.parametrize("pair_factory, model, page_size", [
    *(pytest.param("mooncake", m, p, marks=NEEDS_MOONCAKE) for m in ("tiny-llama", "tiny-deepseek") for p in (1, 16)),
    pytest.param("nixl", "tiny-llama", 1, marks=NEEDS_NIXL),
    pytest.param("nixl", "tiny-deepseek", 16, marks=NEEDS_NIXL),
    ("memory", "tiny-deepseek", 16),
], indirect=["pair_factory"])
def test_outputs_match_a_colocated_engine(pair_factory, model, page_size):
    """Mixed lengths (longer than a chunk, one token), a prefix cached on both sides first:
    every request but the one-token prompt moves its KV, and decode's tokens are the
    colocated engine's."""
    chunk = 32 if page_size == 16 else 24
    pair = pair_factory(model, page_size=page_size, chunked_prefill_size=chunk)
    prefix, *rest = _prompts([40, 1, 5, 17, 70, 100, 3, 9])
    prompts = rest[:5] + [prefix + t for t in rest[5:]]
    pair.submit("warm", prefix + [5, 6], greedy(3))
    pair.run()
    rooms = [pair.submit(f"r{i}", p, greedy(NEW)) for i, p in enumerate(prompts)]
    pair.run()
    want = _colocated(model, prompts, page_size=page_size, chunked_prefill_size=chunk)
    assert [pair.outputs[f"r{i}"]["ids"] for i in range(len(prompts))] == want
    d, p = pair.decode.stats(), pair.prefill.stats()
    assert d["kv_received"] == len(prompts) and d["local_prefills"] == 1 and d["fallbacks"] == 0  # +warm-up
    assert p["rooms_completed"] == len(prompts)  # the one-token prompt never paired
    cached = [pair.outputs[f"r{i}"]["final"].cached_tokens for i in (5, 6)]
    assert all(c == (40 // page_size) * page_size for c in cached), cached  # prefill's hit, via its KVCompletion
    assert len(rooms) == len(set(rooms))
    pair.assert_idle_and_accounted()


def test_a_prompt_decode_already_caches_needs_no_transfer(pair_factory):
    pair = pair_factory("tiny-llama", page_size=4)
    (prompt,) = _prompts([21])  # prompt[:-1] is 20 tokens: 5 whole pages
    pair.submit("a", prompt, greedy(4))
    pair.run()
    before = pair.prefill.stats()["forward_steps"]
    pair.submit("b", prompt, greedy(NEW))
    pair.run()
    assert pair.prefill.stats()["forward_steps"] == before  # nothing was prefilled there
    assert pair.decode.stats()["local_prefills"] == 1
    assert pair.outputs["b"]["ids"] == _colocated("tiny-llama", [prompt], page_size=4)[0]
    pair.assert_idle_and_accounted()


def test_a_shared_prompt_lands_in_decode_s_cache_and_its_samples_fork_from_it(pair_factory):
    """n > 1 disaggregated (entrypoints/parallel_sampling.py): the room's request asks for no new
    token, ends once its KV landed, and the samples run on decode as local requests hitting that
    KV; each sample's tokens are a colocated engine's with the same per-sample seed."""
    pair = pair_factory("tiny-llama", page_size=4)
    (prompt,) = _prompts([22], seed=3)
    sampling = SamplingParams(max_new_tokens=NEW, temperature=1.0, seed=11, ignore_eos=True).validate()
    pair.submit("shared", prompt, dataclasses.replace(sampling.for_copy(0), max_new_tokens=0))
    pair.run()
    assert pair.outputs["shared"]["ids"] == [] and pair.outputs["shared"]["final"].finish_reason["type"] == "length"
    assert pair.decode.stats()["kv_received"] == 1 and pair.prefill.stats()["rooms_completed"] == 1
    before = pair.prefill.stats()["forward_steps"]
    for j in range(3):
        pair.submit_local(f"s{j}", prompt, sampling.for_copy(j))
    pair.run()
    assert pair.prefill.stats()["forward_steps"] == before  # the samples never reached prefill
    got = [pair.outputs[f"s{j}"] for j in range(3)]
    assert all(g["final"].cached_tokens == 20 for g in got)  # prompt[:-1]'s whole pages, received from prefill
    eng = pdserve.Engine(model_path="tiny-llama", num_threads=1, page_size=4, max_total_tokens=POOL_TOKENS)
    want = eng.generate(input_ids=prompt, sampling_params={**_seeded(sampling), "n": 3})
    assert [g["ids"] for g in got] == [w["output_ids"] for w in want]
    assert len({tuple(g["ids"]) for g in got}) > 1  # the seeds differ per sample
    pair.assert_idle_and_accounted()


def _seeded(sampling: SamplingParams) -> dict:
    return {"max_new_tokens": sampling.max_new_tokens, "temperature": sampling.temperature, "seed": sampling.seed,
            "ignore_eos": True}


# ------------------------------------------------------------ layer by layer
class RecordingBackend(TransferBackend):
    """The real backend, with every post recorded next to the forward's layer events."""

    def __init__(self, inner: TransferBackend, events: list):
        self.inner, self.events = inner, events

    session_id = property(lambda self: self.inner.session_id)

    def post_writes(self, peer, srcs, dsts, lens):
        self.events.append(("post", list(srcs), list(dsts), list(lens)))
        return self.inner.post_writes(peer, srcs, dsts, lens)

    def register(self, regions):
        self.inner.register(regions)

    def unregister(self, addrs):
        self.inner.unregister(addrs)

    def poll(self, handle):
        return self.inner.poll(handle)

    def write_sync(self, *a, **kw):
        return self.inner.write_sync(*a, **kw)

    def notifies(self):
        return self.inner.notifies()

    def probe(self, peer, timeout_s=2.0):
        return self.inner.probe(peer, timeout_s)

    def outstanding(self):
        return self.inner.outstanding()

    def close(self):
        self.inner.close()


def test_kv_streams_layer_by_layer_in_one_write_per_page_run(pair_factory):
    """Layer 0's writes are posted before the last layer's forward starts, and each layer moves
    each buffer in as many network writes as the request has contiguous page runs."""
    pair = pair_factory("tiny-llama", page_size=4, chunked_prefill_size=0)
    sched, sender = pair.prefill, pair.prefill.mode.sender
    events: list = []
    sender.backend = RecordingBackend(sender.backend, events)
    layers = sched.runner.model.model.layers
    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda *_a, i=i: events.append(("layer", i)))
    staged = []
    stage = sender.stage

    def record_stage(room, pages, end_pos, row=None):
        r = sender.rooms[room]
        kv = next(iter(r.kvs.values()))
        staged.append((list(pages[r.start_page:]), list(kv.dst_pages)))
        stage(room, pages, end_pos, row)

    sender.stage = record_stage
    taken = sched.allocator.alloc(24)
    sched.allocator.free(taken[::3])  # fragment prefill's free pages: every third is free
    (prompt,) = _prompts([41])  # 40 positions: 10 pages of 4, one chunk
    pair.submit("a", prompt, greedy(4))
    pair.run()
    assert pair.outputs["a"]["ids"] == _colocated("tiny-llama", [prompt], n=4, page_size=4)[0]
    ((src_pages, dst_pages),) = staged
    runs = len(page_runs(src_pages, dst_pages))
    assert runs > 1  # the fragmentation worked: several runs to merge
    first_post = next(i for i, ev in enumerate(events) if ev[0] == "post")
    assert first_post < events.index(("layer", len(layers) - 1)), events[:10]
    k, v = sched.runner.pool.buffer_descriptors()
    writes: dict[tuple[str, int], int] = {}
    for ev in events:
        if ev[0] != "post":
            continue
        for addr in merge_contiguous(*ev[1:])[0]:
            for d in (k, v):
                if d.base_addr <= addr < d.base_addr + d.total_bytes:
                    key = (d.name, (addr - d.base_addr) // d.layer_stride)
                    writes[key] = writes.get(key, 0) + 1
    assert writes == {(b, layer): runs for b in ("k", "v") for layer in range(len(layers))}
    sched.allocator.free([p for i, p in enumerate(taken) if i % 3])
    pair.assert_idle_and_accounted()


@pytest.mark.parametrize("path", ["after its forward", "in the next forward's layers"])
def test_a_landed_room_s_completion_does_not_wait_for_the_next_forward(pair_factory, monkeypatch, path):
    """On a busy prefill server another forward follows the one that finished a room: decode hears
    of the room once its writes have landed, while prefill waits briefly after the room's forward
    or from a layer of the next forward, not only when that forward has ended. Here prefill never
    steps again: decode alone must get the completion and decode the colocated tokens."""
    pair = pair_factory("tiny-llama", page_size=4)
    mode = pair.prefill.mode
    if path == "after its forward":  # wait until landed, however loaded the machine
        monkeypatch.setattr(prefill_mode, "LANDING_WAIT_S", RUN_TIMEOUT_S)
        monkeypatch.setattr(prefill_mode, "LANDING_WAIT_SHARE", float("inf"))
    else:
        monkeypatch.setattr(mode, "_await_landing", lambda forward_s: None)
    (prompt,) = _prompts([37])
    room = pair.submit("a", prompt, greedy(NEW))
    pair.run(until=lambda: room in mode.transferring)
    if path != "after its forward":
        assert room not in mode.notified
        r = mode.sender.rooms[room]
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not r.settled(mode.sender.backend):
            assert time.monotonic() < deadline, "the room's writes never landed"
            time.sleep(0.001)
        pair.prefill.runner.layer_hook(0, None)  # the next forward's first layer
    assert room in mode.notified
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while pair.decode.reqs["a"].state is ReqState.WAITING_FOR_KV:
        assert time.monotonic() < deadline, "decode never heard of the landed room"
        pair.decode.step()
    pair.run()
    assert pair.decode.stats()["fallbacks"] == 0
    assert pair.outputs["a"]["ids"] == _colocated("tiny-llama", [prompt], page_size=4)[0]
    assert pair.prefill.stats()["rooms_completed"] == 1
    pair.assert_idle_and_accounted()


# ------------------------------------------------------------------ handshake
@pytest.mark.parametrize("field, prefill, decode", [
    ("page_size", {"page_size": 16}, {"page_size": 1}),
    ("dtype", {"dtype": "bfloat16"}, {"dtype": "float32"}),
    ("weights", {"random_seed": 1}, {"random_seed": 0}),  # dummy weights of another seed: same shapes
    ("kv_cache_dtype", {"kv_cache_dtype": "fp8_e4m3"}, {}),  # fp8 pages would be read as float32 ones
])
def test_mismatched_peer_is_refused_naming_the_field(pair_factory, field, prefill, decode):
    pair = pair_factory("tiny-llama", prefill_flags=prefill, decode_flags=decode)
    (prompt, other) = _prompts([30, 12])
    pair.submit("a", prompt, greedy(NEW))
    pair.run(until=lambda: pair.outputs["a"]["final"] is not None)
    final = pair.outputs["a"]["final"]
    assert final.finish_reason["type"] == "abort" and field in final.finish_reason["message"], final.finish_reason
    if field == "kv_cache_dtype":  # both values, and what decode's "auto" stores
        assert "decode has auto (float32)" in final.finish_reason["message"], final.finish_reason
        assert "has fp8_e4m3" in final.finish_reason["message"], final.finish_reason
    pair.submit_local("b", other, greedy(NEW))  # decode keeps serving
    pair.run(until=lambda: pair.outputs["b"]["final"] is not None)
    assert pair.outputs["b"]["ids"] == _colocated("tiny-llama", [other], **decode)[0]


@pytest.mark.parametrize("pair_factory, model", [pytest.param("mooncake", "tiny-llama", marks=NEEDS_MOONCAKE),
                                                  ("memory", "tiny-deepseek")], indirect=["pair_factory"])
def test_fp8_pages_move_as_they_are_a_quarter_of_the_fp32_bytes(pair_factory, model):
    """--kv-cache-dtype fp8_e4m3 on both sides: decode's tokens are a colocated fp8 engine's (the
    e4m3 bytes prefill wrote are the ones decode reads), and the same prompts land exactly a quarter
    of the bytes a float32 pair moves."""
    prompts = _prompts([40, 17, 5], seed=3)
    received, outputs = {}, {}
    for kv in ("auto", "fp8_e4m3"):
        pair = pair_factory(model, page_size=4, kv_cache_dtype=kv)
        for i, p in enumerate(prompts):
            pair.submit(f"r{i}", p, greedy(NEW))
        pair.run()
        received[kv] = pair.decode.stats()["kv_bytes_received"]
        outputs[kv] = [pair.outputs[f"r{i}"]["ids"] for i in range(len(prompts))]
        assert str(pair.decode.runner.pool.dtype) == ("torch.float8_e4m3fn" if kv != "auto" else "torch.float32")
        pair.assert_idle_and_accounted()
    assert outputs["fp8_e4m3"] == _colocated(model, prompts, page_size=4, kv_cache_dtype="fp8_e4m3")
    assert received["auto"] > 0 and received["fp8_e4m3"] * 4 == received["auto"], received


@pytest.mark.parametrize("pair_factory", [pytest.param("nixl", marks=[NEEDS_NIXL, NEEDS_MOONCAKE])], indirect=True)
def test_a_prefill_and_a_decode_on_different_backends_are_refused_naming_both(pair_factory):
    pair = pair_factory("tiny-llama", prefill_flags={"disaggregation_transfer_backend": "nixl"},
                        decode_flags={"disaggregation_transfer_backend": "mooncake"})
    (prompt,) = _prompts([30])
    pair.submit("a", prompt, greedy(NEW))
    pair.run(until=lambda: pair.outputs["a"]["final"] is not None)
    reason = pair.outputs["a"]["final"].finish_reason
    assert reason["type"] == "abort" and "transfer_backend: decode has mooncake" in reason["message"], reason
    assert "has nixl" in reason["message"], reason
    assert pair.prefill.stats()["rooms_completed"] == 0


@pytest.fixture(scope="module")
def llama_copies(tmp_path_factory):
    """One tiny Llama checkpoint at two paths, and another one of the same shapes."""
    root = tmp_path_factory.mktemp("weights")
    a = make_tiny_hf_model("LlamaForCausalLM", root / "a", seed=0)
    return a, shutil.copytree(a, root / "b"), make_tiny_hf_model("LlamaForCausalLM", root / "other", seed=1)


def test_same_weights_at_two_paths_pair(pair_factory, llama_copies):
    a, b, _ = llama_copies
    pair = pair_factory(a, page_size=4, decode_flags={"model_path": str(b)})
    (prompt,) = _prompts([30])
    pair.submit("a", prompt, greedy(NEW))
    pair.run()
    assert pair.prefill.stats()["rooms_completed"] == 1  # the KV came from prefill
    assert pair.outputs["a"]["ids"] == _colocated(a, [prompt], page_size=4)[0]
    pair.assert_idle_and_accounted()


def test_same_shapes_other_weights_are_refused_naming_weights(pair_factory, llama_copies):
    a, _, other = llama_copies
    pair = pair_factory(a, page_size=4, decode_flags={"model_path": other})
    (prompt,) = _prompts([30])
    pair.submit("a", prompt, greedy(NEW))
    pair.run(until=lambda: pair.outputs["a"]["final"] is not None)
    reason = pair.outputs["a"]["final"].finish_reason
    theirs, mine = (weights_fingerprint(ModelConfig.from_path(m))[:12] for m in (a, other))
    assert reason["type"] == "abort" and f"weights: decode has {mine} (" in reason["message"], reason
    assert f"has {theirs} (" in reason["message"], reason
    assert pair.prefill.stats()["rooms_completed"] == 0


# --------------------------------------------------------------- conditional
def test_short_requests_never_reach_prefill_below_the_minimum(pair_factory):
    pair = pair_factory("tiny-llama", decode_flags={"disaggregation_min_prefill_tokens": 32})
    short, long_ = _prompts([10, 20]), _prompts([60], seed=1)
    for i, p in enumerate(short):
        pair.submit(f"s{i}", p, greedy(NEW))
    pair.run()
    p = pair.prefill.stats()
    assert p["forward_steps"] == 0 and p["rooms_dropped"] == len(short)
    pair.submit("l", long_[0], greedy(NEW))
    pair.run()
    assert pair.prefill.stats()["rooms_completed"] == 1
    want = _colocated("tiny-llama", short + long_)
    assert [pair.outputs[r]["ids"] for r in ("s0", "s1", "l")] == want
    pair.assert_idle_and_accounted()


# ------------------------------------------------------------------ failures
@pytest.mark.parametrize("policy", ["local", "error"])
def test_failed_writes_fall_back_or_fail(pair_factory, policy):
    pair = pair_factory("tiny-deepseek", page_size=4, decode_flags={"disaggregation_fallback": policy})
    faulty = FaultInjectingBackend(pair.prefill.mode.sender.backend)
    faulty.fail_after(3)  # a few writes land, then every one fails: a torn transfer
    pair.prefill.mode.sender.backend = faulty
    prompts = _prompts([30, 45])
    for i, p in enumerate(prompts):
        pair.submit(f"r{i}", p, greedy(NEW))
    pair.run()
    finals = [pair.outputs[f"r{i}"]["final"] for i in range(2)]
    if policy == "local":
        assert [pair.outputs[f"r{i}"]["ids"] for i in range(2)] == _colocated("tiny-deepseek", prompts, page_size=4)
        assert pair.decode.stats()["fallbacks"] == 2
    else:
        assert all(f.finish_reason["type"] == "abort" and "KV transfer failed" in f.finish_reason["message"]
                   for f in finals), [f.finish_reason for f in finals]
    assert pair.decode.stats()["quarantined_pages"] == 0  # prefill's failed completions settled them
    pair.assert_idle_and_accounted()


def test_a_completion_short_of_writes_is_not_trusted(pair_factory):
    """A prefill that skips a layer's writes but reports success: decode's own count from the
    layouts disagrees with the completion, so it never decodes over the missing KV."""
    pair = pair_factory("tiny-llama", page_size=4)
    sender = pair.prefill.mode.sender
    on_layer = sender.on_layer
    sender.on_layer = lambda layer: None if layer == 1 else on_layer(layer)
    (prompt,) = _prompts([33])
    pair.submit("a", prompt, greedy(NEW))
    pair.run()
    assert pair.prefill.stats()["rooms_completed"] == 1  # prefill believes it is done
    assert pair.decode.stats()["fallbacks"] == 1 and pair.decode.stats()["kv_received"] == 0
    assert pair.outputs["a"]["ids"] == _colocated("tiny-llama", [prompt], page_size=4)[0]
    pair.assert_idle_and_accounted()


def test_a_completion_without_the_index_keys_is_not_trusted(pair_factory):
    """DeepSeek-V3.2: a prefill that plans the latent's writes but not the index keys' (a region of
    the same pages) and reports success falls short of decode's count from the layouts: decode
    prefills locally, to the colocated tokens, and every page is accounted for."""
    pair = pair_factory("tiny-deepseek-v32", page_size=4)
    sender = pair.prefill.mode.sender
    plan = sender._plan
    sender._plan = lambda *a, **kw: [op for op in plan(*a, **kw) if op.buffer != "index_k"]
    (prompt,) = _prompts([40])  # past the preset's index_topk (32): the index keys decide what attends
    pair.submit("a", prompt, greedy(NEW))
    pair.run()
    assert pair.prefill.stats()["rooms_completed"] == 1  # prefill believes it is done
    assert pair.decode.stats()["fallbacks"] == 1 and pair.decode.stats()["kv_received"] == 0
    assert pair.outputs["a"]["ids"] == _colocated("tiny-deepseek-v32", [prompt], page_size=4)[0]
    pair.assert_idle_and_accounted()


def test_a_completion_without_one_v4_region_is_not_trusted(pair_factory):
    """DeepSeek-V4: a prefill that sends every region but the CSA layer's compressed entries and
    reports success falls short of decode's count (each layer's count sums the regions it keeps):
    decode prefills locally, to the colocated tokens, and every page is accounted for."""
    pair = pair_factory("tiny-deepseek-v4", page_size=4)
    sender = pair.prefill.mode.sender
    plan = sender._plan
    sender._plan = lambda *a, **kw: [op for op in plan(*a, **kw) if op.buffer != "csa_kv"]
    (prompt,) = _prompts([40])  # several CSA blocks past the preset's window
    pair.submit("a", prompt, greedy(NEW))
    pair.run()
    assert pair.prefill.stats()["rooms_completed"] == 1  # prefill believes it is done
    assert pair.decode.stats()["fallbacks"] == 1 and pair.decode.stats()["kv_received"] == 0
    assert pair.outputs["a"]["ids"] == _colocated("tiny-deepseek-v4", [prompt], page_size=4)[0]
    pair.assert_idle_and_accounted()


def test_unpaired_halves_time_out(pair_factory):
    """Decode's half alone (the router's prefill request was lost): decode falls back once its
    wait times out. Prefill's half alone: prefill answers it with an error after the timeout."""
    pair = pair_factory("tiny-llama", disaggregation_timeout_s=1.0)
    a, b = _prompts([25, 18])
    pair.submit("a", a, greedy(NEW), to_prefill=False)
    pair.run()
    assert pair.outputs["a"]["ids"] == _colocated("tiny-llama", [a])[0]
    assert pair.decode.stats()["fallbacks"] == 1
    # Decode's KV request for "a" reached prefill too: it expired there or met decode's abort
    # first, whichever the clocks gave; count only what "b" adds.
    expired = pair.prefill.stats()["rooms_expired"]
    pair.prefill.add_request("b", b, greedy(NEW), bootstrap=pair.ref(12345))
    finals = []
    pair.run(until=lambda: finals.extend(o for o in pair.prefill_outputs if o.finished) or finals)
    assert finals[0].rid == "b" and "no KV request from decode" in finals[0].finish_reason["message"]
    assert pair.prefill.stats()["rooms_expired"] == expired + 1
    pair.run()
    pair.assert_idle_and_accounted()


@pytest.mark.parametrize("pair_factory", ["memory"], indirect=True)
def test_a_kv_wait_past_the_timeout_names_the_flag(pair_factory):
    """A prompt whose KV does not arrive within --disaggregation-timeout-s (a long prefill, a lost
    prefill half) fails with a reason naming the flag an operator raises for long prompts."""
    pair = pair_factory("tiny-llama", disaggregation_timeout_s=1.0, disaggregation_fallback="error")
    (a,) = _prompts([25])
    pair.submit("a", a, greedy(NEW), to_prefill=False)
    pair.run()
    reason = pair.outputs["a"]["final"].finish_reason
    assert reason["type"] == "abort" and "--disaggregation-timeout-s" in reason["message"], reason
    pair.assert_idle_and_accounted()


def _slow_chunks(pair: PDPair, room: int, seconds: float) -> list[int]:
    """Each prefill forward that computes a chunk of ``room`` takes ``seconds`` longer (a long
    prompt on a slow prefill); returns the list the chunks are counted in."""
    mode, chunks = pair.prefill.mode, []
    before = mode.before_extend

    def slow(reqs, lens):
        if any(r.room == room for r in reqs):
            chunks.append(room)
            time.sleep(seconds)  # the forward's compute, not a wait for an event
        before(reqs, lens)

    mode.before_extend = slow
    return chunks


@pytest.mark.parametrize("pair_factory", ["memory"], indirect=True)
def test_a_prefill_slower_than_the_timeout_lands_its_kv_while_it_reports_progress(pair_factory):
    """The timeout bounds a wait without progress, not the whole prefill: a room whose chunks
    together take longer than --disaggregation-timeout-s, each well within it, keeps decode
    waiting through prefill's progress notices and lands, token-identical, with no fallback."""
    timeout, per_chunk = 3.0, 0.5
    pair = pair_factory("tiny-llama", page_size=4, chunked_prefill_size=8, disaggregation_timeout_s=timeout,
                        disaggregation_fallback="error")
    (prompt,) = _prompts([81])
    room = pair.submit("a", prompt, greedy(NEW))
    chunks = _slow_chunks(pair, room, per_chunk)
    pair.run()
    assert len(chunks) * per_chunk > timeout  # the prefill really outlasted the timeout
    assert pair.outputs["a"]["final"].finish_reason["type"] == "length", pair.outputs["a"]["final"].finish_reason
    assert pair.outputs["a"]["ids"] == _colocated("tiny-llama", [prompt], page_size=4)[0]
    stats = pair.decode.stats()
    assert stats["kv_received"] == 1 and stats["fallbacks"] == 0 and stats["transfer_failures"] == 0, stats
    assert pair.prefill.stats()["rooms_completed"] == 1
    pair.assert_idle_and_accounted()


@pytest.mark.parametrize("pair_factory", ["memory"], indirect=True)
def test_a_stalled_prefill_still_times_out_and_cannot_write_pages_decode_released(pair_factory):
    """A prefill that stops making progress mid-prompt (paused, or a forward longer than the
    timeout: no step, no notice) for longer than --disaggregation-timeout-s: decode falls back on
    its own timer, token-identical; once the prefill resumes it posts nothing for the room, and
    decode's abandoned pages never leave quarantine while the prefill could still write them."""
    pair = pair_factory("tiny-llama", page_size=4, chunked_prefill_size=8, disaggregation_timeout_s=1.0)
    (prompt,) = _prompts([81])
    room = pair.submit("a", prompt, greedy(NEW))
    sender = pair.prefill.mode.sender
    pair.run(until=lambda: room in sender.rooms and sender.rooms[room].next_page > sender.rooms[room].start_page)
    assert sender.rooms[room].state is RoomState.SENDING  # some chunks computed, more to come
    posted = sender.writes_posted
    unsafe: list[float] = []

    def released_while_writable() -> None:
        """Decode's pages for the room left quarantine while prefill may still post to them."""
        quarantined = any(e.room == room for e in pair.decode.mode.quarantine.entries.values())
        waiting = room in pair.decode.mode.rooms
        r = sender.rooms.get(room)
        if r is not None and not waiting and not quarantined and not r.aborted and time.monotonic() <= r.deadline:
            unsafe.append(r.deadline)

    pair.prefill.step = lambda: []  # prefill stalls: no forward, no notice
    pair.run(until=lambda: released_while_writable() or pair.outputs["a"]["final"] is not None)
    stats = pair.decode.stats()
    assert stats["fallbacks"] == 1 and stats["transfer_failures"] == 1 and stats["kv_received"] == 0, stats
    del pair.prefill.step  # prefill resumes
    pair.run(until=lambda: released_while_writable() or not (pair.prefill.has_work() or pair.decode.has_work()))
    assert not unsafe, "decode released a room's pages while prefill could still write them"
    assert sender.writes_posted == posted  # nothing posted for the room once decode had given up
    assert pair.prefill.stats()["rooms_completed"] == 0
    assert pair.outputs["a"]["ids"] == _colocated("tiny-llama", [prompt], page_size=4)[0]
    assert pair.decode.stats()["quarantined_pages"] == 0
    pair.assert_idle_and_accounted()


@pytest.mark.parametrize("pair_factory", ["memory"], indirect=True)
def test_a_forged_or_stale_progress_notice_extends_nothing(pair_factory):
    """Progress notices and their acknowledgements count only for the room's current life, from
    its prefill's own session and for a notice prefill sent; anything else is counted stale and
    moves neither decode's wait nor prefill's write deadline."""
    pair = pair_factory("tiny-llama", page_size=4, chunked_prefill_size=8)
    (prompt,) = _prompts([41])
    room = pair.submit("a", prompt, greedy(NEW))
    prefill, decode = pair.prefill.mode, pair.decode.mode
    pair.run(until=lambda: room in prefill.notices and prefill.notices[room].sent)  # a notice not yet acknowledged
    inc, r = decode.rooms[room].incoming, prefill.sender.rooms[room]
    (seq, sent_at), = prefill.notices[room].sent.items()
    session = pair.decode.mode.directory.peers()[0].fetched_info.ranks[0].session
    wait, now = inc.deadline, time.monotonic()
    stale = decode.counters["stale_messages"]
    for forged in (KVProgress(room, inc.nonce % MAX_NONCE + 1, 0, session, seq),  # another life of the room
                   KVProgress(room, inc.nonce, 0, session + "0", seq),  # not the room's prefill
                   KVProgress(room, inc.nonce, 5, session, seq),  # a rank that prefill does not have
                   KVProgress(room ^ 1, inc.nonce, 0, session, seq)):  # a room decode is not waiting on
        decode._on_message(forged, now)
    assert inc.deadline == wait and decode.counters["stale_messages"] == stale + 4
    deadline, stale = r.deadline, prefill.counters["stale_messages"]
    timeout = prefill.config.timeout_s
    for forged_ack in (KVProgressAck(room, inc.nonce % MAX_NONCE + 1, seq, decode.server_id, timeout),
                       KVProgressAck(room, inc.nonce, seq + 1, decode.server_id, timeout),  # a notice never sent
                       KVProgressAck(room, inc.nonce, seq, "another-decode", timeout)):
        prefill._on_message(forged_ack, now)
    assert (r.deadline, r.acked_at) == (deadline, float("-inf"))
    assert prefill.counters["stale_messages"] == stale + 3
    # The genuine one, from a decode that claims a far longer wait: prefill keeps to its own timeout.
    prefill._on_message(KVProgressAck(room, inc.nonce, seq, decode.server_id, 100 * timeout), now)
    assert r.acked_at == sent_at and r.deadline == max(deadline, sent_at + timeout)
    pair.run()
    assert pair.outputs["a"]["ids"] == _colocated("tiny-llama", [prompt], page_size=4)[0]
    assert pair.decode.stats()["fallbacks"] == 0
    pair.assert_idle_and_accounted()


@pytest.mark.parametrize("pair_factory", ["memory"], indirect=True)
def test_a_notice_decode_never_accepted_extends_no_deadline(pair_factory):
    """Prefill extends its write deadline only on decode's acknowledgement, never on sending a
    notice: a notice lost on the way (or refused) must not let prefill write past decode's wait."""
    pair = pair_factory("tiny-llama", page_size=4, chunked_prefill_size=8)
    (prompt,) = _prompts([41])
    room = pair.submit("a", prompt, greedy(NEW))
    dropped: list = []
    pair.decode.mode._on_progress = dropped.append  # every notice is lost before decode
    sender, seen = pair.prefill.mode.sender, []

    def record() -> bool:
        r = sender.rooms.get(room)
        if r is not None:
            seen.append((r.deadline, r.acked_at))
        return not (pair.prefill.has_work() or pair.decode.has_work())

    pair.run(until=record)
    assert dropped and all(p.room == room for p in dropped)  # notices went out
    assert seen and set(seen) == {(seen[0][0], float("-inf"))}, set(seen)
    assert pair.outputs["a"]["ids"] == _colocated("tiny-llama", [prompt], page_size=4)[0]
    pair.assert_idle_and_accounted()


def test_an_abort_during_a_slow_transfer_keeps_its_pages_out_of_reach(pair_factory):
    """Decode's client leaves while prefill's writes are still on the (slowed) network: the
    destination pages stay quarantined until prefill's writes have settled, so the late bytes
    cannot land in another request's KV; the other requests' tokens are unchanged."""
    pair = pair_factory("tiny-llama", page_size=2, max_total_tokens=200)
    faulty = FaultInjectingBackend(pair.prefill.mode.sender.backend)
    faulty.delay_posts(1.0)
    pair.prefill.mode.sender.backend = faulty
    victim, *others = _prompts([61, 30, 36, 40])
    room = pair.submit("v", victim, greedy(NEW))
    req = pair.decode.reqs["v"]
    pair.run(until=lambda: pair.prefill.stats()["rooms_transferring"] == 1)
    assert req.state is ReqState.WAITING_FOR_KV
    abandoned = set(req.pages[req.num_cached_pages:])
    assert pair.decode.abort("v")
    assert pair.decode.stats()["quarantined_pages"] == len(abandoned)
    # Long enough to still be decoding when the late writes land, and needing most of the pool.
    for i, p in enumerate(others):
        pair.submit_local(f"o{i}", p, greedy(48))
    reused_early: list = []

    def step_check():
        writes_in_flight = room in pair.prefill.mode.sender.rooms
        for r in pair.decode._live_reqs():
            if writes_in_flight and set(r.pages) & abandoned:
                reused_early.append(r.rid)
        return all(pair.outputs[f"o{i}"]["final"] is not None for i in range(len(others)))

    pair.run(until=step_check)
    assert not reused_early, "a quarantined page went to another request while writes to it were in flight"
    pair.run()
    assert [pair.outputs[f"o{i}"]["ids"] for i in range(len(others))] == _colocated(
        "tiny-llama", others, n=48, page_size=2)
    assert pair.outputs["v"]["final"].finish_reason["type"] == "abort"
    assert pair.decode.stats()["quarantined_pages"] == 0
    assert pair.prefill.stats()["rooms_aborted"] == 1  # decode's abort reached prefill's room
    pair.assert_idle_and_accounted()


def test_a_prefill_side_abort_reaches_decode_at_once(pair_factory):
    """Prefill's client left (the router cancelled it): decode hears it from prefill and prefills
    locally right away, long before its own timeout."""
    pair = pair_factory("tiny-llama", page_size=4, disaggregation_timeout_s=600)
    faulty = FaultInjectingBackend(pair.prefill.mode.sender.backend)
    faulty.hold()  # writes never report done: only the abort can end the room
    pair.prefill.mode.sender.backend = faulty
    (prompt,) = _prompts([37])
    pair.submit("a", prompt, greedy(NEW))
    pair.run(until=lambda: pair.prefill.stats()["rooms_transferring"] == 1)
    assert faulty.outstanding().batches >= 1  # held: still counted until they report done
    assert pair.prefill.abort("a")
    faulty.release()
    pair.run()
    assert pair.decode.stats()["fallbacks"] == 1
    assert pair.outputs["a"]["ids"] == _colocated("tiny-llama", [prompt], page_size=4)[0]
    pair.assert_idle_and_accounted()


def test_the_aux_row_carries_the_last_prefilled_hidden_state(pair_factory):
    pair = pair_factory("tiny-deepseek", page_size=4)
    sent, landed = [], []
    sender, decode = pair.prefill.mode.sender, pair.decode.mode
    finish, land = sender.finish, decode._land

    def record_finish(room, hidden):
        sent.append(hidden.clone())
        finish(room, hidden)

    def record_land(room, now):
        landed.append(decode.aux[decode.rooms[room].aux_slot].clone())
        land(room, now)

    sender.finish, decode._land = record_finish, record_land
    (prompt,) = _prompts([29])
    pair.submit("a", prompt, greedy(4))
    pair.run()
    assert len(sent) == len(landed) == 1 and torch.equal(sent[0].float(), landed[0])


@pytest.mark.parametrize("pair_factory", [pytest.param("mooncake", marks=NEEDS_MOONCAKE),
                                          pytest.param("nixl", marks=NEEDS_NIXL)], indirect=True)
def test_packed_transfers_match_a_colocated_engine_and_free_their_staging_on_abort(pair_factory):
    """Decode with ``--disaggregation-transfer-pack on`` (one TP size each: every GQA room packs,
    through both staging buffers): tokens equal the colocated engine's over chunked prompts. A
    room aborted while its writes are on the (slowed) network keeps its staging range in
    quarantine with its pages; afterwards every range on both sides is back."""
    pair = pair_factory("tiny-llama", page_size=4, chunked_prefill_size=32,
                        decode_flags={"disaggregation_transfer_pack": "on"})
    prompts = _prompts([61, 30, 9])
    for i, p in enumerate(prompts):
        pair.submit(f"r{i}", p, greedy(NEW))
    pair.run()
    want = _colocated("tiny-llama", prompts, page_size=4, chunked_prefill_size=32)
    assert [pair.outputs[f"r{i}"]["ids"] for i in range(len(prompts))] == want
    d, p = pair.decode.stats(), pair.prefill.stats()
    assert d["kv_rooms_packed"] == len(prompts) and d["fallbacks"] == 0, d
    assert 0 < p["kv_writes_packed"] == p["kv_writes_sent"], p  # every block found a staging range
    sender, staging = pair.prefill.mode.sender, pair.decode.mode.staging
    faulty = FaultInjectingBackend(sender.backend)
    faulty.delay_posts(1.0)
    sender.backend = faulty
    pair.submit("v", _prompts([45], seed=1)[0], greedy(NEW))
    pair.run(until=lambda: pair.prefill.stats()["rooms_transferring"] == 1)
    assert pair.decode.abort("v")
    (entry,) = pair.decode.mode.quarantine.entries.values()
    assert entry.staging is not None and staging.ranges_in_use == 1  # late bytes may still land there
    pair.run()
    assert staging.ranges_in_use == 0 and sender.staging.ranges_in_use == 0
    assert pair.outputs["v"]["final"].finish_reason["type"] == "abort"
    pair.assert_idle_and_accounted()
