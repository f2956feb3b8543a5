"""P/D bootstrap, in one place: the fields a router adds to a request, prefill's registry (an
HTTP server), decode's client of it, and room pairing.

A P/D router picks a prefill and a decode worker per request and adds ``bootstrap_host``,
``bootstrap_port`` and ``bootstrap_room`` (SGLang's wire format, ``with_bootstrap``) before it sends
the request to both; the host and port name the prefill's registry, the room pairs the two
halves. A batch body (several prompts) gets one room per prompt, and host and port repeated per
prompt, as lists of the batch's length, as sglang-router does. Rooms are random 63-bit integers
(``0 <= room < 2**63``), so they fit a signed 64-bit field anywhere they travel.

A prefill server runs one ``BootstrapServer`` (in its frontend process, on
``--disaggregation-bootstrap-port``). Each of its ranks registers a ``RankRecord`` and the
server-wide ``CompatRecord``; decode fetches them once all ranks are in, refuses a peer whose
compatibility record differs (naming the field), and then talks to the ranks directly.

HTTP API (JSON bodies in the ``protocol.from_dict`` form of the records):
  PUT /bootstrap/compat   CompatRecord           -> 200, or 409 when it contradicts the one held
  PUT /bootstrap/rank     RankRecord             -> 200 (a rank registering again replaces its
                                                    record: it restarted), or 409 on a layout clash
  GET /bootstrap          {"compat", "ranks", "complete", "missing"}
  GET /health             "ok"

Every request but ``/health`` is checked by the server's ``PeerAuth`` (``disagg/auth.py``):
signed with the shared token, else from a loopback peer; refused with 401 (403 for a
non-loopback peer without a token) and counted in ``refused`` by reason. Under a token a
signature is good for one request to this registry: its target must be one of the names this
registry answers to (``wrong_target`` otherwise) and its nonce unseen (``replay`` otherwise); and
every answer to a signed request is signed in turn (over the request's nonce), so a client under
a token takes records only from a registry that holds the token. Bodies over ``MAX_BODY_BYTES``
get a 413 without being parsed (read and discarded up to ``MAX_DISCARD_BYTES``, so the client
sees the answer rather than a broken pipe).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import logging
import secrets
import socket
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, Generic, TypeVar
from urllib.parse import urlsplit

from pdserve.disagg.auth import ANSWER_HEADER, SIGNATURE_HEADER, AuthError, NonceCache, PeerAuth, is_loopback, peer_auth
from pdserve.disagg.layout import KVLayout
from pdserve.disagg.protocol import ProtocolError, check_endpoint, from_dict, parse_json
from pdserve.transfer.base import BufferDescriptor

if TYPE_CHECKING:
    from pdserve.config import ServerArgs

logger = logging.getLogger(__name__)

DEFAULT_BOOTSTRAP_PORT = 8998
MAX_BODY_BYTES = 1 << 20  # a rank record with its buffers is a few hundred bytes
# An oversized body is read and dropped up to this much before the 413, so the client reads the answer instead
# of a reset; past it the connection is closed unread.
MAX_DISCARD_BYTES = 8 << 20
DISCARD_IDLE_S = 5.0  # a client that stops sending what it declared gets its 413 after this much silence
REFUSED_GRACE_S = 1.0  # how long a refused connection is retried (a registry restarting its listener)
MAX_SNAPSHOT_BYTES = 64 << 20  # a snapshot holds at most layout.MAX_RANKS records
KV_LAYOUTS = ("gqa-hnd", "mla", "regions")
# what a router adds to a request (a client's own are dropped: disagg/routed.py)
BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_signature")
ROOM_BITS = 63


class BootstrapError(RuntimeError):
    """The bootstrap exchange failed: unreachable, incomplete, refused or malformed."""


class Unreachable(BootstrapError):
    """Nothing listens at the registry's address (connections refused)."""


class IncompatiblePeer(BootstrapError):
    """Prefill and decode disagree on something the KV bytes depend on; names the field."""


class RoomError(ValueError):
    """A request half that cannot be accepted (duplicate, already paired, dropped)."""


# --- the request's bootstrap fields (the router writes them, both workers read them) ---------


def bootstrap_host(url: str) -> str:
    """The host part of a worker URL as a peer would put it in a URL (IPv6 in brackets)."""
    host = urlsplit(url).hostname
    if host is None:
        raise ValueError(f"worker url: no host in {url!r}")
    try:
        return f"[{host}]" if isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address) else host
    except ValueError:  # a DNS name
        return host


def batch_size(body: dict) -> int | None:
    """Number of prompts in a batch body, or None for a single request.

    Batches: ``/generate`` with ``text`` a list or ``input_ids`` a list of lists;
    ``/v1/completions`` with ``prompt`` a list of strings or of token lists (a flat
    list of ints is one tokenized prompt). An empty list counts as a single request:
    the worker rejects it with its own error. ``n`` is not a batch: a prompt's samples share its
    room (decode forks them from the KV it received).
    """
    for name in ("text", "input_ids", "prompt"):
        value = body.get(name)
        if isinstance(value, list) and value and not isinstance(value[0], int):
            return len(value)
    return None


def new_room() -> int:
    """A room from the OS's CSPRNG: a room names a request's KV on prefill, so it must not be
    predictable from rooms seen before (MT19937, ``random``'s generator, is after 624 outputs)."""
    return secrets.randbits(ROOM_BITS)


def with_bootstrap(body: dict, host: str, port: int) -> dict:
    """A copy of ``body`` with the bootstrap fields of one prefill worker added (any sent are dropped)."""
    body = {k: v for k, v in body.items() if k not in BOOTSTRAP_FIELDS}
    n = batch_size(body)
    if n is None:
        fields = {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": new_room()}
    else:
        fields = {"bootstrap_host": [host] * n, "bootstrap_port": [port] * n,
                  "bootstrap_room": [new_room() for _ in range(n)]}
    return {**body, **fields}


# --- records ----------------------------------------------------------------------------------


def state_layout(model_config, index_cache_dtype: str = "model") -> str:
    """A token slot's regions as the compatibility record names them: ``k+v``, ``latent``,
    ``latent+index_k[128]:bfloat16`` (DeepSeek-V3.2's index keys in the model dtype; ``index_cache_dtype``
    fp8_e4m3: ``latent+index_k[128]:float8_e4m3fn+index_k_scale[1]:float32``), or a
    regions model's every region with the layers keeping it, ``window_kv[512]:bfloat16@0,1,2+...``
    (DeepSeek-V4: a V3 or V3.2 side, or a V4 of other layer kinds, never pairs with it)."""
    mc = model_config
    if mc.state_regions:
        return "+".join(f"{name}[{width}]{f'/{rate}' if rate > 1 else ''}:{mc.dtype}@{','.join(map(str, layers))}"
                        for name, layers, width, rate in mc.state_regions)
    regions = ["latent"] if mc.is_mla else ["k", "v"]
    if mc.index_head_dim:
        if index_cache_dtype == "fp8_e4m3":
            blocks = mc.index_head_dim // min(128, mc.index_head_dim)
            regions += [f"index_k[{mc.index_head_dim}]:float8_e4m3fn", f"index_k_scale[{blocks}]:float32"]
        else:
            regions.append(f"index_k[{mc.index_head_dim}]:{mc.dtype}")
    return "+".join(regions)


@dataclass(frozen=True)
class CompatRecord:
    """What must be equal on both sides for KV bytes to mean the same thing."""

    # served name or path, for messages only: the same weights may sit at different paths
    model: str = field(compare=False)
    architecture: str  # HF architecture name
    dtype: str  # the model dtype (what an "auto" KV cache stores)
    page_size: int
    kv_layout: str  # "gqa-hnd", "mla" or "regions" (state_layout names them)
    num_layers: int
    num_kv_heads: int  # the model's total KV heads (1 for MLA)
    head_dim: int  # one head's row (kv_lora_rank + qk_rope_head_dim for MLA)
    weights: str  # sha256 hex of the weights (models/fingerprint.py): same on every path, split and rank
    # --disaggregation-transfer-backend: a Mooncake side and a NIXL side cannot reach each other
    transfer_backend: str = "mooncake"
    # weight quantization (config.Fp8BlockConfig.name, "none"): FP8 weights compute other
    # activations, so their KV means something else to a full-precision side
    quantization: str = "none"
    # --kv-cache-dtype: fp8 pages read as model-dtype bytes (or the reverse) would be garbage
    kv_cache_dtype: str = "auto"
    # --speculative-algorithm ("none": off): the draft's KV is one more pool layer, sent with the prompt's
    speculative: str = "none"
    # the regions of a token's slot beyond kv_layout's own, with their widths and dtypes (``state_layout``):
    # a V3 prefill's pages lack the index keys a V3.2 decode would read
    state_layout: str = ""
    # per-request records outside the pages (roles.state_records; DeepSeek-V4's bounded layout): a side
    # keeping the window in pages ("none") and one keeping it in records read each other's bytes as garbage
    state_records: str = "none"

    def __post_init__(self):
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout: {self.kv_layout!r} is not one of {KV_LAYOUTS}")
        if len(self.weights) != 64 or not set(self.weights) <= set("0123456789abcdef"):
            raise ValueError(f"weights: {self.weights[:80]!r} is not a sha256 hex digest")

    @classmethod
    def from_model(cls, model_config, page_size: int, model: str | None = None, seed: int = 0,
                   transfer_backend: str = "mooncake", kv_cache_dtype: str = "auto",
                   speculative: str | None = None, state_records: str = "none",
                   index_cache_dtype: str = "model") -> CompatRecord:
        """From a ``config.ModelConfig`` (``model`` defaults to its path; ``seed``: of dummy weights;
        ``speculative``: the speculative algorithm, None when off; ``index_cache_dtype``: what V3.2's
        index keys are stored as, resolved)."""
        from pdserve.models.fingerprint import weights_fingerprint

        mc = model_config
        quant = mc.quantization
        kv_layout = "regions" if mc.state_regions else "mla" if mc.is_mla else "gqa-hnd"
        return cls(model or mc.path, mc.architecture, mc.dtype, page_size, kv_layout,
                   mc.num_layers, mc.num_kv_heads, mc.head_dim, weights_fingerprint(mc, seed), transfer_backend,
                   quant.name if quant is not None else "none", kv_cache_dtype, speculative or "none",
                   state_layout(mc, index_cache_dtype), state_records)

    def check(self, other: CompatRecord, mine: str = "prefill", theirs: str = "decode") -> None:
        """Raise IncompatiblePeer naming the first compared field that differs. The weights
        digest comes last: it differs whenever the config does, and says less than the field."""
        for f in sorted(dataclasses.fields(self), key=lambda f: f.name == "weights"):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.compare and a != b:
                if f.name == "weights":  # short digests, and the names an operator recognises
                    a, b = f"{a[:12]} ({self.model})", f"{b[:12]} ({other.model})"
                if f.name == "kv_cache_dtype":  # what "auto" stores
                    a, b = (f"auto ({r.dtype})" if v == "auto" else v for r, v in ((self, a), (other, b)))
                raise IncompatiblePeer(f"{f.name}: {mine} has {a}, {theirs} has {b}")


@dataclass(frozen=True)
class RankRecord:
    """One prefill rank, as decode needs it to send KV requests and plan the writes."""

    rank: int  # attention rank: dp_rank * tp_size + tp_rank
    session: str  # transfer session, "host:rpc_port"
    buffers: list[BufferDescriptor]  # KV buffers, in layout.buffers order
    control: str  # ZMQ endpoint taking KVRequest, KVAbort, DropRoom, Heartbeat
    layout: KVLayout  # the server's KV layout and parallel shape (same on every rank)
    seed: int = 0  # seed of the random source-rank draw (layout.source_pick), same on every rank
    transfer_info: str = ""  # the transfer backend's peer_info (NIXL: its agent metadata); "": none needed

    def __post_init__(self):
        if not 0 <= self.rank < self.layout.num_ranks:
            raise ValueError(f"rank: {self.rank} outside [0, {self.layout.num_ranks})")
        names = tuple(b.name for b in self.buffers)
        if names != self.layout.buffers:
            raise ValueError(f"buffers: {names} where the layout has {self.layout.buffers}")
        check_endpoint(self.control, "control")


@dataclass(frozen=True)
class BootstrapInfo:
    """What decode learns from a complete registry."""

    compat: CompatRecord
    ranks: list[RankRecord]  # sorted by rank, one per attention rank

    @property
    def layout(self) -> KVLayout:
        return self.ranks[0].layout


def _json(obj: Any) -> bytes:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = dataclasses.asdict(obj)
    return json.dumps(obj).encode()


# --- the registry and its HTTP server -----------------------------------------------------------


class BootstrapRegistry:
    """Thread-safe store of one prefill server's records (the HTTP handler's state)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._compat: CompatRecord | None = None
        self._ranks: dict[int, RankRecord] = {}

    def put_compat(self, compat: CompatRecord) -> None:
        with self._lock:
            if self._compat is not None:
                self._compat.check(compat, "registered", "new")
            self._compat = compat

    def put_rank(self, rec: RankRecord) -> None:
        with self._lock:
            for other in self._ranks.values():
                if other.rank != rec.rank and (other.layout, other.seed) != (rec.layout, rec.seed):
                    raise BootstrapError(f"rank {rec.rank}: layout or seed differs from rank {other.rank}'s")
            if rec.rank in self._ranks:
                logger.info("bootstrap: rank %d registered again (session %s)", rec.rank, rec.session)
            self._ranks[rec.rank] = rec

    def snapshot(self) -> dict:
        with self._lock:
            ranks = [self._ranks[r] for r in sorted(self._ranks)]
            want = ranks[0].layout.num_ranks if ranks else None
            missing = [r for r in range(want) if r not in self._ranks] if want else []
            return {"compat": dataclasses.asdict(self._compat) if self._compat else None,
                    "ranks": [dataclasses.asdict(r) for r in ranks],
                    "complete": bool(ranks) and not missing and self._compat is not None,
                    "missing": missing}


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = 10.0  # a peer that stops sending mid-request (or lies about Content-Length) is dropped
    nonce: str | None = None  # the verified request's nonce, which its answer's signature covers

    def do_GET(self):  # noqa: N802 (http.server's naming)
        self.nonce = None
        if self.path == "/health":
            return self._reply(200, "ok")
        if not self._allowed(b""):
            return None
        if self.path == "/bootstrap":
            return self._reply(200, self.server.registry.snapshot())
        return self._reply(404, {"error": f"no route {self.path[:100]}"})

    def do_PUT(self):  # noqa: N802
        routes: dict[str, tuple[type, Callable[[Any], None]]] = {
                  "/bootstrap/compat": (CompatRecord, self.server.registry.put_compat),
                  "/bootstrap/rank": (RankRecord, self.server.registry.put_rank)}
        self.nonce = None
        body = self._body()
        if body is None or not self._allowed(body):
            return None
        if self.path not in routes:
            return self._reply(404, {"error": f"no route {self.path[:100]}"})
        cls, put = routes[self.path]
        try:
            put(from_dict(cls, parse_json(body, MAX_BODY_BYTES), cls.__name__))
        except ValueError as e:  # malformed JSON or record (ProtocolError is a ValueError)
            return self._reply(400, {"error": str(e), "kind": "malformed"})
        except IncompatiblePeer as e:
            return self._reply(409, {"error": str(e), "kind": "incompatible"})
        except BootstrapError as e:
            return self._reply(409, {"error": str(e), "kind": "conflict"})
        return self._reply(200, {"ok": True})

    def _body(self) -> bytes | None:
        """The request body, or None once a 4xx went out (too large, bad length)."""
        length = self.headers.get("Content-Length", "0")
        if not length.isdigit():
            self._reply(400, {"error": "Content-Length: not a number", "kind": "malformed"})
            return None
        if int(length) > MAX_BODY_BYTES:
            self.close_connection = True  # the rest of an unread body must not be parsed as a request
            self._discard(int(length))
            self._reply(413, {"error": f"body of {length} bytes (at most {MAX_BODY_BYTES})", "kind": "malformed"})
            return None
        return self.rfile.read(int(length))

    def _discard(self, length: int) -> None:
        """Read and drop a body too large to take, up to ``MAX_DISCARD_BYTES``: a client still sending
        when the answer comes and the connection closes would see a broken pipe, not the 413. A body
        declared beyond the bound is not waited for at all."""
        left = length if length <= MAX_DISCARD_BYTES else 0
        try:
            self.connection.settimeout(DISCARD_IDLE_S)
            while left > 0:
                chunk = self.rfile.read(min(left, 1 << 16))
                if not chunk:
                    return
                left -= len(chunk)
        except OSError:  # the client stopped sending (or gave up): answer anyway
            return

    def _allowed(self, body: bytes) -> bool:
        reason = "auth"
        try:
            signed = self.server.auth.verify(self.command, self.path, body, self.headers.get(SIGNATURE_HEADER),
                                             self.client_address[0])
            if signed is not None:
                if not self.server.answers_to(signed.target, self.connection.getsockname()[0]):
                    reason = "wrong_target"
                    raise AuthError(f"signed for the registry at {signed.target[:100]}, not this one "
                                    f"(port {self.server.server_address[1]})")
                if not self.server.nonces.add(signed.nonce, signed.t):
                    reason = "replay"
                    raise AuthError("this signed request was accepted before (a replay)")
                self.nonce = signed.nonce
            return True
        except AuthError as e:
            self.server.refused[reason] += 1
            logger.warning("bootstrap: refused %s %s from %s (%s): %s", self.command, self.path[:100],
                           self.client_address[0], reason, e)
            self.close_connection = True
            code = 403 if self.server.auth.token is None else 401
            self._reply(code, {"error": str(e), "kind": "unauthorized"})
            return False

    def _reply(self, code: int, payload) -> None:
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.nonce is not None:  # answers to a verified request prove the token (and which request)
            for k, v in self.server.auth.sign_answer(self.nonce, code, data).items():
                self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, fmt, *args):  # http.server logs every request to stderr otherwise
        logger.debug("bootstrap %s: " + fmt, self.client_address[0], *args)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr, registry: BootstrapRegistry, auth: PeerAuth, names: tuple[str, ...] = ()):
        super().__init__(addr, _Handler)
        self.registry = registry
        self.auth = auth
        self.refused: Counter[str] = Counter()  # "auth" | "wrong_target" | "replay" -> requests
        self.nonces = NonceCache()
        self.names = own_names(str(self.server_address[0]), names)

    def answers_to(self, target: str, local_address: str) -> bool:
        """Whether a request signed for ``target`` ("host:port") was meant for this registry: the
        port it listens on, and a host it is known by (its own names, or the address this very
        connection reached: a registry on all interfaces is known by each of them)."""
        host, _, port = target.rpartition(":")
        host = host.strip("[]").lower()
        return port == str(self.server_address[1]) and (host in self.names or host == local_address.lower())


def own_names(bound: str, extra: tuple[str, ...] = ()) -> frozenset[str]:
    """The hosts a registry bound to ``bound`` is known by: that address, and for a wildcard or
    loopback bind the loopback names and this machine's own name and addresses; ``extra``: names
    an operator gave it (a DNS name peers use)."""
    names = {bound.lower(), *(n.strip("[]").lower() for n in extra)}
    wildcard = bound in ("0.0.0.0", "::", "")
    if wildcard or is_loopback(bound):
        names |= {"localhost", "127.0.0.1", "::1"}
    if wildcard:
        hostname = socket.gethostname()
        names |= {hostname.lower(), socket.getfqdn().lower()}
        try:
            names |= {str(a[4][0]).lower() for a in socket.getaddrinfo(hostname, None)}
        except OSError:  # a host whose own name does not resolve: the connection's address still counts
            pass
    return frozenset(names)


class BootstrapServer:
    """The registry served over HTTP from a background thread. ``port=0`` picks a free port."""

    def __init__(self, host: str = "127.0.0.1", port: int = DEFAULT_BOOTSTRAP_PORT, auth: PeerAuth | None = None,
                 names: tuple[str, ...] = ()):
        """``names``: hosts peers reach this registry by beyond its own (``own_names``)."""
        self.registry = BootstrapRegistry()
        self._server = _Server((host, port), self.registry, auth or PeerAuth(), names)
        self._thread: threading.Thread | None = None

    @property
    def refused(self) -> Counter[str]:
        """Requests refused by reason ("auth", "wrong_target", "replay")."""
        return self._server.refused

    @property
    def host(self) -> str:
        return str(self._server.server_address[0])  # typed str | bytes; an AF_INET server's is a str

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def start(self) -> BootstrapServer:
        # A short poll interval: shutdown() waits up to one interval.
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), name="bootstrap-http",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Idempotent; frees the port."""
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join()
            self._thread = None
        self._server.server_close()

    def __enter__(self) -> BootstrapServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def open_registry(args: ServerArgs) -> BootstrapServer:
    """A prefill server's registry on ``--host`` and ``--disaggregation-bootstrap-port``, listening
    (its scheduler ranks register there once they start; decode servers read it)."""
    server = BootstrapServer(args.host, args.disaggregation_bootstrap_port, peer_auth(args.disagg_config())).start()
    logger.info("bootstrap registry on %s:%d", args.host, server.port)
    return server


# --- the client -----------------------------------------------------------------------------


class BootstrapClient:
    """HTTP client of a BootstrapServer: prefill ranks register, decode fetches.

    Every call retries while the server is not up (or, for ``fetch``, not complete) until its
    ``timeout_s``, then raises BootstrapError saying what it last saw.
    """

    def __init__(self, request_timeout_s: float = 2.0, interval_s: float = 0.1, auth: PeerAuth | None = None):
        self.request_timeout_s = request_timeout_s
        self.interval_s = interval_s
        self.auth = auth or PeerAuth()
        self.refused_grace_s = REFUSED_GRACE_S

    def fetch(self, host: str, port: int, timeout_s: float = 30.0) -> BootstrapInfo:
        """The complete registry. Retries while it is incomplete or does not answer; gives up at
        once when the server refuses (4xx) and after ``refused_grace_s`` when nothing listens on
        the port (a dead prefill: decode falls back instead of waiting out ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        refused_until = time.monotonic() + self.refused_grace_s
        while True:
            status, why = self._call("GET", host, port, "/bootstrap")
            if status == 200 and isinstance(why, dict) and why.get("complete") is True:
                return self._info(why, host, port)
            if status == 200 and isinstance(why, dict):
                why = (f"{len(why.get('ranks') or [])} prefill ranks registered, missing ranks "
                       f"{str(why.get('missing'))[:200]}" + ("" if why.get("compat") else ", no compatibility record"))
            elif status is not None:
                why = f"HTTP {status}: {str(why.get('error', why) if isinstance(why, dict) else why)[:300]}"
                if 400 <= status < 500:
                    raise BootstrapError(f"bootstrap {host}:{port} refused: {why}")
            elif "refused" in str(why).lower() and time.monotonic() >= refused_until:
                raise Unreachable(f"bootstrap {host}:{port}: {why}: nothing listens there")
            self._wait_or_fail(deadline, host, port, timeout_s, why)

    def register_compat(self, host: str, port: int, compat: CompatRecord, timeout_s: float = 30.0) -> None:
        self._put(host, port, "/bootstrap/compat", compat, timeout_s)

    def register_rank(self, host: str, port: int, record: RankRecord, timeout_s: float = 30.0) -> None:
        self._put(host, port, "/bootstrap/rank", record, timeout_s)

    def _put(self, host, port, path, record, timeout_s) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            status, why = self._call("PUT", host, port, path, _json(record))
            if status == 200:
                return
            if status is not None:  # the server answered: retrying will not change its mind
                cls = IncompatiblePeer if why.get("kind") == "incompatible" else BootstrapError
                raise cls(f"bootstrap {host}:{port} refused {path}: {why.get('error', why)}")
            self._wait_or_fail(deadline, host, port, timeout_s, why)

    def _call(self, method: str, host: str, port: int, path: str, body: bytes | None = None):
        """(status, payload) from the server, or (None, reason) when it did not answer. Under a
        token, an answer that does not prove the token raises BootstrapError: whoever listens
        there is not this deployment's registry, and nothing it says is used."""
        signed = self.auth.sign(method, path, body or b"", target=f"{host}:{port}")
        headers = {"Content-Type": "application/json", **signed}
        req = urllib.request.Request(f"http://{host}:{port}{path}", data=body, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.request_timeout_s) as resp:
                data = resp.read(MAX_SNAPSHOT_BYTES + 1)
                self._check_answer(signed, resp.status, data, resp.headers.get(ANSWER_HEADER), host, port)
                return resp.status, parse_json(data, MAX_SNAPSHOT_BYTES)
        except urllib.error.HTTPError as e:
            try:
                return e.code, parse_json(e.read(MAX_BODY_BYTES))
            except ValueError:
                return e.code, {"error": f"HTTP {e.code} {e.reason}"}
        except (urllib.error.URLError, OSError) as e:
            return None, f"no answer ({getattr(e, 'reason', e)})"
        except ProtocolError as e:  # the server answered, but not with a registry snapshot
            return 502, {"error": f"malformed answer: {e}"}

    def _check_answer(self, signed: dict, status: int, data: bytes, header: str | None, host: str, port: int) -> None:
        if self.auth.token is None:
            return
        nonce = dict(p.partition("=")[::2] for p in signed[SIGNATURE_HEADER].split(","))["n"]
        try:
            self.auth.verify_answer(nonce, status, data, header)
        except AuthError as e:
            raise BootstrapError(f"bootstrap {host}:{port}: {e}") from None

    def _wait_or_fail(self, deadline: float, host: str, port: int, timeout_s: float, why) -> None:
        if time.monotonic() + self.interval_s > deadline:
            raise BootstrapError(f"bootstrap {host}:{port}: {why} after {timeout_s:.1f}s")
        time.sleep(self.interval_s)

    @staticmethod
    def _info(snap: dict, host: str, port: int) -> BootstrapInfo:
        try:
            compat = from_dict(CompatRecord, snap.get("compat"), "compat")
            if not isinstance(snap.get("ranks"), list):
                raise ProtocolError("ranks: expected a list")
            ranks = [from_dict(RankRecord, r, f"ranks[{i}]") for i, r in enumerate(snap["ranks"])]
            _check_ranks(ranks)
        except ProtocolError as e:
            raise BootstrapError(f"bootstrap {host}:{port}: malformed record: {e}") from None
        return BootstrapInfo(compat, ranks)


def _check_ranks(ranks: list[RankRecord]) -> None:
    """One record per attention rank 0..n-1 of one layout (what ``BootstrapInfo`` promises)."""
    if not ranks:
        raise ProtocolError("ranks: none registered")
    if [r.rank for r in ranks] != list(range(ranks[0].layout.num_ranks)):
        raise ProtocolError(f"ranks: {[r.rank for r in ranks][:16]} is not one record per rank of the layout")
    if any(r.layout != ranks[0].layout for r in ranks):
        raise ProtocolError("ranks: records disagree on the layout")


# --- pairing the two halves of a request ---------------------------------------------------------


# H: what the caller keeps of the HTTP half (a request); K: of a KV request.
H = TypeVar("H")
K = TypeVar("K")


@dataclass
class Paired(Generic[H, K]):
    """Both halves arrived: ``http`` from the router, ``kv`` the KV requests by part (decode rank)."""

    room: int
    http: H
    kv: dict[int, K]


@dataclass
class Dropped(Generic[H]):
    """Decode prefills the room itself (DropRoom): the HTTP half, to finish without work; or,
    with ``reason``, decode gave up on the request (``RoomTable.cancel``): to fail with it."""

    room: int
    http: H
    reason: str | None = None


@dataclass
class Expired(Generic[H, K]):
    """A half that waited past the timeout for its other half."""

    room: int
    http: H | None
    kv: dict[int, K]


@dataclass
class _Entry(Generic[H, K]):
    since: float
    http: H | None = None
    kv: dict[int, K] = field(default_factory=dict)
    parts: int | None = None
    state: str = "waiting"  # "waiting", or a tombstone: "paired", "dropped"
    reason: str | None = None  # a dropped room's: why decode gave up on it (None: decode prefills it)


class RoomTable(Generic[H, K]):
    """Pairs the HTTP half of a request (router -> prefill) with its KV half (decode's KV
    requests, one per destination rank: ``parts`` of them), whichever arrives first.

    Pure: the caller passes ``now`` (any monotonic clock). Not thread-safe: one loop owns it.
    Paired and dropped rooms leave a tombstone for ``timeout_s`` so a duplicate is refused
    rather than waiting forever; ``expire(now)`` returns halves that waited too long and
    forgets old tombstones.
    """

    def __init__(self, timeout_s: float):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self._rooms: dict[int, _Entry[H, K]] = {}

    def __len__(self) -> int:
        """Rooms with a half waiting."""
        return sum(e.state == "waiting" for e in self._rooms.values())

    def add_http(self, room: int, item: H, now: float) -> Paired[H, K] | Dropped[H] | None:
        e = self._entry(room, now, "HTTP half")
        if e.state == "dropped":
            if e.http is not None:
                raise RoomError(f"room {room}: HTTP half already arrived")
            e.http = item
            return Dropped(room, item, e.reason)
        if e.http is not None:
            raise RoomError(f"room {room}: HTTP half already arrived")
        e.http = item
        return self._pair_if_complete(room, e, now)

    def add_kv(self, room: int, part: int, item: K, now: float, parts: int = 1) -> Paired[H, K] | None:
        e = self._entry(room, now, "KV request")
        if e.state == "dropped":
            raise RoomError(f"room {room}: dropped by decode, KV request refused")
        if e.parts is not None and e.parts != parts:
            raise RoomError(f"room {room}: KV request says {parts} parts, an earlier one said {e.parts}")
        if part in e.kv:
            raise RoomError(f"room {room}: KV request part {part} already arrived")
        if not 0 <= part < parts:
            raise RoomError(f"room {room}: KV request part {part} outside [0, {parts})")
        e.parts = parts
        e.kv[part] = item
        return self._pair_if_complete(room, e, now)

    def drop(self, room: int, now: float) -> Dropped[H] | None:
        """Decode will prefill ``room`` itself. Returns the waiting HTTP half, if any; a half
        arriving later is answered ``Dropped`` by ``add_http``."""
        e = self._entry(room, now, "DropRoom")
        if e.kv:
            raise RoomError(f"room {room}: decode already sent KV requests, cannot drop")
        e.state, e.since = "dropped", now
        return Dropped(room, e.http) if e.http is not None else None

    def cancel(self, room: int, now: float, reason: str | None = None) -> Expired[H, K] | None:
        """Either side gave up on a room that is not paired yet: returns its waiting halves (to
        fail) and leaves a tombstone, so a half arriving later is answered ``Dropped`` (with
        ``reason``, to fail with). A room not
        seen yet gets the tombstone too: decode may give up (a grammar it cannot compile) before
        the router's HTTP half reaches prefill, which would otherwise wait for the KV half until
        ``timeout_s``."""
        e = self._rooms.get(room)
        if e is not None and e.state != "waiting":
            return None
        self._rooms[room] = _Entry(now, state="dropped", reason=reason)
        return Expired(room, e.http, e.kv) if e is not None else None

    def expire(self, now: float) -> list[Expired[H, K]]:
        out: list[Expired[H, K]] = []
        for room, e in list(self._rooms.items()):
            if now - e.since < self.timeout_s:
                continue
            del self._rooms[room]
            if e.state == "waiting":
                out.append(Expired(room, e.http, e.kv))
        return out

    def _entry(self, room: int, now: float, what: str) -> _Entry[H, K]:
        e = self._rooms.setdefault(room, _Entry(now))
        if e.state == "paired":
            raise RoomError(f"room {room}: already paired, duplicate {what} refused")
        return e

    def _pair_if_complete(self, room: int, e: _Entry[H, K], now: float) -> Paired[H, K] | None:
        if e.http is None or e.parts is None or len(e.kv) < e.parts:
            return None
        paired = Paired(room, e.http, e.kv)
        self._rooms[room] = _Entry(now, state="paired")
        return paired
