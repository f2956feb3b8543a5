"""What the router knows of its workers' KV caches, for ``--policy cache_aware``.

* Prefill workers: each one's ``PrefixView`` (``Worker.kv``): the router's own guess of its cache
  (``ApproxIndex``: the prompts it routed there, LRU-sized to the worker's reported pool) and, when
  the worker publishes KV events, a ``KVEventSubscriber`` following them. Fresh events replace the
  guess; while they are stale (silent worker, resync pending, failed snapshot) the guess is used.
  The guess is kept up to date either way, so a fallback starts from the recent past.
* The prompt's blocks: token pages hashed as the servers hash them, with the tokenizer
  (``--tokenizer-path``, else the path a prefill worker reports in ``/get_model_info``; local
  files only). Without one, blocks of the prompt's text (``approx_index.text_block_hashes``);
  events cannot be matched then (they hash tokens), so the guess alone is used. Which of the two
  is decided once a prefill worker has answered, and said once. Until then, routed by load.
* Decode workers: their free KV pages and running requests, read from ``/get_server_info`` after
  each health round (the policy prefers fewer in flight, then more free pages).

The policy tells the view each choice (``PickObserver``): the candidates' views are asked for
the prompt's hashes within one synchronous ``WorkerSet.pick``, so the last hashes asked are the
prompt being placed; ``placed`` notes the choice, and once the workers accept the request the
proxy has it recorded in the chosen worker's guess (``accepted``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from pdserve.engine.tokenizer import has_tokenizer
from pdserve.obs.kv_event_publisher import EventCurveKeys
from pdserve.router.approx_index import CHARS_PER_TOKEN, ApproxIndex, text_block_hashes
from pdserve.router.kv_events import KVEventSubscriber
from pdserve.router.kv_index import key_check, prompt_block_hashes
from pdserve.router.policy import CacheAwarePolicy, Candidate
from pdserve.router.prompt_tokens import load_local_tokenizer, prompt_ids, prompt_text
from pdserve.router.workers import Worker, WorkerSet

logger = logging.getLogger(__name__)

WILDCARD_HOSTS = ("0.0.0.0", "*", "::", "")
LOAD_KEYS = ("num_running_reqs", "num_waiting_reqs", "free_pages", "total_pages")
UNKNOWN_POOL_BLOCKS = 1 << 16  # a worker's guess holds this many blocks until it reports its pool
# prompts are hashed up to the workers' context length (the most any of them reported); a worker that
# reports none (sglang) leaves this bound
UNKNOWN_CONTEXT_TOKENS = 1 << 17
MATCH_TOKENS, MATCH_TEXT = "tokens", "text"


@dataclass(frozen=True)
class Placement:
    """A prompt's block hashes and the prefill worker picked for it."""

    url: str
    hashes: Sequence[int]


class PrefixView:
    """What cache_aware believes one prefill worker caches: its KV events while they are fresh and
    prompts are hashed by tokens, else the router's guess. Runs on the router's event loop."""

    def __init__(self, owner: CacheView, url: str):
        self.owner = owner
        self.url = url
        self.guess = ApproxIndex(UNKNOWN_POOL_BLOCKS)
        self.events: KVEventSubscriber | None = None
        self.pool_known = False

    @property
    def on_events(self) -> bool:
        """Whether the worker's own events answer (else the guess)."""
        return self.owner.match_by == MATCH_TOKENS and self.events is not None and self.events.fresh

    def matched_blocks(self, hashes: Sequence[int]) -> int:
        self.owner.asking = hashes  # the prompt being placed (see the module doc)
        if self.on_events:
            assert self.events is not None
            return self.events.matched_blocks(hashes)
        return self.guess.matched_blocks(hashes)

    @property
    def num_blocks(self) -> int:
        if self.on_events:
            assert self.events is not None
            return self.events.num_blocks
        return self.guess.num_blocks

    def set_pool(self, total_pages: Any) -> None:
        if isinstance(total_pages, int) and total_pages > 0:
            self.guess.resize(total_pages)
            self.pool_known = True

    def unfollow(self) -> None:
        if self.events is not None:
            events, self.events = self.events, None
            events.stop()

    def status(self) -> dict:
        """The router's ``/get_server_info`` entry for this worker."""
        return {"source": "events" if self.on_events else "approximate",
                "approximate": {"blocks": self.guess.num_blocks, "capacity": self.guess.capacity,
                                "pool_known": self.pool_known, "evicted": self.guess.evicted}}


class CacheView:
    """Owned by the router's event loop; the subscribers' threads only touch their own index."""

    def __init__(self, prefill: WorkerSet, decode: WorkerSet, call, headers: dict, tokenizer_path: str | None,
                 stale_s: float, timeout_s: float, prefill_aware: bool, decode_aware: bool, approximate: bool = True,
                 hash_key: bytes = b"", snapshot_headers: dict | None = None):
        self.prefill = prefill
        self.hash_key = hash_key  # the deployment's block hash key: the workers' events hash under it
        # /kv_events/snapshot is a worker-only route (web/api_key.py): the admin key when there is one
        self.snapshot_headers = headers if snapshot_headers is None else snapshot_headers
        self.decode = decode
        self.call = call  # PDProxy.call
        self.headers = headers
        self.stale_s = stale_s
        self.timeout_s = timeout_s
        self.prefill_aware = prefill_aware
        self.decode_aware = decode_aware
        self.approximate = approximate  # False: no guesses (a worker without fresh events holds nothing)
        self.tokenizer: Any | None = None
        self.tokenizer_path = tokenizer_path
        self.match_by: str | None = None  # MATCH_TOKENS or MATCH_TEXT once decided; None: routed by load
        self.page_size: int | None = None  # set once match_by is decided: prompts are hashed from then on
        self.views: dict[str, PrefixView] = {}
        self.context_len: int | None = None  # the longest context a prefill worker reported
        self.asking: Sequence[int] | None = None
        self.last_placed: Placement | None = None  # the pick's choice, until the proxy takes it
        self._said: set[str] = set()
        self._busy = False
        self._loading = False  # a tokenizer is loading on its thread
        if tokenizer_path:
            self.tokenizer = load_local_tokenizer(tokenizer_path)
            self.match_by = MATCH_TOKENS if self.tokenizer is not None else MATCH_TEXT
            if self.tokenizer is None:
                logger.warning("no tokenizer in --tokenizer-path %s: cache_aware matches prompts by their text "
                               "(approximate; KV events go unused)", tokenizer_path)
        if prefill_aware:
            for w in prefill.workers:
                self._view(w)
            if isinstance(prefill.policy, CacheAwarePolicy):
                prefill.policy.observer = self

    # ----------------------------------------------------------- requests
    @property
    def hashes_prompts(self) -> bool:
        """Whether ``prompt_hashes`` would hash anything (else it answers [] at once)."""
        return self.prefill_aware and self.page_size is not None

    def prompt_hashes(self, path: str, body: dict) -> list[int]:
        """The block hashes of the request's prompt, up to the context length; [] when they cannot be
        known (routed by load). Blocking (a tokenizer runs): the proxy calls it on its hashing thread."""
        if not self.prefill_aware or self.page_size is None:
            return []
        limit = self.context_len or UNKNOWN_CONTEXT_TOKENS
        ids = prompt_ids(self.tokenizer, path, body, limit)
        if ids:
            salt = body.get("cache_salt")
            return prompt_block_hashes(ids, self.page_size, self.hash_key, salt if isinstance(salt, str) else "")
        text = prompt_text(path, body) if self.tokenizer is None else None
        return text_block_hashes(text[:limit * CHARS_PER_TOKEN], CHARS_PER_TOKEN * self.page_size) if text else []

    # PickObserver (the prefill side's CacheAwarePolicy)
    def prompt_key(self) -> int | None:
        return self.asking[-1] if self.asking else None

    def placed(self, candidate: Candidate) -> None:
        """Noted only: the guess learns the prompt once the request is accepted (``accepted``), so a
        request the workers refuse (too long, malformed) leaves the guesses as they were."""
        hashes, self.asking = self.asking, None
        self.last_placed = Placement(candidate.url, hashes) if hashes else None

    def take_placement(self) -> Placement | None:
        """The last pick's choice (once): the proxy keeps it with the request until it is accepted."""
        placement, self.last_placed = self.last_placed, None
        return placement

    def accepted(self, placement: Placement) -> None:
        """The request placed by ``placement`` was accepted: its blocks become the worker's most recent."""
        view = self.views.get(placement.url)
        if view is not None and self.approximate:
            view.guess.insert(placement.hashes)

    def forget(self) -> None:
        """The workers' caches were flushed: every guess is empty again (events say so themselves)."""
        for view in self.views.values():
            view.guess.clear()

    # ------------------------------------------------------------ refresh
    def schedule_refresh(self) -> None:
        """After a health round: follow new prefill workers, drop dead ones, read decode loads."""
        if not self._busy and (self.prefill_aware or self.decode_aware):
            self._busy = True
            asyncio.ensure_future(self._refresh())

    async def _refresh(self) -> None:
        try:
            if self.prefill_aware:
                self._drop_moved()
                for w in list(self.prefill.workers):
                    await self._update(w, self._view(w))
            if self.decode_aware:
                await asyncio.gather(*(self._read_load(w) for w in self.decode.healthy))
        finally:
            self._busy = False

    def _view(self, w: Worker) -> PrefixView:
        view = self.views.get(w.url)
        if view is None:
            view = self.views[w.url] = PrefixView(self, w.url)
        w.kv = view
        return view

    def drop(self, url: str) -> None:
        """A worker discovery removed: its view goes (the guess and any KV follower)."""
        view = self.views.pop(url, None)
        if view is not None:
            view.unfollow()

    def _drop_moved(self) -> None:
        """Views of workers that left the prefill set (a role switch): no longer asked."""
        current = {w.url for w in self.prefill.workers}
        for url in [u for u in self.views if u not in current]:
            self.views.pop(url).unfollow()
        for w in self.decode.workers:
            if isinstance(w.kv, PrefixView):
                w.kv = None

    async def _update(self, w: Worker, view: PrefixView) -> None:
        if not w.healthy:
            view.unfollow()
            view.guess.clear()  # it may come back restarted, its cache empty
        elif view.events is None or not view.events.fresh or not view.pool_known:
            # a silent worker may have restarted between health checks on another port
            info = await self._get_json(w, "/get_server_info")
            if info is None:
                return
            view.set_pool(info.get("total_pages"))
            context = info.get("context_length")
            if isinstance(context, int) and context > 0 and context > (self.context_len or 0):
                self.context_len = context
            if self.page_size is None and not await self._decide(w, info):
                return
            if self.views.get(w.url) is not view:
                return  # removed (discovery) or moved while its info was read: nothing to follow
            await self._follow(w, view, info)

    async def _decide(self, w: Worker, info: dict) -> bool:
        """How prompts are matched (by tokens or text) and their page size, from the first prefill
        worker that answers: True once decided. A tokenizer loads on a daemon thread (importing
        transformers takes seconds, many on a busy host): health rounds go on meanwhile, prompts are
        routed by load until it is decided, and a router stopping meanwhile does not wait for it."""
        page_size = info.get("page_size")
        if not isinstance(page_size, int) or page_size < 1:
            return False
        if self.match_by is None:
            if self._loading:
                return False
            model = await self._get_json(w, "/get_model_info")
            if model is None:
                return False  # the next round asks again
            path = model.get("tokenizer_path")
            if not (isinstance(path, str) and has_tokenizer(path)):
                self._decided(None, str(path), w, page_size)
            else:
                self._loading = True
                _on_daemon_thread(lambda: load_local_tokenizer(path),
                                  lambda tokenizer: self._decided(tokenizer, path, w, page_size))
                return False
        self.page_size = page_size
        return True

    def _decided(self, tokenizer: Any | None, path: str, w: Worker, page_size: int) -> None:
        self._loading = False
        self.tokenizer = tokenizer
        self.match_by = MATCH_TOKENS if tokenizer is not None else MATCH_TEXT
        if tokenizer is not None:
            self.tokenizer_path = path
            logger.info("tokenizing prompts with %s (reported by %s)", path, w.url)
        else:
            logger.info("cache_aware: no local tokenizer at %s (reported by %s; give --tokenizer-path): prompts are "
                        "matched by their text against what the router sent each worker (approximate); the "
                        "workers' KV events go unused", path, w.url)
        self.page_size = page_size

    async def _follow(self, w: Worker, view: PrefixView, info: dict) -> None:
        endpoint, page_size = info.get("kv_events_endpoint"), info.get("page_size")
        if not isinstance(endpoint, str) or not isinstance(page_size, int):
            self._say_once(f"events {w.url}", "prefill worker %s publishes no KV events: cache_aware guesses "
                           "its cache from the requests routed to it (start it with --kv-events-config to route "
                           "on what it holds)", w.url)
            return
        if self.match_by != MATCH_TOKENS:
            self._say_once(f"events {w.url}", "prefill worker %s publishes KV events, but without a tokenizer the "
                           "router cannot hash prompts as it does: routed on the router's guess (give "
                           "--tokenizer-path)", w.url, level=logging.WARNING)
            return
        if page_size != self.page_size:
            self._say_once(f"page {w.url}", "prefill worker %s: page size %d differs from the others' %d: its KV "
                           "events are not followed (routed on the router's guess)", w.url, page_size,
                           self.page_size, level=logging.ERROR)
            return
        if info.get("kv_hash_key_check", key_check(self.hash_key)) != key_check(self.hash_key):
            self._say_once(f"key {w.url}", "prefill worker %s hashes KV blocks under another key than this router "
                           "(--kv-hash-key-file or PDSERVE_KV_HASH_KEY differ): its KV events are not followed "
                           "(routed on the router's guess)", w.url, level=logging.ERROR)
            return
        endpoint = _reachable(endpoint, w.url)
        if view.events is not None:
            if view.events.endpoint == endpoint:
                return  # the same stream, silent for now: its subscriber reconnects by itself
            view.unfollow()
        # a publisher reachable from other machines is a CURVE server under keys derived from the hash key
        curve = EventCurveKeys.from_hash_key(self.hash_key) if info.get("kv_events_curve") and self.hash_key else None
        view.events = KVEventSubscriber(w.url, endpoint, lambda: self._snapshot(w), self.stale_s, curve=curve).start()
        logger.info("following KV events of prefill worker %s at %s", w.url, endpoint)

    async def _read_load(self, w: Worker) -> None:
        info = await self._get_json(w, "/get_server_info")
        if info is not None:
            w.load = {k: info[k] for k in LOAD_KEYS if isinstance(info.get(k), int)}

    async def _get_json(self, w: Worker, path: str) -> dict | None:
        try:
            reply = await self.call(w, "GET", path, timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        except Exception as e:  # noqa: BLE001 - whatever failed, the next round retries
            logger.debug("%s %s: %s", w.url, path, e)
            return None
        body = reply.json()
        return body if reply.status == 200 and isinstance(body, dict) else None

    def _snapshot(self, w: Worker) -> dict:
        """Blocking: runs on the worker's subscriber thread."""
        req = urllib.request.Request(w.url + "/kv_events/snapshot", headers=self.snapshot_headers)
        with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:  # noqa: S310 - the worker's own URL
            return json.loads(resp.read())

    # ------------------------------------------------------------- status
    def status(self, w: Worker) -> dict:
        """``kv_events`` (its subscriber's status, or None) and ``cache_view`` of one worker."""
        view = w.kv if isinstance(w.kv, PrefixView) else None
        events = view.events.status() if view is not None and view.events is not None else None
        return {"kv_events": events, "cache_view": view.status() if view is not None else None}

    def summary(self) -> dict:
        return {"match_by": self.match_by, "tokenizer": self.tokenizer_path if self.tokenizer is not None else None,
                "page_size": self.page_size}

    def close(self) -> None:
        for view in self.views.values():
            view.unfollow()

    def _say_once(self, key: str, msg: str, *args: object, level: int = logging.INFO) -> None:
        if key not in self._said:
            self._said.add(key)
            logger.log(level, msg, *args)


def _on_daemon_thread(work: Callable[[], Any], done: Callable[[Any], None]) -> None:
    """``done(work())`` on the calling event loop, ``work`` on a daemon thread (an executor's thread
    would hold the process at exit until it ends). A failure is ``done(None)``; nothing runs once the
    loop has closed."""
    loop = asyncio.get_running_loop()

    def run() -> None:
        try:
            result = work()
        except Exception as e:  # noqa: BLE001 - a tokenizer that does not load is no tokenizer
            logger.warning("tokenizer did not load: %s: %s", type(e).__name__, e)
            result = None
        try:
            loop.call_soon_threadsafe(done, result)
        except RuntimeError:  # the loop closed meanwhile: the router is gone
            pass

    threading.Thread(target=run, name="router-tokenizer", daemon=True).start()


def _reachable(endpoint: str, worker_url: str) -> str:
    """A wildcard host in the endpoint (a server bound to every interface) becomes the worker's host."""
    parts = urlsplit(endpoint)
    if parts.scheme == "tcp" and (parts.hostname or "") in WILDCARD_HOSTS:
        host = urlsplit(worker_url).hostname or "127.0.0.1"
        return f"tcp://{host}:{parts.port}"
    return endpoint
