"""The hierarchical KV cache (device -> host -> storage) inside the engine: same greedy tokens
with and without it while pages cycle through host memory, hits reported by tier, load-back
gating admission, aborts while loading, and flag validation.

Engines are shared per module (one per model x layout): the device pool holds 16 pages of 4
tokens, so three 28-token prompts cannot all stay on the device and their pages move to host.
"""

from __future__ import annotations

import time

import pytest
import torch

import pdserve
from pdserve.config import ServerArgs
from pdserve.engine.request import Req, SamplingParams
from pdserve.mem.hicache_storage import StorageLeg
from pdserve.mem.hiradix_cache import HiRadixCache
from pdserve.mem.host_pool import CopyOp, HostKVPool
from pdserve.mem.kv_pool import GQAKVPool, KVPool, MLAKVPool
from pdserve.mem.storage import PageStore, create_page_store, namespace

KW = dict(page_size=4, max_total_tokens=64, max_running_requests=2, chunked_prefill_size=64)
GREEDY = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
PRESETS = ("tiny-llama", "tiny-deepseek")
LAYOUTS = ("layer_first", "page_first")
# One engine per layout: each also runs one write policy (demotion on eviction vs copy on insert).
POLICY = {"layer_first": "write_through", "page_first": "write_back"}


def _prompts(n: int, length: int = 28, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 200, (length,), generator=g).tolist() for _ in range(n)]


PROMPTS = _prompts(3)


def _hi(engine: pdserve.Engine) -> HiRadixCache:
    cache = engine.scheduler.cache
    assert isinstance(cache, HiRadixCache)
    return cache


def _balanced(engine: pdserve.Engine) -> None:
    s = engine.scheduler
    s.check_memory()  # device pages, host pages (free + cached + in flight == total), rows
    s.cache.check_invariants()
    assert not s.has_work()
    assert s.cache.num_evictable_pages == s.cache.num_cached_pages  # nothing left locked


@pytest.fixture(scope="module")
def reference() -> dict[str, list[list[int]]]:
    """Greedy tokens of PROMPTS without the hierarchical cache (one plain engine per model)."""
    out = {}
    for preset in PRESETS:
        with pdserve.Engine(model_path=preset, **KW) as e:
            out[preset] = [e.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in PROMPTS]
    return out


@pytest.fixture(scope="module")
def engines():
    made: dict[tuple[str, str], pdserve.Engine] = {}

    def get(preset: str, layout: str) -> pdserve.Engine:
        if (preset, layout) not in made:
            made[preset, layout] = pdserve.Engine(model_path=preset, enable_hierarchical_cache=True,
                                                  hicache_mem_layout=layout, hicache_write_policy=POLICY[layout],
                                                  **KW)
        return made[preset, layout]

    yield get
    for e in made.values():
        e.shutdown()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("preset", PRESETS)
def test_greedy_tokens_identical_while_pages_cycle_through_host(reference, engines, preset, layout):
    engine = engines(preset, layout)
    outs = [engine.generate(input_ids=p, sampling_params=GREEDY) for p in PROMPTS + PROMPTS]
    assert [o["output_ids"] for o in outs] == reference[preset] * 2
    for o in outs:
        meta = o["meta_info"]
        assert sum(meta["cached_tokens_by_tier"].values()) == meta["cached_tokens"]
    # The second round found prompt 0's prefix only in host memory (the device had evicted it).
    assert outs[3]["meta_info"]["cached_tokens_by_tier"]["host"] > 0
    assert outs[3]["meta_info"]["cached_tokens"] == 24  # 6 whole pages; the last prompt token always runs
    stats = engine.get_server_info()
    assert stats["cache_hit_tokens_host"] > 0 and stats["host_load_bytes"] > 0 and stats["host_backup_bytes"] > 0
    if POLICY[layout] == "write_back":
        assert stats["device_demoted_pages"] > 0
    _balanced(engine)


def test_multi_turn_hit_comes_from_host(engines):
    engine = engines("tiny-llama", "page_first")
    turn1 = _prompts(1, seed=7)[0]
    first = engine.generate(input_ids=turn1, sampling_params=GREEDY)
    for p in _prompts(3, seed=8):  # push every page of turn 1 off the device
        engine.generate(input_ids=p, sampling_params=GREEDY)
    turn2 = turn1 + first["output_ids"] + _prompts(1, length=8, seed=9)[0]
    second = engine.generate(input_ids=turn2, sampling_params=GREEDY)
    meta = second["meta_info"]
    assert meta["cached_tokens"] >= len(turn1)
    assert meta["cached_tokens_by_tier"] == {"device": 0, "host": meta["cached_tokens"], "storage": 0}
    _balanced(engine)


class _Gate:
    """A copy that has not landed until ``open`` (stands in for a slow device copy)."""

    def __init__(self) -> None:
        self.landed = False

    def query(self) -> bool:
        return self.landed

    def synchronize(self) -> None:
        self.landed = True


def _delay_next_load(cache: HiRadixCache) -> _Gate:
    """The next load-back lands only once the returned gate opens; later ones run as usual."""
    real = cache.host.load
    gate = _Gate()

    def load(host_pages, device_pages) -> CopyOp:
        cache.host.load = real  # type: ignore[method-assign]
        op = real(host_pages, device_pages)
        op.event = gate  # type: ignore[assignment]  # duck-typed event: query / synchronize
        return op

    cache.host.load = load  # type: ignore[method-assign]
    return gate


def _on_host(engine: pdserve.Engine, seed: int) -> list[int]:
    """A prompt whose prefix sits in host memory only."""
    prompt = _prompts(1, seed=seed)[0]
    engine.generate(input_ids=prompt, sampling_params=GREEDY)
    for p in _prompts(2, seed=seed + 1):
        engine.generate(input_ids=p, sampling_params=GREEDY)
    return prompt


def test_request_waits_for_its_load_and_abort_while_loading_gives_everything_back(engines):
    engine = engines("tiny-llama", "layer_first")
    sched, cache = engine.scheduler, _hi(engine)
    prompt = _on_host(engine, seed=20)
    want = engine.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"]  # loads it back
    prompt = _on_host(engine, seed=20)  # and off the device again
    # Not runnable until the copy lands: steps run nothing for it.
    gate = _delay_next_load(cache)
    sched.add_request("wait", prompt, SamplingParams(**GREEDY))
    for _ in range(3):
        assert sched.step() == []
    assert sched.reqs["wait"].row is None and cache.num_loading_pages > 0
    sched.check_memory()  # loading pages are accounted while in flight
    gate.landed = True
    out: list[int] = []
    while sched.has_work():
        out += [t for o in sched.step() for t in o.new_token_ids]
    assert out == want
    # Aborted while its load is in flight: the load lands in the cache, nothing leaks.
    prompt = _on_host(engine, seed=20)
    gate = _delay_next_load(cache)
    sched.add_request("gone", prompt, SamplingParams(**GREEDY))
    sched.step()
    assert cache.num_loading_pages > 0 and not gate.landed
    assert sched.abort("gone")
    while sched.has_work():
        sched.step()
    assert cache.num_loading_pages == 0
    _balanced(engine)


def test_storage_tier_serves_a_prefix_after_host_eviction_and_restart(reference, tmp_path):
    kw = dict(KW, enable_hierarchical_cache=True, hicache_ratio=0.5, hicache_storage_backend="file",
              hicache_storage_dir=str(tmp_path), hicache_storage_size_gb=0.01, hicache_storage_chunk_tokens=8,
              hicache_storage_prefetch_policy="wait_complete")
    with pdserve.Engine(model_path="tiny-llama", **kw) as engine:
        first = engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
        for p in PROMPTS[1:] + _prompts(2, seed=30):  # off the device, then off the 8-page host pool
            engine.generate(input_ids=p, sampling_params=GREEDY)
        again = engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
        assert first["output_ids"] == again["output_ids"] == reference["tiny-llama"][0]
        assert again["meta_info"]["cached_tokens_by_tier"]["storage"] > 0
        stats = engine.get_server_info()
        assert stats["storage_put_bytes"] > 0 and stats["storage_hit_pages"] > 0
        _balanced(engine)
        _hi(engine).storage.flush()  # type: ignore[union-attr]
    with pdserve.Engine(model_path="tiny-llama", **kw) as restarted:
        out = restarted.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
        assert out["output_ids"] == reference["tiny-llama"][0]
        assert out["meta_info"]["cached_tokens_by_tier"]["storage"] == 24  # 3 whole chunks of 8
        _balanced(restarted)
        # Every stored page truncated on disk: a miss (counted), recomputed, never a wrong token.
        assert restarted.flush_cache()
        for f in (f for f in tmp_path.rglob("*") if f.is_file() and f.stat().st_size > 64):
            f.write_bytes(f.read_bytes()[:-16])
        out = restarted.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
        assert out["output_ids"] == reference["tiny-llama"][0]
        assert out["meta_info"]["cached_tokens"] == 0
        stats = restarted.get_server_info()
        assert stats["storage_misses"] > 0 and stats["storage_hits"] == 3  # the three before the damage
        _balanced(restarted)


def _storage_kw(storage_dir) -> dict:
    return dict(KW, enable_hierarchical_cache=True, hicache_storage_backend="file",
                hicache_storage_dir=str(storage_dir), hicache_storage_size_gb=0.01, hicache_storage_chunk_tokens=8,
                hicache_storage_prefetch_policy="wait_complete")


def _serve_once(model_path: str, storage_dir, prompt: list[int], **flags) -> tuple[list[int], dict, dict]:
    """One engine start on ``storage_dir``: (tokens, meta_info, server info) of ``prompt``, with
    every page it stored written out before it stops."""
    with pdserve.Engine(model_path=model_path, **_storage_kw(storage_dir), **flags) as engine:
        out = engine.generate(input_ids=prompt, sampling_params=GREEDY)
        _hi(engine).storage.flush()  # type: ignore[union-attr]
        info = engine.get_server_info()
        _balanced(engine)
    return out["output_ids"], out["meta_info"], info


def test_weights_swapped_at_the_same_path_are_not_served_the_old_kv(tmp_path):
    """The field report: new weights copied over the old ones at the same path, the server
    restarted on the same --hicache-storage-dir. The namespace comes from the weights' content,
    so the old model's pages are no hit, and the tokens are the new model's (transformers
    recomputing the whole prefix is the oracle)."""
    from fixtures.tiny_models import greedy_continuation, make_hf_model_and_dir

    model_dir, storage = tmp_path / "model", tmp_path / "kv"
    old, path = make_hf_model_and_dir("LlamaForCausalLM", model_dir, seed=0)
    prompt = PROMPTS[0]
    tokens, _, _ = _serve_once(path, storage, prompt)
    assert tokens == greedy_continuation(old, prompt, GREEDY["max_new_tokens"])
    tokens, meta, _ = _serve_once(path, storage, prompt)  # a plain restart reuses the stored pages
    assert meta["cached_tokens_by_tier"]["storage"] == 24
    new, _ = make_hf_model_and_dir("LlamaForCausalLM", model_dir, seed=1)  # same shapes, same files
    want = greedy_continuation(new, prompt, GREEDY["max_new_tokens"])
    assert want != tokens  # the swap changes the answer, so stale KV would show
    tokens, meta, info = _serve_once(path, storage, prompt)
    assert meta["cached_tokens"] == 0 and info["storage_hits"] == 0
    assert tokens == want


def test_under_a_token_pages_planted_in_the_file_tier_are_counted_misses(reference, tmp_path):
    """Someone without the token rewrites every stored page with other KV and a correct CRC:
    the restarted server counts them as ``storage_bad_mac`` misses and recomputes; a page it
    then stores itself (signed) is a hit."""
    from pdserve.mem.storage import page_format
    from pdserve.obs.metrics import ServerMetrics

    prompt, want, token = PROMPTS[0], reference["tiny-llama"][0], "deployment secret"
    assert _serve_once("tiny-llama", tmp_path, prompt, disaggregation_auth_token=token)[0] == want
    pages = [f for f in tmp_path.rglob("*") if f.is_file() and f.name != ".lock"]
    assert pages
    for f in pages:
        blob = f.read_bytes()
        ns, key, length = page_format.header_view(blob)
        f.write_bytes(page_format.pack(ns, key, bytes(length)))  # all-zero KV, no MAC
    with pdserve.Engine(model_path="tiny-llama", disaggregation_auth_token=token, **_storage_kw(tmp_path)) as engine:
        out = engine.generate(input_ids=prompt, sampling_params=GREEDY)
        assert out["output_ids"] == want and out["meta_info"]["cached_tokens"] == 0
        info = engine.get_server_info()
        assert info["storage_bad_mac"] >= 1 and info["storage_hits"] == 0 and info["storage_corrupt"] == 0
        metrics = ServerMetrics("m")
        metrics.set_scheduler_stats(info)
        assert "pdserve:hicache_storage_bad_mac_total" in metrics.render().decode()
        _hi(engine).storage.flush()  # type: ignore[union-attr]
        assert engine.flush_cache()
        out = engine.generate(input_ids=prompt, sampling_params=GREEDY)
        # Chunk 0 was rewritten (signed) after its miss; chunk 1 is still a planted page (the
        # first miss ended the read) and is refused in its turn.
        assert out["output_ids"] == want and out["meta_info"]["cached_tokens_by_tier"]["storage"] == 8
        assert engine.get_server_info()["storage_bad_mac"] == info["storage_bad_mac"] + 1
        _balanced(engine)


def _page_files(root) -> set:
    return {f for f in root.rglob("*") if f.is_file() and f.name != ".lock"}


def test_under_a_token_a_signed_page_copied_under_another_key_or_namespace_is_a_counted_miss(reference, tmp_path):
    """Someone who can write the store but has no token copies genuine signed pages: prompt A's
    page rewritten under prompt B's key, and a page signed for C's key in another namespace (what
    a server of another model under the same token writes) rewritten into this one, header CRCs
    fixed. The MAC covers key and namespace, so each load is a ``storage_bad_mac`` miss and the
    tokens are those of an uncached run, never A's or the other model's KV served as this prefix."""
    from pdserve.mem.storage import page_format

    token, (a, b, c) = "deployment secret", PROMPTS
    files: list[set] = []
    with pdserve.Engine(model_path="tiny-llama", disaggregation_auth_token=token, **_storage_kw(tmp_path)) as writer:
        for prompt in (a, b, c):
            writer.generate(input_ids=prompt, sampling_params=GREEDY)
            _hi(writer).storage.flush()  # type: ignore[union-attr]
            files.append(_page_files(tmp_path) - set().union(*files))
    assert all(files)
    a_pages = [f.read_bytes() for f in sorted(files[0])]

    def moved(blob: bytes, field: slice, value: bytes) -> bytes:
        out = bytearray(blob)
        out[field] = value
        out[page_format.HEADER_BYTES - 4:page_format.HEADER_BYTES] = \
            page_format.crc32c(bytes(out[:page_format.HEADER_BYTES - 4])).to_bytes(4, "little")
        return bytes(out)

    key_field, ns_field = slice(40, 72), slice(8, 40)  # page_format's header layout
    elsewhere = namespace({"model": "another model under the same token"})
    for i, f in enumerate(sorted(files[1])):  # B's keys now hold A's signed pages
        ns, key, _ = page_format.header_view(f.read_bytes())
        f.write_bytes(moved(a_pages[i % len(a_pages)], key_field, key))
    for i, f in enumerate(sorted(files[2])):  # C's keys hold pages signed for them in another namespace
        ns, key, _ = page_format.header_view(f.read_bytes())
        payload = a_pages[i % len(a_pages)][page_format.HEADER_BYTES:]
        signed = page_format.pack(elsewhere, key, payload, page_format.mac_key(token))
        f.write_bytes(moved(signed, ns_field, ns))
    with pdserve.Engine(model_path="tiny-llama", disaggregation_auth_token=token, **_storage_kw(tmp_path)) as engine:
        bad_mac = 0
        for i, prompt in ((1, b), (2, c)):
            out = engine.generate(input_ids=prompt, sampling_params=GREEDY)
            info = engine.get_server_info()
            assert out["output_ids"] == reference["tiny-llama"][i] and out["meta_info"]["cached_tokens"] == 0, i
            assert info["storage_bad_mac"] > bad_mac and info["storage_hits"] == 0 and info["storage_corrupt"] == 0
            bad_mac = info["storage_bad_mac"]
        _balanced(engine)


def _rank_files(root, tp_rank: int) -> set:
    """Every stored page object of one TP rank's shard of the file tier (not a write in flight)."""
    return {f for f in (root / f"tp{tp_rank}-of-2").rglob("*") if f.is_file() and not f.name.startswith(".")}


def _wait_stored(root, num_files: int) -> None:
    """Until both ranks' storage threads have written ``num_files`` page objects each."""
    deadline = time.monotonic() + 30
    while any(len(_rank_files(root, r)) < num_files for r in (0, 1)):
        assert time.monotonic() < deadline, f"storage never reached {num_files} objects per rank"
        time.sleep(0.01)


def test_tp2_ranks_load_the_minimum_hit_and_match_one_rank(reference, tmp_path):
    """TP=2 with every tier: each rank's storage shard holds what it holds; the ranks agree on
    the shortest hit, load that much, recompute the rest, and give the one-rank plain engine's
    tokens, never a hang. Storage keys chain over the whole prefix, so the files a request adds
    are the chunks it completed: deleting rank 1's newest ones leaves it a shorter hit."""
    kw = dict(KW, enable_hierarchical_cache=True, hicache_storage_backend="file", hicache_storage_dir=str(tmp_path),
              hicache_storage_size_gb=0.01, hicache_storage_chunk_tokens=8, tp_size=2,
              hicache_storage_prefetch_policy="wait_complete")
    prompt, want = PROMPTS[0], reference["tiny-llama"][0]

    def run(ids: list[int]) -> dict:
        assert engine.flush_cache()  # device and host emptied: hits can only come from storage
        return engine.generate(input_ids=ids, sampling_params=GREEDY)

    with pdserve.Engine(model_path="tiny-llama", **kw) as engine:
        run(prompt[:9])  # 12 tokens cached: chunk 0 stored on both ranks
        _wait_stored(tmp_path, 1)
        chunk0 = _rank_files(tmp_path, 1)
        out = run(prompt)  # both ranks hold chunk 0: an 8-token hit; chunks 1 and 2 stored
        assert out["output_ids"] == want
        assert out["meta_info"]["cached_tokens_by_tier"] == {"device": 0, "host": 0, "storage": 8}
        _wait_stored(tmp_path, 3)
        for f in _rank_files(tmp_path, 1) - chunk0:  # rank 1 loses chunks 1 and 2, rank 0 keeps all three
            f.unlink()
        out = run(prompt)
        assert out["output_ids"] == want
        assert out["meta_info"]["cached_tokens_by_tier"] == {"device": 0, "host": 0, "storage": 8}
        for f in _rank_files(tmp_path, 1):  # rank 1 holds nothing: nobody loads
            f.unlink(missing_ok=True)
        out = run(prompt)
        assert out["output_ids"] == want and out["meta_info"]["cached_tokens"] == 0
        # Pages cycling device -> host (-> storage) on both ranks.
        outs = [engine.generate(input_ids=p, sampling_params=GREEDY) for p in PROMPTS + PROMPTS]
        assert [o["output_ids"] for o in outs] == reference["tiny-llama"] * 2
        assert outs[3]["meta_info"]["cached_tokens"] == 24 and outs[3]["meta_info"]["cached_tokens_by_tier"]["host"]
        for m in engine.scheduler.check_memory().ranks:  # raises if any rank's books are off
            assert not m.has_work and m.free_pages + m.cached_pages == m.total_pages, m


@pytest.mark.parametrize("field, value, words", [
    ("hicache_storage_chunk_tokens", 6, "--hicache-storage-chunk-tokens): must be a multiple of the page size (4)"),
    ("hicache_ratio", 0.0, "--hicache-ratio): must be > 0"),
    ("hicache_size", -1.0, "--hicache-size): must be >= 0"),
    ("hicache_write_policy", "write_around", "--hicache-write-policy): 'write_around' is not one of"),
    ("hicache_mem_layout", "row", "--hicache-mem-layout): 'row' is not one of"),
    ("hicache_storage_backend", "s3", "--hicache-storage-backend): 's3' is not one of"),
    ("hicache_storage_prefetch_policy", "never", "--hicache-storage-prefetch-policy): 'never' is not one of"),
    ("hicache_storage_backend_extra_config", "{bad", "--hicache-storage-backend-extra-config): not valid JSON"),
    ("hicache_storage_backend_extra_config", "[1]", "--hicache-storage-backend-extra-config): must be a JSON obj"),
    ("hicache_storage_backend_extra_config", '{"prefetch_timeout_base": 0}',
     "extra-config): prefetch_timeout_base must be a number > 0, got 0"),
    ("disable_radix_cache", True, "--enable-hierarchical-cache): needs the radix cache"),
    ("dp_size", 2, "--enable-hierarchical-cache): runs with one attention group for now (dp_size 1"),
])
def test_flag_errors_name_the_flag(field, value, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        ServerArgs(model_path="tiny-llama", page_size=4, enable_hierarchical_cache=True, **{field: value})


# ------------------------------------------------------------------ host pool and storage leg
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["gqa", "mla", "mla+index_k"])
def test_host_pool_round_trips_pages_and_payloads(kind, layout):
    """Every region of a page goes down and comes back (DeepSeek-V3.2's index keys with the latent)."""
    g = torch.Generator().manual_seed(0)
    dev: KVPool = (GQAKVPool(6, 4, 3, 2, 8, torch.float32) if kind == "gqa"
                   else MLAKVPool(6, 4, 3, 16, 8, torch.float32, index_head_dim=8 if "index_k" in kind else 0))
    assert len(dev.page_buffers()) == (1 if kind == "mla" else 2)
    for _, buf in dev.page_buffers():
        buf.copy_(torch.randn(buf.shape, generator=g))
    before = [buf.clone() for _, buf in dev.page_buffers()]
    host = HostKVPool(dev, 4, layout)
    assert host.backup([5, 1], [0, 3]).done()
    # Page bytes against the slow twin: each device page of each buffer, layer by layer.
    want = b"".join(buf[:, p].contiguous().numpy().tobytes() for p in (5, 1) for _, buf in dev.page_buffers())
    assert host.page_payload([0, 3]) == want
    host.set_page_payload([2, 1], want)
    assert host.load([2, 1], [0, 4]).done()
    for (_, buf), old in zip(dev.page_buffers(), before):
        assert torch.equal(buf[:, 0], old[:, 5]) and torch.equal(buf[:, 4], old[:, 1])
        assert torch.equal(buf[:, 2], old[:, 2])  # untouched
    with pytest.raises(ValueError, match="payload of"):
        host.set_page_payload([0], want)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_host_pool_holds_fp8_pages_as_their_bytes(kind, layout):
    """An fp8 device pool's host copies and storage payloads are its e4m3 bytes: a quarter of a
    float32 pool's page, and back on the device bit for bit."""
    from pdserve.mem.kv_pool import FP8_DTYPE

    g = torch.Generator().manual_seed(1)
    fp8 = dict(compute_dtype=torch.float32)
    dev: KVPool = (GQAKVPool(6, 4, 3, 2, 8, FP8_DTYPE, **fp8, k_scale=0.5) if kind == "gqa"
                   else MLAKVPool(6, 4, 3, 16, 8, FP8_DTYPE, **fp8, latent_scale=0.25))
    for _, buf in dev.page_buffers():
        buf.copy_(torch.randn(buf.shape, generator=g) * 100)
    raw = [buf.view(torch.uint8).clone() for _, buf in dev.page_buffers()]
    host = HostKVPool(dev, 4, layout)
    full = HostKVPool(GQAKVPool(6, 4, 3, 2, 8, torch.float32) if kind == "gqa"
                      else MLAKVPool(6, 4, 3, 16, 8, torch.float32), 4)
    assert all(b.dtype == FP8_DTYPE for b in host.buffers) and host.page_bytes * 4 == full.page_bytes
    assert host.backup([5, 1], [0, 3]).done()
    want = b"".join(r[:, p].contiguous().numpy().tobytes() for p in (5, 1) for r in raw)
    assert host.page_payload([0, 3]) == want and len(want) == 2 * host.page_bytes
    host.set_page_payload([2, 1], want)
    assert host.load([2, 1], [0, 4]).done()
    for (_, buf), old in zip(dev.page_buffers(), raw):
        raw_now = buf.view(torch.uint8)
        assert torch.equal(raw_now[:, 0], old[:, 5]) and torch.equal(raw_now[:, 4], old[:, 1])


def test_fp8_pages_round_trip_through_host_and_file_storage_and_stay_apart_from_fp32_ones(tmp_path):
    """--kv-cache-dtype fp8_e4m3 with host and file tiers: a restart serves the prefix from storage
    with the tokens of the first run, storing a quarter of the float32 run's bytes; a float32
    server on the same directory never reads those pages (the namespace holds the pool dtype)."""
    prompt = PROMPTS[0]
    tokens, _, info = _serve_once("tiny-llama", tmp_path / "fp8", prompt, kv_cache_dtype="fp8_e4m3")
    again, meta, _ = _serve_once("tiny-llama", tmp_path / "fp8", prompt, kv_cache_dtype="fp8_e4m3")
    assert again == tokens and meta["cached_tokens_by_tier"]["storage"] == 24
    _, _, full_info = _serve_once("tiny-llama", tmp_path / "fp32", prompt)
    assert info["storage_put_bytes"] > 0 and info["storage_put_bytes"] * 4 == full_info["storage_put_bytes"]
    _, meta, info = _serve_once("tiny-llama", tmp_path / "fp8", prompt)
    assert meta["cached_tokens"] == 0 and info["storage_hits"] == 0


class _PutFailsOnce:
    """A store whose first put raises (a broken backend), then behaves."""

    def __init__(self, store: PageStore) -> None:
        self.inner, self.name, self.failed = store, store.name, False

    def put(self, key: bytes, payload: bytes) -> bool:
        if not self.failed:
            self.failed = True
            raise OSError("backend fell over")
        return self.inner.put(key, payload)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def test_storage_thread_that_raises_is_restarted_and_counted(tmp_path):
    ns = namespace({"model": "test"})
    store = create_page_store("file", directory=str(tmp_path), size_gb=0.001, namespace=ns, extra_config=None)
    leg = StorageLeg(_PutFailsOnce(store), ns, 8, 4)  # type: ignore[arg-type]
    try:
        keys = leg.keys(list(range(16)))
        leg.put_async(keys[0], b"a" * 32)  # lost with the thread
        leg.put_async(keys[1], b"b" * 32)
        leg.flush()
        assert leg.stats()["storage_thread_restarts"] == 1
        assert store.exists(keys[1:]) == 1 and leg.fetch(keys, 16) == []  # the run starts at a miss
        assert leg.fetch(keys[1:], 16) == [b"b" * 32]
    finally:
        leg.close()


def _tiers(policy: str, device_pages: int = 8, host_pages: int = 8) -> HiRadixCache:
    from pdserve.mem.allocator import PageAllocator

    dev = GQAKVPool(device_pages, 2, 1, 1, 4, torch.float32)
    return HiRadixCache(PageAllocator(device_pages), 2, HostKVPool(dev, host_pages), policy)


def test_prepare_loads_what_every_rank_holds_waits_while_one_is_busy_and_refuses_diverged_devices():
    """One rank's arbitration, its peer's row ([device pages, host/storage pages, busy]) given."""
    from pdserve.config import HiCacheConfig
    from pdserve.mem.cache_manager import HitDivergedError, KVCacheManager

    kv = KVCacheManager(8, 2, 4, 64, hicache=HiCacheConfig(enabled=True), pool=GQAKVPool(8, 2, 1, 1, 4, torch.float32))
    peer = [0, 0, 0]
    kv.agree_hits_with(lambda row: [row, peer])
    tokens = list(range(3, 15))  # 6 pages of 2

    def new(rid: str) -> Req:
        return Req(rid, list(tokens), SamplingParams(max_new_tokens=4), uid=("first", "second", "third").index(rid))

    first = new("first")
    assert kv.prepare(first, tokens) and kv.admit(first, tokens) and kv.grow(first, len(tokens))
    first.kv_len = len(tokens)
    kv.release(first, len(tokens))
    assert kv.evict(6) == 6  # every page now only in host memory
    second = new("second")
    peer[:] = [0, 6, 1]  # the peer is still loading these pages for another request: wait, load nothing
    assert not kv.prepare(second, tokens) and kv.hicache is not None and kv.hicache.num_loading_pages == 0
    peer[:] = [0, 2, 0]  # the peer holds 2 of the 6 pages below the device
    assert kv.prepare(second, tokens) and kv.admit(second, tokens)
    assert second.cached_len == 4 and second.cached_by_tier == {"device": 0, "host": 4, "storage": 0}
    third = new("third")
    peer[:] = [3, 0, 0]  # the peer's device holds a page ours does not: diverged, never a different batch
    with pytest.raises(HitDivergedError, match="third: ranks hold different device prefixes"):
        kv.prepare(third, tokens)
    kv.drop(second)
    kv.check([])


@pytest.mark.parametrize("policy, copies_after_insert, copies_after_two_hits",
                         [("write_through", 3, 3), ("write_through_selective", 0, 3), ("write_back", 0, 0)])
def test_write_policies_decide_when_pages_go_down(policy, copies_after_insert, copies_after_two_hits):
    cache = _tiers(policy)
    tokens = list(range(6))
    assert cache.insert(tokens, cache.allocator.alloc(3) or []).released == []
    assert cache.num_host_cached_pages == copies_after_insert
    for _ in range(2):
        cache.match_prefix(tokens)
    dup = cache.allocator.alloc(3) or []
    assert cache.insert(tokens, dup).released == dup  # the same blocks again: duplicates returned
    cache.allocator.free(dup)
    assert cache.num_host_cached_pages == copies_after_two_hits
    # Evicting every device page keeps every page findable on host (write-back demotes now).
    evicted = cache.evict(3)
    assert len(evicted) == 3 and cache.allocator.num_free == 5
    cache.allocator.free(evicted)
    match = cache.match_tiers(tokens)
    assert match.device.pages == [] and len(match.host) == 3
    cache.check_invariants()
    cache.check_host_pages()


def test_a_tier_hit_ends_on_a_reusable_boundary():
    """Blocks of 4 pages (DeepSeek-V4's bounded layout keeps a boundary's tails in the block's
    pages): a block whose first page is still on the device continues from host memory, and only a
    continuation that completes the block may be loaded."""
    from pdserve.mem.allocator import PageAllocator

    dev = GQAKVPool(8, 2, 1, 1, 4, torch.float32)
    cache = HiRadixCache(PageAllocator(8), 2, HostKVPool(dev, 8), "write_back", reuse_tokens=8)
    tokens = list(range(16))  # two blocks of 4 pages
    cache.insert(tokens, cache.allocator.alloc(8) or [])
    cache.allocator.free(cache.evict(3))  # the second block: its first page on the device, three on host
    whole = cache.match_tiers(tokens)
    assert (len(whole.device.pages), len(whole.ahead), len(whole.host)) == (4, 1, 3)
    assert cache.usable_host(whole) == 3 and whole.last is whole.host[-1]
    short = cache.match_tiers(tokens[:14])  # ends one page short of the block's end
    assert (len(short.device.pages), len(short.ahead), len(short.host)) == (4, 1, 2)
    assert cache.usable_host(short) == 0
    cache.check_invariants()
    cache.check_host_pages()


def test_metrics_render_per_tier_counters(engines):
    from pdserve.obs.metrics import ServerMetrics

    engine = engines("tiny-llama", "layer_first")
    metrics = ServerMetrics("m")
    metrics.set_scheduler_stats(engine.get_server_info())
    text = metrics.render().decode()
    for line in ('pdserve:cache_hit_tokens_total{model_name="m",tier="host"}', "pdserve:hicache_host_load_bytes_total",
                 "pdserve:hicache_host_total_pages", "pdserve:hicache_host_load_bandwidth",
                 "pdserve:hicache_host_loads_skipped_total"):
        assert line in text


def test_pd_prefill_loads_host_hits_and_decode_gets_the_same_tokens(reference):
    from disagg.pd_pair import PDPair, greedy

    pair = PDPair("tiny-llama", prefill_flags=dict(enable_hierarchical_cache=True), backend="memory", **KW)
    try:
        for i, p in enumerate(PROMPTS + PROMPTS):
            pair.submit(f"r{i}", p, greedy(GREEDY["max_new_tokens"]))
            pair.run()
        assert [pair.outputs[f"r{i}"]["ids"] for i in range(6)] == reference["tiny-llama"] * 2
        assert pair.prefill.stats()["cache_hit_tokens_host"] > 0
        pair.assert_idle_and_accounted()
    finally:
        pair.close()


def test_salted_requests_share_no_page_in_any_tier(tmp_path):
    """cache_salt isolation holds through host and storage: a prompt stored under one salt is a miss
    under another salt (or none) after the device and host tiers are flushed, and a hit under its own."""
    from pdserve.engine.request import SamplingParams

    with pdserve.Engine(model_path="tiny-llama", **_storage_kw(tmp_path)) as engine:
        s = engine.scheduler

        def run(salt: str, i: int) -> dict[str, int]:
            assert engine.flush_cache()  # device and host emptied: hits can only come from storage
            req = s.add_request(f"salted-{i}", PROMPTS[0], SamplingParams(max_new_tokens=1, temperature=0.0),
                                cache_salt=salt)
            while s.has_work():
                s.step()
            _hi(engine).storage.flush()  # type: ignore[union-attr]
            return dict(req.cached_by_tier)

        assert sum(run("tenant-a", 0).values()) == 0
        assert sum(run("tenant-b", 1).values()) == 0
        assert sum(run("", 2).values()) == 0
        assert run("tenant-a", 3)["storage"] == 24  # its own salt: 3 stored chunks of 8
        _balanced(engine)
    leg = _hi(engine).storage
    assert leg is not None and leg.keys(PROMPTS[0], "tenant-a")[0] != leg.keys(PROMPTS[0], "tenant-b")[0] \
        != leg.keys(PROMPTS[0])[0]
