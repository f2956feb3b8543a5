"""What the router knows of its workers' KV caches, for ``--policy cache_aware``.

* Prefill workers: each one's KV-event endpoint (from its ``/get_server_info``) followed by a
  ``KVEventSubscriber``, started once the worker is healthy and stopped when it is marked dead.
* The tokenizer that turns a request into the token ids the servers will see (``--tokenizer-path``,
  else the path a prefill worker reports in ``/get_model_info``; local files only). Without one,
  or without KV events, requests are routed by load and the log says so once.
* Decode workers: their free KV pages and running requests, read from ``/get_server_info`` after
  each health round (the policy prefers fewer in flight, then more free pages).
"""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.request
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from pdserve.router.kv_events import KVEventSubscriber
from pdserve.router.kv_index import prompt_block_hashes
from pdserve.router.prompt_tokens import load_local_tokenizer, prompt_ids
from pdserve.router.workers import Worker, WorkerSet

logger = logging.getLogger(__name__)

WILDCARD_HOSTS = ("0.0.0.0", "*", "::", "")
LOAD_KEYS = ("num_running_reqs", "num_waiting_reqs", "free_pages", "total_pages")


class CacheView:
    """Owned by the router's event loop; the subscribers' threads only touch their own index."""

    def __init__(self, prefill: WorkerSet, decode: WorkerSet, call, headers: dict, tokenizer_path: str | None,
                 stale_s: float, timeout_s: float, prefill_aware: bool, decode_aware: bool):
        self.prefill = prefill
        self.decode = decode
        self.call = call  # PDProxy.call
        self.headers = headers
        self.stale_s = stale_s
        self.timeout_s = timeout_s
        self.prefill_aware = prefill_aware
        self.decode_aware = decode_aware
        self.tokenizer: Any | None = None
        self.tokenizer_path = tokenizer_path
        self.page_size: int | None = None
        self._said: set[str] = set()
        self._busy = False
        if tokenizer_path:
            self.tokenizer = load_local_tokenizer(tokenizer_path)
            if self.tokenizer is None:
                self._say_once("tokenizer", "no tokenizer in --tokenizer-path %s: cache_aware routes prefill by load",
                               tokenizer_path)

    # ----------------------------------------------------------- requests
    def prompt_hashes(self, path: str, body: dict) -> list[int]:
        """The page hashes of the request's prompt; [] when they cannot be known (routed by load)."""
        if not self.prefill_aware or self.page_size is None:
            return []
        if self.tokenizer is None:
            self._say_once("tokenizer", "no tokenizer (give --tokenizer-path, or serve a model whose path is a "
                           "local directory): cache_aware routes prefill by load")
            return []
        ids = prompt_ids(self.tokenizer, path, body)
        return prompt_block_hashes(ids, self.page_size) if ids else []

    # ------------------------------------------------------------ refresh
    def schedule_refresh(self) -> None:
        """After a health round: follow new prefill workers, drop dead ones, read decode loads."""
        if not self._busy and (self.prefill_aware or self.decode_aware):
            self._busy = True
            asyncio.ensure_future(self._refresh())

    async def _refresh(self) -> None:
        try:
            if self.prefill_aware:
                for w in self.prefill.workers:
                    await self._follow_or_drop(w)
            if self.decode_aware:
                await asyncio.gather(*(self._read_load(w) for w in self.decode.healthy))
        finally:
            self._busy = False

    async def _follow_or_drop(self, w: Worker) -> None:
        if not w.healthy:
            self._drop(w)
        elif w.kv is None or (isinstance(w.kv, KVEventSubscriber) and not w.kv.fresh):
            # a silent worker may have restarted between health checks on another port
            info = await self._get_json(w, "/get_server_info")
            if info is None:
                return
            if isinstance(w.kv, KVEventSubscriber):
                if w.kv.endpoint == _reachable(str(info.get("kv_events_endpoint")), w.url):
                    return
                self._drop(w)
            await self._follow(w, info)

    async def _follow(self, w: Worker, info: dict) -> None:
        endpoint, page_size = info.get("kv_events_endpoint"), info.get("page_size")
        if not isinstance(endpoint, str) or not isinstance(page_size, int):
            self._say_once(f"events {w.url}", "prefill worker %s publishes no KV events (start it with "
                           "--kv-events-config): routed as if it cached nothing", w.url)
            return
        if self.page_size not in (None, page_size):
            logger.error("prefill worker %s: page size %d differs from the others' %d: its KV events are not "
                         "followed", w.url, page_size, self.page_size)
            return
        self.page_size = page_size
        if self.tokenizer is None and not self.tokenizer_path:
            await self._find_tokenizer(w)
        endpoint = _reachable(endpoint, w.url)
        w.kv = KVEventSubscriber(w.url, endpoint, lambda: self._snapshot(w), self.stale_s).start()
        logger.info("following KV events of prefill worker %s at %s", w.url, endpoint)

    async def _find_tokenizer(self, w: Worker) -> None:
        info = await self._get_json(w, "/get_model_info")
        path = info.get("tokenizer_path") if info is not None else None
        self.tokenizer = await asyncio.to_thread(load_local_tokenizer, path) if isinstance(path, str) else None
        if self.tokenizer is not None:
            self.tokenizer_path = path
            logger.info("tokenizing prompts with %s (reported by %s)", path, w.url)

    def _drop(self, w: Worker) -> None:
        if w.kv is not None:
            kv, w.kv = w.kv, None
            if isinstance(kv, KVEventSubscriber):
                kv.stop()

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
        req = urllib.request.Request(w.url + "/kv_events/snapshot", headers=self.headers)
        with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:  # noqa: S310 - the worker's own URL
            return json.loads(resp.read())

    # ------------------------------------------------------------- status
    def followers(self) -> Sequence[tuple[Worker, KVEventSubscriber]]:
        return [(w, w.kv) for w in self.prefill.workers if isinstance(w.kv, KVEventSubscriber)]

    def close(self) -> None:
        for w in self.prefill.workers:
            self._drop(w)

    def _say_once(self, key: str, msg: str, *args: object) -> None:
        if key not in self._said:
            self._said.add(key)
            logger.warning(msg, *args)


def _reachable(endpoint: str, worker_url: str) -> str:
    """A wildcard host in the endpoint (a server bound to every interface) becomes the worker's host."""
    parts = urlsplit(endpoint)
    if parts.scheme == "tcp" and (parts.hostname or "") in WILDCARD_HOSTS:
        host = urlsplit(worker_url).hostname or "127.0.0.1"
        return f"tcp://{host}:{parts.port}"
    return endpoint
