"""A Kubernetes API server on 127.0.0.1 that replays recorded answers (``recorded/k8s_pods.json``):
``GET /api/v1/namespaces/{ns}/pods`` and ``/api/v1/pods`` answer the PodList (filtered by
``labelSelector``, equality terms, as the API server does), and with ``watch=true`` stream the
recorded watch events newer than ``resourceVersion``, one JSON object a line, as the test releases
them (``release``). A relist sees the pods as the released events left them. Requests that do not
carry the kubeconfig's token are refused with 401, as a real API server would.

So the router's discovery runs the official ``kubernetes`` client, over real HTTP, against answers
in the API's own shape."""

from __future__ import annotations

import asyncio
import copy
import json
import threading
from pathlib import Path

from aiohttp import web

from entrypoints.server_utils import free_port

RECORDED = Path(__file__).with_name("recorded") / "k8s_pods.json"
TOKEN = "recorded-token"


def _matches(pod: dict, selector: str) -> bool:
    labels = pod["metadata"].get("labels") or {}
    terms = [t for t in selector.split(",") if t]
    return all(labels.get(k) == v for k, _, v in (t.partition("=") for t in terms))


def _rv(obj: dict) -> int:
    return int(obj["metadata"]["resourceVersion"])


class KubeAPI:
    def __init__(self, recorded: Path = RECORDED):
        doc = json.loads(recorded.read_text())
        self.pod_list = doc["list"]
        self.pods = {p["metadata"]["name"]: p for p in self.pod_list["items"]}
        self.version = int(self.pod_list["metadata"]["resourceVersion"])
        self.pending = list(doc["events"])  # not released yet
        self.released: list[dict] = []
        self.requests: list[dict] = []  # what reached it: path, query, whether the token was right
        self.port = free_port()
        self._changed: asyncio.Condition | None = None
        self.closing = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kubeconfig(self, path: Path) -> Path:
        path.write_text(json.dumps({  # JSON is YAML: the client's loader reads it
            "apiVersion": "v1", "kind": "Config", "current-context": "recorded",
            "clusters": [{"name": "recorded", "cluster": {"server": self.url}}],
            "users": [{"name": "router", "user": {"token": TOKEN}}],
            "contexts": [{"name": "recorded", "context": {"cluster": "recorded", "user": "router"}}]}))
        return path

    # ------------------------------------------------------------ control
    def start(self) -> KubeAPI:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kube-api", daemon=True)
        self._thread.start()
        self._call(self._start())
        return self

    def close(self) -> None:
        self._call(self._end_watches())
        self._call(self._runner.cleanup())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def release(self) -> dict:
        """The next recorded event goes to the watchers (and into what a list answers); returns it."""
        return self._call(self._release())

    def watchers(self) -> int:
        """Watch requests being answered now."""
        return sum(1 for r in self.requests if r["watch"] and r["open"])

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(30)

    async def _start(self) -> None:
        self._changed = asyncio.Condition()
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{namespace}/pods", self._pods)
        app.router.add_get("/api/v1/pods", self._pods)
        self._runner = web.AppRunner(app, shutdown_timeout=0.5)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True).start()

    async def _end_watches(self) -> None:
        assert self._changed is not None
        async with self._changed:
            self.closing = True
            self._changed.notify_all()

    async def _release(self) -> dict:
        assert self._changed is not None
        event = self.pending.pop(0)
        obj = event["object"]
        self.version = max(self.version, _rv(obj))
        if event["type"] == "DELETED":
            self.pods.pop(obj["metadata"]["name"], None)
        elif event["type"] != "BOOKMARK":
            self.pods[obj["metadata"]["name"]] = obj
        async with self._changed:
            self.released.append(event)
            self._changed.notify_all()
        return event

    # ------------------------------------------------------------ API
    async def _pods(self, request: web.Request) -> web.StreamResponse:
        q = request.query
        record = {"path": request.path, "query": dict(q), "watch": q.get("watch") == "true", "open": True,
                  "token_ok": request.headers.get("Authorization") == f"Bearer {TOKEN}"}
        self.requests.append(record)
        try:
            if not record["token_ok"]:
                return web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                          "message": "Unauthorized", "reason": "Unauthorized", "code": 401},
                                         status=401)
            namespace = request.match_info.get("namespace")
            selector = q.get("labelSelector", "")
            if record["watch"]:
                return await self._watch(request, namespace, selector, int(q.get("resourceVersion") or 0))
            items = [p for p in self.pods.values() if _matches(p, selector)
                     and namespace in (None, p["metadata"]["namespace"])]
            return web.json_response({**self.pod_list, "metadata": {"resourceVersion": str(self.version)},
                                      "items": copy.deepcopy(items)})
        finally:
            record["open"] = False

    async def _watch(self, request: web.Request, namespace: str | None, selector: str, since: int):
        assert self._changed is not None
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        sent = 0
        try:
            while not self.closing:
                async with self._changed:
                    await self._changed.wait_for(lambda n=sent: len(self.released) > n or self.closing)
                    new, sent = self.released[sent:], len(self.released)
                for event in new:
                    obj = event["object"]
                    if _rv(obj) <= since:
                        continue
                    if event["type"] != "BOOKMARK" and not (_matches(obj, selector) and
                                                           namespace in (None, obj["metadata"]["namespace"])):
                        continue
                    await resp.write(json.dumps(event).encode() + b"\n")
        except ConnectionError:
            pass  # the client left
        return resp
