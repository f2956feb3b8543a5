"""Workers that come and go while the router runs: Kubernetes pods found by label
(``--service-discovery``) and a workers file watched for changes (``--workers-file``).

Each source says which workers it wants now; a ``Reconciler`` applies that to the ``Fleet`` on
the router's event loop: it adds what is new and removes what it added and no longer wants
(a worker given by ``--prefill``/``--decode`` or by another source is never its to remove).
A worker added starts unchecked and serves once a health check passes, as at start-up.

Kubernetes (sglang-router's flags): one watch per role, with the label selector
``--selector`` + ``--prefill-selector`` (or ``--decode-selector``), in
``--service-discovery-namespace`` (required: a labelled pod in another namespace is no worker of
ours). A pod is a worker while it is
Running and Ready with a pod IP and not being deleted: ``http://<pod IP>:<--service-discovery-port>``;
a prefill pod's bootstrap port is its ``--bootstrap-port-annotation`` (sglang.ai/bootstrap-port),
else 8998. Each watch starts from a list (a pod gone meanwhile is dropped) and is listed again
when it ends or fails. The official ``kubernetes`` client is imported only here, only when asked
for (``pip install 'pdserve[router-k8s]'``); it reads the in-cluster service account, else the
kubeconfig (``$KUBECONFIG``, ``~/.kube/config``).

Workers file (JSON, or YAML by its .yaml/.yml suffix):
``{"prefill": [{"url": U, "bootstrap_port": P} | U, ...], "decode": [U | {"url": U}, ...]}``.
Its owner must be the router's user or root, and no group or other may write it (``check_private``).
It is polled every ``FILE_POLL_S``; a change of its size, mtime or inode makes the router read it
again. A file that does not parse or names a bad value is an error at start-up; later, the error is
logged and the workers stay as they were.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import stat
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.router.config import DEFAULT_BOOTSTRAP_PORT, PrefillSpec, RouterArgs, check_url, normalize_url
from pdserve.router.workers import Fleet, Role

logger = logging.getLogger(__name__)

FILE_POLL_S = 1.0
WATCH_TIMEOUT_S = 300  # the API server ends each watch after this long; it is listed and watched again
WATCH_READ_TIMEOUT_S = WATCH_TIMEOUT_S + 30  # a watch silent longer than the server's own limit is dead
CONNECT_TIMEOUT_S = 10
RETRY_S = 5.0  # after a failed list or watch
FIRST_LIST_WAIT_S = 10.0  # the router waits this long for each role's first list before its first health check


class DiscoveryError(Exception):
    """A source cannot start (no kubernetes client or config, an unreadable workers file)."""


@dataclass(frozen=True)
class Wanted:
    """A worker a source wants in the fleet."""

    role: Role
    url: str
    bootstrap_port: int | None = None


class Reconciler:
    """What one source wants, applied to the fleet (event loop only). ``owned``: the workers this
    source added, by URL."""

    def __init__(self, fleet: Fleet, source: str, on_change: Callable[[str], None] | None = None):
        self.fleet = fleet
        self.source = source
        self.on_change = on_change  # called with "added" / "removed" (the router's metrics)
        self.owned: dict[str, Wanted] = {}

    def apply(self, wanted: Iterable[Wanted], roles: Iterable[Role] = tuple(Role)) -> None:
        """Make this source's workers of ``roles`` exactly ``wanted``: the new ones are added before
        the gone ones are removed (a replaced worker never leaves its role with none for a moment);
        one whose role or bootstrap port changed is removed and added anew."""
        roles = set(roles)
        want = {w.url: w for w in wanted if w.role in roles}
        mine = {url: had for url, had in self.owned.items() if had.role in roles}
        self._remove([url for url, had in mine.items() if url in want and want[url] != had])
        for url, w in want.items():
            if url not in self.owned and self.fleet.add(w.role, url, w.bootstrap_port, self.source) is not None:
                self.owned[url] = w
                self._changed("added")
        self._remove([url for url in mine if url not in want])

    def _remove(self, urls: list[str]) -> None:
        for url in urls:
            del self.owned[url]
            if self.fleet.remove(url, self.source) is not None:
                self._changed("removed")

    def _changed(self, event: str) -> None:
        if self.on_change is not None:
            self.on_change(event)


class WorkerSource(ABC):
    """Feeds a Reconciler while the router runs: ``start`` (on the event loop; raises DiscoveryError
    when it cannot), then ``stop`` at shutdown."""

    name: str

    @abstractmethod
    async def start(self, reconciler: Reconciler) -> None: ...

    @abstractmethod
    async def stop(self) -> None: ...


# ------------------------------------------------------------------ workers file
def parse_workers(text: str, yaml_syntax: bool) -> list[Wanted]:
    """The workers a file names; ValueError naming the field of anything wrong."""
    data = _load_yaml(text) if yaml_syntax else _load_json(text)
    if not isinstance(data, dict) or not set(data) <= {"prefill", "decode"}:
        raise ValueError("workers file: must be an object with 'prefill' and 'decode' lists")
    out: list[Wanted] = []
    for i, entry in enumerate(_list(data, "prefill")):
        out.append(_prefill_entry(entry, f"prefill[{i}]"))
    for i, entry in enumerate(_list(data, "decode")):
        url = entry.get("url") if isinstance(entry, dict) else entry
        if not isinstance(url, str):
            raise ValueError(f"decode[{i}]: give a URL, or an object with 'url'")
        check_url(normalize_url(url), f"decode[{i}]")
        out.append(Wanted(Role.DECODE, normalize_url(url)))
    urls = [w.url for w in out]
    for url in urls:
        if urls.count(url) > 1:
            raise ValueError(f"workers file: {url} is listed twice")
    return out


def _load_json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as e:
        raise ValueError(f"workers file: invalid JSON ({e})") from None


def _load_yaml(text: str) -> Any:
    try:
        import yaml
    except ImportError:
        raise ValueError("workers file: YAML needs PyYAML (pip install 'pdserve[router-k8s]'), or write JSON") \
            from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"workers file: invalid YAML ({e})") from None


def _list(data: dict, key: str) -> list:
    value = data.get(key, [])
    if not isinstance(value, list):
        raise ValueError(f"{key}: must be a list")
    return value


def _prefill_entry(entry: Any, field: str) -> Wanted:
    if isinstance(entry, str):
        entry = {"url": entry}
    if not isinstance(entry, dict) or not isinstance(entry.get("url"), str) or \
            not set(entry) <= {"url", "bootstrap_port"}:
        raise ValueError(f"{field}: give a URL, or an object with 'url' and optionally 'bootstrap_port'")
    port = entry.get("bootstrap_port", DEFAULT_BOOTSTRAP_PORT)
    if not isinstance(port, int) or isinstance(port, bool):
        raise ValueError(f"{field}.bootstrap_port: must be an integer port, got {port!r}")
    try:
        spec = PrefillSpec(normalize_url(entry["url"]), port)
    except ValueError as e:
        raise ValueError(f"{field}: {e}") from None
    return Wanted(Role.PREFILL, spec.url, spec.bootstrap_port)


def check_private(path: Path) -> None:
    """ValueError unless ``path`` (symlinks followed, as a ConfigMap mounts it) is a regular file that
    only this user or root owns and may change: the router sends the worker key and every prompt to
    the URLs it names, so whoever may write it may read them."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise ValueError("not a regular file")
    if st.st_uid not in (os.geteuid(), 0):
        raise ValueError(f"owned by uid {st.st_uid}, not by this user ({os.geteuid()}) or root: refused (the "
                         f"router sends the worker key and the prompts to the URLs it names)")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ValueError(f"mode {stat.S_IMODE(st.st_mode):o} lets others change it: refused (chmod go-w; the "
                         f"router sends the worker key and the prompts to the URLs it names)")


class WorkersFile(WorkerSource):
    """``--workers-file``: read at start (its errors stop the router), then polled."""

    name = "file"

    def __init__(self, path: str, poll_s: float = FILE_POLL_S):
        self.path = Path(path)
        self.poll_s = poll_s
        self.seen: tuple[int, int, int] | None = None  # inode, size, mtime_ns of the version applied
        self.error: str | None = None  # the last error logged (each new one is logged once)
        self.task: asyncio.Task | None = None

    async def start(self, reconciler: Reconciler) -> None:
        try:
            reconciler.apply(self._read())
        except (OSError, ValueError) as e:
            raise DiscoveryError(f"workers_file: {self.path}: {e}") from None
        logger.info("workers file %s: %d workers; watching it for changes", self.path, len(reconciler.owned))
        self.task = asyncio.ensure_future(self._poll(reconciler))

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

    def _stat(self) -> tuple[int, int, int]:
        st = os.stat(self.path)
        return st.st_ino, st.st_size, st.st_mtime_ns

    def _read(self) -> list[Wanted]:
        stat = self._stat()
        check_private(self.path)
        wanted = parse_workers(self.path.read_text(), self.path.suffix.lower() in (".yaml", ".yml"))
        self.seen = stat
        return wanted

    async def _poll(self, reconciler: Reconciler) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                if self._stat() == self.seen:
                    continue
                wanted = self._read()
            except (OSError, ValueError) as e:
                if str(e) != self.error:
                    self.error = str(e)
                    logger.error("workers file %s: %s; keeping the workers as they are", self.path, e)
                continue
            self.error = None
            before = dict(reconciler.owned)
            reconciler.apply(wanted)
            if reconciler.owned != before:
                logger.info("workers file %s changed: %d workers", self.path, len(reconciler.owned))


# -------------------------------------------------------------------- Kubernetes
def pod_worker(pod: Any, role: Role, port: int, annotation: str) -> Wanted | None:
    """The worker a pod (the client's V1Pod) is, or None while it is not Running + Ready with an IP."""
    meta, status = pod.metadata, pod.status
    if status is None or meta is None or meta.deletion_timestamp is not None:
        return None
    ready = any(c.type == "Ready" and c.status == "True" for c in status.conditions or ())
    if status.phase != "Running" or not ready or not status.pod_ip:
        return None
    host = f"[{status.pod_ip}]" if ":" in status.pod_ip else status.pod_ip
    return Wanted(role, f"http://{host}:{port}", _bootstrap_port(meta, annotation) if role is Role.PREFILL else None)


def _bootstrap_port(meta: Any, annotation: str) -> int:
    value = (meta.annotations or {}).get(annotation)
    if value is None:
        return DEFAULT_BOOTSTRAP_PORT
    if isinstance(value, str) and value.isdigit() and 0 < int(value) < 65536:
        return int(value)
    logger.warning("pod %s: annotation %s=%r is not a port; using %d", meta.name, annotation, value,
                   DEFAULT_BOOTSTRAP_PORT)
    return DEFAULT_BOOTSTRAP_PORT


class KubernetesDiscovery(WorkerSource):
    """``--service-discovery``: a thread per role lists and watches its pods; what it finds is
    applied on the event loop."""

    name = "kubernetes"

    def __init__(self, args: RouterArgs):
        self.namespace = args.service_discovery_namespace
        self.port = args.service_discovery_port
        self.annotation = args.bootstrap_port_annotation
        self.selectors = {Role.PREFILL: ",".join(args.selector + args.prefill_selector),
                          Role.DECODE: ",".join(args.selector + args.decode_selector)}
        self.stopping = threading.Event()
        self.threads: list[threading.Thread] = []
        self.api: Any = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.reconciler: Reconciler | None = None
        self.listed: dict[Role, asyncio.Event] = {}  # set once the role's first list is applied

    async def start(self, reconciler: Reconciler) -> None:
        """Starts a thread per role and waits (a while) for their first lists, so the first health
        round sees the workers there are."""
        self.api = _core_api()
        self.loop = asyncio.get_running_loop()
        self.reconciler = reconciler
        self.listed = {role: asyncio.Event() for role in self.selectors}
        where = f"namespace {self.namespace}"
        for role, selector in self.selectors.items():
            logger.info("discovering %s workers: pods with %s in %s, port %d", role.value, selector, where, self.port)
            thread = threading.Thread(target=self._follow, args=(role,), name=f"discovery {role.value}", daemon=True)
            thread.start()
            self.threads.append(thread)
        try:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in self.listed.values())), FIRST_LIST_WAIT_S)
        except asyncio.TimeoutError:
            logger.warning("discovery: no pod list from the Kubernetes API within %g s; serving meanwhile",
                           FIRST_LIST_WAIT_S)

    async def stop(self) -> None:
        """The threads end at their next event or timeout (daemons: they never hold the router up)."""
        self.stopping.set()

    def _follow(self, role: Role) -> None:
        pods: dict[str, Wanted] = {}
        failed = ""
        while not self.stopping.is_set():
            try:
                version = self._list(role, pods)
                self._watch(role, pods, version)
                failed = ""
            except Exception as e:  # noqa: BLE001 - the API, the network or the config: list again later
                why = _why(e)
                if why != failed:
                    logger.warning("discovering %s workers: %s; trying again every %g s", role.value, why, RETRY_S)
                failed = why
                self.stopping.wait(RETRY_S)

    def _list_call(self) -> tuple[Callable[..., Any], dict]:
        return self.api.list_namespaced_pod, {"namespace": self.namespace}

    def _list(self, role: Role, pods: dict[str, Wanted]) -> str | None:
        call, kwargs = self._list_call()
        result = call(label_selector=self.selectors[role], _request_timeout=(CONNECT_TIMEOUT_S, WATCH_TIMEOUT_S),
                      **kwargs)
        pods.clear()
        for pod in result.items or ():
            self._note(pod, role, pods)
        self._post(role, pods)
        return result.metadata.resource_version if result.metadata is not None else None

    def _watch(self, role: Role, pods: dict[str, Wanted], version: str | None) -> None:
        from kubernetes import watch

        call, kwargs = self._list_call()
        stream = watch.Watch().stream(call, label_selector=self.selectors[role], resource_version=version,
                                      timeout_seconds=WATCH_TIMEOUT_S,
                                      _request_timeout=(CONNECT_TIMEOUT_S, WATCH_READ_TIMEOUT_S), **kwargs)
        for event in stream:
            if self.stopping.is_set():
                return
            if event["type"] == "DELETED":
                pods.pop(_key(event["object"]), None)
            elif event["type"] in ("ADDED", "MODIFIED"):
                self._note(event["object"], role, pods)
            else:
                continue  # BOOKMARK
            self._post(role, pods)

    def _note(self, pod: Any, role: Role, pods: dict[str, Wanted]) -> None:
        wanted = pod_worker(pod, role, self.port, self.annotation)
        if wanted is None:
            pods.pop(_key(pod), None)
        else:
            pods[_key(pod)] = wanted

    def _post(self, role: Role, pods: dict[str, Wanted]) -> None:
        """Hand the role's pods to the event loop (a copy: the thread goes on changing its own)."""
        loop, reconciler = self.loop, self.reconciler
        if loop is None or reconciler is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(reconciler.apply, list(pods.values()), (role,))
            loop.call_soon_threadsafe(self.listed[role].set)
        except RuntimeError:
            pass  # the loop closed as the router stopped


def _why(e: Exception) -> str:
    """What failed, the same words each time it fails the same way (an ApiException's text carries
    the answer's headers and dates)."""
    status, reason = getattr(e, "status", None), getattr(e, "reason", None)
    if isinstance(status, int) and status:
        hint = " (RBAC: the service account needs get, list and watch on pods)" if status == 403 else ""
        return f"the Kubernetes API answered {status} {reason}{hint}"
    return re.sub(r" at 0x[0-9a-f]+", "", f"{type(e).__name__}: {e}")  # urllib3 names its objects' addresses


def _key(pod: Any) -> str:
    return f"{pod.metadata.namespace}/{pod.metadata.name}"


def _core_api() -> Any:
    """The official client's CoreV1Api, configured in-cluster or from the kubeconfig."""
    try:
        from kubernetes import client, config
    except ImportError:
        raise DiscoveryError("service_discovery: needs the kubernetes package (pip install "
                             "'pdserve[router-k8s]')") from None
    try:
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config()
        else:
            config.load_kube_config()
    except (config.ConfigException, OSError) as e:
        raise DiscoveryError(f"service_discovery: no Kubernetes configuration (not in a cluster, and the "
                             f"kubeconfig: {e})") from None
    return client.CoreV1Api()


def make_sources(args: RouterArgs) -> list[WorkerSource]:
    sources: list[WorkerSource] = []
    if args.workers_file is not None:
        sources.append(WorkersFile(args.workers_file))
    if args.service_discovery:
        sources.append(KubernetesDiscovery(args))
    return sources
