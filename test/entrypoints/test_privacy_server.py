"""Issue 33's privacy findings against one real server (API key, admin key, KV events on loopback,
a KV hash key from the environment as ``pdserve up`` hands it, page size 1: one token per block).

- ``/kv_events/snapshot``: worker-only (the inference key is refused), and its hashes give the
  cached prompt away to no one without the key (the vocabulary attack of test/obs/test_cache_privacy.py).
- ``cache_salt``: different salts, no prefix hit; the same salt, a hit.
- ``/health_generate`` generates: it needs the key.
"""

from __future__ import annotations

import json

import httpx
import pytest

from pdserve.config import KV_HASH_KEY_ENV, resolve_kv_hash_key
from pdserve.mem.radix_cache import ROOT_HASH, hash_block, key_check
from pdserve.web.api_key import ADMIN_KEY_ENV, WORKER_HEADER, worker_credential
from server_utils import Server

API_KEY, ADMIN_KEY, HASH_SECRET = "inference-key", "admin-key", "deployment-hash-secret"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
EVENTS = json.dumps({"publisher": "zmq", "endpoint": "tcp://127.0.0.1:*"})
SECRET_PROMPT = [17, 305, 96, 44, 17, 17, 1021, 7, 415]  # "My bank PIN is 4417 ..." as token ids
KEY = resolve_kv_hash_key(None, {KV_HASH_KEY_ENV: HASH_SECRET})


@pytest.fixture(scope="module")
def server():
    s = Server("--page-size", "1", "--max-total-tokens", "512", "--kv-events-config", EVENTS, api_key=API_KEY,
               env={ADMIN_KEY_ENV: ADMIN_KEY, KV_HASH_KEY_ENV: HASH_SECRET})
    s.start()
    yield s
    s.stop()


def generate(server: Server, ids: list[int], salt: str | None = None, headers: dict | None = None) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
    if salt is not None:
        body["cache_salt"] = salt
    r = server.post("/generate", json=body, headers=headers or {})
    assert r.status_code == 200, r.text
    return r.json()["meta_info"]


def rebuild(blocks: list[dict], vocab: int, key: bytes = b"") -> list[int]:
    """The attacker of test/obs/test_cache_privacy.py over a snapshot: the longest chain from the root
    whose every block's token it finds by trying the vocabulary."""
    children: dict[int, list[int]] = {}
    for b in blocks:
        children.setdefault(b["parent_block_hash"] if b["parent_block_hash"] is not None else ROOT_HASH,
                            []).append(b["block_hash"])
    best: list[int] = []
    stack: list[tuple[int, list[int]]] = [(ROOT_HASH, [])]
    while stack:
        h, tokens = stack.pop()
        best = max(best, tokens, key=len)
        for child in children.get(h, []):
            t = next((t for t in range(vocab) if hash_block(h, [t], key) == child), None)
            if t is not None:
                stack.append((child, [*tokens, t]))
    return best


def test_the_snapshot_is_worker_only_and_its_hashes_need_the_key(server):
    generate(server, SECRET_PROMPT)
    assert server.get("/kv_events/snapshot").status_code == 403  # the inference key: not a worker's
    assert httpx.get(server.url + "/kv_events/snapshot", timeout=30).status_code == 401
    worker = {WORKER_HEADER: worker_credential(KEY)}
    for headers in (ADMIN, worker):
        r = httpx.get(server.url + "/kv_events/snapshot", headers=headers, timeout=30)
        assert r.status_code == 200, r.text
    blocks = r.json()["blocks"]
    assert len(blocks) >= len(SECRET_PROMPT) - 1
    vocab = server.get("/get_model_info").json()["vocab_size"]
    assert rebuild(blocks, vocab) == []  # unkeyed guesses find nothing
    assert rebuild(blocks, vocab, KEY)[:len(SECRET_PROMPT)] == SECRET_PROMPT  # with the key: all of it
    assert server.info()["kv_hash_key_check"] == key_check(KEY)  # what the router compares its key with


def test_different_cache_salts_never_share_a_prefix(server):
    prompt = list(range(600, 640))
    assert generate(server, prompt, "tenant-a")["cached_tokens"] == 0
    assert generate(server, prompt, "tenant-a")["cached_tokens"] == 39  # the same salt: a hit
    assert generate(server, prompt, "tenant-b")["cached_tokens"] == 0  # another salt: none
    assert generate(server, prompt)["cached_tokens"] == 0  # no salt: none
    r = server.post("/generate", json={"input_ids": prompt, "cache_salt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
    r = server.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "cache_salt": "tenant-b"})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 39, r.text


def test_health_generate_needs_the_key(server):
    assert httpx.get(server.url + "/health_generate", timeout=30).status_code == 401
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    assert server.get("/health_generate").status_code == 200
