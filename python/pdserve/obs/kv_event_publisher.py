"""Publishes the KV cache's events on a ZMQ PUB socket, off the scheduler thread.

Wire format (one ZMQ multipart message per batch, as vLLM's and SGLang's publishers):
``[topic, seq as u64 big-endian, payload]`` where ``payload`` is JSON
``{"seq", "epoch", "ts", "events": [...], "data_parallel_rank"}`` (``epoch``: random per start)
and each event carries ``type`` ("BlockStored", "BlockRemoved", "AllBlocksCleared") and
vLLM/Dynamo's field names.

Who may read them: a ``BlockStored`` event's ``token_ids`` are the cached prompts' tokens. They
are published only when the socket is reachable from this machine alone (a loopback address,
``ipc://``, ``inproc://``); a socket bound to any other address, wildcards included, publishes
the events without ``token_ids`` (logged once, and ``kv_events_token_ids`` false in
``/get_server_info``). Routing needs only the block hashes: the router hashes the prompts it sees
itself (``router/kv_index.py``). The hashes themselves give the prompts away unless keyed (a
dictionary attack, ``mem/radix_cache.py``), and even keyed they tell which cached blocks are
equal. So a socket reachable from other machines is a ZMQ CURVE server (``kv_events_curve`` true
in ``/get_server_info``): traffic is encrypted, and its ZAP handler admits one client key. Both
keypairs derive from the block hash key (``EventCurveKeys.from_hash_key``), which the router
holds too: a subscriber without the key gets no handshake, no hash. An unkeyed server (no
``--kv-hash-key-file``) has nothing to derive them from: it publishes on this machine alone, and
refuses to start bound anywhere else. The endpoint defaults to the server's ``--host``
(``KVEventsConfig.endpoint_for``), never every interface.

An idle publisher sends an empty batch (``events: []``) with the last number every second.

``seq`` numbers batches 1, 2, 3 ... with no hole unless a batch was lost: the scheduler
thread numbers a batch when it closes it, then hands it to a bounded queue without waiting;
a full queue drops the batch (its number is still used), so a subscriber sees the gap and
resyncs from ``snapshot`` (served over HTTP by the server), which says the seq it is current to.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import queue
import random
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import orjson
import zmq
import zmq.auth.thread
from zmq.utils import z85

from pdserve.obs.kv_events import MEDIUM_GPU, EventBuffer, KVEvent, event_dict

if TYPE_CHECKING:
    from pdserve.config import KVEventsConfig

logger = logging.getLogger(__name__)

WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]", "")
_STOP = object()
BIND_TIMEOUT_S = 10.0
HEARTBEAT_S = 1.0


SERVER_KEY_LABEL = b"pdserve KV events, CURVE server key, v1"
CLIENT_KEY_LABEL = b"pdserve KV events, CURVE client key, v1"


@dataclass(frozen=True)
class EventCurveKeys:
    """Z85 CURVE keypairs of the KV events port, derived from the block hash key: the publisher's
    (the server, which binds) and the one client key its ZAP handler admits (the router's)."""

    server_public: bytes
    server_secret: bytes = field(repr=False)
    client_public: bytes
    client_secret: bytes = field(repr=False)

    @classmethod
    def from_hash_key(cls, hash_key: bytes) -> EventCurveKeys:
        if not hash_key:
            raise ValueError("CURVE keys of the KV events port need a block hash key (--kv-hash-key-file)")
        server_public, server_secret = _keypair(hash_key, SERVER_KEY_LABEL)
        client_public, client_secret = _keypair(hash_key, CLIENT_KEY_LABEL)
        return cls(server_public, server_secret, client_public, client_secret)

    def secure_subscriber(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (before it connects) a CURVE client of the publisher."""
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.client_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.client_secret)


def _keypair(hash_key: bytes, label: bytes) -> tuple[bytes, bytes]:
    """HMAC-SHA256(hash key, label) as the 32-byte secret key: a label apart from the hash chain's use."""
    secret = z85.encode(hmac.new(hash_key, label, hashlib.sha256).digest())
    return zmq.curve_public(secret), secret


class _OneKey:
    """ZAP credentials provider (pyzmq's interface): admits one Z85 client public key."""

    def __init__(self, allowed: bytes):
        self.allowed = allowed

    def callback(self, domain: str, key: bytes) -> bool:
        return hmac.compare_digest(key, self.allowed)


def connectable(bound: str, advertise_host: str) -> str:
    """``bound`` (a socket's last endpoint) as peers should connect to it: a wildcard host becomes
    ``advertise_host`` (the server's --host) unless that is a wildcard too; the router then uses
    the host of the worker's URL."""
    if not bound.startswith("tcp://"):
        return bound
    parts = urlsplit(bound)
    host = parts.hostname or ""
    if host in WILDCARD_HOSTS and advertise_host not in WILDCARD_HOSTS:
        host = advertise_host
    elif host in WILDCARD_HOSTS:
        host = "0.0.0.0"
    if ":" in host:
        host = f"[{host}]"
    return f"tcp://{host}:{parts.port}"


def local_only(bound: str) -> bool:
    """Whether ``bound`` (a socket's last endpoint) can be reached from this machine alone."""
    if not bound.startswith("tcp://"):
        return bound.startswith(("ipc://", "inproc://"))
    try:
        return ipaddress.ip_address(urlsplit(bound).hostname or "").is_loopback
    except ValueError:  # a wildcard or an interface name: reachable from elsewhere
        return False


class KVEventPublisher(EventBuffer):
    """The sink a scheduler's KV cache manager reports to; ``flush`` once per scheduler step closes
    a batch. ``drop_next``: a test hook, the next N batches are numbered but never sent."""

    def __init__(self, config: KVEventsConfig, advertise_host: str = "127.0.0.1", data_parallel_rank: int = 0,
                 hash_key: bytes = b""):
        super().__init__()
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self.seq = 0  # the last batch numbered
        self.epoch = random.getrandbits(63)  # a restarted server numbers from 1 again under a new epoch
        self.dropped_batches = 0
        self.drop_next = 0
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._bound = threading.Event()
        self._bind_error: str | None = None
        self._bound_at = ""
        self._endpoint = config.endpoint_for(advertise_host)
        # CURVE wherever the socket is reachable from other machines (decided on the endpoint asked for;
        # the bound one is checked against it below)
        self.curve = EventCurveKeys.from_hash_key(hash_key) if hash_key and not local_only(self._endpoint) else None
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        self._thread.start()
        if not self._bound.wait(BIND_TIMEOUT_S) or self._bind_error is not None:
            raise ValueError(f"kv_events_config: cannot bind endpoint {self._endpoint!r} "
                             f"({self._bind_error or 'timed out'})")
        self.endpoint = connectable(self._bound_at, advertise_host)
        self.token_ids = local_only(self._bound_at)  # prompts' tokens only to this machine's own readers
        if not self.token_ids and self.curve is None:
            self.close()
            raise ValueError(f"kv_events_config: endpoint {self._bound_at} can be read from other machines without "
                             "authentication, and unkeyed block hashes give the cached prompts away: give every "
                             "server and the router the same --kv-hash-key-file (or $PDSERVE_KV_HASH_KEY), or bind "
                             "a loopback or ipc:// endpoint")
        if not self.token_ids:
            logger.info("KV events at %s can be reached from other machines: CURVE-encrypted for holders of the "
                        "block hash key only, and without token ids (block hashes only, all cache-aware routing "
                        "needs)", self._bound_at)

    # ---------------------------------------------------- scheduler thread
    def flush(self) -> None:
        """Close the events since the last flush into the next numbered batch and queue it (never blocks)."""
        events = self.take()
        if not events:
            return
        self.seq += 1
        if self.drop_next > 0:
            self.drop_next -= 1
            self.dropped_batches += 1
            return
        try:
            self._queue.put_nowait((self.seq, time.time(), events))
        except queue.Full:
            self.dropped_batches += 1

    def snapshot(self, blocks: list[tuple[int, int | None]], block_size: int) -> dict:
        """Every cached block as of batch ``seq`` (pending events are flushed first, so a subscriber
        that applies this and then batches after ``seq`` misses nothing)."""
        self.flush()
        return {"seq": self.seq, "epoch": self.epoch, "block_size": block_size,
                "data_parallel_rank": self.data_parallel_rank,
                "blocks": [{"block_hash": h, "parent_block_hash": p, "medium": MEDIUM_GPU} for h, p in blocks]}

    def stats(self) -> dict:
        return {"kv_events_endpoint": self.endpoint, "kv_events_seq": self.seq,
                "kv_events_dropped_batches": self.dropped_batches, "kv_events_token_ids": self.token_ids,
                "kv_events_curve": self.curve is not None}

    def close(self) -> None:
        """Send what is queued (bounded), then stop the thread and close the socket."""
        self.flush()
        try:
            self._queue.put(_STOP, timeout=1.0)
        except queue.Full:
            pass
        self._thread.join(2.0)

    # ---------------------------------------------------- publisher thread
    def _run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUB)
        auth = None
        try:
            sock.setsockopt(zmq.SNDHWM, self.config.hwm)
            sock.setsockopt(zmq.LINGER, 0)
            if self.curve is not None:
                auth = self._secure(ctx, sock, self.curve)
            sock.bind(self._endpoint)
            self._bound_at = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as e:
            self._bind_error = str(e)
            if auth is not None:
                auth.stop()
            sock.close()
            ctx.term()
            self._bound.set()
            return
        self._bound.set()
        topic = self.config.topic.encode()
        try:
            while (item := self._next()) is not _STOP:
                seq, ts, events = item
                sock.send_multipart([topic, seq.to_bytes(8, "big"), self._payload(seq, ts, events)])
        finally:
            if auth is not None:
                auth.stop()
            sock.close()
            ctx.term()

    @staticmethod
    def _secure(ctx: zmq.Context[Any], sock: zmq.Socket, keys: EventCurveKeys) -> zmq.auth.thread.ThreadAuthenticator:
        """``sock`` a CURVE server whose ZAP handler (one thread, on ``ctx``) admits the router's key only."""
        auth = zmq.auth.thread.ThreadAuthenticator(ctx, log=logger)
        auth.start()
        auth.configure_curve_callback("*", _OneKey(keys.client_public))
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.server_public)
        return auth

    def _next(self):
        """The next queued batch, or after HEARTBEAT_S idle an empty one carrying the last number
        closed: subscribers tell an idle worker from a silent one, and see a drop at the tail."""
        try:
            return self._queue.get(timeout=HEARTBEAT_S)
        except queue.Empty:
            return self.seq, time.time(), []

    def _payload(self, seq: int, ts: float, events: list[KVEvent]) -> bytes:
        return orjson.dumps({"seq": seq, "epoch": self.epoch, "ts": ts, "data_parallel_rank": self.data_parallel_rank,
                             "events": [self._event(e) for e in events]})

    def _event(self, event: KVEvent) -> dict:
        d = event_dict(event)
        if not self.token_ids:
            d.pop("token_ids", None)
        return d
